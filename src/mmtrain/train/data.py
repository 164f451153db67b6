"""Training batches for a model spec: shards -> StreamingLoader -> SampleDecoder -> micro-batches.

The loader owns the order and the resumable position; the decoder turns a shard sample into one
tensor per tower (decode + train transform, randomness from (seed, epoch, position)). This module
only connects them to the run config and hands the loop an endless stream of micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mmtrain.config import RunConfig
from mmtrain.data.loader import StreamingLoader
from mmtrain.data.shards import ShardSet
from mmtrain.data.tokenizer import get_tokenizer
from mmtrain.data.transforms import SampleDecoder
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError


class TrainData:
    """Micro-batches of `micro_batch` samples for one rank, endlessly (epoch after epoch)."""

    def __init__(
        self, config: RunConfig, spec: ModelSpec, *, rank: int, world_size: int, micro_batch: int
    ):
        sources = []
        for i, source in enumerate(config.data.train):
            try:
                sources.append(ShardSet.open(source.path))
            except (FileNotFoundError, ValueError) as err:
                raise FieldError(f"data.train[{i}].path", f"{source.path!r}: {err}") from None
        weights = [s.weight for s in config.data.train] if len(sources) > 1 else None
        tokenizer = get_tokenizer(config.data.tokenizer) if "text" in _modalities(spec) else None
        self.loader = StreamingLoader(
            sources,
            SampleDecoder(spec, train=True, tokenizer=tokenizer),
            micro_batch,
            seed=config.seed,
            rank=rank,
            world_size=world_size,
            weights=weights,
            shuffle_window=config.data.shuffle_window,
            num_workers=config.data.workers,
            persistent_workers=config.data.workers > 0,
            with_keys=True,
        )
        self._stream: Iterator[dict[str, Any]] | None = None
        self.last_keys: list[str] = []

    def _batches(self) -> Iterator[dict[str, Any]]:
        while True:  # each pass is the rest of one epoch (the loader moves on to the next)
            yield from self.loader

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch {tower name: tensor}; its sample keys go to `last_keys`."""
        if self._stream is None:
            self._stream = self._batches()
        batch = next(self._stream)
        self.last_keys = batch.pop("__key__", [])
        return batch

    def corrupt_samples(self) -> int:
        """Corrupt samples this rank skipped since this object was made."""
        return sum(self.loader.corrupt_counts.values())

    def state_dict(self) -> dict[str, Any]:
        """Loader position (a collective under torch.distributed: call it on every rank)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._stream is not None:
            raise RuntimeError("load the data state before taking the first batch")
        self.loader.load_state_dict(state)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()  # shuts down the loader's workers
            self._stream = None
        for source in self.loader.plan.sources:
            source.close()


def _modalities(spec: ModelSpec) -> set[str]:
    return {tower.modality for tower in spec.towers.values()}
