"""What every Hugging Face format shares: the folder, its config.json, its weights, and the
streaming writer.

A HF folder holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`); pickled weights (pytorch_model.bin) are never loaded. A mapping
(`hf_clip`, `hf_llama`, `hf_llava`) refuses what it cannot read with an `HFFolderError` (a
FieldError naming the file and the config field; a `Section` reads a (sub-)config that way) and
describes its tensors as `KeyGroup`s: the same numbers under our names and HF's.
`write_hf_groups` streams them into safetensors files one group at a time, so a model bigger
than memory converts. transformers is never imported here.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmtrain.atomic import atomic_write_text
from mmtrain.models.formats.keys import Shape
from mmtrain.models.safetensors_files import (
    INDEX_FILE,
    MAX_SHARD_BYTES,
    WEIGHTS_FILE,
    SafetensorsReader,
    TensorEntry,
    WeightsFileError,
    meta_state,
    open_weights,
    write_tensors,
)
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


class HFFolderError(FieldError):
    """A HF folder that cannot be read: the message names the file and, where one is to blame,
    the config field (e.g. `.../config.json: text_config.hidden_act: ...`)."""

    def __init__(self, file: str | Path, message: str, field: str = ""):
        super().__init__(f"{file}: {field}" if field else str(file), message)


class NoHFCounterpart(ValueError):
    """The model spec has no counterpart among the HF classes mmtrain writes; the message lists
    every reason."""


# ----------------------------------------------------------------------------- config.json
@dataclass(frozen=True)
class Section:
    """One (sub-)config of config.json, defaults filled in, read with errors naming the field."""

    file: Path
    prefix: str  # "text_config." / "vision_config." / "" (top level or a bare vision model)
    values: dict[str, Any]

    def get(self, key: str, kind: type) -> Any:
        value = self.values.get(key)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(key, f"expected {kind.__name__}, got {value!r}")
        return value

    def square(self, key: str) -> int:
        """An image or patch size: an int, or [h, w] with h == w (the only shape we build)."""
        value = self.values.get(key)
        if isinstance(value, list | tuple) and len(value) == 2 and value[0] == value[1]:
            value = value[0]
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"expected one size (square images), got {value!r}")
        return value

    def error(self, key: str, message: str) -> HFFolderError:
        return HFFolderError(self.file, message, field=f"{self.prefix}{key}")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object of a HF folder (config.json, a tokenizer's or processor's file)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise HFFolderError(path, f"cannot be read: {err.strerror}") from None
    except ValueError as err:  # not JSON, or not UTF-8
        raise HFFolderError(path, f"is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise HFFolderError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def sub_config(config: dict[str, Any], key: str, defaults: dict[str, Any], file: Path) -> Section:
    """The nested config `key` (`vision_config`, `text_config`) over `defaults`, its errors
    naming `key.<field>`."""
    # Configs written before transformers 4.25 may also hold `<key>_dict`, which wins.
    values = dict(defaults)
    for name in (key, f"{key}_dict"):
        part = config.get(name) or {}
        if not isinstance(part, dict):
            raise HFFolderError(file, f"expected a mapping, got {part!r}", field=name)
        values.update(part)
    return Section(file, f"{key}.", values)


# ----------------------------------------------------------------------------- reading
def is_hf_folder(path: str | Path) -> bool:
    """True for a folder with a config.json (a Hugging Face model folder; mmtrain's own model
    folders hold spec.yaml instead). Whether it is one we can read, `hf.read_hf_model` tells."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def open_hf_folder(path: str | Path) -> tuple[Path, Path, dict[str, Any]]:
    """(folder, its config.json path, the parsed config) of a HF model folder; HFFolderError
    naming the folder when it has no config.json."""
    folder = Path(path)
    if not is_hf_folder(folder):
        raise HFFolderError(folder, f"is not a Hugging Face model folder (no {CONFIG_FILE})")
    config_path = folder / CONFIG_FILE
    return folder, config_path, read_json(config_path)


def open_hf_weights(folder: Path) -> SafetensorsReader:
    """A lazy reader of a HF folder's tensors: model.safetensors, or the shards its index
    lists. Pickled weights (pytorch_model.bin) are never loaded."""
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / INDEX_FILE).is_file():
        pickles = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        hint = (
            f"; {pickles[0]} is not read (pickles can run code): re-save it with "
            "save_pretrained(..., safe_serialization=True)"
            if pickles
            else ""
        )
        raise HFFolderError(folder, f"has no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")
    try:
        return open_weights(folder)
    except WeightsFileError as err:
        raise HFFolderError(err.path, err.message) from None


def read_hf_weights(folder: Path) -> dict[str, Tensor]:
    """All tensors of a HF folder (`open_hf_weights`), in memory."""
    with open_hf_weights(folder) as reader:
        try:
            return {name: reader[name] for name in reader}
        except WeightsFileError as err:
            raise HFFolderError(err.path, err.message) from None


# ----------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class KeyGroup:
    """Tensors holding the same numbers under our names and HF's: each side's tensors,
    flattened and concatenated in order, are equal. Usually one tensor a side (a rename)."""

    ours: tuple[tuple[str, Shape], ...]
    theirs: tuple[tuple[str, Shape], ...]


def hf_entries(meta: Mapping[str, Tensor], groups: Sequence[KeyGroup]) -> list[TensorEntry]:
    """The (name, dtype, shape) of every HF tensor `groups` give, in order; each takes the
    dtype of its group's first tensor of ours (`meta`: our tensors, meta ones will do)."""
    return [
        TensorEntry(name, meta[group.ours[0][0]].dtype, shape)
        for group in groups
        for name, shape in group.theirs
    ]


def regroup(state: Mapping[str, Tensor], groups: list[KeyGroup], src: str, dst: str) -> dict:
    """Tensors named on side `dst` ("ours"/"theirs") from a state dict named on side `src`."""
    out: dict[str, Tensor] = {}
    for group in groups:
        sources, targets = getattr(group, src), getattr(group, dst)
        if len(sources) == 1 and len(targets) == 1:
            out[targets[0][0]] = state[sources[0][0]].reshape(targets[0][1])
            continue
        flat = torch.cat([state[name].reshape(-1) for name, _ in sources])
        parts = flat.split([math.prod(shape) for _, shape in targets])
        for (name, shape), part in zip(targets, parts, strict=True):
            out[name] = part.reshape(shape).clone()  # own storage: safetensors refuses shared
    return out


def stream_groups(
    source: Mapping[str, Tensor], groups: Sequence[KeyGroup]
) -> Iterator[tuple[str, Tensor]]:
    """HF tensors from ours, group by group: only one group's tensors of `source` (a state
    dict, or a lazy reader of a folder) are read at a time. The HF tensors are views where
    they can be (the writer copies their bytes), so a group costs about its own size."""
    for group in groups:
        sources = [source[name] for name, _ in group.ours]
        if len(sources) == 1:
            flat = sources[0].reshape(-1)
        else:
            flat = torch.cat([t.reshape(-1) for t in sources])
        del sources
        parts = flat.split([math.prod(shape) for _, shape in group.theirs])
        for (name, shape), part in zip(group.theirs, parts, strict=True):
            yield name, part.reshape(shape)
        del flat, parts, part  # before the next group is read: one group alive at a time


def write_hf_groups(
    out_dir: str | Path,
    source: Mapping[str, Tensor],
    groups: Sequence[KeyGroup],
    config: dict[str, Any],
    name: str,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    prefix: str = "model",
) -> Path:
    """The HF tensors of `groups`, streamed from `source` into `prefix`.safetensors (or shards
    of at most `max_shard_bytes` and the index), then config.json, each atomically (config.json
    last: a folder that has it has its weights); `name` (the architecture) is for the log.
    The caller checks `source`'s keys first (`check_keys`). Returns the folder."""
    out = Path(out_dir)
    entries = hf_entries(meta_state(source), groups)
    write_tensors(
        out, entries, stream_groups(source, groups), max_shard_bytes=max_shard_bytes, prefix=prefix
    )
    atomic_write_text(out / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
    log.info("wrote %s (%s, %d tensors)", out, name, len(entries))
    return out
