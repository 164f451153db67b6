"""Hugging Face folders of every architecture mmtrain reads, behind one pair of calls.

`read_hf_model(folder)` picks the reader by config.json's `architectures` (or `model_type`):
CLIP / SigLIP (`hf_clip`: towers `image`, `text`), Llama / Qwen2 (`hf_llama`: a language model,
its decoder under the tower name `text`), LLaVA (`hf_llava`: image tower, projector, decoder),
Qwen2-VL / Qwen2.5-VL (`hf_qwen2_vl`: a native-resolution vision tower and an M-RoPE decoder).
It returns a `ModelSpec` and a state dict in the names of the model `create_model(spec)` builds.
`write_hf_model(model, folder)` is the reverse, the class chosen by the spec; `write_hf_state`
does it from a state dict or a lazy reader of a model folder, one tensor at a time, so a model
bigger than memory converts (shards of at most 5 GB and model.safetensors.index.json).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models.formats import hf_clip, hf_llama, hf_llava, hf_qwen2_vl
from mmtrain.models.formats.hf_common import (
    CONFIG_FILE,
    HFFolderError,
    KeyGroup,
    NoHFCounterpart,
    is_hf_folder,
    read_json,
)
from mmtrain.models.safetensors_files import MAX_SHARD_BYTES
from mmtrain.spec import ModelSpec

TEXT_TOWER = "text"  # the decoder's name among a LanguageModel's towers

__all__ = [
    "HFFolderError",
    "NoHFCounterpart",
    "export_groups",
    "export_vocab_size",
    "family_of",
    "hf_counterpart",
    "is_hf_folder",
    "language_model_spec",
    "module_prefixes",
    "read_hf_model",
    "write_hf_model",
    "write_hf_state",
]


def family_of(config: dict[str, Any], file: Path) -> str:
    """ "clip" (CLIP / SigLIP), "llama" (Llama / Qwen2), "llava" or "qwen2_vl" (Qwen2-VL and
    Qwen2.5-VL) for a config.json; raises
    HFFolderError listing what mmtrain reads otherwise."""
    names, model_type = config.get("architectures"), config.get("model_type")
    if hf_llava.is_llava_config(config):
        return "llava"
    if hf_qwen2_vl.is_qwen2_vl_config(config):
        return "qwen2_vl"
    if isinstance(names, list) and len(names) == 1:
        if names[0] in hf_llama.ARCHITECTURES:
            return "llama"
        if names[0] in hf_clip.ARCHITECTURES:
            return "clip"
    if names is None and model_type in hf_llama.BY_MODEL_TYPE:
        return "llama"
    if names is None and model_type in hf_clip.BY_MODEL_TYPE:
        return "clip"
    supported = [*hf_clip.ARCHITECTURES, *hf_llama.ARCHITECTURES, hf_llava.ARCHITECTURE,
                 *hf_qwen2_vl.ARCHITECTURES]  # fmt: skip
    raise HFFolderError(
        file, f"{names!r} is not supported; mmtrain reads {', '.join(supported)}", "architectures"
    )


def language_model_spec(decoder: DecoderSpec, name: str) -> ModelSpec:
    """The ModelSpec of a decoder LM alone (no towers besides the decoder itself)."""
    return ModelSpec(
        name=name, embed_dim=decoder.width, towers={}, objective="next_token", decoder=decoder
    )


def native_family(config: dict[str, Any]) -> str | None:
    """The native family of a config.json (`family_of`), None for a class mmtrain has no
    module of (which trains as a hub model, models/hub/)."""
    try:
        return family_of(config, Path(CONFIG_FILE))
    except HFFolderError:
        return None


def spec_of_folder(path: str | Path) -> ModelSpec:
    """The ModelSpec of a HF folder of a native family, from its config (and a Qwen2-VL's
    processor pixel budget) alone: no weights read."""
    folder = Path(path)
    config = read_json(folder / CONFIG_FILE)
    family = family_of(config, folder / CONFIG_FILE)
    name = folder.resolve().name
    if family == "clip":
        return hf_clip.spec_from_config(config, folder / CONFIG_FILE, name)[0]
    if family == "llava":
        return hf_llava.spec_from_config(config, folder / CONFIG_FILE, name)
    if family == "qwen2_vl":
        pixels = hf_qwen2_vl.processor_pixels(folder)
        return hf_qwen2_vl.spec_from_config(config, folder / CONFIG_FILE, name, pixels)
    return language_model_spec(hf_llama.spec_from_config(config, folder / CONFIG_FILE), name)


def read_hf_model(path: str | Path) -> tuple[ModelSpec, dict[str, Tensor]]:
    """(spec, state dict) of a HF folder of any architecture mmtrain reads, the state dict in
    the names of `create_model(spec)`'s model; dtypes are kept. Raises HFFolderError (a
    FieldError) naming the file and the config field to blame."""
    folder = Path(path)
    if not is_hf_folder(folder):
        raise HFFolderError(folder, f"is not a Hugging Face model folder (no {CONFIG_FILE})")
    family = family_of(read_json(folder / CONFIG_FILE), folder / CONFIG_FILE)
    if family == "clip":
        return hf_clip.read_hf_folder(folder)
    if family == "llava":
        return hf_llava.read_hf_llava(folder)
    if family == "qwen2_vl":
        return hf_qwen2_vl.read_hf_qwen2_vl(folder)
    decoder, state = hf_llama.read_hf_decoder(folder)
    spec = language_model_spec(decoder, folder.resolve().name)
    return spec, {f"towers.{TEXT_TOWER}.{k}": t for k, t in state.items()}


def hf_counterpart(spec: ModelSpec) -> str:
    """The transformers class that `write_hf_model` writes for `spec`; raises NoHFCounterpart
    listing why there is none."""
    if spec.decoder is None:
        return hf_clip.hf_layout(spec).arch.name
    if spec.vision is not None:
        return hf_qwen2_vl.hf_config(spec, torch.float32)["architectures"][0]
    if spec.projector is not None:
        hf_llava.llava_layout(spec)  # raises where LLaVA cannot express the spec
        return hf_llava.ARCHITECTURE
    return hf_llama.hf_architecture(spec.decoder)  # a decoder alone (no towers: spec.py)


def export_groups(spec: ModelSpec) -> list[KeyGroup]:
    """The key groups `write_hf_state` writes for `spec` (our tensors -> the written HF
    tensors), from the family's own key map; raises NoHFCounterpart when it has none."""
    hf_counterpart(spec)
    if spec.decoder is None:
        return hf_clip.key_map(spec, hf_clip.hf_layout(spec))
    if spec.vision is not None:
        return hf_qwen2_vl.key_groups(spec)
    if spec.projector is not None:
        return hf_llava.export_groups(spec)
    return hf_llama.export_groups(spec.decoder, f"towers.{TEXT_TOWER}.")


def module_prefixes(spec: ModelSpec) -> dict[str, str]:
    """Written key prefix -> the module path transformers 5 builds it at, where they differ
    (PEFT names adapters by the modules of the class it loads: formats/peft_adapter.py)."""
    hf_counterpart(spec)
    if spec.decoder is None:
        return hf_clip.module_prefixes(hf_clip.hf_layout(spec))
    if spec.vision is not None:
        return dict(hf_qwen2_vl.MODULE_PREFIXES)
    if spec.projector is not None:
        return dict(hf_llava.MODULE_PREFIXES)
    return {}  # Llama / Qwen2 are built as they are saved


def export_vocab_size(spec: ModelSpec) -> int | None:
    """The vocab_size of the folder `write_hf_state` writes for `spec` (the decoder's, or a
    CLIP text tower's), which its tokenizer must fit; None without a text input."""
    if spec.decoder is not None:
        return spec.decoder.vocab_size
    tower = spec.towers.get(TEXT_TOWER)
    return getattr(tower.stem, "vocab_size", None) if tower is not None else None


def write_hf_model(
    model: nn.Module, out_dir: str | Path, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> str:
    """Write `model` (a MultimodalModel or LanguageModel) as a HF folder; returns the class
    written. Raises NoHFCounterpart when the spec has none."""
    return write_hf_state(model.spec, model.state_dict(), out_dir, max_shard_bytes=max_shard_bytes)


def write_hf_state(
    spec: ModelSpec,
    state: Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> str:
    """Write the HF folder of the model `create_model(spec)` builds, from its state dict: in
    memory, or a lazy reader of a model folder (`build.read_model_folder`), which is then read
    one tensor at a time. Shards of at most `max_shard_bytes` past one file; returns the class
    written. Raises NoHFCounterpart when the spec has none, CheckpointMismatch when `state`
    does not fit it."""
    arch = hf_counterpart(spec)
    if spec.decoder is None:
        hf_clip.write_hf_encoder(spec, state, out_dir, max_shard_bytes=max_shard_bytes)
    elif spec.vision is not None:
        hf_qwen2_vl.write_hf_qwen2_vl(spec, state, out_dir, max_shard_bytes=max_shard_bytes)
    elif spec.projector is not None:
        hf_llava.write_hf_llava(spec, state, out_dir, max_shard_bytes=max_shard_bytes)
    else:
        hf_llama.write_hf_decoder(
            spec.decoder,
            state,
            out_dir,
            prefix=f"towers.{TEXT_TOWER}.",
            max_shard_bytes=max_shard_bytes,
        )
    return arch
