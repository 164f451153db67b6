"""What the main process no longer does per VLM micro-batch: the collation (padding or packing
the decoded samples into rows, stacking their images) now runs in the loader's workers, and
images travel as uint8 (normalised on the device) instead of float32.

LLaVA-1.5-shaped micro-batches: `--batch` conversations, each one 336 px image (576 positions)
and log-normal text (median `--median` ids, sigma 0.7), rows of 2,048 positions. For each
layout the bench times, on this machine, the work a micro-batch costs the process that does the
collation: rebuilding the samples from the decoded tensors and `conversation_batch` (what the
main process did in series with the step before; the workers do it now), and reports the bytes
of the batch to page-lock and copy to the GPU, float32 vs uint8 images. The best of `--rounds`.

    python bench/vlm_batches.py [--batch 16] [--rounds 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
from common import append_results, load_average

from mmtrain.data.stream.conversation_batches import (
    ConversationDecoder,
    ConversationSample,
    conversation_batch,
)

IMAGE_SIDE, IMAGE_TOKENS, ROW, IMAGE_ID = 336, 576, 2048, 32000


def decoded_samples(n: int, median: float, uint8: bool, seed: int = 0) -> list[dict]:
    """What `ConversationDecoder.__call__` returns for `n` one-image conversations."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        text = int(min(ROW - IMAGE_TOKENS, max(8, rng.lognormal(math.log(median), 0.7))))
        ids = rng.integers(3, 30000, text).tolist()
        ids[1] = IMAGE_ID
        labels = [-100] * (text // 2) + ids[text // 2 :]
        if uint8:
            image = torch.randint(0, 256, (1, 3, IMAGE_SIDE, IMAGE_SIDE), dtype=torch.uint8)
        else:
            image = torch.randn(1, 3, IMAGE_SIDE, IMAGE_SIDE)
        out.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "image": image})
    return out


def collate_ms(outputs: list[dict], pack: bool, rounds: int) -> float:
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        samples: list[ConversationSample] = [ConversationDecoder.sample_of(o) for o in outputs]
        conversation_batch(
            samples, pack=pack, row_length=ROW, image_token_id=IMAGE_ID, image_tokens=IMAGE_TOKENS
        )
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def batch_bytes(outputs: list[dict], pack: bool) -> int:
    samples = [ConversationDecoder.sample_of(o) for o in outputs]
    batch = conversation_batch(
        samples, pack=pack, row_length=ROW, image_token_id=IMAGE_ID, image_tokens=IMAGE_TOKENS
    )
    return sum(t.numel() * t.element_size() for t in batch.values() if isinstance(t, torch.Tensor))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--median", type=float, default=190.0)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [
        "| layout | images | collation (ms / micro-batch) | batch bytes |",
        "|---|---|---:|---:|",
    ]
    for pack in (False, True):
        for uint8 in (False, True):
            outputs = decoded_samples(args.batch, args.median, uint8)
            ms = collate_ms(outputs, pack, args.rounds)
            mib = batch_bytes(outputs, pack) / 2**20
            layout = "packed" if pack else "padded"
            kind = "uint8" if uint8 else "float32"
            rows.append(f"| {layout} | {kind} | {ms:.2f} | {mib:.1f} MiB |")
    print("\n".join(rows))
    if not args.no_append:
        notes = [
            f"{args.batch} one-image conversations a micro-batch, text median {args.median:g} "
            f"ids, rows of {ROW}; threads {args.threads}; load average {load_average()}.",
            "The collation ran in the main process, in series with the step, until this change; "
            "the loader's workers do it now (and, on CUDA, the DataLoader's pin thread pins "
            "the batch), so these milliseconds left the step's critical path. uint8 images "
            "are a quarter of the image bytes to pin and copy.",
        ]
        append_results("VLM micro-batches: collation and bytes", rows, notes)


if __name__ == "__main__":
    main()
