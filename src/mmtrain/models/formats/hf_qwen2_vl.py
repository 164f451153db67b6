"""Hugging Face Qwen2-VL / Qwen2.5-VL interop: a `Qwen2VLForConditionalGeneration` or
`Qwen2_5_VLForConditionalGeneration` folder <-> a native-resolution VLM `ModelSpec` (`vision`:
the tower with its merger, `vision_tokens`, a decoder LM with M-RoPE) and the state dict of its
`LanguageModel` (keys `towers.vision.*`, `towers.text.*`).

The language model is Qwen2 with `mrope_section` (read by `hf_llama` once the section is taken
out of its rotary parameters); the vision tower is read here. Weight names: the published
checkpoints (and transformers 5's `save_pretrained`) hold `visual.*`, `model.*` (the LM) and
`lm_head.weight`; transformers 5 builds `model.visual.*` and `model.language_model.*`. Both
spellings are read; the published layout is written. The processor's files
(preprocessor_config.json, the tokenizer's, chat_template.*) are the user's to keep beside the
weights: `min_pixels` / `max_pixels` of preprocessor_config.json are read into the spec when it
is there, and `mmtrain convert` copies the files through.

Refused, naming config.json and the field: a vision activation or layout mmtrain's tower does
not build, sliding-window attention in the LM, a vision width that is not the LM's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models.formats import hf_llama
from mmtrain.models.formats.hf_common import (
    HFFolderError,
    KeyGroup,
    NoHFCounterpart,
    Section,
    open_hf_folder,
    read_hf_weights,
    regroup,
    sub_config,
    write_hf_groups,
)
from mmtrain.models.formats.keys import CheckpointMismatch, check_keys
from mmtrain.models.safetensors_files import MAX_SHARD_BYTES, meta_state
from mmtrain.native_vision_spec import NativeVisionSpec
from mmtrain.spec import DECODER_TOWER, VISION_TOWER, ModelSpec, VisionTokens
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

ARCHITECTURES = {  # architecture -> (model_type, family)
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "qwen2_vl"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "qwen2_5_vl"),
}
BY_MODEL_TYPE = {model_type: name for name, (model_type, _) in ARCHITECTURES.items()}
PROCESSOR_FILE = "preprocessor_config.json"
# Defaults of transformers' vision configs: a key missing from config.json means this value.
VISION_DEFAULTS = {
    "qwen2_vl": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu",
                 "mlp_ratio": 4, "num_heads": 16, "in_channels": 3, "patch_size": 14,
                 "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen2_5_vl": {"depth": 32, "hidden_size": 1280, "hidden_act": "silu",
                   "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
                   "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                   "window_size": 112, "out_hidden_size": 3584,
                   "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 4},
}  # fmt: skip
TOP_DEFAULTS = {"image_token_id": 151655, "video_token_id": 151656,
                "vision_start_token_id": 151652, "vision_end_token_id": 151653}  # fmt: skip
# Spellings of the parts' key prefixes -> the names each part is read in.
VISION_PREFIXES = ("model.visual.", "visual.")
LM_PREFIXES = {"model.language_model.": "model.", "model.": "model.", "lm_head.": "lm_head."}
OUT_VISION = "visual."
# The written prefixes -> where transformers 5 builds those modules (`model.visual.`,
# `model.language_model.`): the names PEFT gives adapters (models/formats/peft_adapter.py).
MODULE_PREFIXES = {OUT_VISION: "model.visual.", "model.": "model.language_model.",
                   "lm_head.": "lm_head."}  # fmt: skip


# ----------------------------------------------------------------------------- config.json -> spec
def family_of(config: dict[str, Any], file: Path) -> str:
    """ "qwen2_vl" or "qwen2_5_vl" for a config.json of those classes."""
    names = config.get("architectures")
    if names is None and config.get("model_type") in BY_MODEL_TYPE:
        names = [BY_MODEL_TYPE[config["model_type"]]]
    if not isinstance(names, list) or len(names) != 1 or names[0] not in ARCHITECTURES:
        raise HFFolderError(file, f"{names!r} is not a Qwen2-VL class", field="architectures")
    return ARCHITECTURES[names[0]][1]


def is_qwen2_vl_config(config: dict[str, Any]) -> bool:
    names = config.get("architectures")
    if names is None:
        return config.get("model_type") in BY_MODEL_TYPE
    return isinstance(names, list) and len(names) == 1 and names[0] in ARCHITECTURES


def _vision(section: Section, family: str, pixels: dict[str, int]) -> NativeVisionSpec:
    """The tower of `vision_config`."""
    get = section.get
    if family == "qwen2_vl":
        act = get("hidden_act", str)
        width = get("embed_dim", int)
        fields = {"width": width, "mlp_hidden": int(width * get("mlp_ratio", float)),
                  "mlp": "gelu", "activation": act, "norm": "layer_norm",
                  "out_width": get("hidden_size", int)}  # fmt: skip
    else:
        if get("hidden_act", str) != "silu":
            raise section.error("hidden_act", "Qwen2.5-VL's gated MLP is built with silu only")
        fields = {"width": get("hidden_size", int), "mlp_hidden": get("intermediate_size", int),
                  "mlp": "swiglu", "activation": "silu", "norm": "rms_norm",
                  "out_width": get("out_hidden_size", int), "window_size": get("window_size", int),
                  "full_attention_blocks": tuple(section.values["fullatt_block_indexes"])}  # fmt: skip
    fields.update(
        depth=get("depth", int), heads=get("num_heads", int), in_channels=get("in_channels", int),
        patch_size=get("patch_size", int), merge_size=get("spatial_merge_size", int),
        temporal_patch=get("temporal_patch_size", int), **pixels,
    )  # fmt: skip
    try:
        return NativeVisionSpec(**fields)
    except FieldError as err:
        raise section.error(err.path, err.message) from None


def _decoder(config: dict[str, Any], file: Path) -> DecoderSpec:
    """The LM of `text_config` (or, in configs written before transformers 5, the top level):
    Qwen2 with the M-RoPE section of its rotary parameters."""
    text = dict(config.get("text_config") or {k: v for k, v in config.items()
                                              if k not in ("vision_config", "architectures")})  # fmt: skip
    section = None
    for key in ("rope_scaling", "rope_parameters"):
        params = text.get(key)
        if isinstance(params, dict) and "mrope_section" in params:
            section = params["mrope_section"]
            rest = {k: v for k, v in params.items() if k not in ("mrope_section", "type")}
            rest["rope_type"] = (
                "default" if rest.get("rope_type") in (None, "mrope") else rest["rope_type"]
            )
            text[key] = rest
    if section is None:
        raise HFFolderError(file, "no mrope_section in the LM's rotary parameters",
                            field="text_config.rope_parameters")  # fmt: skip
    text.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    decoder = hf_llama.spec_from_config(text, file)
    try:
        return dataclasses.replace(decoder, mrope_section=tuple(section))
    except FieldError as err:
        raise HFFolderError(
            file, err.message, field="text_config.rope_parameters.mrope_section"
        ) from None


def processor_pixels(folder: Path) -> dict[str, int]:
    """min_pixels / max_pixels of the processor's preprocessor_config.json (its `size`
    shortest_edge / longest_edge in newer ones), where the folder has it."""
    path = folder / PROCESSOR_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    size = data.get("size") if isinstance(data.get("size"), dict) else {}
    low = data.get("min_pixels", size.get("shortest_edge"))
    high = data.get("max_pixels", size.get("longest_edge"))
    return {k: v for k, v in (("min_pixels", low), ("max_pixels", high)) if isinstance(v, int)}


def spec_from_config(
    config: dict[str, Any], file: Path, name: str, pixels: dict[str, int] | None = None
) -> ModelSpec:
    family = family_of(config, file)
    vision_section = sub_config(config, "vision_config", VISION_DEFAULTS[family], file)
    vision = _vision(vision_section, family, pixels or {})
    decoder = _decoder(config, file)
    top = Section(file, "", {**TOP_DEFAULTS, **config})
    tps = vision_section.values.get("tokens_per_second") if family == "qwen2_5_vl" else None
    # The start / end ids wrap each placeholder in the chat format; a config's defaults outside
    # a small model's vocabulary (a test model) wrap nothing.
    start, end = top.get("vision_start_token_id", int), top.get("vision_end_token_id", int)
    if max(start, end) >= decoder.vocab_size:
        start = end = None
    tokens = VisionTokens(top.get("image_token_id", int), top.get("video_token_id", int),
                          None if tps is None else float(tps), start, end)  # fmt: skip
    try:
        return ModelSpec(name=name, embed_dim=decoder.width, towers={}, objective="next_token",
                         decoder=decoder, vision=vision, vision_tokens=tokens)  # fmt: skip
    except FieldError as err:
        raise HFFolderError(file, err.message, field=err.path) from None


# ----------------------------------------------------------------------------- weights
def _vision_groups(v: NativeVisionSpec, prefix: str) -> list[KeyGroup]:
    """Every tensor of the vision tower with its HF tensors (under `prefix`)."""
    w, f, merged = v.width, v.mlp_hidden, v.merged_width()
    ours = f"towers.{VISION_TOWER}."

    def rename(a: str, b: str, shape: tuple[int, ...]) -> KeyGroup:
        return KeyGroup(((ours + a, shape),), ((prefix + b, shape),))

    norm = ("weight", "bias") if v.norm == "layer_norm" else ("weight",)
    kernel = (w, v.in_channels, v.temporal_patch, v.patch_size, v.patch_size)
    groups = [rename("patch_embed.weight", "patch_embed.proj.weight", kernel)]
    for i in range(v.depth):
        o = t = f"blocks.{i}."
        groups += [rename(f"{o}norm{n}.{p}", f"{t}norm{n}.{p}", (w,)) for n in (1, 2) for p in norm]
        groups += [rename(f"{o}attn.qkv.weight", f"{t}attn.qkv.weight", (3 * w, w)),
                   rename(f"{o}attn.qkv.bias", f"{t}attn.qkv.bias", (3 * w,)),
                   rename(f"{o}attn.out.weight", f"{t}attn.proj.weight", (w, w)),
                   rename(f"{o}attn.out.bias", f"{t}attn.proj.bias", (w,))]  # fmt: skip
        if v.mlp == "gelu":
            groups += [rename(f"{o}mlp.fc1.weight", f"{t}mlp.fc1.weight", (f, w)),
                       rename(f"{o}mlp.fc1.bias", f"{t}mlp.fc1.bias", (f,)),
                       rename(f"{o}mlp.fc2.weight", f"{t}mlp.fc2.weight", (w, f)),
                       rename(f"{o}mlp.fc2.bias", f"{t}mlp.fc2.bias", (w,))]  # fmt: skip
        else:  # our fc1 holds the gate's rows, then the up projection's
            for p, shape in (("weight", (f, w)), ("bias", (f,))):
                both = (
                    (prefix + f"{t}mlp.gate_proj.{p}", shape),
                    (prefix + f"{t}mlp.up_proj.{p}", shape),
                )
                groups.append(KeyGroup(((ours + f"{o}mlp.fc1.{p}", (2 * f, *shape[1:])),), both))
            groups += [rename(f"{o}mlp.fc2.weight", f"{t}mlp.down_proj.weight", (w, f)),
                       rename(f"{o}mlp.fc2.bias", f"{t}mlp.down_proj.bias", (w,))]  # fmt: skip
    groups += [rename(f"merger.norm.{p}", f"merger.ln_q.{p}", (w,)) for p in norm]
    groups += [rename("merger.fc1.weight", "merger.mlp.0.weight", (merged, merged)),
               rename("merger.fc1.bias", "merger.mlp.0.bias", (merged,)),
               rename("merger.fc2.weight", "merger.mlp.2.weight", (v.out_width, merged)),
               rename("merger.fc2.bias", "merger.mlp.2.bias", (v.out_width,))]  # fmt: skip
    return groups


def key_groups(spec: ModelSpec, vision_prefix: str = OUT_VISION) -> list[KeyGroup]:
    """Every tensor of the LanguageModel with its HF tensors: the tower's, then the LM's
    (hf_llama's, in the published layout)."""
    groups = _vision_groups(spec.vision, vision_prefix)
    groups += hf_llama.export_groups(spec.decoder, f"towers.{DECODER_TOWER}.")
    return groups


def _split_parts(state: Mapping[str, Tensor], where: Path) -> tuple[dict, dict]:
    """(vision, LM) tensors of a checkpoint, named `visual.*` and `model.*` / `lm_head.*`."""
    vision, lm, stray = {}, {}, []
    for key, tensor in state.items():
        prefix = next((p for p in VISION_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            vision[OUT_VISION + key[len(prefix) :]] = tensor
            continue
        prefix = next((p for p in LM_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            stray.append(key)
            continue
        name = LM_PREFIXES[prefix] + key[len(prefix) :]
        if name in lm:
            raise HFFolderError(where, f"holds {key} and another spelling of it")
        lm[name] = tensor
    if stray:
        raise HFFolderError(where, f"holds tensors outside visual / model / lm_head: "
                            f"{', '.join(stray[:4])}")  # fmt: skip
    return vision, lm


def hf_to_mmtrain(state: Mapping[str, Tensor], spec: ModelSpec, where: Path) -> dict[str, Tensor]:
    """A checkpoint's tensors (any spelling) -> the LanguageModel's; CheckpointMismatch lists
    every key that does not fit."""
    vision, lm = _split_parts(state, where)
    groups = _vision_groups(spec.vision, OUT_VISION)
    check_keys(vision, {name: shape for g in groups for name, shape in g.theirs},
               what="the visual weights do not match config.json's vision_config",
               hint="Were config.json and the safetensors files saved from the same model?")  # fmt: skip
    out = regroup(vision, groups, "theirs", "ours")
    decoder = hf_llama.hf_to_mmtrain(lm, spec.decoder)
    out.update({f"towers.{DECODER_TOWER}.{k}": t for k, t in decoder.items()})
    return out


def read_hf_qwen2_vl(path: str | Path) -> tuple[ModelSpec, dict[str, Tensor]]:
    """(spec, state dict) of a HF Qwen2-VL / Qwen2.5-VL folder, the state dict in the
    LanguageModel's names (`load_state_dict(strict=True)`); dtypes kept. HFFolderError naming
    the file and field for anything it cannot read."""
    folder, config_path, config = open_hf_folder(path)
    spec = spec_from_config(config, config_path, folder.resolve().name, processor_pixels(folder))
    weights = read_hf_weights(folder)
    weights = {k: t for k, t in weights.items() if not k.endswith(hf_llama.IGNORED_SUFFIXES)}
    try:
        state = hf_to_mmtrain(weights, spec, folder)
    except CheckpointMismatch as err:
        raise HFFolderError(folder, str(err)) from None
    log.info("read %s (%s, %d tensors)", folder, family_of(config, config_path), len(weights))
    return spec, state


# ----------------------------------------------------------------------------- writing
def hf_config(spec: ModelSpec, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for `spec` as transformers' Qwen2-VL / Qwen2.5-VL class reads it; raises
    NoHFCounterpart where neither expresses it."""
    v, tokens = spec.vision, spec.vision_tokens
    if v is None or spec.decoder is None or spec.decoder.mrope_section is None:
        raise NoHFCounterpart(f"model {spec.name!r}: Qwen2-VL is a native vision tower and an "
                              "M-RoPE decoder")  # fmt: skip
    qwen25 = v.mlp == "swiglu"
    if (v.norm == "rms_norm") != qwen25 or (v.window_size > 0 and not qwen25):
        raise NoHFCounterpart(f"model {spec.name!r}: Qwen2-VL's tower is layer_norm + gelu MLP, "
                              "Qwen2.5-VL's rms_norm + swiglu with windows")  # fmt: skip
    if not qwen25 and v.mlp_hidden % v.width:
        raise NoHFCounterpart(f"model {spec.name!r}: Qwen2-VL's vision MLP is a whole "
                              f"mlp_ratio of the width, not {v.mlp_hidden} / {v.width}")  # fmt: skip
    tps = tokens.tokens_per_second
    if qwen25 and tps is not None and tps != int(tps):
        raise NoHFCounterpart(f"model {spec.name!r}: Qwen2.5-VL's tokens_per_second is whole")
    common = {"depth": v.depth, "num_heads": v.heads, "in_channels": v.in_channels,
              "patch_size": v.patch_size, "spatial_merge_size": v.merge_size,
              "temporal_patch_size": v.temporal_patch}  # fmt: skip
    if qwen25:
        vision = {**common, "model_type": "qwen2_5_vl_vision", "hidden_size": v.width,
                  "intermediate_size": v.mlp_hidden, "out_hidden_size": v.out_width,
                  "hidden_act": "silu", "window_size": v.window_size,
                  "fullatt_block_indexes": list(v.full_attention_blocks),
                  "tokens_per_second": int(tps or 1)}  # fmt: skip
    else:
        vision = {**common, "model_type": "qwen2_vl_vision", "embed_dim": v.width,
                  "hidden_size": v.out_width, "mlp_ratio": v.mlp_hidden // v.width,
                  "hidden_act": v.activation}  # fmt: skip
    text = {k: val for k, val in hf_llama.hf_config(spec.decoder, dtype).items()
            if k not in ("architectures", "dtype", "torch_dtype")}  # fmt: skip
    text["model_type"] = "qwen2_5_vl_text" if qwen25 else "qwen2_vl_text"
    text["rope_scaling"] = {"type": "mrope", "mrope_section": list(spec.decoder.mrope_section),
                            "rope_type": "default"}  # fmt: skip
    name = "Qwen2_5_VLForConditionalGeneration" if qwen25 else "Qwen2VLForConditionalGeneration"
    return {"architectures": [name], "model_type": ARCHITECTURES[name][0],
            "vision_config": vision, "text_config": text,
            "image_token_id": tokens.image_token_id, "video_token_id": tokens.video_token_id,
            **({} if tokens.start_id is None else {"vision_start_token_id": tokens.start_id,
                                                   "vision_end_token_id": tokens.end_id}),
            "tie_word_embeddings": spec.decoder.tie_embeddings,
            "dtype": str(dtype).removeprefix("torch."),
            "torch_dtype": str(dtype).removeprefix("torch.")}  # fmt: skip


def write_hf_qwen2_vl(
    spec: ModelSpec,
    state: Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a HF Qwen2-VL / Qwen2.5-VL folder for the LanguageModel's state dict (in memory,
    or a lazy reader of a model folder), config.json last; NoHFCounterpart when neither
    class expresses `spec`."""
    groups = key_groups(spec)
    meta = meta_state(state)
    check_keys(meta, {name: shape for g in groups for name, shape in g.ours},
               what="the state dict does not match the spec",
               hint="Export with the spec the model was built from.")  # fmt: skip
    config = hf_config(spec, meta[f"towers.{DECODER_TOWER}.embed.weight"].dtype)
    return write_hf_groups(out_dir, state, groups, config, config["architectures"][0],
                           max_shard_bytes=max_shard_bytes)  # fmt: skip
