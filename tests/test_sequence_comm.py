"""Sequence-parallel primitives (train/sequence_comm.py, train/ring_attention.py) against
unsplit attention.

Claim under test: a group of N ranks, each holding its slice of the same sequences (contiguous
or zig-zag chunks), computes with the Ulysses all-to-all or with ring attention exactly the
output, and exactly the gradients for q, k and v, that one process computes on the whole
sequence (models.attention's `attend` + `build_attention_mask`, or SDPA), including packed
documents, padding keys, grouped-query attention and queries that are a subset of the keys.

Every rank's slice is compared (the parent reassembles the slices by `local_indices`), so a
wrong merge, a wrong zig-zag position or a dk/dv accumulator that never comes home fails.
Tolerance: float64, 1e-9 absolute: both sides add the same O(1) terms in another order
(~1e-15), while one wrong key changes an output by ~1e-2.

All cases of one world size run in ONE spawn (module fixture), two world sizes: N = 2 (the
next and previous rank are the same peer) and N = 4.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import mmtrain.distributed
import mmtrain.train.ring_attention as ring_attention_module
from dist_helpers import run_distributed
from mmtrain.models.attention import attend, build_attention_mask, document_runs
from mmtrain.train.ring_attention import (
    CONTIGUOUS,
    LAYOUTS,
    ZIGZAG,
    local_chunks,
    local_indices,
    ring_attention,
)
from mmtrain.train.ring_blocks import CPU_FLASH, EFFICIENT, FLASH, MATH, block_kernel
from mmtrain.train.sequence_comm import (
    RingPass,
    SequenceGroup,
    heads_to_sequence,
    sequence_to_heads,
)

DT = torch.float64
ATOL = 1e-9
B, H, HKV, T, D = 2, 4, 2, 24, 8
IMAGE = 8  # non-causal case: the first IMAGE tokens attend to all T (image + text) keys
CPU = torch.device("cpu")
# Packed rows: several documents per row (an id that repeats later is a new run), padding
# (-1) at the end. Boundaries fall inside chunks for both layouts and N = 2, 4.
DOCUMENT_IDS = torch.tensor(
    [
        [0] * 5 + [1] * 8 + [2] * 7 + [-1] * 4,
        [7] * 11 + [3] * 6 + [7] * 4 + [-1] * 3,
    ]
)
CAUSAL_CASES = [(layout, masked) for layout in LAYOUTS for masked in (False, True)]


def full_inputs(seed: int, heads: int = H, kv_heads: int = HKV) -> dict[str, torch.Tensor]:
    """The whole sequences every rank (and the reference) starts from: q, k, v and the loss
    weights w (loss = sum(out * w))."""
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(B, heads, T, D, generator=g, dtype=DT),
        "k": torch.randn(B, kv_heads, T, D, generator=g, dtype=DT),
        "v": torch.randn(B, kv_heads, T, D, generator=g, dtype=DT),
        "w": torch.randn(B, heads, T, D, generator=g, dtype=DT),
    }


def key_valid_of(ids: torch.Tensor) -> torch.Tensor:
    return ids != -1


def output_and_grads(fn, inputs: dict[str, torch.Tensor], w: torch.Tensor) -> dict:
    """fn(q, k, v)'s output and the gradients of sum(out * w) for q, k and v."""
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("q", "k", "v")}
    out = fn(leaves["q"], leaves["k"], leaves["v"])
    (out * w).sum().backward()
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def take(x: torch.Tensor, layout: str, rank: int, world: int, dim: int) -> torch.Tensor:
    """This rank's slice of a full sequence along `dim`."""
    return x.index_select(dim, local_indices(layout, rank, world, x.shape[dim]))


def assemble(parts: list[torch.Tensor], layout: str, dim: int = 2) -> torch.Tensor:
    """The full sequence from the ranks' slices (inverse of `take`)."""
    world = len(parts)
    length = sum(p.shape[dim] for p in parts)
    full = torch.empty(
        *parts[0].shape[:dim], length, *parts[0].shape[dim + 1 :], dtype=parts[0].dtype
    )
    for rank, part in enumerate(parts):
        full.index_copy_(dim, local_indices(layout, rank, world, length), part)
    return full


# ----------------------------------------------------------------------------- references
def reference_causal(inputs: dict, masked: bool) -> dict:
    if masked:
        mask, is_causal = build_attention_mask(
            T, 0, CPU, key_mask=key_valid_of(DOCUMENT_IDS), document_ids=DOCUMENT_IDS
        )
    else:
        mask, is_causal = None, True
    return output_and_grads(lambda q, k, v: attend(q, k, v, mask, is_causal), inputs, inputs["w"])


def cross_inputs(inputs: dict) -> dict:
    """Non-causal, Tq != Tk: the image tokens' queries over every (image + text) key."""
    return {**inputs, "q": inputs["q"][:, :, :IMAGE], "w": inputs["w"][:, :, :IMAGE]}


def cross_key_valid() -> torch.Tensor:
    """Padding keys for the masked non-causal case: row 0 loses some, row 1 all of them (its
    queries have no key at all: output 0, gradients 0)."""
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, 3:7] = False
    valid[0, 20:] = False
    valid[1] = False
    return valid


def dense_reference(q, k, v, allowed):
    """Masked attention written out, with rows that have no allowed key giving 0 (SDPA gives
    NaN there); GQA by repeating k, v."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, -math.inf)
    some = allowed.any(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(some, scores, torch.zeros_like(scores)), dim=-1) * some
    return p @ v


# ----------------------------------------------------------------------------- the ranks
def _all_to_all_case(group: SequenceGroup, rank: int, world: int) -> dict:
    inputs = {n: take(t, CONTIGUOUS, rank, world, 2) for n, t in full_inputs(1, H, H).items()}
    heads = sequence_to_heads(inputs["q"], group)
    result = {"heads": heads, "round_trip": heads_to_sequence(heads, group)}

    def through_heads(q, k, v):
        q, k, v = (sequence_to_heads(x, group) for x in (q, k, v))
        return heads_to_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=True), group)

    return {**result, **output_and_grads(through_heads, inputs, inputs["w"])}


def _ring_causal_case(group: SequenceGroup, layout: str, masked: bool) -> dict:
    rank, world = group.rank, group.size
    inputs = {n: take(t, layout, rank, world, 2) for n, t in full_inputs(2).items()}
    masks = {}
    if masked:
        masks = {
            "documents": take(document_runs(DOCUMENT_IDS), layout, rank, world, 1),
            "key_valid": take(key_valid_of(DOCUMENT_IDS), layout, rank, world, 1),
        }

    def ring(q, k, v):
        return ring_attention(q, k, v, group, causal=True, layout=layout, **masks)

    return output_and_grads(ring, inputs, inputs["w"])


def _ring_cross_case(group: SequenceGroup, masked: bool) -> dict:
    rank, world = group.rank, group.size
    inputs = {
        n: take(t, CONTIGUOUS, rank, world, 2) for n, t in cross_inputs(full_inputs(3)).items()
    }
    masks = {"key_valid": take(cross_key_valid(), CONTIGUOUS, rank, world, 1)} if masked else {}

    def ring(q, k, v):
        return ring_attention(q, k, v, group, causal=False, **masks)

    return output_and_grads(ring, inputs, inputs["w"])


class _RecordingTimer:
    """A comm timer that records the spans the collectives open (mmtrain.distributed's hook)."""

    in_step = True

    def __init__(self) -> None:
        self.spans: list = []
        self.clock = 0.0

    def stamp(self) -> float:
        self.clock += 1.0
        return self.clock

    def begin(self, exposure: str, collective: str):
        span = type("Span", (), {"exposure": exposure, "collective": collective, "end": None})()
        self.spans.append(span)
        return span


def _ring_pass_case(group: SequenceGroup) -> dict:
    """One hop of mixed dtypes (floats, int64 run ids, bool masks), timed by a fake timer."""
    timer = _RecordingTimer()
    mmtrain.distributed.set_collective_timer(timer)
    try:
        mine = [
            torch.full((2, 3), float(group.rank), dtype=DT),
            torch.full((4,), group.rank, dtype=torch.int64),
            torch.tensor([group.rank % 2 == 0, True]),
        ]
        received = RingPass(mine, group).wait()
    finally:
        mmtrain.distributed.set_collective_timer(None)
    return {
        "received": received,
        "spans": [(s.exposure, s.collective, s.end is not None) for s in timer.spans],
    }


def _all_cases(rank: int, world: int) -> dict:
    group = SequenceGroup.from_process_group(dist.new_group(list(range(world))))
    assert (group.rank, group.size) == (rank, world)
    results = {"all_to_all": _all_to_all_case(group, rank, world), "pass": _ring_pass_case(group)}
    for layout, masked in CAUSAL_CASES:
        results[("causal", layout, masked)] = _ring_causal_case(group, layout, masked)
    for masked in (False, True):
        results[("cross", masked)] = _ring_cross_case(group, masked)
    # Blocks of 1 or 2 query rows (uneven cuts of 3-row chunks at N = 4): cut diagonal blocks
    # keep their triangle, and keys past a block's last query are never read (the fused
    # kernel cuts masked rows by their bias; the math kernel every row by its scores).
    saved, ring_attention_module.SCORE_ELEMENTS = ring_attention_module.SCORE_ELEMENTS, 100
    try:
        for layout, masked in CAUSAL_CASES:
            results[("blocks", layout, masked)] = _ring_causal_case(group, layout, masked)
            with sdpa_kernel(SDPBackend.MATH):  # the fallback: no fused kernel
                results[("math", layout, masked)] = _ring_causal_case(group, layout, masked)
        results[("blocks-cross", True)] = _ring_cross_case(group, True)
    finally:
        ring_attention_module.SCORE_ELEMENTS = saved
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["N2", "N4"])
def ranks(request) -> list[dict]:
    return run_distributed(_all_cases, world_size=request.param)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    error = (actual - expected).abs().max().item()
    assert error <= ATOL, f"{what}: max error {error:.3g}"


def assert_matches(parts: list[dict], expected: dict, layout: str) -> None:
    for name in ("out", "dq", "dk", "dv"):
        assert_close(assemble([p[name] for p in parts], layout), expected[name], name)


# ----------------------------------------------------------------------------- distributed
@pytest.mark.slow
def test_all_to_all_trades_sequence_for_heads_and_back(ranks):
    world = len(ranks)
    inputs = full_inputs(1, H, H)
    for rank, result in enumerate(ranks):
        part = result["all_to_all"]
        heads = slice(rank * H // world, (rank + 1) * H // world)
        assert torch.equal(part["heads"], inputs["q"][:, heads])
        assert torch.equal(part["round_trip"], take(inputs["q"], CONTIGUOUS, rank, world, 2))
    expected = output_and_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        inputs,
        inputs["w"],
    )
    assert_matches([r["all_to_all"] for r in ranks], expected, CONTIGUOUS)


@pytest.mark.slow
def test_ring_pass_receives_from_the_previous_rank_and_is_timed_in_flight(ranks):
    world = len(ranks)
    for rank, result in enumerate(ranks):
        previous = (rank - 1) % world
        floats, ints, flags = result["pass"]["received"]
        assert torch.equal(floats, torch.full((2, 3), float(previous), dtype=DT))
        assert torch.equal(ints, torch.full((4,), previous, dtype=torch.int64))
        assert torch.equal(flags, torch.tensor([previous % 2 == 0, True]))
        # Launch to completion in flight; the wait for it exposed; both under the ring's name.
        hidden, exposed = mmtrain.distributed.EXPOSED_HIDDEN, mmtrain.distributed.EXPOSED_ALL
        expected = [(hidden, "ring_exchange", True), (exposed, "ring_exchange", True)]
        assert sorted(result["pass"]["spans"]) == sorted(expected)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "masked"), CAUSAL_CASES)
def test_ring_attention_causal_equals_unsplit_attention(ranks, layout, masked):
    expected = reference_causal(full_inputs(2), masked)
    assert_matches([r[("causal", layout, masked)] for r in ranks], expected, layout)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "masked"), CAUSAL_CASES)
def test_ring_attention_in_blocks_of_few_queries_is_still_exact(ranks, layout, masked):
    expected = reference_causal(full_inputs(2), masked)
    assert_matches([r[("blocks", layout, masked)] for r in ranks], expected, layout)
    assert_matches([r[("math", layout, masked)] for r in ranks], expected, layout)
    inputs = cross_inputs(full_inputs(3))
    allowed = cross_key_valid()[:, None, None, :].expand(B, 1, IMAGE, T)
    cross = output_and_grads(lambda q, k, v: dense_reference(q, k, v, allowed), inputs, inputs["w"])
    assert_matches([r[("blocks-cross", True)] for r in ranks], cross, CONTIGUOUS)


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True])
def test_ring_attention_of_a_query_subset_over_all_keys(ranks, masked):
    inputs = cross_inputs(full_inputs(3))
    if masked:
        allowed = cross_key_valid()[:, None, None, :].expand(B, 1, IMAGE, T)
        expected = output_and_grads(
            lambda q, k, v: dense_reference(q, k, v, allowed), inputs, inputs["w"]
        )
        assert torch.all(expected["out"][1] == 0)
    else:
        expected = output_and_grads(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            inputs,
            inputs["w"],
        )
    assert_matches([r[("cross", masked)] for r in ranks], expected, CONTIGUOUS)


# ----------------------------------------------------------------------------- one rank
@pytest.mark.parametrize(("layout", "masked"), CAUSAL_CASES)
def test_one_rank_ring_attention_equals_unsplit_attention(layout, masked):
    inputs = full_inputs(4)
    masks = {}
    if masked:
        masks = {"documents": document_runs(DOCUMENT_IDS), "key_valid": key_valid_of(DOCUMENT_IDS)}
    group = SequenceGroup.single()
    actual = output_and_grads(
        lambda q, k, v: ring_attention(q, k, v, group, causal=True, layout=layout, **masks),
        inputs,
        inputs["w"],
    )
    expected = reference_causal(inputs, masked)
    for name in ("out", "dq", "dk", "dv"):
        assert_close(actual[name], expected[name], name)


class AttentionOps(TorchDispatchMode):
    """Counts the calls of SDPA's CPU flash kernels (forward, backward) and of logsumexp (the
    math blocks'), with the dtypes of the flash kernel's q, k and v."""

    FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"flash": 0, "flash_backward": 0, "logsumexp": 0}
        self.dtypes: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.FLASH:
            self.counts["flash"] += 1
            self.dtypes.add(tuple(a.dtype for a in args[:3]))
        elif func is self.FLASH_BACKWARD:
            self.counts["flash_backward"] += 1
        elif func is torch.ops.aten.logsumexp.default:
            self.counts["logsumexp"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("layout", "masked"), CAUSAL_CASES)
def test_one_rank_ring_attention_runs_its_blocks_in_the_fused_cpu_kernel(layout, masked):
    """Every block through SDPA's CPU flash kernel (it returns the log-sum-exp): one call per
    block forward and backward, no block math; float64, equal to unsplit attention."""
    inputs = full_inputs(4)
    masks = {}
    if masked:
        masks = {"documents": document_runs(DOCUMENT_IDS), "key_valid": key_valid_of(DOCUMENT_IDS)}
    group = SequenceGroup.single()
    with AttentionOps() as ops:
        actual = output_and_grads(
            lambda q, k, v: ring_attention(q, k, v, group, causal=True, layout=layout, **masks),
            inputs,
            inputs["w"],
        )
    blocks = len(local_chunks(layout, 0, 1)) * (len(local_chunks(layout, 0, 1)) + 1) // 2
    assert ops.counts == {"flash": blocks, "flash_backward": blocks, "logsumexp": 0}
    assert ops.dtypes == {(DT, DT, DT)}
    expected = reference_causal(inputs, masked)
    for name in ("out", "dq", "dk", "dv"):
        assert_close(actual[name], expected[name], name)


def test_the_math_blocks_run_where_no_fused_kernel_applies():
    inputs = full_inputs(4)
    masks = {"documents": document_runs(DOCUMENT_IDS), "key_valid": key_valid_of(DOCUMENT_IDS)}
    assert block_kernel(inputs["q"], inputs["k"], inputs["v"], True) == CPU_FLASH
    with sdpa_kernel(SDPBackend.MATH):
        assert block_kernel(inputs["q"], inputs["k"], inputs["v"], True) == MATH
        with AttentionOps() as ops:
            actual = output_and_grads(
                lambda q, k, v: ring_attention(
                    q, k, v, SequenceGroup.single(), causal=True, layout=ZIGZAG, **masks
                ),
                inputs,
                inputs["w"],
            )
    assert ops.counts["flash"] == ops.counts["flash_backward"] == 0 < ops.counts["logsumexp"]
    expected = reference_causal(inputs, True)
    for name in ("out", "dq", "dk", "dv"):
        assert_close(actual[name], expected[name], name)


def test_fp32_inputs_reach_the_fused_kernel_in_the_autocast_dtype():
    """Under bf16 autocast the blocks read bf16 (as SDPA would), merged in fp32; gradients come
    back in the inputs' fp32."""
    inputs = {n: t.float() for n, t in full_inputs(9).items()}
    masks = {"documents": document_runs(DOCUMENT_IDS), "key_valid": key_valid_of(DOCUMENT_IDS)}
    with AttentionOps() as ops, torch.autocast("cpu", dtype=torch.bfloat16):
        actual = output_and_grads(
            lambda q, k, v: ring_attention(
                q, k, v, SequenceGroup.single(), causal=True, layout=ZIGZAG, **masks
            ),
            inputs,
            inputs["w"],
        )
    assert ops.dtypes == {(torch.bfloat16,) * 3}
    assert actual["out"].dtype == torch.bfloat16 and actual["dq"].dtype == torch.float32
    # Against float64 attention of the bf16-rounded inputs: the kernel rounds its softmax
    # weights and each block's output to bf16 (2^-8 relative, each at most max|v| in size),
    # the ring its merged output once more; its fp32 sums of <= T terms add T 2^-24 max|v|.
    rounded = {n: t.bfloat16().double() for n, t in inputs.items()}
    expected = reference_causal(rounded, True)
    bound = (3 * 2**-8 + T * 2**-24) * rounded["v"].abs().max().item()
    assert (actual["out"].double() - expected["out"]).abs().max().item() <= bound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's fused kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_fused_blocks_are_as_exact_as_the_math_blocks(dtype, masked):
    """CUDA's flash (bf16, unmasked) and memory-efficient kernels against float64 attention of
    the same `dtype`-rounded inputs: their error is at most twice the math blocks' (which
    compute in fp32 and round once) plus one rounding of the largest value, while one wrong
    key moves an output by ~1e-1."""
    cuda = torch.device("cuda")
    inputs = {n: t.to(dtype).double() for n, t in full_inputs(10).items()}
    masks = {}
    if masked:
        masks = {"documents": document_runs(DOCUMENT_IDS), "key_valid": key_valid_of(DOCUMENT_IDS)}
    exact = reference_causal(inputs, masked)
    on_cuda = {n: t.to(cuda, dtype) for n, t in inputs.items()}
    cuda_masks = {n: t.to(cuda) for n, t in masks.items()}
    kernel = block_kernel(on_cuda["q"], on_cuda["k"], on_cuda["v"], masked)
    assert kernel == (FLASH if dtype == torch.bfloat16 and not masked else EFFICIENT)

    def ring(q, k, v):
        return ring_attention(
            q, k, v, SequenceGroup.single(), causal=True, layout=ZIGZAG, **cuda_masks
        )

    fused = output_and_grads(ring, on_cuda, on_cuda["w"])
    with sdpa_kernel(SDPBackend.MATH):
        math_blocks = output_and_grads(ring, on_cuda, on_cuda["w"])
    unit = torch.finfo(dtype).eps / 2
    for name in ("out", "dq", "dk", "dv"):
        fused_error, math_error = (
            (result[name].cpu().double() - exact[name]).abs().max().item()
            for result in (fused, math_blocks)
        )
        scale = exact[name].abs().max().item()
        assert fused_error <= 2 * math_error + unit * scale, name


def test_one_rank_ring_attention_gradients_pass_gradcheck():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 6, 3, generator=g, dtype=DT, requires_grad=True)
    k = torch.randn(1, 1, 6, 3, generator=g, dtype=DT, requires_grad=True)
    v = torch.randn(1, 1, 6, 3, generator=g, dtype=DT, requires_grad=True)
    runs = torch.tensor([[0, 0, 0, 1, 1, 2]])
    valid = torch.tensor([[True, False, True, True, True, False]])

    def ring(q, k, v):
        return ring_attention(
            q, k, v, SequenceGroup.single(), causal=True, layout=ZIGZAG, documents=runs,
            key_valid=valid,
        )  # fmt: skip

    assert torch.autograd.gradcheck(ring, (q, k, v))


def test_queries_without_any_key_give_zero_output_and_gradients():
    inputs = full_inputs(6)
    valid = torch.zeros(B, T, dtype=torch.bool)
    actual = output_and_grads(
        lambda q, k, v: ring_attention(
            q, k, v, SequenceGroup.single(), causal=False, key_valid=valid
        ),
        inputs,
        inputs["w"],
    )
    for name in ("out", "dq", "dk", "dv"):
        assert torch.all(actual[name] == 0), name


def test_half_precision_inputs_keep_their_dtype_under_autocast():
    inputs = {n: t.float() for n, t in full_inputs(7).items()}
    half = {n: t.bfloat16() for n, t in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(
            half["q"], half["k"], half["v"], SequenceGroup.single(), causal=True, layout=ZIGZAG
        )
    assert out.dtype == torch.bfloat16
    expected = attend(inputs["q"], inputs["k"], inputs["v"], None, True)
    assert (out.float() - expected).abs().max().item() < 5e-2


def test_local_chunks_balance_zigzag():
    assert local_chunks(CONTIGUOUS, 2, 4) == (2,)
    assert local_chunks(ZIGZAG, 1, 4) == (1, 6)
    assert local_indices(ZIGZAG, 0, 2, 8).tolist() == [0, 1, 6, 7]


# ----------------------------------------------------------------------------- misuse
def test_misuse_raises_errors_that_name_the_argument():
    inputs = full_inputs(8)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    one = SequenceGroup.single()
    with pytest.raises(ValueError, match="causal"):
        ring_attention(q[:, :, :IMAGE], k, v, one, causal=True)
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, k, v, one, causal=True, layout="striped")
    with pytest.raises(ValueError, match="divisible"):
        ring_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], one, causal=True, layout=ZIGZAG)
    with pytest.raises(ValueError, match="kv heads"):
        ring_attention(q[:, :3], k, v, one, causal=True)
    with pytest.raises(ValueError, match="query_documents"):
        ring_attention(
            q[:, :, :IMAGE], k, v, one, causal=False, documents=document_runs(DOCUMENT_IDS)
        )
    with pytest.raises(ValueError, match="layout"):
        local_chunks("striped", 0, 2)
    three = SequenceGroup(group=object(), size=3, rank=0, ranks=(0, 1, 2))
    with pytest.raises(ValueError, match=r"heads \(4\).*N \(3\)"):
        sequence_to_heads(q, three)
