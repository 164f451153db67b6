"""Packed vs padded batches: useful (non-padding) tokens per second of a tiny Decoder's forward
and backward on the CPU, in one run, side by side.

Sample lengths are long-tailed, as chat data is: text ids log-normal (median `--median` ids,
sigma `--sigma`), and half the samples carry one image of `--image-length` positions. The same
samples go through `pack_rows` (rows of `--row` positions, `--rows-per-batch` rows a batch,
block-diagonal attention through document_ids) and `padded_batches` (`--batch` samples a batch,
right padding to the longest, SDPA's causal fast path since right padding needs no mask). An
image's placeholder is repeated `image_length` times as a stand-in for its spliced tokens: the
decoder's cost is the same. Rounds alternate the two modes; the best round of each is kept.

Prints the table and appends it to bench/RESULTS.md with the command and the machine.

    python bench/packing.py [--samples 400] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import append_results, load_average

from mmtrain.data.stream.chat_templates import IGNORE_INDEX, EncodedSample
from mmtrain.data.stream.packing import (
    PackedRow,
    expand_images,
    pack_rows,
    padded_batches,
    sample_positions,
)
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models.decoder import Decoder

IMAGE = 3  # placeholder id
FIRST_TEXT_ID = 4


def make_samples(args: argparse.Namespace, vocab: int) -> list[EncodedSample]:
    """Log-normal text lengths, an image in half the samples, the second half of the text trained
    (a prompt, then an answer)."""
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.samples):
        image = bool(rng.random() < 0.5)
        room = args.row - (args.image_length if image else 0)
        n = int(np.clip(rng.lognormal(np.log(args.median), args.sigma), 2, room))
        ids = rng.integers(FIRST_TEXT_ID, vocab, n).tolist()
        if image:
            ids.insert(0, IMAGE)
        answer = len(ids) // 2
        labels = [IGNORE_INDEX] * (len(ids) - answer) + ids[len(ids) - answer :]
        out.append(EncodedSample(ids, labels))
    return out


def to_batch(rows: list[PackedRow], image_length: int) -> dict[str, torch.Tensor]:
    wide = [expand_images(r, IMAGE, image_length) for r in rows]
    return {
        name: torch.tensor([getattr(r, name) for r in wide])
        for name in ("input_ids", "labels", "document_ids", "position_ids")
    }


def step(model: Decoder, batch: dict[str, torch.Tensor], packed: bool) -> None:
    """Forward, next-token loss over the batch's targets, backward."""
    kwargs = {}
    if packed:
        kwargs = {"document_ids": batch["document_ids"], "position_ids": batch["position_ids"]}
    logits = model(batch["input_ids"], **kwargs)
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum")
    (loss / (labels != IGNORE_INDEX).sum()).backward()
    model.zero_grad(set_to_none=True)


def timed(model: Decoder, batches: list[dict[str, torch.Tensor]], packed: bool) -> float:
    start = time.perf_counter()
    for batch in batches:
        step(model, batch, packed)
    return time.perf_counter() - start


def useful(batches: list[dict[str, torch.Tensor]]) -> int:
    return sum(int((b["document_ids"] >= 0).sum()) for b in batches)


def computed(batches: list[dict[str, torch.Tensor]]) -> int:
    return sum(b["input_ids"].numel() for b in batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--median", type=float, default=40.0, help="median text ids")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma")
    parser.add_argument("--image-length", type=int, default=32)
    parser.add_argument("--row", type=int, default=512)
    parser.add_argument("--rows-per-batch", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="samples per padded batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load = load_average()
    spec = DecoderSpec(vocab_size=512, width=128, layers=2, heads=4, mlp_hidden=256)
    model = Decoder(spec)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    samples = make_samples(args, spec.vocab_size)
    settings = {"image_token_id": IMAGE, "image_length": args.image_length}
    rows = list(pack_rows(samples, args.row, **settings))
    packed = [
        to_batch(rows[i : i + args.rows_per_batch], args.image_length)
        for i in range(0, len(rows), args.rows_per_batch)
    ]
    padded = [
        to_batch(b, args.image_length) for b in padded_batches(samples, args.batch, **settings)
    ]
    assert useful(packed) == useful(padded)  # the same tokens either way

    step(model, packed[0], True)  # warm-up: first calls allocate
    step(model, padded[0], False)
    best = {"packed": float("inf"), "padded": float("inf")}
    for _ in range(args.rounds):
        best["packed"] = min(best["packed"], timed(model, packed, True))
        best["padded"] = min(best["padded"], timed(model, padded, False))

    tokens = useful(packed)
    rate = {mode: tokens / seconds for mode, seconds in best.items()}
    shape = {
        "packed": f"{len(packed)} x {args.rows_per_batch} rows of {args.row}",
        "padded": f"{len(padded)} x {args.batch} samples, padded to the longest",
    }
    table = [
        "| mode | batches | positions computed | useful tokens | padding | best round s "
        "| useful tokens/s | / padded |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, batches in (("packed", packed), ("padded", padded)):
        total = computed(batches)
        table.append(
            f"| {mode} | {shape[mode]} | {total} | {tokens} | {1 - tokens / total:.1%} "
            f"| {best[mode]:.2f} | {rate[mode]:,.0f} | {rate[mode] / rate['padded']:.2f}x |"
        )
    sizes = np.array([sample_positions(s, IMAGE, args.image_length) for s in samples])
    notes = [
        f"{args.samples} samples: text ids log-normal (median {args.median:g}, sigma "
        f"{args.sigma:g}, clipped to the row), one image of {args.image_length} positions in "
        f"half of them; Decoder width {spec.width}, {spec.layers} layers, vocab "
        f"{spec.vocab_size}, float32, forward + backward, {args.threads} thread(s), best of "
        f"{args.rounds} alternating rounds; load average before: {load}. Sample positions: "
        f"mean {sizes.mean():.0f}, median {np.median(sizes):.0f}, p95 "
        f"{np.percentile(sizes, 95):.0f}, max {sizes.max()}.",
    ]
    print("\n".join([*notes, "", *table]))
    append_results("packing", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
