"""Evaluate a model on a dataset: embed it on every rank, gather, compute every metric that fits.

    batches ──embed (this rank's share)──▶ Embedded ──gather, dedupe, sort by key──▶ Embedded
        ──▶ retrieval per pair and direction, CLIP score per pair, zero-shot, linear probe,
            fusion-head accuracy ──▶ nested report (eval.json) / flat metrics (metrics.jsonl)

Every rank embeds its own slice of the data (the streaming loader's rank split), the embeddings
are gathered to all ranks, every rank scores its share of the queries, and the per-query results
are gathered again: all ranks work and all return the same numbers.

The streaming loader pads the last step of an epoch with samples from its beginning so that all
ranks take the same number of steps; those repeats are removed by sample key (keys are unique
in WebDataset shards), and the samples are put in key order, so the result does not depend on
the number of ranks or the batch size.

For the training loop: build an `Evaluator` once, call it every N steps on every rank:

    evaluator = Evaluator(spec, config.data.val paths, batch_size=64, tokenizer=tokenizer)
    metrics = evaluator(model)   # {"retrieval/image->text/R@1": 0.41, ...}, same on all ranks
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmtrain import distributed
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.labels import label_value
from mmtrain.data.stream.loader import StreamingLoader
from mmtrain.data.stream.media import (
    DEFAULT_MAX_PIXELS,
    MediaError,
    decode_audio,
    decode_image,
    decode_text,
    decode_timeseries,
    decode_video,
)
from mmtrain.data.stream.tokenizer import Tokenizer, get_tokenizer
from mmtrain.data.stream.transforms import (
    MODALITY_EXTENSIONS,
    AudioTransform,
    ImageTransform,
    TimeSeriesTransform,
    VideoTransform,
    make_transform,
)
from mmtrain.eval.clipscore import clip_score, clip_score_summary
from mmtrain.eval.probe import ProbeConfig, linear_probe, macro_f1
from mmtrain.eval.retrieval import DEFAULT_CHUNK_ELEMENTS, DEFAULT_KS, retrieval_metrics
from mmtrain.eval.zeroshot import DEFAULT_TEMPLATES, class_embeddings, zeroshot_metrics
from mmtrain.losses import at_least_fp32
from mmtrain.models.build import unwrap_model
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

logger = logging.getLogger(__name__)

LABEL_KEY = "label"  # batch key of the int64 class labels
KEY_KEY = "__key__"
PROBE_TEST_EVERY = 5  # without a probe training set: 1 sample in 5 (by key hash) is the test set

__all__ = [
    "EvalDecoder",
    "Embedded",
    "ZeroShotConfig",
    "Evaluator",
    "spec_of",
    "eval_loader",
    "embed",
    "gather_embedded",
    "compute_report",
    "evaluate",
    "evaluate_report",
    "flatten_metrics",
    "parse_pairs",
]


# ----------------------------------------------------------------------------- decoding
class EvalDecoder:
    """A shard sample -> `{tower: tensor}` for the chosen towers (eval transforms: centre crops,
    no randomness), plus `"label"` (int64 scalar) when `labels` is on.

    Only the towers evaluated are decoded, so a four-tower model can be evaluated on image-text
    data. Labels come from the `.cls` member (an integer, WebDataset's convention) or, when the
    sample has none, from field `label_field` of its `.json` member: an integer, or a class name
    looked up in `class_names`. A missing member raises `MediaError` (the loader skips and
    counts the sample).
    """

    def __init__(
        self,
        spec: ModelSpec,
        towers: Sequence[str],
        tokenizer: Tokenizer | None = None,
        *,
        labels: bool = False,
        label_field: str = "label",
        class_names: Sequence[str] | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ):
        unknown = [t for t in towers if t not in spec.towers]
        if unknown:
            raise FieldError(
                "towers", f"no tower {unknown[0]!r} in the model ({', '.join(spec.towers)})"
            )
        self.towers = {name: spec.towers[name] for name in towers}
        self.transforms = {
            name: make_transform(tower, False, tokenizer, name=name)
            for name, tower in self.towers.items()
        }
        self.labels = labels
        self.label_field = label_field
        self.class_index = {n: i for i, n in enumerate(class_names)} if class_names else {}
        self.max_pixels = max_pixels

    def __call__(
        self, sample: Mapping[str, Any], rng: np.random.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        out = {}
        for name, tower in self.towers.items():
            ext = next((e for e in MODALITY_EXTENSIONS[tower.modality] if e in sample), None)
            if ext is None:
                raise MediaError(f"no {tower.modality} member for tower {name!r}")
            transform = self.transforms[name]
            out[name] = transform(self._decode(transform, tower.stem, ext, sample[ext]))
        if self.labels:
            out[LABEL_KEY] = torch.tensor(self._label(sample), dtype=torch.long)
        return out

    def _decode(self, transform: Any, stem: Any, ext: str, data: bytes) -> Any:
        if isinstance(transform, ImageTransform):
            return decode_image(data, self.max_pixels, draft_size=transform.min_decode_size())
        if isinstance(transform, VideoTransform):
            size = transform.image.min_decode_size()
            return decode_video(
                data, transform.frames, short_side=size, max_pixels=self.max_pixels
            ).frames
        if isinstance(transform, AudioTransform):
            return decode_audio(data, stem.sample_rate)
        if isinstance(transform, TimeSeriesTransform):
            return decode_timeseries(data, ext)
        return decode_text(data)

    def _label(self, sample: Mapping[str, Any]) -> int:
        value = label_value(sample, self.label_field)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise MediaError(f"label {value!r} is neither an integer nor a class name")
        if isinstance(value, str):
            if value not in self.class_index:
                raise MediaError(f"label {value!r} is not one of the class names")
            value = self.class_index[value]
        if value < 0 or (self.class_index and value >= len(self.class_index)):
            raise MediaError(f"label {value} is out of range")
        return int(value)


def eval_loader(
    spec: ModelSpec,
    data: str | Path | Sequence[str | Path],
    *,
    batch_size: int,
    towers: Sequence[str] | None = None,
    tokenizer: Tokenizer | str | None = "byte",
    labels: bool = False,
    label_field: str = "label",
    class_names: Sequence[str] | None = None,
    num_workers: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
) -> StreamingLoader:
    """A loader over `data` (folder, glob, brace pattern or list of shards) that yields this
    rank's share of every sample once per epoch, in shard order, with keys."""
    towers = list(spec.towers) if towers is None else list(towers)
    if isinstance(tokenizer, (str, Path)):
        tokenizer = get_tokenizer(tokenizer)
    if not any(spec.towers[t].modality == "text" for t in towers if t in spec.towers):
        tokenizer = None
    try:
        shards = ShardSet.open(data)
    except (FileNotFoundError, ValueError) as err:
        raise FieldError("data", f"{data!r}: {err}") from None
    if len(shards) == 0:
        raise FieldError("data", f"{data!r}: no samples")
    decoder = EvalDecoder(
        spec, towers, tokenizer, labels=labels, label_field=label_field, class_names=class_names
    )
    return StreamingLoader(
        shards,
        decoder,
        batch_size,
        rank=distributed.rank() if rank is None else rank,
        world_size=distributed.world_size() if world_size is None else world_size,
        shuffle=False,
        drop_tail=False,
        num_workers=num_workers,
        with_keys=True,
        # A whole dataset's worth of failures in a row: nothing is decodable, stop at once.
        max_consecutive_corrupt=len(shards),
    )


# ----------------------------------------------------------------------------- embedding
@dataclass
class Embedded:
    """Embeddings of a dataset: row i of every tensor is sample i (key `keys[i]`)."""

    features: dict[str, torch.Tensor]  # tower -> float32 [N, D], L2-normalised
    keys: list[str] | None = None
    labels: torch.Tensor | None = None  # int64 [N]
    fusion: torch.Tensor | None = None  # float32 [N, num_outputs], the fusion head's output

    def __len__(self) -> int:
        return len(next(iter(self.features.values())))

    def select(self, rows: torch.Tensor) -> Embedded:
        """The samples at `rows` (int64 indices on any device)."""
        cpu_rows = rows.cpu()
        return Embedded(
            {n: f[rows.to(f.device)] for n, f in self.features.items()},
            None if self.keys is None else [self.keys[i] for i in cpu_rows.tolist()],
            None if self.labels is None else self.labels[rows.to(self.labels.device)],
            None if self.fusion is None else self.fusion[rows.to(self.fusion.device)],
        )


def spec_of(model: nn.Module) -> ModelSpec:
    """The `ModelSpec` of a model, also inside DDP / torch.compile wrappers."""
    inner = unwrap_model(model)
    if not hasattr(inner, "spec"):
        raise TypeError(f"{type(model).__name__} has no model spec (not an mmtrain model?)")
    return inner.spec


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _model_float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype float inputs are given in: the parameters' (float64 for an `fp64` run)."""
    param = next(model.parameters(), None)
    return param.dtype if param is not None and param.is_floating_point() else torch.float32


def _as_input(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    value = value.to(device, non_blocking=True)
    return value.to(dtype) if value.is_floating_point() else value


@torch.no_grad()
def embed(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    towers: Sequence[str],
    device: torch.device | str | None = None,
) -> Embedded:
    """Run `model` (its forward, so DDP/FSDP wrappers work) on every batch; keep the embeddings
    of `towers`, the keys, labels and fusion outputs. Local to this rank; no collectives
    besides those the model's forward makes."""
    device = torch.device(device) if device is not None else _model_device(model)
    dtype = _model_float_dtype(model)
    spec = spec_of(model)
    features: dict[str, list[torch.Tensor]] = {t: [] for t in towers}
    keys: list[str] = []
    labels: list[torch.Tensor] = []
    fusion: list[torch.Tensor] = []
    has_keys = True
    for batch in batches:
        inputs = {t: _as_input(batch[t], device, dtype) for t in towers}
        out = model(inputs)
        for t in towers:
            features[t].append(at_least_fp32(out[t]))
        if "fusion" in out:
            fusion.append(at_least_fp32(out["fusion"]))
        if LABEL_KEY in batch:
            labels.append(torch.as_tensor(batch[LABEL_KEY]).long().to(device))
        if KEY_KEY in batch:
            keys.extend(batch[KEY_KEY])
        else:
            has_keys = False
    rows = sum(len(f) for f in next(iter(features.values()), []))
    if labels and sum(len(x) for x in labels) != rows:
        raise ValueError("some batches have labels and others do not")
    empty = torch.zeros(0, spec.embed_dim, device=device)
    return Embedded(
        {t: torch.cat(f) if f else empty for t, f in features.items()},
        keys if has_keys else None,
        torch.cat(labels) if labels else None,
        torch.cat(fusion) if fusion else None,
    )


def _gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate tensors with different row counts from all ranks (rank order)."""
    world = distributed.world_size()
    if world == 1:
        return tensor
    count = torch.tensor([tensor.shape[0]], device=tensor.device)
    counts = distributed.all_gather(count).tolist()
    padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = distributed.all_gather(padded).view(world, max(counts), *tensor.shape[1:])
    return torch.cat([gathered[r, :n] for r, n in enumerate(counts)])


def _gather_keys(keys: list[str]) -> list[str]:
    if distributed.world_size() == 1:
        return keys
    parts: list[Any] = [None] * distributed.world_size()
    torch.distributed.all_gather_object(parts, keys)
    return [k for part in parts for k in part]


def gather_embedded(local: Embedded) -> Embedded:
    """Every rank's embeddings on every rank, repeats removed and samples sorted by key.

    A collective: call it on every rank. Without keys the rows stay in rank order and repeats
    cannot be recognised, so pass batches with `"__key__"` (`eval_loader` does)."""
    world = distributed.world_size()
    if world > 1:
        flags = torch.tensor(
            [local.keys is not None, local.labels is not None, local.fusion is not None],
            dtype=torch.long,
            device=next(iter(local.features.values())).device,
        )
        agreed = distributed.all_gather(flags).view(world, 3).min(dim=0).values.tolist()
        if agreed != flags.tolist():
            raise ValueError(
                "ranks disagree on whether batches carry keys, labels or fusion outputs"
            )
    features = {t: _gather_rows(f) for t, f in local.features.items()}
    gathered = Embedded(
        features,
        None if local.keys is None else _gather_keys(local.keys),
        None if local.labels is None else _gather_rows(local.labels),
        None if local.fusion is None else _gather_rows(local.fusion),
    )
    if gathered.keys is None:
        return gathered
    first: dict[str, int] = {}
    for i, key in enumerate(gathered.keys):
        first.setdefault(key, i)
    order = sorted(first)  # key order: independent of ranks, batch size and padding
    rows = torch.tensor([first[k] for k in order], dtype=torch.long)
    return gathered.select(rows)


# ----------------------------------------------------------------------------- metrics
@dataclass
class ZeroShotConfig:
    """Zero-shot classification of every non-text tower with labels (see `zeroshot.py`)."""

    class_names: list[str]
    templates: list[str] = field(default_factory=lambda: list(DEFAULT_TEMPLATES))
    tokenizer: Tokenizer | str = "byte"
    text_tower: str | None = None  # default: the model's first text tower
    batch_size: int = 256  # prompts per forward pass
    ks: tuple[int, ...] = (1, 5)


def _text_tower(spec: ModelSpec, name: str | None) -> str:
    if name is not None:
        if name not in spec.towers:
            raise FieldError("zeroshot.text_tower", f"no tower {name!r} in the model")
        return name
    for tower_name, tower in spec.towers.items():
        if tower.modality == "text":
            return tower_name
    raise FieldError("zeroshot", "zero-shot classification needs a model with a text tower")


@torch.no_grad()
def _embed_texts(
    model: nn.Module, texts: list[str], tower: str, tokenizer: Tokenizer, batch_size: int
) -> torch.Tensor:
    device = _model_device(model)
    context = spec_of(model).towers[tower].stem.context_length
    parts = []
    for i in range(0, len(texts), batch_size):
        ids = tokenizer(texts[i : i + batch_size], context).to(device)
        parts.append(model({tower: ids})[tower].float())
    return torch.cat(parts)


def _probe_split(embedded: Embedded) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic train/test rows: a sample is a test sample when the hash of its key (or
    its index, without keys) falls in 1 of `PROBE_TEST_EVERY` buckets."""
    n = len(embedded)
    if embedded.keys is not None:
        buckets = [
            int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little")
            for k in embedded.keys
        ]
    else:
        buckets = list(range(n))
    test = torch.tensor([b % PROBE_TEST_EVERY == 0 for b in buckets], dtype=torch.bool)
    return torch.nonzero(~test).flatten(), torch.nonzero(test).flatten()


def _probe_features(embedded: Embedded, towers: Sequence[str]) -> torch.Tensor:
    return torch.cat([embedded.features[t] for t in towers], dim=1)


def compute_report(
    model: nn.Module,
    embedded: Embedded,
    pairs: Sequence[tuple[str, str]],
    *,
    zeroshot: ZeroShotConfig | None = None,
    probe: bool = False,
    probe_train: Embedded | None = None,
    probe_config: ProbeConfig | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> dict[str, Any]:
    """All metrics that apply to gathered embeddings, as a nested dict (the body of eval.json).

    Call on every rank with the same `embedded` (from `gather_embedded`); the query work is
    split over the ranks and every rank returns the same report. `model` is needed only for the
    zero-shot class embeddings.
    """
    if len(embedded) == 0:
        raise FieldError(
            "data",
            "no sample could be decoded: all were corrupt or lacked a member the evaluation "
            "needs (a tower's modality, or a label); see the warnings above",
        )
    spec = spec_of(model)
    report: dict[str, Any] = {"n_samples": len(embedded)}
    if pairs:
        report["retrieval"] = retrieval_metrics(
            embedded.features, pairs, ks=ks, chunk_elements=chunk_elements
        )
        report["clip_score"] = {
            f"{a}-{b}": clip_score_summary(clip_score(embedded.features[a], embedded.features[b]))
            for a, b in pairs
        }
    if zeroshot is not None:
        report["zeroshot"] = _zeroshot(model, embedded, zeroshot, chunk_elements)
    if probe:
        report["probe"] = _probe(embedded, probe_train, probe_config)
    if embedded.fusion is not None and embedded.labels is not None and spec.fusion is not None:
        if spec.fusion.task == "classify":
            predictions = embedded.fusion.argmax(dim=1).cpu()
            labels = embedded.labels.cpu()
            report["fusion"] = {
                "accuracy": float((predictions == labels).double().mean()),
                "macro_f1": macro_f1(predictions, labels),
                "n_samples": int(labels.numel()),
            }
    return report


def _zeroshot(
    model: nn.Module, embedded: Embedded, config: ZeroShotConfig, chunk_elements: int
) -> dict[str, Any]:
    if embedded.labels is None:
        raise FieldError("zeroshot", "zero-shot classification needs labels (.cls or a json field)")
    spec = spec_of(model)
    text = _text_tower(spec, config.text_tower)
    tokenizer = (
        get_tokenizer(config.tokenizer)
        if isinstance(config.tokenizer, (str, Path))
        else config.tokenizer
    )
    classes = class_embeddings(
        lambda texts: _embed_texts(model, texts, text, tokenizer, config.batch_size),
        config.class_names,
        config.templates,
    )
    ks = tuple(k for k in config.ks if k <= len(config.class_names)) or (1,)
    out: dict[str, Any] = {}
    for tower, features in embedded.features.items():
        if tower == text:
            continue
        metrics = zeroshot_metrics(
            features, embedded.labels, classes, ks, chunk_elements=chunk_elements
        )
        out[tower] = {
            **metrics,
            "n_classes": len(config.class_names),
            "n_templates": len(config.templates),
        }
    return out


def _probe(
    embedded: Embedded, probe_train: Embedded | None, config: ProbeConfig | None
) -> dict[str, Any]:
    if embedded.labels is None or (probe_train is not None and probe_train.labels is None):
        raise FieldError("probe", "the linear probe needs labels (.cls or a json field)")
    towers = sorted(embedded.features)
    if probe_train is None:
        train_rows, test_rows = _probe_split(embedded)
        if len(train_rows) == 0 or len(test_rows) == 0:
            raise ValueError(f"{len(embedded)} samples are too few to split for the linear probe")
        train, test, split = embedded.select(train_rows), embedded.select(test_rows), "key-hash"
    else:
        train, test, split = probe_train, embedded, "given"
    train_x, test_x = _probe_features(train, towers), _probe_features(test, towers)
    result = linear_probe(train_x, train.labels, test_x, test.labels, config=config)
    return {**result, "towers": towers, "split": split}


# ----------------------------------------------------------------------------- entry points
def parse_pairs(text: str | Sequence[str], spec: ModelSpec) -> list[tuple[str, str]]:
    """`"image-text,audio-text"` (or a list of "a-b") -> [("image", "text"), ...], checked."""
    items = text.split(",") if isinstance(text, str) else list(text)
    pairs = []
    for item in (i.strip() for i in items):
        parts = item.split("-")
        if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
            raise FieldError("pairs", f"{item!r} is not two different tower names joined by '-'")
        for name in parts:
            if name not in spec.towers:
                raise FieldError(
                    "pairs", f"no tower {name!r} in the model; towers: {', '.join(spec.towers)}"
                )
        pairs.append((parts[0], parts[1]))
    return pairs


def _pair_list(pairs: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
    return [(str(a), str(b)) for a, b in pairs]


def _towers_needed(
    spec: ModelSpec, pairs: Sequence[tuple[str, str]], zeroshot: bool, probe: bool
) -> list[str]:
    names = {n for pair in pairs for n in pair}
    if zeroshot:
        names |= {n for n, t in spec.towers.items() if t.modality != "text"}
    if probe or (spec.fusion is not None and not pairs):
        names |= set(spec.fused_towers()) if spec.fusion is not None else set(spec.towers)
    return [n for n in spec.towers if n in names]  # model order


def evaluate_report(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    pairs: Sequence[tuple[str, str]] | None = None,
    *,
    towers: Sequence[str] | None = None,
    zeroshot: ZeroShotConfig | None = None,
    probe: bool = False,
    probe_batches: Iterable[Mapping[str, Any]] | None = None,
    probe_config: ProbeConfig | None = None,
    device: torch.device | str | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> dict[str, Any]:
    """Embed `batches` on this rank, gather, and compute the nested report (see
    `compute_report`). A collective under torch.distributed: call it on every rank. The model is
    put in eval mode for the duration and restored after."""
    spec = spec_of(model)
    pairs = _pair_list(spec.pairs if pairs is None else pairs)
    towers = (
        list(towers)
        if towers is not None
        else _towers_needed(spec, pairs, zeroshot is not None, probe)
    )
    was_training = model.training
    model.eval()
    try:
        embedded = gather_embedded(embed(model, batches, towers, device))
        probe_train = None
        if probe_batches is not None:
            probe_train = gather_embedded(embed(model, probe_batches, towers, device))
        return compute_report(
            model,
            embedded,
            pairs,
            zeroshot=zeroshot,
            probe=probe,
            probe_train=probe_train,
            probe_config=probe_config,
            ks=ks,
            chunk_elements=chunk_elements,
        )
    finally:
        model.train(was_training)


def flatten_metrics(report: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of a nested report as flat keys: `{"retrieval/image->text/R@1": 0.4, ...}`."""
    flat: dict[str, float] = {}
    for key, value in report.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def evaluate(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    pairs: Sequence[tuple[str, str]] | None = None,
    **options: Any,
) -> dict[str, float]:
    """`evaluate_report` flattened for metrics.jsonl / TensorBoard:
    `{"retrieval/image->text/R@1": ..., "clip_score/image-text/mean": ..., ...}`."""
    return flatten_metrics(evaluate_report(model, batches, pairs, **options))


def _data_errors(loader: StreamingLoader, name: str) -> Iterator[dict[str, Any]]:
    """The loader's batches; its RuntimeErrors (only ever about the data, such as too many
    corrupt samples in a row) become FieldErrors naming the data set, so the CLI exits 2."""
    batches = iter(loader)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except RuntimeError as err:
            raise FieldError(name, str(err)) from err
        yield batch


class Evaluator:
    """Periodic evaluation for the training loop: one loader, built once, replayed each call.

    `Evaluator(spec, data, batch_size=...)(model)` returns flat metrics, identical on every
    rank; call it on all ranks at the same step (it is a collective). `.report(model)` gives the
    nested report that `mmtrain eval` writes to eval.json.

    data: the validation shards (folder, glob, brace pattern or list). pairs: tower pairs for
    retrieval and CLIP score (default: the spec's). zeroshot: class names and templates.
    probe: fit a linear probe on the labels, on `probe_data` or else on 4 in 5 samples of
    `data` chosen by key hash. Labels come from `.cls` or json field `label_field` (class
    names mapped through `class_names`, or the zero-shot names). rank / world_size default to
    torch.distributed's.
    """

    def __init__(
        self,
        spec: ModelSpec,
        data: str | Path | Sequence[str | Path],
        *,
        batch_size: int,
        tokenizer: Tokenizer | str = "byte",
        pairs: Sequence[tuple[str, str]] | None = None,
        zeroshot: ZeroShotConfig | None = None,
        probe: bool = False,
        probe_data: str | Path | Sequence[str | Path] | None = None,
        label_field: str = "label",
        class_names: Sequence[str] | None = None,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        ks: Sequence[int] = DEFAULT_KS,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    ):
        self.pairs = _pair_list(spec.pairs if pairs is None else pairs)
        self.towers = _towers_needed(spec, self.pairs, zeroshot is not None, probe)
        if not self.towers:
            raise FieldError(
                "pairs", "nothing to evaluate: give pairs, zero-shot classes or a probe"
            )
        self.options: dict[str, Any] = dict(
            zeroshot=zeroshot, probe=probe, ks=ks, chunk_elements=chunk_elements
        )
        labels = (
            zeroshot is not None
            or probe
            or (spec.fusion is not None and spec.fusion.task == "classify" and not self.pairs)
        )
        loader_options: dict[str, Any] = dict(
            batch_size=batch_size,
            towers=self.towers,
            tokenizer=tokenizer,
            labels=labels,
            label_field=label_field,
            class_names=zeroshot.class_names if zeroshot else class_names,
            num_workers=num_workers,
            rank=rank,
            world_size=world_size,
        )
        self.loader = eval_loader(spec, data, **loader_options)
        self.probe_loader = None
        if probe_data is not None:
            if not probe:
                raise FieldError("probe_data", "a probe training set needs probe=True")
            try:
                self.probe_loader = eval_loader(spec, probe_data, **loader_options)
            except FieldError as err:
                raise FieldError("probe_data", err.message) from None

    def report(self, model: nn.Module, device: torch.device | str | None = None) -> dict[str, Any]:
        """The nested report; also counts corrupt samples skipped (`corrupt_samples`)."""
        loaders = [self.loader] if self.probe_loader is None else [self.loader, self.probe_loader]
        for loader in loaders:
            loader.set_epoch(0)
        before = sum(sum(loader.corrupt_counts.values()) for loader in loaders)
        report = evaluate_report(
            model,
            _data_errors(self.loader, "data"),
            self.pairs,
            towers=self.towers,
            probe_batches=None
            if self.probe_loader is None
            else _data_errors(self.probe_loader, "probe_data"),
            device=device,
            **self.options,
        )
        after = sum(sum(loader.corrupt_counts.values()) for loader in loaders)
        skipped = torch.tensor([after - before])
        if distributed.world_size() > 1:
            skipped = distributed.all_gather(skipped.to(_model_device(model))).sum().cpu()
        report["corrupt_samples"] = int(skipped.sum())
        return report

    def __call__(
        self, model: nn.Module, device: torch.device | str | None = None
    ) -> dict[str, float]:
        return flatten_metrics(self.report(model, device))

    def close(self) -> None:
        """Stop loader workers and close the shard files."""
        for loader in (self.loader, self.probe_loader):
            if loader is not None:
                loader.close()
                for source in loader.plan.sources:
                    source.close()
