"""`create_model`, `save_model` and `load_model`: build a `MultimodalModel` (models/multimodal.py),
or a `LanguageModel` (models/vlm.py) when the spec has a decoder, and save or load it.

A model folder (run folder or converted checkpoint) holds `spec.yaml` (the `ModelSpec`) and the
state dict: `model.safetensors`, or, past `MAX_SHARD_BYTES`, shards listed in
`model.safetensors.index.json` (models/safetensors_files.py). Every file is written atomically.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
import yaml
from torch import nn

from mmtrain.atomic import atomic_write_text
from mmtrain.folders import SPEC_FILE
from mmtrain.models.dit import DiffusionModel
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.models.safetensors_files import (
    INDEX_FILE,
    MAX_SHARD_BYTES,
    WEIGHTS_FILE,
    SafetensorsReader,
    TensorEntry,
    WeightsFileError,
    entries_of,
    has_weights,
    open_weights,
    write_tensors,
)
from mmtrain.models.vlm import LanguageModel
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)


class ModelFileError(FieldError):
    """A model file exists but cannot be used (corrupt, or keys/shapes that do not fit the spec)."""

    def __init__(self, file: str | Path, message: str):
        super().__init__(str(file), message)


def _new_model(spec: ModelSpec) -> nn.Module:
    """The module class of `spec`: a LanguageModel when it has a decoder, a DiffusionModel
    when it has a denoiser, else a MultimodalModel."""
    if spec.decoder is not None:
        return LanguageModel(spec)
    if spec.denoiser is not None:
        return DiffusionModel(spec)
    return MultimodalModel(spec)


def create_model(
    name_or_spec: str | Path | ModelSpec,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> MultimodalModel | LanguageModel:
    """A randomly initialised model from a preset name, a spec file or a `ModelSpec`: a
    `LanguageModel` (LM or vision-language model) when the spec has a decoder, else a
    `MultimodalModel`.

    `device="meta"` builds without memory or init (instant, for counting and planning). The
    initialisation is a pure function of `seed`, whatever the device.
    """
    spec = load_spec(name_or_spec)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if spec.hub is not None and spec.hub.is_denoiser():  # diffusers' own class (lazily)
        from mmtrain.models.hub.denoiser import create_hub_denoiser

        return create_hub_denoiser(spec, device=device, dtype=dtype, seed=seed)
    if spec.hub is not None:  # transformers' own class (imports transformers: here, lazily)
        from mmtrain.models.hub.model import create_hub_model

        return create_hub_model(spec, device=device, dtype=dtype, seed=seed)
    # Build on the meta device (no memory, no default init), then allocate once and init once.
    with torch.device("meta"):
        model = _new_model(spec)
    if device.type != "meta":
        model = model.to_empty(device=device)
        model.init_weights(torch.Generator().manual_seed(seed))
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside torch.compile (`_orig_mod`) and DDP (`module`) wrappers; FSDP2 and
    per-block compile work in place, so their model is the module itself."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        if inner is None:
            return model
        model = inner


MODEL_CLASSES = (MultimodalModel, LanguageModel, DiffusionModel)


def _unwrap(model: nn.Module) -> nn.Module:
    """The MultimodalModel, LanguageModel or DiffusionModel inside its wrappers."""
    inner = unwrap_model(model)
    if not isinstance(inner, MODEL_CLASSES):
        names = ", ".join(c.__name__ for c in MODEL_CLASSES)
        raise TypeError(f"expected one of {names}, got {type(model).__name__}")
    return inner


def save_model(
    model: nn.Module, directory: str | Path, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Path:
    """Write `model`'s weights (`model.safetensors`, or shards of at most `max_shard_bytes` and
    `model.safetensors.index.json`) and `spec.yaml` into `directory`, atomically.

    Returns the folder. Tensors are saved as they are (dtype kept), moved to the CPU one at a time.
    """
    model = _unwrap(model)
    state = model.state_dict()
    return write_model_folder(
        directory, model.spec, entries_of(state), state.items(), max_shard_bytes=max_shard_bytes
    )


def write_model_folder(
    directory: str | Path,
    spec: ModelSpec,
    layout: Sequence[TensorEntry],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a model folder from tensors that arrive one at a time: `layout` lists every
    (name, dtype, shape) up front, in the order `tensors` yields them, and each tensor is
    written and released before the next is asked for. A model whose weights do not fit one
    process (FSDP) is exported by gathering one parameter at a time into this iterator.

    The weights go first, spec.yaml last; a writer that fails leaves the folder as it was.
    """
    directory = Path(directory)
    write_tensors(directory, layout, tensors, max_shard_bytes=max_shard_bytes)
    atomic_write_text(directory / SPEC_FILE, yaml.safe_dump(spec.to_dict(), sort_keys=False))
    return directory


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor], source: str | Path
) -> None:
    """Raise ModelFileError listing missing, unexpected and mis-shaped keys of `state`."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    mis_shaped = sorted(
        f"{k} {list(state[k].shape)} (model: {list(expected[k])})"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if mis_shaped:
        problems.append(f"mis-shaped keys: {_listing(mis_shaped)}")
    if problems:
        raise ModelFileError(
            source,
            "weights do not fit the spec; "
            + "; ".join(problems)
            + ". Was it saved from a different model?",
        )


def model_with_weights(
    spec: ModelSpec, state: Mapping[str, torch.Tensor], source: str | Path | None = None
) -> MultimodalModel | LanguageModel:
    """A model of `spec` adopting the tensors of `state` (no copy, no random init), its derived
    buffers rebuilt. With `source`, keys and shapes are checked first (ModelFileError naming it);
    without, `load_state_dict`'s strict check applies."""
    with torch.device("meta"):
        model = _new_model(spec)
    if source is not None:
        check_state_dict(model, state, source)
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_buffers()
    return model


def is_model_folder(folder: str | Path) -> bool:
    """True when `folder` holds spec.yaml and weights (model.safetensors, or shards + index)."""
    return (Path(folder) / SPEC_FILE).is_file() and has_weights(folder)


def read_model_folder(path: str | Path) -> tuple[ModelSpec, SafetensorsReader]:
    """(spec, lazy reader of the weights) of a model folder, or of the path of its
    model.safetensors or model.safetensors.index.json; no tensor is read yet. Raises
    FileNotFoundError naming a missing file and ModelFileError for an unreadable one."""
    path = Path(path)
    is_weights = path.is_file() and (path.suffix == ".safetensors" or path.name == INDEX_FILE)
    folder = path.parent if is_weights else path
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    expected = f"{WEIGHTS_FILE} (or shards listed in {INDEX_FILE}) and {SPEC_FILE}"
    if not (folder / SPEC_FILE).is_file():
        raise FileNotFoundError(
            f"{folder / SPEC_FILE} is missing: a model folder holds {expected} "
            "(written by mmtrain.save_model, a training run or `mmtrain convert`)"
        )
    if not is_weights and not has_weights(folder):
        raise FileNotFoundError(
            f"{folder / WEIGHTS_FILE} is missing: a model folder holds {expected}"
        )
    spec = ModelSpec.load(folder / SPEC_FILE)
    try:
        return spec, open_weights(path)
    except WeightsFileError as err:
        raise ModelFileError(err.path, err.message) from None


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> MultimodalModel | LanguageModel:
    """Load a model folder (run folder or converted checkpoint: spec.yaml and model.safetensors
    or shards with model.safetensors.index.json), or the path of its weights file. Raises
    FileNotFoundError naming a missing file and ModelFileError for a corrupt file or weights
    that do not fit the spec."""
    spec, reader = read_model_folder(path)
    with reader:
        try:
            state = {name: reader[name] for name in reader}
        except WeightsFileError as err:
            raise ModelFileError(err.path, err.message) from None
    model = model_with_weights(spec, state, reader.source)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model
