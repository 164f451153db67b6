"""Training throughput on the CPU: samples/s and step time of mmtrain's training step for
tiny-clip and a small ViT CLIP, fp32 vs bf16 autocast, with vs without activation
checkpointing, all in one run, with the ratios.

The step is the trainer's own (`forward_backward` + `optimizer_step` of train/loop.py: loss in
fp32, gradient clipping, AdamW) on synthetic batches of the batch contract's shapes, so data
loading is not measured here (the loader has its own benchmark). Prints a table and appends
it to bench/RESULTS.md with the command and the machine.

    python bench/train_throughput.py [--steps 10] [--batch 32] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from common import append_results

import mmtrain
from mmtrain.losses import ContrastiveLoss
from mmtrain.plan.measure import random_batch
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.train.loop import forward_backward, optimizer_step
from mmtrain.train.parallel import apply_activation_checkpointing
from mmtrain.train.precision import make_precision

# A ViT-S/16-shaped image tower at 96 px (36 tokens) with a small text tower: "a small ViT".
SMALL_VIT = {
    "name": "small-vit-clip",
    "embed_dim": 256,
    "pairs": [["image", "text"]],
    "towers": {
        "image": {
            "modality": "image",
            "stem": {"image_size": 96, "patch_size": 16},
            "width": 384,
            "layers": 6,
            "heads": 6,
        },
        "text": {
            "modality": "text",
            "stem": {"vocab_size": 258, "context_length": 32},
            "width": 256,
            "layers": 4,
            "heads": 4,
        },
    },
}


def measure(spec: ModelSpec, precision: str, ac: str, batch: int, steps: int) -> dict:
    """Median step time over `steps` timed steps after 2 warm-up steps."""
    model = mmtrain.create_model(spec, seed=0)
    apply_activation_checkpointing(model, ac)
    prec = make_precision(precision, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = ContrastiveLoss.from_spec(spec, distributed=False)
    data = random_batch(spec, batch, torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, model, loss_fn, [data], prec)
        optimizer_step(model, optimizer, prec, 1.0)
        if i >= 2:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"step_s": step_s, "samples_s": batch / step_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny-clip only, 3 steps")
    parser.add_argument("--no-append", action="store_true", help="print only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {"tiny-clip": load_spec("tiny-clip")}
    if not args.quick:
        models["small-vit-clip"] = ModelSpec.from_dict(SMALL_VIT)
    steps = 3 if args.quick else args.steps
    rows = [
        "| model | precision | AC | batch | step ms | samples/s | vs fp32 | vs no AC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print(rows[0], flush=True)
    for name, spec in models.items():
        base = {}
        for precision in ("fp32", "bf16"):
            for ac in ("none", "full"):
                r = measure(spec, precision, ac, args.batch, steps)
                base[precision, ac] = r["samples_s"]
                vs_fp32 = r["samples_s"] / base["fp32", ac]
                vs_ac = r["samples_s"] / base[precision, "none"]
                rows.append(
                    f"| {name} | {precision} | {ac} | {args.batch} | {1e3 * r['step_s']:.1f} "
                    f"| {r['samples_s']:.1f} | {vs_fp32:.2f}x | {vs_ac:.2f}x |"
                )
                print(rows[-1], flush=True)
    notes = [
        f"threads: {torch.get_num_threads()}; median of {steps} steps after 2 warm-up; synthetic "
        "batches (no data loading). 'vs fp32': samples/s over the same case in fp32; 'vs no AC': "
        "over the same precision without activation checkpointing."
    ]
    if not args.no_append:
        append_results("train_throughput", rows, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
