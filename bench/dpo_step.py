"""DPO's step on the CPU, measured: what scoring by token and the cached reference save.

A text-only LanguageModel whose logits dominate (width 256, `--layers` layer(s), a Llama-3
vocabulary of 128,256, untied head, fp32), full fine-tune, `--pairs` pairs of `--positions`
ids, the last `--answer` ids of each row its answer. Each variant runs in a fresh subprocess,
which reports its peak resident set (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) once the
model, its reference and the batch are built ("before") and after one DPO step, forward and
backward ("peak"), and the step's time and loss:

- logits: the policy's log-probs from the batch's whole logits [2n, T, vocab] (DPO before
  2026-12-06, and a hub model's class today), the reference's read from stored values;
- by token: each target's NLL, the head a chunk of positions at a time (models/vlm.py
  `token_nll`; the trainer's path), the reference's read from stored values (`cache`);
- copy: by token, the reference a frozen copy of the model scored in the step (`copy`).

Every variant's reference is the model itself, so each loss is log 2 (to float32 rounding).
Prints the table and appends it to
bench/RESULTS.md.

    python bench/dpo_step.py [--pairs 2] [--positions 512] [--answer 64] [--layers 1]
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
from mmtrain.config import DpoConfig
from mmtrain.data.stream.preference_batches import PAIR_INDEX, PAIRS
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.spec import ModelSpec
from mmtrain.train.precision import make_precision
from mmtrain.train.reference_cache import ReferenceLogps
from mmtrain.train.step import forward_backward

VOCAB = 128_256
GIB = 2**30
VARIANTS = ("logits", "by token", "copy")


def spec(layers: int, positions: int) -> ModelSpec:
    decoder = DecoderSpec(vocab_size=VOCAB, width=256, layers=layers, heads=4, kv_heads=2,
                          mlp_hidden=688, max_positions=positions, tie_embeddings=False)  # fmt: skip
    return ModelSpec(name="bench-lm", embed_dim=256, towers={}, objective="next_token",
                     decoder=decoder)  # fmt: skip


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def pair_batch(pairs: int, positions: int, answer: int) -> dict:
    """2n rows, chosen first: a shared prompt, then each side's own answer (its labels)."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (pairs, positions - answer), generator=g).repeat(2, 1)
    answers = torch.randint(0, VOCAB, (2 * pairs, answer), generator=g)
    text = torch.cat([prompt, answers], dim=1)
    labels = text.clone()
    labels[:, : positions - answer] = -100
    return {"text": text, "labels": labels, PAIRS: pairs, PAIR_INDEX: list(range(pairs))}


def run_variant(variant: str, pairs: int, positions: int, answer: int, layers: int) -> dict:
    """One DPO step in this process; its RSS before and at the peak, its time and loss."""
    from mmtrain.train.dpo import DpoObjective, reference_logps

    model = mmtrain.create_model(spec(layers, positions), seed=0)
    batch = pair_batch(pairs, positions, answer)
    config = DpoConfig(beta=0.1)
    if variant == "copy":
        reference = mmtrain.create_model(spec(layers, positions), seed=0).requires_grad_(False)
        objective = DpoObjective(model, config, reference=reference)
    else:  # the stored values: the model scored by token, as the cached reference's pass does
        scored = reference_logps(model, batch, None, by_token=True).double().numpy()
        stored = ReferenceLogps(scored.reshape(2, -1).T.copy(), folder=None)
        objective = DpoObjective(model, config, cached=stored)
        objective.by_token = variant == "by token"
    precision = make_precision("fp32", torch.device("cpu"))
    before = max_rss_bytes()
    start = time.perf_counter()
    loss, _ = forward_backward(model, [objective], [batch], precision)
    seconds = time.perf_counter() - start
    return {"before": before, "peak": max_rss_bytes(), "s": seconds, "loss": float(loss)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    sizes = [str(args.pairs), str(args.positions), str(args.answer), str(args.layers)]
    if args.variant:
        print(json.dumps(run_variant(args.variant, *map(int, sizes))))
        return 0

    load = load_average()
    results = {}
    for variant in VARIANTS:
        child = [sys.executable, __file__, "--variant", variant, "--pairs", sizes[0],
                 "--positions", sizes[1], "--answer", sizes[2], "--layers", sizes[3]]  # fmt: skip
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    table = [
        "| variant | RSS before GiB | peak RSS GiB | step peak - before GiB | peak / logits' | step s | loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    first = results["logits"]["peak"]
    for variant, r in results.items():
        step = r["peak"] - r["before"]
        table.append(
            f"| {variant} | {r['before'] / GIB:.2f} | {r['peak'] / GIB:.2f} | {step / GIB:.2f} "
            f"| {r['peak'] / first:.3f}x | {r['s']:.1f} | {r['loss']:.6f} |"
        )
    logits = 2 * args.pairs * args.positions * VOCAB * 4
    notes = [
        f"text-only LanguageModel: width 256, {args.layers} layer(s), 4 heads / 2 kv heads, "
        f"untied head, vocab {VOCAB:,}; {args.pairs} pairs = {2 * args.pairs} rows x "
        f"{args.positions} ids, the last {args.answer} of each scored; fp32; a full fine-tune's "
        f"DPO step (train/step.py forward_backward) per variant, each in a fresh subprocess, "
        f"peak RSS from getrusage(RUSAGE_SELF).ru_maxrss. One fp32 [rows, positions, vocab] "
        f"tensor is {logits / GIB:.2f} GiB; the model's fp32 weights "
        f"{spec(args.layers, args.positions).params() * 4 / GIB:.2f} GiB (the copy's too). "
        f"Load average before: {load}.",
    ]
    print("\n".join([*notes, "", *table]))
    append_results("dpo_step", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
