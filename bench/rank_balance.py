"""How evenly a step's work spreads over the ranks, with the samples dealt by cost
(`data.balance`, order.balanced_order) against the plain interleave.

A step takes as long as its heaviest rank (every collective waits for it), so a rank's
share of the step is useful for mean load / max load of the step's ranks. Costs are forward
FLOPs as the trainer counts them (spec.sequence_flops_by_part) of a document-VLM mixture on
Qwen2.5-VL-7B: per sample 0, 1, 2, 4 or 8 pages (30/40/15/10/5 %), each a letter page
(2200 x 1700), a receipt (1600 x 600) or a slide (1080 x 1920) resized within 1,280 tokens a
page and 6,144 a sample (visual_budget.py), text ids log-normal (median 200, sigma 0.8),
rows cut at 8,192 positions. What the figure leaves out: the decode time of the pages (the
loader's workers), communication, and kernels' efficiency at different sizes.

    python bench/rank_balance.py [--steps 1000] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np
from common import append_results

from mmtrain.config import VisionDataConfig
from mmtrain.data.stream.order import balanced_order
from mmtrain.spec import load_spec
from mmtrain.visual_budget import ImageSize, budget_of

PAGES = ([0, 1, 2, 4, 8], [0.30, 0.40, 0.15, 0.10, 0.05])
SIZES = [ImageSize(2200, 1700), ImageSize(1600, 600), ImageSize(1080, 1920)]
ROW = 8192


def costs(n: int, seed: int) -> np.ndarray:
    spec = load_spec("Qwen2.5-VL-7B")
    budget = budget_of(spec.vision, VisionDataConfig(image_max_tokens=1280, sample_max_tokens=6144))
    rng = np.random.default_rng(seed)
    out = np.empty(n)
    for i in range(n):
        pages = [SIZES[j] for j in rng.integers(0, 3, rng.choice(PAGES[0], p=PAGES[1]))]
        shapes = [(s.frames, s.height, s.width) for s in budget.shapes(pages)]
        text = int(rng.lognormal(np.log(200), 0.8)) + 1
        positions = min(ROW, text + sum(spec.vision.tokens(h, w, t) for t, h, w in shapes))
        out[i] = sum(spec.sequence_flops_by_part([positions], 0, shapes).values())
    return out


def efficiency(order: np.ndarray, cost: np.ndarray, world: int, per_rank: int) -> float:
    """Over all micro-batches (ranks meet at each one's collectives): the summed mean rank
    load / the summed heaviest rank's."""
    chunks = len(order) // (world * per_rank)
    loads = cost[order[: chunks * world * per_rank]].reshape(chunks, per_rank, world).sum(1)
    return float(loads.mean(axis=1).sum() / loads.max(axis=1).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = ["| ranks | micro-batch | accumulation | interleaved | dealt by cost | step time saved |",
            "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    layouts = [(8, 1, 1), (8, 1, 4), (8, 2, 2), (8, 4, 1), (32, 1, 4), (32, 2, 2)]
    for world, per_rank, rounds in layouts:
        n = args.steps * world * per_rank * rounds
        cost = costs(n, args.seed)
        order = np.random.default_rng(args.seed + 1).permutation(n)
        plain = efficiency(order, cost, world, per_rank)
        dealt = balanced_order(order, cost, world, per_rank, rounds)
        share = efficiency(dealt, cost, world, per_rank)
        rows.append(f"| {world} | {per_rank} | {rounds} | {plain:.1%} | {share:.1%} | "
                    f"{1 - plain / share:.1%} |")  # fmt: skip
        print(rows[-1], flush=True)
    notes = [
        "Share of a step's rank-time doing work (mean rank load / heaviest rank's, summed over "
        f"{args.steps} steps) for a document-VLM mixture on Qwen2.5-VL-7B (0-8 pages a sample, "
        "letter / receipt / slide pages within 1,280 tokens each, 6,144 a sample; see the "
        "script's docstring); step time saved = 1 - interleaved / dealt, compute only."
    ]
    print("\n".join(rows))
    append_results("Ranks dealt by cost (data.balance)", rows, notes)


if __name__ == "__main__":
    main()
