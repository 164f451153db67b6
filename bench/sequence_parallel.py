"""Sequence parallelism on the CPU: tokens/s and peak memory per rank when N gloo ranks split
each row (train.sequence_parallel: N), N = 1, 2, 4, all-to-all and ring attention.

One decoder LM (width 256, 4 blocks, 8 heads / 4 kv heads, byte vocabulary) trains on one row
of `--length` positions per step (one document: the causal kernel, no dense mask), fp32,
AdamW, gradients all-reduced over the ranks as DDP would; each variant is a fresh run (its
own processes). Total threads stay 2 where the cores allow: 2 for N = 1, 1 per rank above
(N = 4 oversubscribes a 2-core machine: its tokens/s is a lower bound there).

Peak RSS per rank = VmHWM of /proc/self/status at the end (bench/big_model_memory.py says why
not ru_maxrss); "step" is the peak less the resident set before the first step (the model and
the batch): what the row's activations, attention, gradients and AdamW states (~36 MiB of
the latter two) cost a rank.

    python bench/sequence_parallel.py [--length 8192] [--steps 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import append_results, load_average

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from big_model_memory import peak_rss_bytes  # noqa: E402

from dist_helpers import run_distributed  # noqa: E402

MIB = 2**20
VARIANTS = [(1, "none"), (2, "all_to_all"), (2, "ring"), (4, "all_to_all"), (4, "ring")]


def resident_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _spec():
    from mmtrain.decoder_spec import DecoderSpec
    from mmtrain.models.formats.hf import language_model_spec

    decoder = DecoderSpec(vocab_size=259, width=256, layers=4, heads=8, kv_heads=4,
                          mlp_hidden=704, max_positions=65536)  # fmt: skip
    return language_model_spec(decoder, "bench-sp")


def _rank(rank: int, world: int, attention: str, length: int, steps: int) -> dict:
    import torch.distributed as dist

    from mmtrain.models.build import create_model
    from mmtrain.train.sequence_parallel import apply_sequence_parallel

    spec = _spec()
    model = create_model(spec, seed=0)
    if world > 1:
        apply_sequence_parallel(model, spec, world, attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(0))
    batch = {"text": ids, "labels": ids}

    def step() -> None:
        loss = model(batch)["nll_sum"] / (length - 1)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    before = resident_bytes()
    step()  # a warm-up: the optimizer's states and the allocator's pools exist from here on
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return {"seconds": time.perf_counter() - started, "before": before, "peak": peak_rss_bytes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    load = load_average()
    rows = ["| N | attention | tokens/s (group) | vs N=1 | peak RSS / rank MiB | step MiB / rank | vs N=1 |",
            "|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    base = None
    for n, attention in VARIANTS:
        threads = max(1, 2 // n)
        ranks = run_distributed(_rank, world_size=n, args=(attention, args.length, args.steps),
                                timeout_s=3600, threads=threads)  # fmt: skip
        seconds = max(r["seconds"] for r in ranks)
        rate = args.steps * args.length / seconds
        peak = max(r["peak"] for r in ranks)
        step = max(r["peak"] - r["before"] for r in ranks)
        base = base or (rate, step)
        rows.append(
            f"| {n} | {attention} | {rate:.0f} | {rate / base[0]:.2f} | {peak / MIB:.0f} | "
            f"{step / MIB:.0f} | {step / base[1]:.2f} |"
        )
        print(rows[-1], flush=True)
    notes = [
        f"Decoder LM (width 256, 4 blocks, 8 heads / 4 kv heads, MLP 704, 259 ids), one row of "
        f"{args.length} positions per step, fp32, AdamW, {args.steps} timed steps after one "
        "warm-up; N gloo ranks on this machine (2 threads in all for N <= 2, 1 per rank for "
        "N = 4). tokens/s: the group's row positions per second. Peak RSS: VmHWM per rank at "
        "the end; step: peak less the resident set before the first step (largest rank; "
        "gradients and AdamW states included, ~36 MiB).",
        f"Load average before: {load}.",
    ]
    print("\n".join(rows))
    append_results("sequence_parallel", rows, notes)


if __name__ == "__main__":
    main()
