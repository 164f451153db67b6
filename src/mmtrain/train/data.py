"""Training batches for a model spec: shards -> StreamingLoader -> SampleDecoder -> micro-batches.

The loader owns the order and the resumable position; the decoder turns a shard sample into one
tensor per tower (decode + train transform, randomness from (seed, epoch, position)). This module
connects them to the run config, adds the labels a fusion head trains on, switches the input
size when a progressive-resolution schedule says so, and hands the loop an endless stream of
micro-batches.

Sources that carry different modalities (image-text shards, audio-text shards, time-series-text
shards for one four-tower model) are mixed by optimizer step instead of by sample: each step
takes all its micro-batches from one source, chosen by a schedule that is a pure function of
(seed, weights, step), and decodes only the towers that source has. Every sample of a batch then
has the same towers, on every rank, and the loop aligns the pairs present in the batch.
Sources with the same modalities are mixed by sample, as before.

A decoder LM (a VLM, or a text-only LM) reads conversation shards instead: the loader's workers
pad or pack the valid samples of each `micro_batch` stream entries into rows
(`ConversationBatcher.collate`), so collation runs beside the step; skipped samples make that
micro-batch smaller. The loader's position still counts entries, so resume is exact.

On CUDA (`data.normalise_on_device`, default: when training on a GPU), image and video pixels
stay uint8 from the workers to the device, a quarter of float32's bytes, in page-locked memory
for an asynchronous copy; `pixel_normalisation()` gives the per-channel values the trainer
normalises them with there (the same float32 arithmetic the workers would have done).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmtrain.config import RunConfig
from mmtrain.data.storage.manifest import read_manifest
from mmtrain.data.storage.remote_cache import ShardCache, cache_stats, open_cache
from mmtrain.data.storage.s3 import is_remote
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.buckets import NO_BUCKET, Buckets
from mmtrain.data.stream.conversation_batches import ConversationBatcher, ConversationDecoder
from mmtrain.data.stream.denoiser_inputs import DenoiserDecoder, check_first_samples
from mmtrain.data.stream.labels import label_value, read_class
from mmtrain.data.stream.loader import NoValidSamples, StreamingLoader
from mmtrain.data.stream.media import MediaError
from mmtrain.data.stream.order import apportion, mixing_schedule
from mmtrain.data.stream.preference_batches import (
    PAIR_INDEX,
    PairDecoder,
    ProcessorPairDecoder,
    collate_pairs,
)
from mmtrain.data.stream.processor_batches import ProcessorBatcher, ProcessorDecoder
from mmtrain.data.stream.sample_sizes import bucket_ids
from mmtrain.data.stream.tokenizer import Tokenizer, get_tokenizer
from mmtrain.data.stream.transforms import (
    MODALITY_EXTENSIONS,
    ImageTransform,
    SampleDecoder,
    VideoTransform,
)
from mmtrain.spec import FusionSpec, ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train.sample_costs import sample_costs

logger = logging.getLogger(__name__)

LABEL_KEY = "label"  # batch key of the fusion head's targets (int64 classes or float32 values)
MIX_BLOCK_STEPS = 1000  # steps over which a step-mixing schedule meets the weights exactly


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
    if fusion.task == "classify":
        return read_class(sample, fusion.num_outputs, label_field, class_names, "the fusion head's")
    value = label_value(sample, label_field)
    return _regression_target(value, fusion.num_outputs)


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
    """SampleDecoder (one tensor per tower, or per tower of `towers`) plus the fusion head's
    target under "label"."""

    def __init__(
        self,
        spec: ModelSpec,
        tokenizer: Tokenizer | None,
        label_field: str = "label",
        class_names: Sequence[str] = (),
        towers: Sequence[str] | None = None,
        uint8_pixels: bool = False,
    ):
        self.towers = SampleDecoder(spec, train=True, tokenizer=tokenizer, uint8=uint8_pixels)
        self.names = list(spec.towers) if towers is None else list(towers)
        self.fusion = spec.fusion
        self.label_field = label_field
        self.class_names = list(class_names)

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        out = {name: self.towers.decode_tower(name, sample, rng) for name in self.names}
        if self.fusion is not None:
            out[LABEL_KEY] = read_label(sample, self.fusion, self.label_field, self.class_names)
        return out


def _buckets(
    config: RunConfig, spec: ModelSpec, sources: list[ShardSet], rank: int
) -> tuple[Buckets | None, np.ndarray | None]:
    """`data.buckets` checked against the denoiser, and the bucket of every sample (read from
    the size index, sample_sizes.py); rank 0 logs how many samples each bucket holds."""
    if config.data.buckets is None:
        return None, None
    if spec.denoiser is None:
        raise FieldError("data.buckets", "buckets shape a denoiser's inputs; this model has none")
    buckets = Buckets.for_denoiser(config.data.buckets, spec.denoiser, config.data.video_stride)
    ids, counts = bucket_ids(sources, buckets)
    if rank == 0:
        held = ", ".join(f"{list(s)}: {counts.get(i, 0)}" for i, s in enumerate(buckets.shapes))
        logger.info("buckets %s; in none: %d samples", held, counts.get(NO_BUCKET, 0))
    if counts.get(NO_BUCKET, 0) == len(ids):
        raise FieldError("data.buckets", "no sample of data.train falls in any bucket")
    return buckets, ids


class TrainData:
    """Micro-batches of `micro_batch` samples for one rank, endlessly (epoch after epoch)."""

    def __init__(
        self,
        config: RunConfig,
        spec: ModelSpec,
        *,
        rank: int,
        world_size: int,
        micro_batch: int,
        uint8_pixels: bool = False,
        pin_memory: bool = False,
    ):
        sources = []
        self.cache = _shard_cache(config)
        for i, source in enumerate(config.data.train):
            try:
                sources.append(ShardSet.open(source.path, cache=self.cache))
            except (FileNotFoundError, ValueError) as err:
                raise FieldError(f"data.train[{i}].path", f"{source.path!r}: {err}") from None
        weights = [s.weight for s in config.data.train] if len(sources) > 1 else None
        self._check_labels(config, spec)
        self.micro_batch = micro_batch
        if config.data.balance and spec.decoder is None:
            # A hub model's costs would need every sample through its processor first.
            why = "not yet for hub models" if spec.hub is not None else "a decoder LM's"
            raise FieldError("data.balance", f"deals conversation samples by cost: {why}")
        self.conversations = _conversations(config, spec)
        self.pairs = config.train.objective == "dpo"  # preference pairs, two rows each
        # What a refusal of every sample is told against (`_unfillable`).
        self.row_length = self.conversations.sequence_length if self.conversations else None
        self.native = spec.vision is not None
        self.tokenizer = (
            get_tokenizer(config.data.tokenizer)
            if "text" in _modalities(spec) and self.conversations is None
            else None
        )
        self.label_field = config.data.label_field
        self.class_names = config.data.class_names
        self.video_stride = config.data.video_stride
        self.buckets, bucket_ids = _buckets(config, spec, sources, rank)
        if spec.denoiser is not None:  # latents / text features of other components: exit 2
            check_first_samples(sources, spec, self.buckets)
            if spec.hub is not None:  # a pipeline's denoiser: its own VAE and encoders only
                _check_pipeline_components(config, spec)
        self.spec = spec  # the spec whose sizes the current transforms produce
        self.uint8_pixels = uint8_pixels
        options = dict(
            seed=config.seed,
            rank=rank,
            world_size=world_size,
            shuffle_window=config.data.shuffle_window,
            num_workers=config.data.workers,
            persistent_workers=config.data.workers > 0,
            with_keys=True,
            pin_memory=pin_memory,
        )
        self._sources, self._options = sources, options  # for `pairs_once`
        self.towers: list[tuple[str, ...] | None] = [None]  # None: every tower
        by_source = self.conversations is None and spec.denoiser is None
        towers = [source_towers(s, spec) for s in sources] if by_source else []
        if self.conversations is not None:
            collate = self._collate(spec)
            costs = None
            if config.data.balance:
                costs = sample_costs(sources, spec, self.conversations, config.data.tokenizer)
            self.loaders = [
                StreamingLoader(
                    sources,
                    self._decoder(spec),
                    micro_batch,
                    weights=weights,
                    collate=collate,
                    costs=costs,
                    rounds=config.accumulation_steps(world_size),
                    **options,
                )  # fmt: skip
            ]
        elif len(set(towers)) <= 1:  # one source, or several with the same modalities
            self.loaders = [
                StreamingLoader(
                    sources,
                    self._decoder(spec),
                    micro_batch,
                    weights=weights,
                    buckets=bucket_ids,
                    **options,
                )  # fmt: skip
            ]
        else:
            _check_pairs_covered(spec, towers)
            self.towers = list(towers)
            self.loaders = [
                StreamingLoader(source, self._decoder(spec, names), micro_batch, **options)
                for source, names in zip(sources, towers, strict=True)
            ]
        self.mix = StepMix(weights or [1.0], config.seed)
        self.accumulation = config.accumulation_steps(world_size)
        self._micro_batches = 0  # handed out since the start of training
        self._streams: dict[int, Iterator[dict[str, Any]]] = {}
        self.last_keys: list[str] = []

    def idle_towers(self) -> set[str]:
        """Towers that some steps leave out (sources of different modalities, mixed by step)."""
        if self.towers == [None]:
            return set()
        return set(self.spec.towers) - set.intersection(*(set(t) for t in self.towers))

    @property
    def loader(self) -> StreamingLoader:
        """The loader of the first source (the only one unless sources differ in modalities)."""
        return self.loaders[0]

    @staticmethod
    def _check_labels(config: RunConfig, spec: ModelSpec) -> None:
        names = config.data.class_names
        if not names:
            return
        if spec.fusion is not None and spec.fusion.task == "classify":
            classes, what = spec.fusion.num_outputs, "the fusion head's"
        elif spec.denoiser is not None and spec.denoiser.num_classes:
            classes, what = spec.denoiser.num_classes, "the denoiser's"
        else:
            raise FieldError(
                "data.class_names",
                "only a classifying fusion head or a class-conditional denoiser uses class names",
            )
        if len(names) != classes:
            raise FieldError("data.class_names", f"{len(names)} names for {what} {classes} classes")

    def _decoder(
        self, spec: ModelSpec, towers: Sequence[str] | None = None
    ) -> TrainDecoder | ConversationDecoder | PairDecoder | DenoiserDecoder:
        if self.conversations is not None:
            decoder = self.conversations.decoder(spec, uint8=self.uint8_pixels)
            if not self.pairs:
                return decoder
            if isinstance(decoder, ProcessorDecoder):
                return ProcessorPairDecoder(decoder)
            return PairDecoder(decoder)
        if spec.denoiser is not None:
            return DenoiserDecoder(spec, self.label_field, self.class_names, self.uint8_pixels,
                                   video_stride=self.video_stride, buckets=self.buckets)  # fmt: skip
        return TrainDecoder(
            spec, self.tokenizer, self.label_field, self.class_names, towers, self.uint8_pixels
        )

    def _collate(self, spec: ModelSpec) -> Any:
        assert self.conversations is not None
        if self.pairs:
            return collate_pairs(spec, self.conversations)
        return self.conversations.collate(spec)

    def pixel_normalisation(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{batch key: (mean, inv_std) per channel} of the inputs that arrive as uint8 pixels,
        for `ImageTransform.to_float` on the device; {} when the workers normalise."""
        if not self.uint8_pixels:
            return {}
        decoder = self.loaders[0].decode
        if isinstance(decoder, (PairDecoder, ProcessorPairDecoder)):  # one side's inputs
            decoder = decoder.decoder
        if isinstance(decoder, ProcessorDecoder):  # the folder's processor normalises itself
            return {}
        if isinstance(decoder, ConversationDecoder) and decoder.native is not None:
            values = decoder.native.scale_and_shift()
            return {"image": values, "video": values}
        if isinstance(decoder, ConversationDecoder):
            t = decoder.image_transform
            return {} if t is None else {"image": t.scale_and_shift()}
        if isinstance(decoder, DenoiserDecoder):
            t = decoder.transform
            return {} if t is None else {"image": t.scale_and_shift()}
        found = {}
        for loader in self.loaders:
            for name, t in loader.decode.towers.transforms.items():
                image = t.image if isinstance(t, VideoTransform) else t
                if isinstance(image, ImageTransform):
                    found[name] = image.scale_and_shift()
        return found

    def _current_source(self) -> int:
        if len(self.loaders) == 1:
            return 0
        return self.mix.source(self._micro_batches // self.accumulation)

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch {tower name: tensor, "label": targets (fusion models)}; its
        sample keys go to `last_keys`. With sources of different modalities, the batch holds
        the towers of this step's source only. A decoder LM gets the VLM batch ("text",
        "labels", "position_ids", "image", and "attention_mask" or, packed, "document_ids")."""
        index = self._current_source()
        if index not in self._streams:
            self._streams[index] = _endless(self.loaders[index])
        try:
            batch = next(self._streams[index])
        except NoValidSamples as err:
            raise _unfillable(err, self.row_length, self.native) from None
        self._micro_batches += 1
        self.last_keys = batch.pop("__key__", [])
        index = batch.pop("__index__", [])
        if self.pairs:  # what names each pair's cached reference log-probs
            batch[PAIR_INDEX] = index
        return batch

    def pairs_once(self) -> StreamingLoader:
        """Every training pair once, this rank's share, in storage order (the sources one after
        another, unshuffled, unweighted), decoded and laid out as the training micro-batches
        are: what train/reference_cache.py scores. Its batches carry `__index__`."""
        assert self.pairs and self.conversations is not None
        options = {**self._options, "persistent_workers": False}
        decoder, collate = self._decoder(self.spec), self._collate(self.spec)
        return StreamingLoader(self._sources, decoder, self.micro_batch, collate=collate,
                               shuffle=False, **options)  # fmt: skip

    def source_fingerprints(self) -> list[str]:
        """Each training source's shard names and sizes, hashed (ShardSet.fingerprint)."""
        return [source.fingerprint() for source in self._sources]

    def samples(self) -> int:
        """Samples over every training source: the range of the flat ids batches carry."""
        return sum(len(source) for source in self._sources)

    def pair_inputs_vary(self) -> bool:
        """Whether a pair's inputs are drawn anew at each read (a projector's image tower
        crops and flips at random), so one stored reference score cannot match them."""
        decoder = self.loaders[0].decode
        if not isinstance(decoder, PairDecoder):  # a hub model's processor draws nothing
            return False
        transform = decoder.decoder.image_transform
        return transform is not None and transform.train

    def set_input_spec(self, spec: ModelSpec) -> None:
        """Produce inputs of `spec`'s sizes from the next batch on (progressive resolution).

        Batches the workers prefetched at the old size are dropped; the loader's position counts
        only batches handed out, so no sample is skipped or repeated.
        """
        if spec == self.spec:
            return
        self._stop_streams()
        for loader, towers in zip(self.loaders, self.towers, strict=True):
            loader.close()  # the next iteration starts workers with the new decoder
            loader.decode = self._decoder(spec, towers)
            if self.conversations is not None:
                loader.collate = self._collate(spec)
        self.spec = spec

    def cache_stats(self) -> dict[str, float]:
        """Shard-cache counters of s3:// sources (cumulative, this process); {} when all local.
        Every remote source reads through the run's one cache, which keeps the counters."""
        return cache_stats([self.cache] if self.cache is not None else [])

    def corrupt_samples(self) -> int:
        """Corrupt samples this rank skipped since this object was made or last rewound."""
        return sum(loader.refusals.total("corrupt") for loader in self.loaders)

    def too_long_samples(self) -> int:
        """Samples this rank skipped as too long for the row (data.sequence_length), since
        this object was made or last rewound."""
        return sum(loader.refusals.total("too_long") for loader in self.loaders)

    def state_dict(self) -> dict[str, Any]:
        """Loader position (a collective under torch.distributed: call it on every rank)."""
        if len(self.loaders) == 1:
            return self.loaders[0].state_dict()
        return {
            "mix": "step",
            "steps": self._micro_batches // self.accumulation,
            "sources": [loader.state_dict() for loader in self.loaders],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; also mid-run (a rollback): prefetched batches are dropped and
        the corrupt-sample count restarts at zero."""
        self._stop_streams()
        mixed = state.get("mix") == "step"
        if mixed != (len(self.loaders) > 1) or (
            mixed and len(state["sources"]) != len(self.loaders)
        ):
            raise ValueError(
                "the saved loader state is for other data.train sources (their number or "
                "modalities changed), so the run cannot resume exactly"
            )
        states = state["sources"] if mixed else [state]
        for loader, saved in zip(self.loaders, states, strict=True):
            loader.load_state_dict(saved)
            loader.refusals.clear()
        self._micro_batches = int(state["steps"]) * self.accumulation if mixed else 0

    def _stop_streams(self) -> None:
        for stream in self._streams.values():
            stream.close()  # ends the loader's iteration (and non-persistent workers)
        self._streams.clear()

    def close(self) -> None:
        self._stop_streams()
        for loader in self.loaders:
            loader.close()
            for source in loader.plan.sources:
                source.close()


def _unfillable(err: NoValidSamples, row_length: int | None, native: bool) -> FieldError:
    """Why no batch can be filled, naming the setting to change: `data.sequence_length` when
    most refusals were samples too long for the row (the positions they need and the input
    taking the most), else the data."""
    too_long = err.in_a_row.get("too_long", 0)
    if too_long * 2 < sum(err.in_a_row.values()) or not err.details:
        return FieldError(
            "data.train",
            f"{err}; check the shards with `mmtrain data inspect` (and `data build`'s rejects)",
        )
    needed = max(int(d.get("needed_positions", 0)) for d in err.details)
    largest = max(err.details, key=lambda d: int(d.get("largest_input_positions", 0)))
    row = row_length if row_length is not None else largest.get("max_length")
    what = largest.get("largest_input") or (
        f"an input of {largest.get('largest_input_positions', 0)} positions"
    )
    budget = (
        ", or a smaller pixel budget (data.vision.image_max_tokens, sample_max_tokens) so "
        "that images take fewer positions"
        if native
        else ""
    )
    return FieldError(
        "data.sequence_length",
        f"{row} positions per row hold none of the samples: {too_long} in a row were too long "
        f"(they need up to {needed} positions; the largest input: {what}); give "
        f"data.sequence_length={needed} or more{budget}",
    )


def _conversations(config: RunConfig, spec: ModelSpec) -> ConversationBatcher | None:
    """How conversation samples become a language model's batches: mmtrain's chat templates
    and tokenizer for a native model, the folder's own processor for a hub model."""
    if spec.hub is not None and spec.is_language_model():
        return ProcessorBatcher(config.data, spec)
    return ConversationBatcher(config.data, spec) if spec.is_language_model() else None


def _check_pipeline_components(config: RunConfig, spec: ModelSpec) -> None:
    """Latents and text features that `encode-latents --pipeline` recorded as another
    pipeline's components (a VAE or text encoder whose config differs from the one in the
    run's pipeline folder) are refused, naming the component: they would train silently on
    what this pipeline's decoder and encoders never produce. Remote sources and manifests
    without a record are not checked."""
    from mmtrain.data.ingest.pipeline_encoders import PipelineFolderError, refuse_other_components

    for i, source in enumerate(config.data.train):
        if is_remote(source.path):
            continue
        try:
            latent = read_manifest(source.path).get("latent") or {}
            refuse_other_components(latent, spec.hub.source, f"data.train[{i}]")
        except FileNotFoundError:
            continue
        except PipelineFolderError as err:
            raise FieldError(f"data.train[{i}].path", str(err)) from None


def _shard_cache(config: RunConfig) -> ShardCache | None:
    """The local cache of s3:// shards (`data.cache_dir`, `data.cache_max_gb`); None when every
    source is on local disk (nothing is created then)."""
    paths = [
        p for s in config.data.train for p in ([s.path] if isinstance(s.path, str) else s.path)
    ]
    if not any(is_remote(p) for p in paths):
        return None
    return open_cache(config.data.cache_dir, config.data.cache_max_gb)


def _endless(loader: StreamingLoader) -> Iterator[dict[str, Any]]:
    while True:  # each pass is the rest of one epoch (the loader moves on to the next)
        yield from loader


class StepMix:
    """Which source each optimizer step reads: a pure function of (weights, seed, step).

    Each block of MIX_BLOCK_STEPS steps gives source s its share of `weights` exactly
    (largest remainder), spread evenly through the block with a random phase per block.
    """

    def __init__(self, weights: Sequence[float], seed: int):
        self.counts = apportion(MIX_BLOCK_STEPS, weights)
        self.seed = seed
        self._block: tuple[int, np.ndarray] | None = None

    def source(self, step: int) -> int:
        block = step // MIX_BLOCK_STEPS
        if self._block is None or self._block[0] != block:
            self._block = (block, mixing_schedule(self.counts, self.seed, block))
        return int(self._block[1][step % MIX_BLOCK_STEPS])


def source_towers(source: ShardSet, spec: ModelSpec) -> tuple[str, ...]:
    """The towers of `spec` whose modality the shards of `source` hold (by member extension);
    every tower when they hold none of them, so the decoder names what is missing."""
    exts = {ext.rsplit(".", 1)[-1] for shard in source.shards for ext in shard.exts}
    names = tuple(
        name
        for name, tower in spec.towers.items()
        if exts & set(MODALITY_EXTENSIONS[tower.modality])
    )
    return names or tuple(spec.towers)


def _check_pairs_covered(spec: ModelSpec, towers: Sequence[tuple[str, ...]]) -> None:
    """Each source must feed at least one pair, else its steps train nothing; a fusion head
    (a loss on every step) needs its towers in every source."""
    for i, names in enumerate(towers):
        if spec.fusion is not None and not set(spec.fused_towers()) <= set(names):
            raise FieldError(
                f"data.train[{i}].path",
                f"holds only {', '.join(names)}; the fusion head needs "
                f"{', '.join(spec.fused_towers())} in every source",
            )
        if spec.fusion is None and not any(a in names and b in names for a, b in spec.pairs):
            raise FieldError(
                f"data.train[{i}].path",
                f"holds only {', '.join(names)}: no pair of the model ({spec.pairs}) has both "
                "towers in it; add the missing modality or drop the source",
            )


def _modalities(spec: ModelSpec) -> set[str]:
    return {tower.modality for tower in spec.towers.values()}
