"""The attention path on a GPU, in one line of figures (`attention_note`, for bench/gpu_bench.py):

- a packed bf16 step with fp32 parameters (DDP's and one GPU's layout: bf16 autocast), the
  dtypes of q, k and v each attention kernel receives, and its time against the same model cast
  to bf16 (no autocast);
- which attention kernel runs (torch.profiler's kernel names) for padded-causal decoder rows,
  packed rows (flex attention), ViT blocks, a native-resolution vision tower's windowed and
  full blocks and DiT blocks, and a strict flash-only run of the SDPA ones
  (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`, which raises where flash cannot run);
- ring attention's blocks (one-rank group) through the fused kernel `ring_blocks.block_kernel`
  picks against the math blocks (`sdpa_kernel(SDPBackend.MATH)`), and their largest difference.

Tiny sizes on the CPU (`dry_run`, seconds); on CUDA a 2-layer decoder of 2048 width (16 query
heads of 128, 4 kv heads) on 8192-token packed rows, ViT-B/16 and DiT-XL/2 blocks, a
Qwen2.5-VL-7B-shaped vision tower of two blocks on a 448 x 448 image.

    PYTHONPATH=src:bench python bench/gpu_attention.py [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable

import torch
from common import median_seconds, sync
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import mmtrain.models.decoder as decoder_module
from mmtrain.models.attention import attention_dtype
from mmtrain.models.decoder import Decoder
from mmtrain.models.dit import DiTBlock
from mmtrain.models.layers import Block
from mmtrain.models.native_vision import NativeVisionTower
from mmtrain.spec import load_spec
from mmtrain.train.ring_attention import ZIGZAG, ring_attention
from mmtrain.train.ring_blocks import block_kernel
from mmtrain.train.sequence_comm import SequenceGroup

ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|attn|sdpa|triton_tem|cutlass", re.I)
BF16 = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Sizes:
    width: int
    heads: int
    kv_heads: int
    tokens: int
    vit_batch: int
    vit_width: int
    dit_batch: int
    image_side: int
    ring_tokens: int


CUDA_SIZES = Sizes(2048, 16, 4, 8192, 32, 768, 8, 448, 16384)
CPU_SIZES = Sizes(64, 4, 2, 256, 2, 64, 2, 224, 256)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _median_ms(step: Callable[[], None], device: torch.device) -> float:
    steps = 5 if device.type == "cuda" else 1  # the CPU's run only proves the script runs
    return 1e3 * median_seconds(step, device, steps)  # its warm-up compiles, picks kernels


def _documents(rows: int, tokens: int, device: torch.device) -> torch.Tensor:
    """Packed rows: documents of 1/2, 1/4, 1/8 ... of the row (a long and many short ones)."""
    ids, start, doc = torch.empty(rows, tokens, dtype=torch.long), 0, 0
    while start < tokens:
        length = max(tokens // 2 ** (doc + 1), 16)
        ids[:, start : start + length] = doc
        start, doc = start + length, doc + 1
    return ids.to(device)


def _decoder(s: Sizes, device: torch.device) -> Decoder:
    spec = load_spec("tiny-vlm").decoder.replace(
        width=s.width, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.width // s.heads,
        mlp_hidden=2 * s.width, layers=2,
    )  # fmt: skip
    model = Decoder(spec)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.to(device)


def packed_step_part(s: Sizes, device: torch.device) -> str:
    """(a): fp32 parameters under bf16 autocast against the model cast to bf16."""
    model = _decoder(s, device)
    ids = torch.randint(0, 256, (1, s.tokens), device=device)
    docs = _documents(1, s.tokens, device)
    seen: set[str] = set()  # q/k/v as the decoder hands them -> the one dtype the kernel gets
    real_attend = decoder_module.attend

    def recording(q, k, v, mask, is_causal):
        handed = "/".join(_name(t.dtype) for t in (q, k, v))
        seen.add(f"{handed} -> {_name(attention_dtype(q, k, v))}")
        return real_attend(q, k, v, mask, is_causal)

    def step(m: Decoder, autocast: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast(device.type, dtype=BF16, enabled=autocast):
                m(ids, document_ids=docs).float().square().mean().backward()
            m.zero_grad(set_to_none=True)

        return run

    decoder_module.attend = recording
    try:
        mixed_ms = _median_ms(step(model, True), device)
        cast = model.to(BF16)
        bf16_ms = _median_ms(step(cast, False), device)
    finally:
        decoder_module.attend = real_attend
    return (
        f"packed step ({s.tokens} tokens): fp32 params + bf16 autocast {mixed_ms:.1f} ms, "
        f"bf16 model {bf16_ms:.1f} ms, q/k/v {', '.join(sorted(seen))}"
    )


def _attention_kernels(run: Callable[[], None], device: torch.device) -> str:
    """The attention kernels a forward and backward of `run` launches (CUDA kernel names; the
    CPU's aten ops on a CPU)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    run()  # compiled kernels built outside the profile
    sync(device)
    with profile(activities=activities) as prof:
        run()
        sync(device)
    on_device = device.type == "cuda"
    names = {
        e.name for e in prof.events()
        if (e.device_type == torch.autograd.DeviceType.CUDA) == on_device
        and ATTENTION_KERNEL.search(e.name) and (on_device or e.name.startswith("aten::"))
    }  # fmt: skip
    return ", ".join(sorted(n[:60] for n in names)) or "none found"


def _cases(s: Sizes, device: torch.device) -> dict[str, Callable[[], None]]:
    """Forward and backward of each attention path in bf16 (parameters cast to bf16)."""
    g = torch.Generator().manual_seed(1)
    decoder = _decoder(s, device).to(BF16)
    ids = torch.randint(0, 256, (1, s.tokens), generator=g).to(device)
    docs = _documents(1, s.tokens, device)
    vit = Block(s.vit_width, s.vit_width // 64, 4 * s.vit_width).to(device, BF16)
    vit_x = torch.randn(s.vit_batch, 197, s.vit_width, generator=g).to(device, BF16)
    vision_spec = dataclasses.replace(
        load_spec("Qwen2.5-VL-7B").vision, depth=2, full_attention_blocks=(1,)
    )
    if device.type != "cuda":
        vision_spec = dataclasses.replace(vision_spec, width=64, heads=2, mlp_hidden=64)
    tower = NativeVisionTower(vision_spec).to(device, BF16)
    image = torch.rand(3, s.image_side, s.image_side, generator=g)
    dit_spec = load_spec("DiT-XL-2").denoiser
    if device.type != "cuda":
        dit_spec = dataclasses.replace(dit_spec, width=64, heads=4)
    dit = DiTBlock(dit_spec).to(device, BF16)
    dit_x = torch.randn(s.dit_batch, 256, dit_spec.width, generator=g).to(device, BF16)
    dit_c = torch.randn(s.dit_batch, dit_spec.width, generator=g).to(device, BF16)

    def backward(out: torch.Tensor) -> None:
        out.float().square().mean().backward()

    def vision() -> None:
        patches, grid = tower.patchify([image.to(device, BF16)])
        backward(tower(patches, grid))

    return {
        "padded-causal": lambda: backward(decoder(ids)),
        "packed": lambda: backward(decoder(ids, document_ids=docs)),
        "vit": lambda: backward(vit(vit_x)),
        "windowed vision": vision,
        "dit": lambda: backward(dit(dit_x, dit_c)),
    }


def kernels_part(s: Sizes, device: torch.device) -> str:
    """(b): each path's kernels, and the SDPA paths under flash only."""
    cases = _cases(s, device)
    kernels = "; ".join(f"{name}: {_attention_kernels(run, device)}" for name, run in cases.items())
    strict = []
    for name, run in cases.items():
        if name == "packed":  # flex attention: not an SDPA backend
            continue
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                run()
            sync(device)
            strict.append(f"{name} ok")
        except RuntimeError as error:
            strict.append(f"{name} RAISED {str(error).splitlines()[0][:80]}")
    return f"kernels: {kernels} | flash only: {', '.join(strict)}"


def ring_part(s: Sizes, device: torch.device) -> str:
    """Ring attention's fused blocks against its math blocks (one-rank group, causal zig-zag,
    bf16, forward and backward)."""
    g = torch.Generator().manual_seed(2)
    d = s.width // s.heads
    q = torch.randn(1, s.heads, s.ring_tokens, d, generator=g).to(device, BF16)
    k = torch.randn(1, s.kv_heads, s.ring_tokens, d, generator=g).to(device, BF16)
    v = torch.randn(1, s.kv_heads, s.ring_tokens, d, generator=g).to(device, BF16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    group = SequenceGroup.single()
    outputs = {}

    def run(label: str) -> Callable[[], None]:
        def step() -> None:
            out = ring_attention(*leaves, group, causal=True, layout=ZIGZAG)
            out.float().square().mean().backward()
            outputs[label] = out.detach()

        return step

    fused = block_kernel(q, k, v, masked=False)
    fused_ms = _median_ms(run("fused"), device)
    with sdpa_kernel(SDPBackend.MATH):
        math_ms = _median_ms(run("math"), device)
    diff = (outputs["fused"].float() - outputs["math"].float()).abs().max().item()
    return (
        f"ring ({s.ring_tokens} tokens, bf16): {fused} blocks {fused_ms:.1f} ms vs math "
        f"{math_ms:.1f} ms ({math_ms / fused_ms:.1f}x), max |diff| {diff:.2g}"
    )


def attention_note(device: torch.device, dry_run: bool) -> str:
    """One line: the packed step, the kernels of every path, flash-only, the ring's blocks."""
    s = CPU_SIZES if dry_run or device.type != "cuda" else CUDA_SIZES
    parts = [packed_step_part(s, device), kernels_part(s, device), ring_part(s, device)]
    return f"attention on {device.type}: " + " | ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    print(attention_note(torch.device("cuda" if cuda else "cpu"), args.dry_run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
