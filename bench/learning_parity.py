"""Learning parity: does mmtrain's default initialisation learn as fast as OpenCLIP's?

Three runs on the same shards with the same tower shapes and hyper-parameters, in one command:

- openclip: OpenCLIP's own trainer (`open_clip_train.main`, open_clip_torch 3.3.0) run as its CLI
  would run it, on CPU, in the benchmark venv bench/.venv-openclip (made by train_throughput.py on
  top of the project's torch; this script adds webdataset 0.2.86, open_clip_torch's pinned
  maximum, and braceexpand to it), with OpenCLIP's own init, data pipeline (webdataset,
  `--dataset-resampled`), preprocessing and BPE tokenizer.
  Per-step losses are read from its log (`--log-every-n-steps 1`). Its sample order is not
  reproducible: webdataset's sample shuffle (`wds.shuffle` without an rng, webdataset 0.2.86)
  seeds itself from the process id and the clock, so two runs with the same --seed differ
  (two runs gave a last-16 mean of 3.37 and 2.75). mmtrain's runs are deterministic.
- mmtrain: `train(config)` (what `mmtrain train` runs) with mmtrain's default init.
- mmtrain from OpenCLIP init: the same, but the model starts from OpenCLIP's initial weights
  (drawn as its trainer draws them: `random_seed(seed, 0)` then `create_model`, saved as
  safetensors), given to the run as `init: FILE`, which reads it through mmtrain's OpenCLIP
  converter (`openclip_to_mmtrain`).

Model: tiny-clip with OpenCLIP's BPE vocabulary (64 px / patch 8, width 128 x 5 layers x 4 heads
per tower, causal text of 48 tokens pooled at the end-of-text token, vocab 49408, embed 128).
Data: the quickstart's Twemoji image-caption set (CC-BY 4.0; its train split, one shard).
Training: batch 64, AdamW lr 1e-3, betas (0.9, 0.98), eps 1e-6, weight decay 0.2, 5 warm-up
steps then cosine to 0, no gradient clipping, fp32. Each trainer keeps its own data order,
augmentation and weight-decay groups: this compares frameworks as a user runs them.

Goal: mmtrain's mean loss over the last 16 of 96 steps at most 1.05x OpenCLIP's. Prints a table
and appends it to bench/RESULTS.md with the command and the machine.

    python bench/learning_parity.py [--steps 96] [--threads 1] [--legacy] [--mmtrain-only]

`--legacy` adds a run with the previous default init (N(0, 0.02) for every matrix) for
comparison. `--mmtrain-only` skips OpenCLIP's (non-reproducible) trainer and compares the inits
inside mmtrain's trainer only, against OpenCLIP's initial weights for the same --seed: the
paired comparison to repeat over seeds. Never run in CI: it installs packages into the
benchmark venv and trains for minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OPENCLIP_MODEL = "mmtrain-parity"
VOCAB = 49408  # OpenCLIP's BPE: 256 bytes x 2 + 48894 merges + start/end of text
GOAL = 1.05
OPENCLIP_RUN = "OpenCLIP trainer (its init)"
OPENCLIP_INIT_RUN = "mmtrain train (OpenCLIP's initial weights)"
DEFAULT_RUN = "mmtrain train (default init)"
HYPER = {
    "batch": 64,
    "lr": 1e-3,
    "betas": (0.9, 0.98),
    "eps": 1e-6,
    "weight_decay": 0.2,
    "warmup": 5,
}
# OpenCLIP's trainer logs "Contrastive_loss: 4.1589 (4.1589)" (value, running mean) per step.
LOSS_LINE = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+ .*?Contrastive_loss: ([0-9.]+)")


# ----------------------------------------------------------------------------- shared set-up
def parity_spec():
    """tiny-clip with OpenCLIP's BPE vocabulary."""
    from mmtrain.spec import load_spec, with_tower

    spec = load_spec("tiny-clip")
    return with_tower(spec, "text", stem={"vocab_size": VOCAB})


def make_shards(work: Path) -> Path:
    """The quickstart's Twemoji train split as webdataset shards (png + txt); returns the folder."""
    from mmtrain.quickstart.common import build_shards
    from mmtrain.quickstart.emoji_data import list_emoji, write_raw

    split = write_raw(list_emoji(), work / "raw", val_fraction=0.1)
    build_shards(split.train_dir, work / "shards", workers=2)
    return work / "shards"


def merges_file() -> Path:
    """OpenCLIP's BPE merges file, shipped inside open_clip_torch (in the benchmark venv)."""
    found = sorted((BENCH / ".venv-openclip").glob("lib/python*/site-packages/open_clip/bpe_*.gz"))
    if not found:
        raise FileNotFoundError("no bpe_simple_vocab_16e6.txt.gz in bench/.venv-openclip")
    return found[0]


# ----------------------------------------------------------------------------- OpenCLIP side
def openclip_side(args: argparse.Namespace) -> int:
    """Inside bench/.venv-openclip: save OpenCLIP's initial weights, then run its trainer."""
    sys.path.insert(0, str(BENCH))
    # torchvision's C++ operators cannot load beside the CPU torch: see openclip_step.py.
    sys.modules.setdefault(
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    import open_clip
    import openclip_step
    import safetensors.torch
    from open_clip_train import main as openclip_main

    work = Path(args.openclip_side)
    config = work / f"{OPENCLIP_MODEL}.json"
    config.write_text(json.dumps(openclip_step.openclip_config(parity_spec())))
    open_clip.add_model_config(config)
    # The trainer seeds with random_seed(seed, rank 0) right before creating the model.
    openclip_main.random_seed(args.seed, 0)
    model = open_clip.create_model(OPENCLIP_MODEL, pretrained=None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(state, work / "openclip_init.safetensors")
    if args.init_only:
        return 0
    shards = "::".join(str(p) for p in sorted(Path(args.shards).glob("*.tar")))
    h = HYPER
    argv = [
        "--train-data", shards, "--dataset-type", "webdataset", "--dataset-resampled",
        "--train-num-samples", str(args.steps * h["batch"]), "--epochs", "1",
        "--batch-size", str(h["batch"]), "--workers", "0", "--model", OPENCLIP_MODEL,
        "--lr", str(h["lr"]), "--beta1", str(h["betas"][0]), "--beta2", str(h["betas"][1]),
        "--eps", str(h["eps"]), "--wd", str(h["weight_decay"]), "--warmup", str(h["warmup"]),
        "--lr-scheduler", "cosine", "--precision", "fp32", "--device", "cpu",
        "--seed", str(args.seed), "--log-every-n-steps", "1", "--save-frequency", "0",
        "--zeroshot-frequency", "0", "--report-to", "", "--logs", str(work / "logs"),
        "--name", "parity",
    ]  # fmt: skip
    openclip_main.main(argv)
    return 0


def run_openclip(work: Path, shards: Path, args: argparse.Namespace) -> list[float]:
    """OpenCLIP's trainer in the benchmark venv; its per-step losses from its log (none with
    --mmtrain-only: then only its initial weights are drawn)."""
    sys.path.insert(0, str(BENCH))
    from train_throughput import openclip_python

    python = openclip_python()
    work.mkdir(parents=True, exist_ok=True)
    extra = [str(python), "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run([*extra, "webdataset==0.2.86", "braceexpand==0.1.7"], check=True)
    command = [str(python), __file__, "--openclip-side", str(work), "--shards", str(shards)]
    command += ["--steps", str(args.steps), "--seed", str(args.seed)]
    command += ["--init-only"] if args.mmtrain_only else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with open(work / "stdout.log", "w") as log_file:  # its console output: kept, not shown
        done = subprocess.run(command, env=env, cwd=work, stdout=log_file, stderr=log_file)
    if done.returncode:
        raise RuntimeError(f"OpenCLIP's trainer failed; see {work / 'stdout.log'}")
    if args.mmtrain_only:
        return []
    log_text = (work / "logs" / "parity" / "out.log").read_text()
    losses = {int(n) // HYPER["batch"]: float(x) for n, x in LOSS_LINE.findall(log_text)}
    if sorted(losses) != list(range(1, args.steps + 1)):
        raise RuntimeError(f"OpenCLIP's log has losses for steps {sorted(losses)}")
    return [losses[s] for s in range(1, args.steps + 1)]


# ----------------------------------------------------------------------------- mmtrain side
def run_config(
    spec_path: Path, shards: Path, out: Path, args: argparse.Namespace, init: Path | None = None
):
    """The `mmtrain train` config of the experiment (the same hyper-parameters as OpenCLIP's);
    `init`: start from these weights (an OpenCLIP checkpoint or an mmtrain model folder)."""
    from mmtrain.config import config_from_dict

    h = HYPER
    return config_from_dict(
        {
            "model": str(spec_path),
            "data": {"train": str(shards), "tokenizer": str(merges_file()), "workers": 0},
            "train": {
                "steps": args.steps,
                "batch_size": h["batch"],
                "precision": "fp32",
                "lr": h["lr"],
                "min_lr": 0.0,
                "weight_decay": h["weight_decay"],
                "betas": list(h["betas"]),
                "eps": h["eps"],
                "warmup_steps": h["warmup"],
                "schedule": "cosine",
                "grad_clip": None,
                "device": "cpu",
            },
            "checkpoint": {"every_steps": None, "every_minutes": None, "keep": 1},
            "metrics": {"tensorboard": False},
            "seed": args.seed,
            "out": str(out),
            "init": None if init is None else str(init),
        }
    )


def run_mmtrain(config) -> list[float]:
    """`train(config)`, what `mmtrain train` runs; the per-step losses from OUT/metrics.jsonl."""
    from mmtrain.train.loop import train

    train(config)
    rows = [json.loads(line) for line in (Path(config.out) / "metrics.jsonl").open()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r and "kind" not in r}
    return [losses[s] for s in range(1, config.train.steps + 1)]


def save_legacy_init(spec, folder: Path, seed: int) -> Path:
    """A model folder holding the previous default init (N(0, 0.02) for every matrix, positions
    N(0, 0.01), biases 0, norms 1/0, logit scale from the spec): the user's 1.44x baseline."""
    import torch

    from mmtrain.models import create_model, save_model
    from mmtrain.models.init_rules import NORMS

    model = create_model(spec, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, NORMS) or module is model or name == "bias":
                    continue  # already 1/0, the spec's logit scale, zero
                param.normal_(0.0, 0.01 if name.startswith("pos_") else 0.02, generator=generator)
    return save_model(model, folder)


# ----------------------------------------------------------------------------- report
def last_mean(losses: list[float], n: int = 16) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def table(runs: dict[str, list[float]], steps: int) -> list[str]:
    marks = [s for s in (1, steps // 6, steps // 3, steps // 2, 2 * steps // 3, steps) if s >= 1]
    marks = sorted(set(marks))
    base = last_mean(next(iter(runs.values())))  # the first run is the reference
    head = "| run | " + " | ".join(f"loss @{s}" for s in marks)
    head += " | mean loss last 16 | / first row |"
    rows = [head, "|---|" + "---:|" * (len(marks) + 2)]
    for name, losses in runs.items():
        cells = " | ".join(f"{losses[s - 1]:.3f}" for s in marks)
        mean = last_mean(losses)
        rows.append(f"| {name} | {cells} | {mean:.3f} | {mean / base:.2f}x |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--legacy", action="store_true", help="also the previous N(0, 0.02) init")
    parser.add_argument("--work", help="keep the shards and runs here (default: a temp folder)")
    parser.add_argument(
        "--mmtrain-only",
        action="store_true",
        help="skip OpenCLIP's trainer (its data order varies run to run): compare the inits "
        "inside mmtrain's deterministic trainer only, against OpenCLIP's initial weights",
    )
    parser.add_argument("--openclip-side", help=argparse.SUPPRESS)
    parser.add_argument("--init-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.openclip_side:
        return openclip_side(args)

    import torch
    from common import append_results, load_average

    torch.set_num_threads(args.threads)
    started, load = time.perf_counter(), load_average()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        shards = make_shards(work)
        spec = parity_spec()
        spec_path = work / "spec.yaml"
        spec.save(spec_path)
        runs = {OPENCLIP_RUN: run_openclip(work / "openclip", shards, args)}
        init = work / "openclip" / "openclip_init.safetensors"
        runs[OPENCLIP_INIT_RUN] = run_mmtrain(
            run_config(spec_path, shards, work / "mmtrain-openclip-init", args, init)
        )
        runs[DEFAULT_RUN] = run_mmtrain(run_config(spec_path, shards, work / "mmtrain", args))
        if args.legacy:
            legacy = save_legacy_init(spec, work / "legacy-init", args.seed)
            runs["mmtrain train (previous init, N(0, 0.02))"] = run_mmtrain(
                run_config(spec_path, shards, work / "mmtrain-legacy", args, legacy)
            )
    runs = {name: losses for name, losses in runs.items() if losses}
    rows = table(runs, args.steps)
    base = next(iter(runs))  # OpenCLIP's trainer, or with --mmtrain-only its init in mmtrain
    ratio = last_mean(runs[DEFAULT_RUN]) / last_mean(runs[base])
    notes = [
        f"load average at start: {load}; whole run: {time.perf_counter() - started:.0f} s; "
        f"{args.threads} thread(s) per run",
        f"Twemoji train split (quickstart data), tiny-clip with OpenCLIP's BPE (vocab {VOCAB}, "
        f"context 48), batch {HYPER['batch']}, {args.steps} steps, AdamW lr 1e-3 betas 0.9/0.98 "
        "eps 1e-6 wd 0.2, 5 warm-up steps, cosine to 0, no clipping, fp32, seed "
        f"{args.seed}. "
        + (
            "--mmtrain-only: OpenCLIP's trainer not run; its initial weights (same seed) "
            "trained by mmtrain are the reference. "
            if args.mmtrain_only
            else "OpenCLIP: its own trainer (open_clip_train.main), init, data pipeline and "
            "tokenizer (sample order not reproducible, see the script's docstring). "
        )
        + "mmtrain: train(config) with the same BPE merges file. mean loss last 16 = mean "
        f"training loss of steps {args.steps - 15}-{args.steps}.",
        f"mmtrain default init / {base}: {ratio:.2f}x (goal <= {GOAL:.2f}x): "
        + ("met" if ratio <= GOAL else "NOT met"),
    ]
    print("\n".join([*notes, "", *rows]))
    append_results("learning_parity", rows, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
