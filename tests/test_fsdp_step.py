"""One optimizer step under FSDP2 with gradient accumulation, on 2 real gloo ranks (CPU):

- every micro-batch's gradient is reduce-scattered into the gradient shards, so between
  micro-batches a rank holds only its shards, never an unsharded gradient per parameter
  (`set_requires_gradient_sync(False)` held one: +4 B/param in fp32 on a GPU);
- the gradients, their norm and the weights after the step are the single-process big
  batch's (float64: the ranks sum in another order, rounding stays ~1e-16 per operation);
- the gradient clipping runs on the foreach kernels with the sharded (DTensor) gradients
  (`clip_grad_norm_`'s default leaves them for a loop of one norm per parameter).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mmtrain
from dist_helpers import run_distributed
from micro import micro_spec
from mmtrain.losses import ContrastiveLoss
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.measure_step import random_batch
from mmtrain.train.objectives import ContrastiveObjective
from mmtrain.train.precision import make_precision
from mmtrain.train.step import forward_backward, optimizer_step

SPEC = ModelSpec.from_dict(micro_spec("micro", embed_dim=16, context_length=8, text_pooling=None))
FP64 = make_precision("fp64", torch.device("cpu"))
EXACT = {"rtol": 1e-9, "atol": 1e-12}  # float64 (see tests/test_parallel.py)
BATCH, MICRO_BATCHES, WORLD = 8, 4, 2
GRAD_CLIP = 1e-3  # below the gradient's norm: the clip scales every gradient


class CountOps(TorchDispatchMode):
    """Counts the aten ops called with tensors (DTensors included: the mode sees the op before
    DTensor turns it into its local ops)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard; a tensor itself


def _leaf_storages() -> dict[int, int]:
    """{address: bytes} of the storages of every tensor alive in this process that autograd
    did not produce (no grad_fn: parameters, gradients, buffers, inputs) and is not a scalar,
    with the gradients of the leaves. What a gradient is held in, FSDP's own buffers
    included, is one of these, whoever references it."""
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): no proxy objects asked
            continue
        tensors = [obj]
        if obj.is_leaf and obj.grad is not None:
            tensors.append(obj.grad)
        for tensor in map(_local, tensors):
            if tensor.grad_fn is not None or tensor.dim() == 0 or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def _global_batch() -> dict[str, torch.Tensor]:
    batch = random_batch(SPEC, BATCH, torch.Generator().manual_seed(7))
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def _model() -> torch.nn.Module:
    return mmtrain.create_model(SPEC, seed=0).double()


def _step(model, trained, micro_batches) -> dict:
    """forward_backward + optimizer_step of one step; the full gradients (before the clip),
    the norm, the weights after the step and the clip's aten ops."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)  # no foreach ops
    objective = ContrastiveObjective(model, ContrastiveLoss.from_spec(SPEC))
    forward_backward(trained, [objective], micro_batches, FP64)
    grads = {n: p.grad for n, p in model.named_parameters()}
    full = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    shard_bytes = sum({_local(g).untyped_storage().data_ptr(): _local(g).untyped_storage().nbytes()
                       for g in grads.values() if g.dim()}.values())  # fmt: skip
    full = {n: g.detach().clone() for n, g in full.items()}  # before the clip scales them
    with CountOps() as ops:
        norm, stepped, _ = optimizer_step(model, optimizer, FP64, GRAD_CLIP)
    assert stepped
    return {
        "grads": full,
        "norm": norm,
        "weights": parallel.full_model_state_dict(model),
        "ops": ops.calls,
        "shard_bytes": shard_bytes,
    }


def _fsdp_step(rank: int, world: int) -> dict:
    """This rank's share of the global batch in MICRO_BATCHES micro-batches under FSDP2, with
    the bytes of gradient storage alive as each micro-batch's forward starts."""
    model = _model()
    trained = parallel.apply_fsdp(model, "fp64")
    held: list[int] = []
    before: dict[int, int] = {}

    def census(module, args):
        if not torch.is_grad_enabled():
            return  # the contrastive objective's feature pass (no gradient)
        alive = _leaf_storages()
        if not held and not before:
            before.update(alive)  # the first micro-batch: what the step started with
        held.append(sum(n for ptr, n in alive.items() if ptr not in before))

    # Before FSDP's own pre-forward, which gathers the root's parameters.
    model.register_forward_pre_hook(census, prepend=True)
    mine = {k: v.chunk(world)[rank] for k, v in _global_batch().items()}
    micro = [{k: v.chunk(MICRO_BATCHES)[j] for k, v in mine.items()} for j in range(MICRO_BATCHES)]
    result = _step(model, trained, micro)
    result["held"] = held
    result["unsharded_grad_bytes"] = sum(
        p.numel() * p.element_size() for p in model.parameters() if p.dim() and p.requires_grad
    )
    return result


@pytest.fixture(scope="module")
def runs() -> tuple[dict, dict]:
    fsdp = run_distributed(_fsdp_step, WORLD, timeout_s=300)[0]
    model = _model()
    single = _step(model, model, [_global_batch()])  # one process, one big batch
    return fsdp, single


@pytest.mark.slow
def test_accumulation_holds_only_gradient_shards_between_micro_batches(runs):
    fsdp, _ = runs
    held, shards, unsharded = fsdp["held"], fsdp["shard_bytes"], fsdp["unsharded_grad_bytes"]
    assert len(held) == MICRO_BATCHES and held[0] == 0
    # The shards are about half of the gradient on 2 ranks (a row of padding per parameter).
    assert shards < 0.6 * unsharded, (shards, unsharded)
    # After micro-batches 1..3 the gradient lives in the shards and nowhere else: holding an
    # unsharded copy (FSDP without its reduce-scatter) is `unsharded` bytes more.
    for j, alive in enumerate(held[1:], start=1):
        assert alive <= shards, f"before micro-batch {j}: {alive} B alive, shards {shards} B"


@pytest.mark.slow
def test_fsdp_accumulation_equals_the_single_process_big_batch(runs):
    fsdp, single = runs
    assert list(fsdp["grads"]) == list(single["grads"])
    torch.testing.assert_close(fsdp["grads"], single["grads"], **EXACT)
    torch.testing.assert_close(fsdp["norm"], single["norm"], **EXACT)
    assert fsdp["norm"] > GRAD_CLIP  # so the clip scaled the gradients before the step
    torch.testing.assert_close(fsdp["weights"], single["weights"], **EXACT)


@pytest.mark.slow
def test_clipping_sharded_gradients_runs_the_foreach_kernels(runs):
    fsdp, single = runs
    for ops in (fsdp["ops"], single["ops"]):  # DTensor gradients, and plain CPU tensors
        assert ops.get("_foreach_norm", 0) >= 1, ops
        assert ops.get("_foreach_mul_", 0) >= 1, ops
        # One norm per parameter is the loop foreach replaces; one norm of the norms remains.
        assert ops.get("linalg_vector_norm", 0) <= 1, ops


def test_without_a_clip_the_norm_is_measured_and_no_gradient_rewritten():
    """`train.grad_clip: null`: the norm is still reported, and no pass multiplies every
    gradient by 1 (what clipping to an infinite norm does: a read and write of each)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    objective = ContrastiveObjective(model, ContrastiveLoss.from_spec(SPEC))
    forward_backward(model, [objective], [_global_batch()], FP64)
    grads = [p.grad.clone() for p in model.parameters()]
    with CountOps() as ops:
        norm, stepped, _ = optimizer_step(model, optimizer, FP64, grad_clip=None)
    assert stepped and ops.calls.get("_foreach_norm", 0) >= 1
    assert "_foreach_mul_" not in ops.calls, ops.calls  # (AdamW runs no foreach op here)
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(norm, want, **EXACT)
