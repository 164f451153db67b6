"""Check the planner against a published training time: LLaVA-1.5-7B stage 2 (visual
instruction tuning on the 665K mixture), planned from a length distribution, padded and packed.

Published (haotian-liu/LLaVA README, "Visual Instruction Tuning", commit 022a1057): "Visual
instruction tuning takes around 20 hours for LLaVA-v1.5-13B on 8x A100 (80G) ... It takes
around 10 hours for LLaVA-v1.5-7B on 8x A100 (40G)"; the paper (Liu et al. 2023, "Improved
Baselines with Visual Instruction Tuning", arXiv 2310.03744): the 13B model "finishes full
training in ~1 day on a single 8-A100 node". Recipe (scripts/v1_5/finetune.sh): DeepSpeed
ZeRO-3, bf16 (the model in bf16, fp32 master weights and Adam states in the optimizer: the
planner's `bf16-weights`), gradient checkpointing, per-device batch 16, global batch 128,
one epoch, model_max_length 2048, the vision tower frozen, group_by_modality_length.

No copy of llava_v1_5_mix665k.json is used here, so the lengths are SYNTHETIC, seeded, and
stated (see `synthetic_llava_665k`). With the real file converted to conversation shards,
`mmtrain plan --model llava-1.5-7b --data DIR --tokenizer ... --chat-template vicuna-v1`
plans from the real distribution instead.

    python bench/plan_llava.py [--samples 665298] [--draw 100000]
"""

from __future__ import annotations

import argparse
import datetime
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

from mmtrain.hardware import default_catalog
from mmtrain.lengths import Lengths, summarize
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.data_plan import plan_from_data
from mmtrain.spec import load_spec

PUBLISHED_H = 10.0  # LLaVA README: ~10 h for LLaVA-v1.5-7B stage 2 on 8x A100 (40G)
SAMPLES = 665_298  # records of llava_v1_5_mix665k (mrm8488/llava_v1_5_mix665k dataset card)
TEXT_ONLY = 40_000  # ShareGPT conversations (llava-v1.5-7b model card: "40K ShareGPT data")
CASES = (  # (GPU, precision, bytes per parameter)
    ("a100-40g", "bf16-weights", 16),
    ("a100-40g", "bf16-weights", 18),
    ("a100-40g", "bf16", 16),
    ("a100", "bf16-weights", 16),
)

ASSUMPTION = (
    "Synthetic lengths (assumed, not measured): 94% of conversations hold one image (576 "
    "positions spliced in for its placeholder); their text ids (Vicuna-v1 template included) "
    "are log-normal with median 190 and sigma 0.7 (mean 243); the 6% text-only ShareGPT "
    "conversations log-normal with median 800 and sigma 0.8 (mean ~1,100, truncated at 2,048). "
    "Overall about 290 text ids per conversation, the order of magnitude the mixture's size "
    "gives: 768 MB of text for 665,298 records (mrm8488/llava_v1_5_mix665k dataset card), "
    "~1.15 KB a record, at ~4 characters per Llama token ~290 tokens, plus the template."
)


def synthetic_llava_665k(draw: int, seed: int = 0) -> Lengths:
    """`draw` conversations from the stated synthetic mixture (module docstring)."""
    rng = random.Random(seed)
    positions, images = [], []
    for _ in range(draw):
        if rng.random() < TEXT_ONLY / SAMPLES:
            text, image = int(rng.lognormvariate(math.log(800), 0.8)), 0
        else:
            text, image = int(rng.lognormvariate(math.log(190), 0.7)), 1
        positions.append(max(text, 8) + image * 575)
        images.append(image)
    return Lengths(tuple(positions), tuple(images), source="synthetic LLaVA-665K mixture")


def _machine() -> str:
    import os
    import platform

    return f"{platform.processor() or 'CPU'}, {os.cpu_count()} cores (the planner needs no GPU)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--draw", type=int, default=100_000, help="synthetic samples drawn")
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args()
    spec = load_spec("llava-1.5-7b")
    spec = replace(spec, decoder=spec.decoder.replace(max_positions=2048))
    lengths = synthetic_llava_665k(args.draw)
    dist = summarize(lengths.positions)
    catalog = default_catalog()
    rows = [
        "| GPUs | precision | layout | rows | samples/row | fill | mem GiB/GPU | fits | MFU "
        "| useful MFU | predicted h | published h |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    notes = []
    # The recipe's DeepSpeed bf16 (the model in bf16, fp32 master and Adam states: 16 B/param,
    # 18 with DeepSpeed's fp32 gradient partitions), then torch autocast for comparison.
    for gpu, precision, bytes_per_param in CASES:
        cfg = PlanConfig(
            gpu=gpu, gpus=8, precision=precision, bytes_per_param=bytes_per_param, zero=3,
            ac="full", micro_batch=16, global_batch=128,
        )  # fmt: skip
        for p in plan_from_data(
            spec,
            lengths,
            cfg,
            catalog,
            sequence_length=2048,
            samples=args.samples,
            adapt=lambda m: m.with_modes({"image": "frozen"}),
        ):
            lay, mem, t = p.layout, p.plan.memory, p.plan.time
            useful = t.mfu * lay.useful_flops / lay.computed_flops
            rows.append(
                f"| 8 x {p.plan.gpu.name} | {precision} ({bytes_per_param} B/param) | "
                f"{lay.name} | {p.plan.config.samples:,} | {lay.samples_per_row:.2f} | "
                f"{lay.fill:.1%} | {mem.total_bytes / 2**30:.1f} | "
                f"{'yes' if mem.fits else 'NO'} | {t.mfu:.1%} | {useful:.1%} | {p.hours:.1f} | "
                f"~{PUBLISHED_H:g} |"
            )
            print(rows[-1], flush=True)
            if gpu == CASES[0][0] and precision == CASES[0][1] and bytes_per_param == 16:
                notes.append(f"{lay.name}: family {t.efficiency_family}, {t.efficiency_source}")
    text = "\n".join(
        [
            f"\n## plan_llava ({datetime.date.today()})",
            "",
            f"command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
            f"machine: {_machine()}",
            "",
            "LLaVA-1.5-7B stage 2 (665K conversations, ZeRO-3, full checkpointing, "
            "micro-batch 16, global 128, tower frozen, rows of 2048) against the published "
            "~10 h on 8x A100 (40G) (haotian-liu/LLaVA README). The recipe's DeepSpeed bf16 "
            "is `bf16-weights`; `bf16` (torch autocast, fp32 residual stream) for comparison. "
            "MFU counts the computed positions (padding included); useful MFU the samples' own.",
            f"{ASSUMPTION} Drawn {args.draw:,}: positions mean {dist['mean']:,}, p50 "
            f"{dist['p50']:,}, p90 {dist['p90']:,}, p99 {dist['p99']:,}, max {dist['max']:,}.",
            "",
            *rows,
            "",
            "Achievable fraction of peak (plan/compute.py):",
            "",
            *(f"- {n}" for n in notes),
            "",
        ]
    )
    print(text)
    if not args.no_append:
        with open(Path(__file__).parent / "RESULTS.md", "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
