"""Training batches for a model spec: shards -> StreamingLoader -> SampleDecoder -> micro-batches.

The loader owns the order and the resumable position; the decoder turns a shard sample into one
tensor per tower (decode + train transform, randomness from (seed, epoch, position)). This module
connects them to the run config, adds the labels a fusion head trains on, switches the input
size when a progressive-resolution schedule says so, and hands the loop an endless stream of
micro-batches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmtrain.config import RunConfig
from mmtrain.data.loader import StreamingLoader
from mmtrain.data.media import MediaError, decode_text
from mmtrain.data.shards import ShardSet
from mmtrain.data.tokenizer import Tokenizer, get_tokenizer
from mmtrain.data.transforms import SampleDecoder
from mmtrain.spec import FusionSpec, ModelSpec
from mmtrain.structured import FieldError

LABEL_KEY = "label"  # batch key of the fusion head's targets (int64 classes or float32 values)


def read_label(
    sample: Mapping[str, Any],
    fusion: FusionSpec,
    label_field: str = "label",
    class_names: Sequence[str] = (),
) -> torch.Tensor:
    """The fusion head's target of one shard sample, from its `.cls` member (WebDataset's
    convention) or else field `label_field` of its `.json` member.

    classify: an integer in [0, num_outputs) or a name from `class_names` -> int64 scalar.
    regress: a number or a list of `num_outputs` numbers -> float32 [num_outputs].
    Raises MediaError (the loader skips and counts the sample) when the label is missing or
    does not fit the head.
    """
    if "cls" in sample:
        text = decode_text(sample["cls"], what="label").strip()
        try:
            value: Any = json.loads(text)  # "3", "0.5" or "[0.1, 2]"
        except ValueError:
            value = text  # a class name
    elif "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except ValueError as err:
            raise MediaError(f"json member is not valid JSON: {err}") from None
        if not isinstance(meta, dict) or label_field not in meta:
            raise MediaError(f"no .cls member and the json member has no field {label_field!r}")
        value = meta[label_field]
    else:
        raise MediaError(f"no label: neither a .cls member nor a .json with {label_field!r}")
    if fusion.task == "classify":
        return torch.tensor(_class_index(value, fusion.num_outputs, class_names), dtype=torch.long)
    return _regression_target(value, fusion.num_outputs)


def _class_index(value: Any, classes: int, class_names: Sequence[str]) -> int:
    if isinstance(value, str):
        if value not in class_names:
            raise MediaError(f"label {value!r} is not one of data.class_names")
        return list(class_names).index(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MediaError(f"label {value!r} is not an integer class or a class name")
    if not 0 <= value < classes:
        raise MediaError(f"label {value} is outside the fusion head's {classes} classes")
    return value


def _regression_target(value: Any, outputs: int) -> torch.Tensor:
    values = value if isinstance(value, list) else [value]
    if len(values) != outputs or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        raise MediaError(f"regression target {value!r} is not {outputs} number(s)")
    target = torch.tensor(values, dtype=torch.float32)
    if not torch.isfinite(target).all():
        raise MediaError(f"regression target {value!r} is not finite")
    return target


class TrainDecoder:
    """SampleDecoder (one tensor per tower) plus the fusion head's target under "label"."""

    def __init__(
        self,
        spec: ModelSpec,
        tokenizer: Tokenizer | None,
        label_field: str = "label",
        class_names: Sequence[str] = (),
    ):
        self.towers = SampleDecoder(spec, train=True, tokenizer=tokenizer)
        self.fusion = spec.fusion
        self.label_field = label_field
        self.class_names = list(class_names)

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        out = self.towers(sample, rng)
        if self.fusion is not None:
            out[LABEL_KEY] = read_label(sample, self.fusion, self.label_field, self.class_names)
        return out


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
        self._check_labels(config, spec)
        self.tokenizer = (
            get_tokenizer(config.data.tokenizer) if "text" in _modalities(spec) else None
        )
        self.label_field = config.data.label_field
        self.class_names = config.data.class_names
        self.spec = spec  # the spec whose sizes the current transforms produce
        self.loader = StreamingLoader(
            sources,
            self._decoder(spec),
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

    @staticmethod
    def _check_labels(config: RunConfig, spec: ModelSpec) -> None:
        fusion = spec.fusion
        names = config.data.class_names
        if names and (fusion is None or fusion.task != "classify"):
            raise FieldError("data.class_names", "only a classifying fusion head uses class names")
        if names and fusion is not None and len(names) != fusion.num_outputs:
            raise FieldError(
                "data.class_names",
                f"{len(names)} names for the fusion head's {fusion.num_outputs} classes",
            )

    def _decoder(self, spec: ModelSpec) -> TrainDecoder:
        return TrainDecoder(spec, self.tokenizer, self.label_field, self.class_names)

    def _batches(self) -> Iterator[dict[str, Any]]:
        while True:  # each pass is the rest of one epoch (the loader moves on to the next)
            yield from self.loader

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch {tower name: tensor, "label": targets (fusion models)}; its
        sample keys go to `last_keys`."""
        if self._stream is None:
            self._stream = self._batches()
        batch = next(self._stream)
        self.last_keys = batch.pop("__key__", [])
        return batch

    def set_input_spec(self, spec: ModelSpec) -> None:
        """Produce inputs of `spec`'s sizes from the next batch on (progressive resolution).

        Batches the workers prefetched at the old size are dropped; the loader's position counts
        only batches handed out, so no sample is skipped or repeated.
        """
        if spec == self.spec:
            return
        self._stop_stream()
        self.loader.close()  # the next iteration starts workers with the new decoder
        self.loader.decode = self._decoder(spec)
        self.spec = spec

    def corrupt_samples(self) -> int:
        """Corrupt samples this rank skipped since this object was made or last rewound."""
        return sum(self.loader.corrupt_counts.values())

    def state_dict(self) -> dict[str, Any]:
        """Loader position (a collective under torch.distributed: call it on every rank)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; also mid-run (a rollback): prefetched batches are dropped and
        the corrupt-sample count restarts at zero."""
        self._stop_stream()
        self.loader.load_state_dict(state)
        self.loader.corrupt_counts.clear()

    def _stop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()  # ends the loader's iteration (and non-persistent workers)
            self._stream = None

    def close(self) -> None:
        self._stop_stream()
        self.loader.close()
        for source in self.loader.plan.sources:
            source.close()


def _modalities(spec: ModelSpec) -> set[str]:
    return {tower.modality for tower in spec.towers.values()}
