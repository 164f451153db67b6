"""Training throughput on the CPU, in one run:

- openclip: mmtrain vs OpenCLIP on the same tiny config (tiny-clip), the same initial weights,
  batches, optimizer and precision (fp32), at 1 and 2 threads, interleaved in rounds; samples/s,
  the ratio mmtrain/OpenCLIP (goal >= 1.2x) and the two loss curves' largest difference. OpenCLIP
  runs from its own virtual environment (bench/.venv-openclip, made on first use on top of the
  project's torch, so no second torch is downloaded); see bench/openclip_step.py.
- checkpoint: `train(config)` on tiny shards with checkpoints at the config's default interval vs
  none but the final one; the wall-clock overhead and the loop's own `checkpoint_s_total`.
- precision: mmtrain's step for tiny-clip and a small ViT CLIP, fp32 vs bf16 autocast, with vs
  without activation checkpointing, with the ratios.

Prints the tables and appends them to bench/RESULTS.md with the command and the machine. Never run
in CI: the first run installs open_clip_torch, torchvision (Python parts), ftfy, regex, wcwidth.

    python bench/train_throughput.py [--parts openclip,checkpoint] [--batch 64] [--rounds 6]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import append_results, load_average
from PIL import Image

import mmtrain
from mmtrain.config import load_config
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.losses import ContrastiveLoss
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.train.loop import forward_backward, optimizer_step, train
from mmtrain.train.measure_step import random_batch
from mmtrain.train.objectives import ContrastiveObjective
from mmtrain.train.parallel import apply_activation_checkpointing
from mmtrain.train.precision import make_precision

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VENV = BENCH / ".venv-openclip"
OPENCLIP_VERSION = "3.3.0"
PARTS = ("openclip", "checkpoint", "precision")

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
    objectives = [ContrastiveObjective(model, ContrastiveLoss.from_spec(spec, distributed=False))]
    data = random_batch(spec, batch, torch.Generator().manual_seed(0))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, objectives, [data], prec)
        optimizer_step(model, optimizer, prec, 1.0)
        if i >= 2:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"step_s": step_s, "samples_s": batch / step_s}


# ----------------------------------------------------------------------------- OpenCLIP
def openclip_python() -> Path:
    """The benchmark venv's python, made on first use: a bare venv whose .pth adds the project
    venv's site-packages (torch, mmtrain), plus OpenCLIP and its import-time needs, --no-deps."""
    python = VENV / "bin" / "python"
    torch_minor = int(torch.__version__.split(".")[1])
    # torchvision 0.(minor + 15) is built for torch 2.minor (0.28 <-> 2.13); only its Python
    # parts are used (see openclip_step.py), but pip should still get the matching release.
    packages = [
        f"open_clip_torch=={OPENCLIP_VERSION}",
        f"torchvision==0.{torch_minor + 15}.*",
        "ftfy",
        "regex",
        "wcwidth",
    ]
    stamp = VENV / "installed.txt"
    if stamp.is_file() and stamp.read_text().split() == packages:
        return python
    print(f"making {VENV} ({', '.join(packages)})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    project = sysconfig.get_paths()["purelib"]  # addsitedir also runs its .pth (editable mmtrain)
    Path(purelib, "_mmtrain_project.pth").write_text(f"import site; site.addsitedir({project!r})\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", *packages]
    subprocess.run(pip, check=True)
    stamp.write_text("\n".join(packages) + "\n")
    return python


def compare_openclip(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Rows of the mmtrain vs OpenCLIP table, one per thread count, and notes."""
    python = openclip_python()
    rows = [
        "| threads | batch | mmtrain step ms | OpenCLIP step ms | mmtrain samples/s "
        "| OpenCLIP samples/s | mmtrain/OpenCLIP | max loss diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes, versions = [], ""
    for threads in args.threads:
        command = [
            str(python), str(BENCH / "openclip_step.py"), "--threads", str(threads),
            "--batch", str(args.batch), "--rounds", str(args.rounds),
            "--per-round", str(args.per_round),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        ours, theirs = (statistics.median(result["times"][n]) for n in ("mmtrain", "openclip"))
        # The ratio of each round's medians, then their median: robust to one slow round.
        ratio = statistics.median(_round_ratios(result, args.per_round))
        diff = max(
            abs(a - b)
            for a, b in zip(result["losses"]["mmtrain"], result["losses"]["openclip"], strict=True)
        )
        rows.append(
            f"| {threads} | {args.batch} | {1e3 * ours:.0f} | {1e3 * theirs:.0f} "
            f"| {args.batch / ours:.1f} | {args.batch / theirs:.1f} | {ratio:.2f}x | {diff:.1e} |"
        )
        print(rows[-1] if len(rows) > 3 else "\n".join(rows), flush=True)
        versions = f"open_clip_torch {result['open_clip']}, torch {result['torch']}"
    notes.append(
        f"mmtrain vs OpenCLIP ({versions}): tiny-clip (64 px / patch 8, width 128 x 5 layers x 4 "
        "heads per tower, context 48, vocab 258, embed 128), the same initial weights "
        "(mmtrain's init through mmtrain_to_openclip) and batches, AdamW (same groups), fp32, "
        "grad clip 1.0. Step = forward + contrastive loss + backward + clip + AdamW. "
        f"{args.rounds} interleaved rounds x {args.per_round} steps each after 2 warm-up steps; "
        "step ms = median; mmtrain/OpenCLIP = median over rounds of the samples/s ratio; max loss "
        "diff = largest |loss difference| over all steps of the two runs."
    )
    return rows, notes


def _round_ratios(result: dict, per_round: int) -> list[float]:
    ours, theirs = result["times"]["mmtrain"], result["times"]["openclip"]
    return [
        statistics.median(theirs[i : i + per_round]) / statistics.median(ours[i : i + per_round])
        for i in range(0, len(ours), per_round)
    ]


# ----------------------------------------------------------------------------- checkpoints
def make_shards(folder: Path, samples: int) -> str:
    """PNG + caption shards of noisy coloured squares (decoded by the real loader)."""
    rng = np.random.default_rng(0)
    colors = ("red", "green", "blue")
    with ShardWriter(folder, max_samples=128) as writer:
        for i in range(samples):
            pixels = rng.integers(0, 60, (72, 80, 3)).astype(np.uint8)
            pixels[..., i % 3] += 150
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            caption = f"a {colors[i % 3]} square, number {i}".encode()
            writer.write({"__key__": f"s{i:06d}", "png": buffer.getvalue(), "txt": caption})
    return str(folder)


def checkpoint_overhead(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """tiny-clip through `train(config)` with intermediate checkpoints vs only the final one."""
    path = ROOT / "configs" / "tiny-clip.yaml"
    defaults = load_config(path, ["data.train=unused"])
    default_every = defaults.checkpoint.every_steps
    every = args.checkpoint_every or default_every
    steps = args.checkpoint_steps or 2 * every
    warmup = min(defaults.train.warmup_steps, steps)  # only a short trial run needs less
    threads = torch.get_num_threads()
    torch.set_num_threads(args.checkpoint_threads)
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        shards = make_shards(Path(folder) / "shards", 4 * args.checkpoint_batch)
        for label, interval in ((f"every {every} steps", every), ("final only", None)):
            overrides = [
                f"data.train={shards}",
                f"out={folder}/run-{interval}",
                f"train.steps={steps}",
                f"train.batch_size={args.checkpoint_batch}",
                f"train.micro_batch={args.checkpoint_batch}",
                f"train.warmup_steps={warmup}",
                f"checkpoint.every_steps={'null' if interval is None else interval}",
                "checkpoint.every_minutes=null",
                "metrics.tensorboard=false",
                f"metrics.log_every={steps}",
            ]
            start = time.perf_counter()
            result = train(load_config(path, overrides))
            runs[label] = {
                "wall": time.perf_counter() - start,
                # The last row is written before the final save: it holds the intermediate ones.
                "saved_s": result.history[-1]["checkpoint_s_total"],
                "saves": (steps - 1) // interval if interval else 0,  # the final one not counted
                "step_s": statistics.median(row["step_s"] for row in result.history),
            }
    torch.set_num_threads(threads)
    rows = [
        "| checkpoints | steps | batch | saves | wall s | median step s | checkpoint_s_total "
        f"| s per save | overhead (wall) | overhead (loop) | at every {default_every} steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = runs["final only"]["wall"]
    for label, run in runs.items():
        per_save = run["saved_s"] / run["saves"] if run["saves"] else 0.0
        loop = run["saved_s"] / (run["wall"] - run["saved_s"])
        at_default = per_save / (default_every * run["step_s"])
        rows.append(
            f"| {label} | {steps} | {args.checkpoint_batch} | {run['saves']} + final "
            f"| {run['wall']:.1f} | {run['step_s']:.3f} | {run['saved_s']:.2f} | {per_save:.3f} "
            f"| {100 * (run['wall'] / base - 1):+.1f}% | {100 * loop:.2f}% "
            f"| {100 * at_default:.2f}% |"
        )
    print("\n".join(rows), flush=True)
    notes = [
        f"checkpoint overhead: `train(config)` on configs/tiny-clip.yaml ({steps} steps, batch "
        f"{args.checkpoint_batch}, {args.checkpoint_threads} thread(s), PNG shards through the "
        f"real loader), checkpoint.every_steps = {every} vs null; both also save at the last step "
        "(not counted). overhead (wall): wall time over the run without intermediate "
        "checkpoints (noisy on a shared machine); overhead (loop): the loop's own "
        "checkpoint_s_total (intermediate saves) over the rest of that run's wall time; at every "
        f"{default_every} steps (the config's default interval): s per save / ({default_every} x "
        "median step s)."
    ]
    return rows, notes


# ----------------------------------------------------------------------------- precision
def precision_table(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """mmtrain alone: fp32 vs bf16, activation checkpointing or not, for two models."""
    models = {"tiny-clip": load_spec("tiny-clip"), "small-vit-clip": ModelSpec.from_dict(SMALL_VIT)}
    rows = [
        "| model | precision | AC | batch | step ms | samples/s | vs fp32 | vs no AC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print(rows[0], flush=True)
    for name, spec in models.items():
        base = {}
        for precision in ("fp32", "bf16"):
            for ac in ("none", "full"):
                r = measure(spec, precision, ac, args.precision_batch, args.precision_steps)
                base[precision, ac] = r["samples_s"]
                vs_fp32 = r["samples_s"] / base["fp32", ac]
                vs_ac = r["samples_s"] / base[precision, "none"]
                rows.append(
                    f"| {name} | {precision} | {ac} | {args.precision_batch} "
                    f"| {1e3 * r['step_s']:.1f} | {r['samples_s']:.1f} | {vs_fp32:.2f}x "
                    f"| {vs_ac:.2f}x |"
                )
                print(rows[-1], flush=True)
    notes = [
        f"precision: threads {torch.get_num_threads()}; median of {args.precision_steps} steps "
        "after 2 warm-up; synthetic batches (no data loading). 'vs fp32': samples/s over the same "
        "case in fp32; 'vs no AC': over the same precision without activation checkpointing."
    ]
    return rows, notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="openclip,checkpoint", help=f"of {', '.join(PARTS)}")
    parser.add_argument("--batch", type=int, default=64, help="OpenCLIP comparison batch")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    parser.add_argument("--per-round", type=int, default=2, help="steps of each per round")
    parser.add_argument("--checkpoint-batch", type=int, default=16)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="default: the config's")
    parser.add_argument("--checkpoint-steps", type=int, default=None, help="default: 2 intervals")
    parser.add_argument("--checkpoint-threads", type=int, default=1)
    parser.add_argument("--precision-batch", type=int, default=32)
    parser.add_argument("--precision-steps", type=int, default=10)
    parser.add_argument("--no-append", action="store_true", help="print only")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    started, load = time.perf_counter(), load_average()
    rows, notes = [], [f"load average at start: {load}"]
    for part, run in (
        ("openclip", compare_openclip),
        ("checkpoint", checkpoint_overhead),
        ("precision", precision_table),
    ):
        if part in parts:
            part_rows, part_notes = run(args)
            rows += [*part_rows, ""]
            notes += part_notes
    notes.append(f"whole run: {time.perf_counter() - started:.0f} s")
    print(notes[-1])
    if not args.no_append:
        append_results("train_throughput", rows[:-1], notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
