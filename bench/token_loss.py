"""Peak memory of one next-token training step with a large vocabulary: the full logits
against the chunked loss (models/token_loss.py), on the CPU, measured.

A small text-only LanguageModel (width 256, `--layers` layers, a Llama-3 vocabulary of
128,256) so that the logits dominate; `--rows` x `--positions` ids, every one a target, fp32.
Each variant runs in a fresh subprocess (nothing freed by one can be reused by the other), which
reports its peak resident set (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) after building the
model and the batch ("before") and after one forward + backward ("peak"):

- full: `model.logits(batch)` [R, T, vocab] then `train/objectives.py: token_nll_sum` (the
  path before the chunked loss: fp32 logits, their shifted copy, the saved log-softmax);
- chunked: `model(batch)["nll_sum"]` with "labels" in the batch (the trainer's path).

If the machine has too little memory available for the full variant (about 4.5 x its logits),
`--rows` is lowered and the notes say so. Prints the table and appends it to bench/RESULTS.md.

    python bench/token_loss.py [--rows 4] [--positions 2048] [--layers 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from common import append_results, load_average

import mmtrain
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.spec import ModelSpec
from mmtrain.train.objectives import count_targets, token_nll_sum

VOCAB = 128_256
GIB = 2**30
VARIANTS = ("full", "chunked")


def spec(layers: int, positions: int) -> ModelSpec:
    decoder = DecoderSpec(
        vocab_size=VOCAB,
        width=256,
        layers=layers,
        heads=4,
        kv_heads=2,
        mlp_hidden=688,
        max_positions=positions,
        tie_embeddings=False,
    )
    return ModelSpec(
        name="bench-lm", embed_dim=256, towers={}, objective="next_token", decoder=decoder
    )


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_variant(variant: str, rows: int, positions: int, layers: int) -> dict:
    """One step in this process; its RSS before and at the peak, its time and loss."""
    model = mmtrain.create_model(spec(layers, positions), seed=0)
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, VOCAB, (rows, positions), generator=g)
    batch = {"text": text, "labels": text.clone()}
    before = max_rss_bytes()
    start = time.perf_counter()
    if variant == "full":
        nll = token_nll_sum(model.logits({"text": text}), batch["labels"])
    else:
        nll = model(batch)["nll_sum"]
    loss = nll / count_targets(batch["labels"])
    loss.backward()
    seconds = time.perf_counter() - start
    return {"before": before, "peak": max_rss_bytes(), "s": seconds, "loss": float(loss.detach())}


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.rows, args.positions, args.layers)))
        return 0

    load = load_average()
    rows, notes = args.rows, []
    logits_bytes = lambda r: r * args.positions * VOCAB * 4  # noqa: E731
    while rows > 1 and 4.5 * logits_bytes(rows) + 2 * GIB > available_bytes():
        rows //= 2
    if rows != args.rows:
        notes.append(f"too little memory available for {args.rows} rows: ran {rows}.")
    results = {}
    for variant in VARIANTS:
        child = [sys.executable, __file__, "--variant", variant, "--rows", str(rows)]
        child += ["--positions", str(args.positions), "--layers", str(args.layers)]
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])

    table = [
        "| variant | RSS before GiB | peak RSS GiB | step peak - before GiB | / full | step s | loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    full_step = results["full"]["peak"] - results["full"]["before"]
    for variant, r in results.items():
        step = r["peak"] - r["before"]
        table.append(
            f"| {variant} | {r['before'] / GIB:.2f} | {r['peak'] / GIB:.2f} | {step / GIB:.2f} "
            f"| {step / full_step:.3f}x | {r['s']:.1f} | {r['loss']:.6f} |"
        )
    gap = abs(results["chunked"]["loss"] - results["full"]["loss"])
    notes = [
        f"text-only LanguageModel: width 256, {args.layers} layer(s), 4 heads / 2 kv heads, "
        f"untied head, vocab {VOCAB:,}; {rows} x {args.positions} ids, all targets; fp32; one "
        f"forward + backward per variant, each in a fresh subprocess, peak RSS from "
        f"getrusage(RUSAGE_SELF).ru_maxrss (after building the model and batch, and after the "
        f"step). One fp32 [{rows}, {args.positions}, vocab] tensor is "
        f"{logits_bytes(rows) / GIB:.2f} GiB. Chunked: "
        f"{2**26 // VOCAB} positions a chunk (2**26 logits). |loss difference| {gap:.1e}. "
        f"Load average before: {load}.",
        *notes,
    ]
    print("\n".join([*notes, "", *table]))
    append_results("token_loss", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
