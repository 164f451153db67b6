"""Preference-pair shards -> DPO micro-batches (train/dpo.py reads them).

A pair sample (`mmtrain data build` of TRL / LLaVA preference records: data/stream/
conversations.py) is its prompt's turns with a `chosen` and a `rejected` answer. `PairDecoder`
encodes both sides with the run's chat template as two conversations, the prompt and one
answer as the assistant's last turn, and keeps labels on that final answer only (a multi-turn
prompt's earlier answers are context, not what the pair compares). The inputs (images, clips)
are decoded once, for the chosen side, and shared by the rejected side: the same pixels, the
same random crop; the micro-batch holds each once, so the vision tower encodes it once
(`image_sources` / `video_sources` say which input each placeholder takes: models/
visual_inputs.py, models/vlm.py).

`collate_pairs` lays out n pairs as 2n samples, the chosen sides first and the rejected ones
after them in the same order (what `DpoObjective` splits): one to a row, or packed (`data.pack`:
`document_ids` give each position's sample, `pairs` their count). A hub model's pairs
(`ProcessorPairDecoder`) are the folder's processor's tensors of each side, made as its
conversations are (data/stream/processor_batches.py; the processor is deterministic, so both
sides hold the same pixels), collated by the processor path's own collate in the same order,
padded or packed (the processor path's `document_ids` number a row's samples, so a packed
batch also carries `sample_ids`: each position's sample in the micro-batch). A padded hub
batch's second half of pixels repeats its first, and says so (`PAIRED_PIXELS`): the class's
vision encoder runs once a pair (models/hub/shared_pixels.py); a packed one's are encoded per
side.

A side whose final answer does not fit `data.sequence_length` whole is refused (counted as
too long), never scored on a cut answer; a plain conversation in a dpo run is skipped and
counted (`not_a_pair`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from mmtrain.data.stream.chat_templates import IGNORE_INDEX, EncodedSample
from mmtrain.data.stream.conversation_batches import (
    ConversationBatcher,
    ConversationDecoder,
    ConversationSample,
    SkippedSample,
    read_conversation,
)
from mmtrain.data.stream.conversations import Conversation
from mmtrain.data.stream.processor_batches import (
    ProcessorBatcher,
    ProcessorDecoder,
    collate_packed,
    collate_processed,
)
from mmtrain.models.hub.shared_pixels import PAIRED_PIXELS
from mmtrain.spec import ModelSpec

REJECTED = "rejected_"  # prefix of the rejected side's tensors in a decoded pair
PAIRS = "pairs"  # the batch key of its pair count, an int (train/dpo.py's PAIRS_KEY)
SAMPLE_IDS = "sample_ids"  # a hub model's packed positions' samples (train/dpo.py's)
# The batch key of each pair's sample id over the run's sources (a host list, pair order):
# what names its cached reference log-probs (train/reference_cache.py).
PAIR_INDEX = "pair_index"


def final_answer_labels(labels: list[int]) -> list[int]:
    """`labels` with every target masked but the last run of targets (the final answer)."""
    end = len(labels)
    while end and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    start = end
    while start and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return [IGNORE_INDEX] * start + labels[start:]


def _pair(sample: dict[str, Any]) -> tuple[Conversation, list[bytes], list[bytes]]:
    conv, images, videos = read_conversation(sample)
    if not conv.is_preference():
        raise SkippedSample(
            "not_a_pair", f"{conv.key}: a conversation, not a preference pair (dpo trains on "
            "pairs: 'chosen' and 'rejected')",
        )  # fmt: skip
    return conv, images, videos


def _check_whole(key: str, side: str, length: int, limit: int) -> None:
    """A side that reaches the row's limit may have lost the end of its answer: refused."""
    if length >= limit:
        raise SkippedSample(
            "truncated_no_targets",
            f"{key}: the {side} side takes {limit} positions or more, so its answer may be "
            "cut; a pair is scored on whole answers (raise data.sequence_length or shorten the "
            "pair)",
        )


class PairDecoder:
    """A pair sample -> both sides' tensors: the chosen side's as `ConversationDecoder` gives
    them, the rejected side's ids, labels and spans under `rejected_`."""

    def __init__(self, decoder: ConversationDecoder):
        self.decoder = decoder

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        conv, images, videos = _pair(sample)
        assert conv.chosen is not None and conv.rejected is not None
        chosen = self.decoder.encode_parsed(conv.answered(conv.chosen), images, videos, rng)
        rejected = self.decoder.encode_text(conv.answered(conv.rejected), images, videos)
        chosen = replace(chosen, labels=self._answer(conv.key, "chosen", chosen))
        rejected = EncodedSample(rejected.input_ids, self._answer(conv.key, "rejected", rejected),
                                 rejected.spans)  # fmt: skip
        out = ConversationDecoder.tensors(chosen)
        out[REJECTED + "input_ids"] = torch.tensor(rejected.input_ids, dtype=torch.long)
        out[REJECTED + "labels"] = torch.tensor(rejected.labels, dtype=torch.long)
        out[REJECTED + "spans"] = torch.tensor(rejected.spans, dtype=torch.long).reshape(-1, 2)
        return out

    def _answer(self, key: str, side: str, encoded: EncodedSample) -> list[int]:
        _check_whole(key, side, len(encoded.input_ids), self.decoder.max_length)
        return final_answer_labels(list(encoded.labels))


class ProcessorPairDecoder:
    """A pair sample -> both sides' processor tensors (batch of one each), the rejected side's
    under `rejected_`, labels on each side's final answer."""

    def __init__(self, decoder: ProcessorDecoder):
        self.decoder = decoder

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        conv, images, videos = _pair(sample)
        out: dict[str, Any] = {}
        for side, answer, prefix in (("chosen", conv.chosen, ""), ("rejected", conv.rejected,
                                                                   REJECTED)):  # fmt: skip
            assert answer is not None
            encoded = self.decoder.encode_parsed(conv.answered(answer), images, videos)
            ids = encoded["input_ids"]
            _check_whole(conv.key, side, ids.shape[1], self.decoder.sequence_length)
            labels = final_answer_labels(encoded["labels"][0].tolist())
            encoded["labels"] = torch.tensor([labels], dtype=torch.long)
            out.update({prefix + name: value for name, value in encoded.items()})
        return out


def pair_samples(out: dict[str, Any]) -> tuple[ConversationSample, ConversationSample]:
    """(chosen, rejected) of a decoded pair, the rejected side sharing the chosen's inputs."""
    chosen = ConversationDecoder.sample_of(out)
    ids, labels = out[REJECTED + "input_ids"].tolist(), out[REJECTED + "labels"].tolist()
    spans = tuple((int(i), int(n)) for i, n in out[REJECTED + "spans"].tolist())
    rejected = ConversationSample(ids, labels, spans if chosen.visual is not None else (),
                                  images=chosen.images, visual=chosen.visual)  # fmt: skip
    return chosen, rejected


def collate_pairs(
    spec: ModelSpec, batcher: ConversationBatcher | ProcessorBatcher
) -> functools.partial:
    """The streaming loader's collate of a dpo run: decoded pairs -> 2n rows, chosen first."""
    if isinstance(batcher, ProcessorBatcher):
        row_length = batcher.sequence_length if batcher.pack else None
        return functools.partial(_collate_processed, batcher.pad_id, row_length)
    return functools.partial(_collate, batcher, spec)


def _collate_processed(
    pad_id: int, row_length: int | None, outputs: list[dict[str, Any]]
) -> dict[str, Any]:
    chosen = [{k: v for k, v in out.items() if not k.startswith(REJECTED)} for out in outputs]
    rejected = [{k[len(REJECTED) :]: v for k, v in out.items() if k.startswith(REJECTED)}
                for out in outputs]  # fmt: skip
    samples = chosen + rejected
    if row_length is None:
        batch: dict[str, Any] = collate_processed(samples, pad_id)
        # The rejected sides' pixels repeat the chosen sides', in order: encoded once.
        batch[PAIRED_PIXELS] = any(k.startswith("pixel_values") for k in batch)
    else:
        for index, sample in enumerate(samples):  # padding's 0 owns no target
            sample[SAMPLE_IDS] = torch.full_like(sample["input_ids"], index)
        batch = collate_packed(samples, pad_id, row_length)
    batch[PAIRS] = len(outputs)
    return batch


def _collate(
    batcher: ConversationBatcher, spec: ModelSpec, outputs: list[dict[str, Any]]
) -> dict[str, torch.Tensor]:
    # Module level, so the partial pickles into the loader's worker processes.
    pairs = [pair_samples(out) for out in outputs]
    batch = batcher.batch([c for c, _ in pairs] + [r for _, r in pairs], spec)
    batch[PAIRS] = len(pairs)  # a host int: the loss reads it without a device sync
    return batch
