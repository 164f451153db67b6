"""A DPO pair's images through the vision tower once, against once per side, on the CPU.

A native-resolution VLM (tiny-qwen2-vl's layout with a wider, deeper tower: width 256, 8
blocks, so that the tower's share of a step is a VLM's rather than a toy's), `--pairs` pairs
of `--pages` 96 x 96 pages each, padded rows, fp32. One forward + backward of the model's
logits (the step's work up to the loss), timed alike for the batch as the trainer lays it out
(each image once, `image_sources`: data/stream/conversation_batches.py) and for the same batch
with every side's images given apart; their logits are checked equal. MFU's vision FLOPs of
each (train/metrics.py) beside. Prints the table and appends it to bench/RESULTS.md.

    python bench/dpo_images.py [--pairs 4] [--pages 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys

import numpy as np
import torch
from common import append_results, load_average, median_seconds
from PIL import Image

from mmtrain.config import DataConfig, DataSource, VisionDataConfig
from mmtrain.data.stream.conversation_batches import ConversationBatcher
from mmtrain.data.stream.preference_batches import PairDecoder, collate_pairs
from mmtrain.models.build import create_model
from mmtrain.models.visual_inputs import IMAGE_SOURCES, IMAGES
from mmtrain.spec import load_spec
from mmtrain.train.metrics import language_model_forward_flops


def spec():
    base = load_spec("tiny-qwen2-vl")
    vision = dataclasses.replace(base.vision, width=256, depth=8, heads=4, mlp_hidden=512)
    return dataclasses.replace(base, vision=vision)


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (96, 96, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def pair_batch(model_spec, pairs: int, pages: int) -> dict:
    data = DataConfig(train=[DataSource("unused")], chat_template="plain", sequence_length=2048,
                      vision=VisionDataConfig(image_max_tokens=144))  # fmt: skip
    batcher = ConversationBatcher(data, model_spec)
    decode = PairDecoder(batcher.decoder(model_spec, train=False))
    outs = []
    for p in range(pairs):
        members = {f"{n}.png": _png(p * pages + n) for n in range(pages)}
        record = {"id": str(p), "images": list(members), "chosen": "twelve", "rejected": "ten",
                  "messages": [{"role": "user", "content": "<image>" * pages + "Read it."}]}  # fmt: skip
        sample = {"__key__": str(p), "json": json.dumps(record).encode(), **members}
        outs.append(decode(sample, np.random.default_rng(0)))
    return collate_pairs(model_spec, batcher)(outs)


def apart(batch: dict) -> dict:
    """The batch with each side's images given on their own."""
    out = {k: v for k, v in batch.items() if k not in (IMAGE_SOURCES, "video_sources")}
    out[IMAGES] = [batch[IMAGES][i] for i in batch[IMAGE_SOURCES]]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--pages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    load = load_average()
    torch.manual_seed(0)
    model_spec = spec()
    model = create_model(model_spec, seed=0)
    batches = {"once a pair": pair_batch(model_spec, args.pairs, args.pages)}
    batches["once a side"] = apart(batches["once a pair"])

    def step(batch: dict) -> None:
        model.zero_grad()
        model.logits(batch).sum().backward()

    with torch.no_grad():
        logits = [model.logits(b) for b in batches.values()]
    gap = (logits[0] - logits[1]).abs().max().item()
    rows = {}
    for name, batch in batches.items():
        seconds = median_seconds(lambda b=batch: step(b), torch.device("cpu"), args.steps)
        rows[name] = (len(batch[IMAGES]), seconds, language_model_forward_flops(model_spec, batch))
    base = rows["once a side"][1]
    table = ["| images | encoded | fwd+bwd s | vs once a side | vision GFLOP (fwd) | text GFLOP (fwd) |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, (images, seconds, flops) in rows.items():
        table.append(f"| {name} | {images} | {seconds:.2f} | {seconds / base:.2f}x | "
                     f"{flops['vision'] / 1e9:.2f} | {flops['text'] / 1e9:.2f} |")  # fmt: skip
    notes = [
        f"tiny-qwen2-vl's layout, tower width 256 x 8 blocks; {args.pairs} pairs of "
        f"{args.pages} 96 x 96 pages (144 tokens each), padded rows; fp32; median of "
        f"{args.steps} forward + backward of the logits after one warm-up. |logits difference| "
        f"{gap:.1e}. Load average before: {load}.",
    ]
    print("\n".join([*notes, "", *table]))
    append_results("dpo_images", table, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
