"""What a native-resolution VLM's step waits for on a GPU, in one line of figures
(`vlm_syncs_note`, for bench/gpu_bench.py):

- the device syncs of a native VLM's forward and backward (padded and packed rows of pages at
  their own sizes), counted under `torch.cuda.set_sync_debug_mode("warn")`; the batch comes
  pinned and moves without blocking, as the loader's does (tests/test_host_reads.py counts the
  same on the CPU: 0 from mmtrain's code; what is left here is torch's or the kernels');
- the vision tower compiled per block (`train.compile`) over 4 micro-batches of other page
  sizes: frames dynamo compiled after each (a count that still rises at the 3rd and 4th is a
  recompile per layout; tests/test_vision_compile.py holds it on the CPU), and the last
  layout's forward + backward time compiled against eager.

Tiny sizes on the CPU (`dry_run`, seconds: no sync counting there); on CUDA tiny-qwen2-vl for
the syncs (the count is the code's, not the size's) and a Qwen2.5-VL-7B-shaped tower of two
blocks (one windowed, one full) in bf16 on pages of 448 to 1008 pixels a side.

    PYTHONPATH=src:bench python bench/gpu_vlm_syncs.py [--dry-run]
"""

from __future__ import annotations

import argparse
import dataclasses
import random

import torch
from common import count_syncs, median_seconds

from mmtrain.models import create_model
from mmtrain.models.native_vision import NativeVisionTower
from mmtrain.models.splice import splice_sizes
from mmtrain.models.visual_inputs import IMAGES, VIDEO_FPS, VIDEOS
from mmtrain.models.vlm import SPLICE_SIZES
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.train.step import move_batch

BF16 = torch.bfloat16
IGNORE = -100


def _pages(rng: random.Random, unit: int, sides: range, count: int) -> list[torch.Tensor]:
    return [torch.rand(3, rng.choice(sides) * unit, rng.choice(sides) * unit)
            for _ in range(count)]  # fmt: skip


def native_batch(spec: ModelSpec, rows: int, pack: bool, seed: int) -> dict:
    """A native VLM's batch as the loader lays it out (data/stream/conversation_batches.py):
    a few text ids around each page's placeholder, two samples per row when packed (document
    ids), right padding otherwise; the splice's sizes counted on the host."""
    assert spec.vision is not None and spec.vision_tokens is not None
    rng = random.Random(seed)
    image_id = spec.vision_tokens.image_token_id
    unit = spec.vision.merge_unit_pixels()
    ids, documents, images, counts = [], [], [], []
    for _ in range(rows):
        row, docs = [], []
        for document in range(2 if pack else 1):
            page = _pages(rng, unit, range(2, 9), 1)[0]
            images.append(page)
            counts.append(spec.vision.tokens(page.shape[1], page.shape[2]))
            text = [rng.randrange(200) for _ in range(rng.randrange(3, 12))]
            sample = [*text[:2], image_id, *text[2:]]
            row += sample
            docs += [document] * len(sample)
        ids.append(row)
        documents.append(docs)
    width = max(len(row) for row in ids)
    text = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    document_ids = torch.tensor([d + [-1] * (width - len(d)) for d in documents])
    labels = torch.where((document_ids >= 0) & (text != image_id), text, IGNORE)
    labels[:, 0] = IGNORE
    batch: dict = {"text": text, "labels": labels}
    if pack:
        batch["document_ids"] = document_ids
    else:
        batch["attention_mask"] = document_ids >= 0
    batch.update({IMAGES: images, VIDEOS: [], VIDEO_FPS: []})
    batch[SPLICE_SIZES] = splice_sizes(
        (text == image_id) & (document_ids >= 0), torch.tensor(counts), batch.get("attention_mask")
    )
    return batch


def _pinned(batch: dict) -> dict:
    def pin(value):
        if isinstance(value, list):
            return [pin(v) for v in value]
        return value.pin_memory() if isinstance(value, torch.Tensor) else value

    return {key: pin(value) for key, value in batch.items()}


def step_syncs(device: torch.device, pack: bool) -> int | None:
    """Syncs of one forward and backward of tiny-qwen2-vl (None off CUDA: nothing to count)."""
    spec = load_spec("tiny-qwen2-vl")
    model = create_model(spec, seed=0).to(device)
    batch = native_batch(spec, rows=4, pack=pack, seed=1)
    if device.type != "cuda":
        model(move_batch(batch, device))["nll_sum"].backward()  # runs; nothing to count
        return None
    batch = _pinned(batch)

    def step() -> None:
        moved = move_batch(batch, device)  # pinned: asynchronous copies
        with torch.autocast("cuda", BF16):
            nll = model(moved)["nll_sum"]
        nll.backward()

    step()  # warm-up: first calls set up kernels and workspaces
    return count_syncs(step, device)


def tower_recompiles(device: torch.device, dry_run: bool) -> tuple[list[int], float, float]:
    """Compiled frames after each of 4 layouts, and the last layout's forward + backward
    seconds compiled and eager (median of 3)."""
    from torch._dynamo.utils import counters

    spec = dataclasses.replace(
        load_spec("Qwen2.5-VL-7B").vision, depth=2, full_attention_blocks=(1,)
    )
    if dry_run:
        spec = dataclasses.replace(spec, width=64, heads=2, mlp_hidden=64)
    dtype = BF16 if device.type == "cuda" else torch.float32
    eager = NativeVisionTower(spec).to(device, dtype)
    compiled = NativeVisionTower(spec).to(device, dtype)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.blocks:  # dry run: dynamo alone (the same recompiles), in seconds
        block.compile(backend="eager" if dry_run else "inductor")
    torch._dynamo.reset()
    counters.clear()
    unit = spec.merge_unit_pixels()
    sides = range(2, 5) if dry_run else range(448 // unit, 1008 // unit + 1)
    rng = random.Random(0)
    layouts = [_pages(rng, unit, sides, count) for count in (2, 3, 1, 4)]

    def run(tower: NativeVisionTower, pages: list[torch.Tensor]) -> None:
        tokens = torch.cat(tower.embed([p.to(device, dtype) for p in pages]))
        tokens.float().square().mean().backward()

    frames = []
    for pages in layouts:
        run(compiled, pages)
        frames.append(counters["frames"]["ok"])
    seconds = [median_seconds(lambda t=tower: run(t, layouts[-1]), device, 3)
               for tower in (compiled, eager)]  # fmt: skip
    return frames, seconds[0], seconds[1]


def vlm_syncs_note(device: torch.device, dry_run: bool) -> str:
    syncs = {name: step_syncs(device, pack) for name, pack in (("padded", False), ("packed", True))}
    frames, compiled_s, eager_s = tower_recompiles(device, dry_run)
    counted = (
        ", ".join(f"{n} {c}" for n, c in syncs.items())
        if device.type == "cuda"
        else f"not counted on {device.type}"
    )
    return (
        f"native VLM fwd+bwd device syncs: {counted}; vision tower compiled per block over 4 "
        f"page layouts: compiled frames {frames} (flat after the 2nd: no recompile per layout), "
        f"last layout fwd+bwd {compiled_s * 1e3:.1f} ms compiled vs {eager_s * 1e3:.1f} ms eager"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    print(vlm_syncs_note(torch.device("cuda" if cuda else "cpu"), dry_run=not cuda))


if __name__ == "__main__":
    main()
