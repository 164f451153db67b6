"""Each conversation sample's cost, so that a step's samples can be dealt to the ranks evenly
(`data.balance`, data/stream/order.py `balanced_order`).

A VLM's samples differ wildly in work: a page of 1,280 tokens through the tower and the LM
against a short text-only exchange. Ranks meet at every collective of a step, so the step
takes as long as its heaviest rank. The cost of a sample is its forward FLOPs as the trainer
counts them for MFU: the LM over its positions (text ids and each input's tokens, truncated
to `data.sequence_length`) and the tower over each page and clip at its budgeted size
(`spec.sequence_flops_by_part`); a preference pair's, its two rows' and its inputs' once. The
positions and sizes are `data inspect`'s counts
(`conversation_counts`: headers only, the loader's own rules); a sample the loader would
refuse costs 0. Kept beside the first local shard, `.sample-costs-{digest}.npy`, the digest
naming the shards, the spec, the tokenizer, the template, the budget and the length, so a
restarted run and every rank read it instead of the headers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from mmtrain.atomic import atomic_save_npy
from mmtrain.data.ingest.inspect import conversation_counts
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.conversation_batches import ConversationBatcher
from mmtrain.spec import ModelSpec

logger = logging.getLogger(__name__)

__all__ = ["sample_costs"]


def sample_costs(
    sources: list[ShardSet], spec: ModelSpec, batcher: ConversationBatcher, tokenizer: str
) -> np.ndarray:
    """float64 [samples of all sources, flat order]: each sample's forward FLOPs."""
    return np.concatenate([_source_costs(s, spec, batcher, tokenizer) for s in sources])


def _source_costs(
    shards: ShardSet, spec: ModelSpec, batcher: ConversationBatcher, tokenizer: str
) -> np.ndarray:
    path = _cache_path(shards, spec, batcher, tokenizer)
    if path is not None and path.exists():
        try:
            costs = np.load(path, allow_pickle=False)
            if costs.shape == (len(shards),):
                return costs
        except (OSError, ValueError):
            pass  # a damaged file is computed again
    tokens = spec.vision_tokens
    counts = conversation_counts(
        shards,
        batcher.tokenizer,
        batcher.template,
        image_tokens=spec.image_tokens(),
        budget=batcher.budget,
        wrap=tokens is not None and tokens.start_id is not None,
    )
    costs = np.zeros(len(shards), dtype=np.float64)
    shapes = counts.visual_shapes or [()] * len(counts.indices)
    for index, chosen, rejected, images, visual in zip(
        counts.indices, counts.positions, counts.rejected_positions, counts.images, shapes,
        strict=True,
    ):  # fmt: skip
        # A preference pair is two rows whose inputs the tower encodes once.
        lengths = [min(n, batcher.sequence_length) for n in (chosen, rejected) if n]
        parts = spec.sequence_flops_by_part(lengths, images if spec.vision is None else 0, visual)
        costs[index] = float(sum(parts.values()))
    if path is not None and not atomic_save_npy(path, costs):
        logger.info("sample costs of %s not kept (a read-only folder)", path.parent)
    return costs


def _cache_path(
    shards: ShardSet, spec: ModelSpec, batcher: ConversationBatcher, tokenizer: str
) -> Path | None:
    if shards.remote or not shards.shards:
        return None
    key = json.dumps(
        [shards.fingerprint(), spec.to_dict(), tokenizer, batcher.template.name,
         repr(batcher.budget), batcher.sequence_length],
        sort_keys=True, default=str,
    )  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return shards.shard_path(0).parent / f".sample-costs-{digest}.npy"
