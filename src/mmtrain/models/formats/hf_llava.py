"""Hugging Face LLaVA interop: a `LlavaForConditionalGeneration` folder <-> a vision-language
`ModelSpec` (an image tower, a projector, a decoder LM) and the state dict of its
`LanguageModel` (keys `towers.image.*`, `towers.text.*`, `projector.*`).

A LLaVA checkpoint is three models side by side, and each part is read by the module that
knows it: the vision tower (`vision_config`: a CLIP or SigLIP vision model) by `hf_clip`, the
language model (`text_config`: Llama or Qwen2) by `hf_llama`, and the projector
(`multi_modal_projector.linear_1` / GELU / `linear_2`, LLaVA-1.5's mlp2x_gelu) here.

Weight names. transformers 5 builds `model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.language_model.*` and `lm_head.weight`, but reads and writes the layout of the published
checkpoints (transformers 4): `vision_tower.vision_model.*` (transformers 5 drops
`vision_model.`), `multi_modal_projector.*`, `language_model.model.*`,
`language_model.lm_head.weight`. Every one of these spellings is read; the published layout is
written, which both major versions of transformers load.

Refused, naming config.json and the field: a projector other than gelu MLP with biases, a
list of feature layers, a feature selection other than "default" (drop the class token) or
"full", "default" on a SigLIP tower (it has no class token: HF would drop a patch), and what
`hf_clip` / `hf_llama` refuse in the two towers.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models.formats import hf_clip, hf_llama
from mmtrain.models.formats.hf_common import (
    HFFolderError,
    KeyGroup,
    NoHFCounterpart,
    Section,
    open_hf_folder,
    read_hf_weights,
    stream_groups,
    sub_config,
    write_hf_groups,
)
from mmtrain.models.formats.keys import CheckpointMismatch, check_keys
from mmtrain.models.safetensors_files import MAX_SHARD_BYTES, meta_state
from mmtrain.spec import ModelSpec, ProjectorSpec, TowerSpec
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

ARCHITECTURE = "LlavaForConditionalGeneration"
MODEL_TYPE = "llava"
IMAGE_TOWER, TEXT_TOWER = "image", "text"  # the LanguageModel's tower names (the contract)

# Defaults of transformers' LlavaConfig: a key missing from config.json means this value.
DEFAULTS = {
    "image_token_index": 32000,
    "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
    "multimodal_projector_bias": True,
    "tie_word_embeddings": False,
}
# LlavaConfig's vision tower when config.json has no vision_config at all (LLaVA-1.5's).
DEFAULT_VISION_CONFIG = {
    "model_type": "clip_vision_model",
    "intermediate_size": 4096,
    "hidden_size": 1024,
    "patch_size": 14,
    "image_size": 336,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
}
# vision_config.model_type -> the hf_clip class whose vision model LLaVA nests
VISION_ARCHITECTURES = {
    "clip_vision_model": "CLIPVisionModel",
    "siglip_vision_model": "SiglipVisionModel",
}
# feature selection -> keep_cls ("default" drops the first token, the class token)
STRATEGIES = {"default": False, "full": True}

# Spellings of the three parts' key prefixes, each -> the name the parts are read in: the
# vision model's own keys, a bare LlamaForCausalLM's keys, and the projector's own keys.
VISION_PREFIXES = (
    "model.vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.vision_model.",
    "vision_tower.",
)
LM_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",
}
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# What is written: the published (transformers 4) layout.
OUT_VISION, OUT_PROJECTOR = "vision_tower.vision_model.", "multi_modal_projector."
OUT_LM = {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}
# our projector layers <-> LLaVA's
PROJECTOR_LAYERS = {"fc1": "linear_1", "fc2": "linear_2"}
# The written prefixes -> where transformers 5 builds those modules (its LlavaModel nests the
# parts under `model.`; its vision model has no `vision_model.` level): the names PEFT gives
# adapters (models/formats/peft_adapter.py).
MODULE_PREFIXES = {
    OUT_VISION: "model.vision_tower.",
    OUT_PROJECTOR: "model.multi_modal_projector.",
    OUT_LM["model."]: "model.language_model.",
    OUT_LM["lm_head."]: "lm_head.",
}


# ----------------------------------------------------------------------------- config.json -> spec
def _section(config: dict[str, Any], file: Path) -> Section:
    return Section(file, "", {**DEFAULTS, **config})


def _check_architecture(config: dict[str, Any], file: Path) -> None:
    names = config.get("architectures")
    if names is None and config.get("model_type") == MODEL_TYPE:
        names = [ARCHITECTURE]
    if names != [ARCHITECTURE]:
        raise HFFolderError(
            file, f"{names!r} is not supported here; expected [{ARCHITECTURE!r}]", "architectures"
        )
    if config.get("model_type") != MODEL_TYPE:
        raise HFFolderError(
            file, f"{config.get('model_type')!r} does not go with {ARCHITECTURE}", "model_type"
        )


def _vision_tower(config: dict[str, Any], file: Path) -> TowerSpec:
    """The image tower of `vision_config`, read by hf_clip as the vision model it is."""
    vision = config.get("vision_config")
    if vision is None:
        vision = DEFAULT_VISION_CONFIG
    if not isinstance(vision, dict):
        raise HFFolderError(file, f"expected a mapping, got {vision!r}", "vision_config")
    model_type = vision.get("model_type", "clip_vision_model")
    if model_type not in VISION_ARCHITECTURES:
        raise HFFolderError(
            file,
            f"{model_type!r} is not supported; mmtrain reads {', '.join(VISION_ARCHITECTURES)}",
            "vision_config.model_type",
        )
    arch = hf_clip.ARCHITECTURES[VISION_ARCHITECTURES[model_type]]
    defaults = hf_clip.VISION_DEFAULTS[arch.family]
    section = sub_config({"vision_config": vision}, "vision_config", defaults, file)
    return hf_clip.image_tower(section, arch, headless_ok=True)


def _decoder(config: dict[str, Any], file: Path) -> DecoderSpec:
    """The LM of `text_config` (read by hf_llama); errors name `text_config.<field>`."""
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise HFFolderError(file, f"expected a mapping, got {text!r}", "text_config")
    # LlavaConfig's text model is a Llama unless text_config says otherwise.
    text = {"model_type": "llama", **text}
    try:
        spec = hf_llama.spec_from_config(text, file)
    except FieldError as err:
        field = err.path.removeprefix(f"{file}: ") if err.path != str(file) else ""
        raise HFFolderError(file, err.message, f"text_config.{field}") from None
    # transformers ties the LM head when either level says so (LlavaConfig forwards it up).
    if _section(config, file).get("tie_word_embeddings", bool) and not spec.tie_embeddings:
        spec = dataclasses.replace(spec, tie_embeddings=True)
    return spec


def _image_token_id(config: dict[str, Any], top: Section) -> int:
    # transformers 5 reads `image_token_id` as another name of `image_token_index`.
    given = [key for key in ("image_token_index", "image_token_id") if config.get(key) is not None]
    if len(given) == 2 and config["image_token_index"] != config["image_token_id"]:
        raise top.error(
            "image_token_id",
            f"{config['image_token_id']} differs from image_token_index "
            f"{config['image_token_index']}",
        )
    return top.get(given[0] if given else "image_token_index", int)


def _projector(config: dict[str, Any], top: Section, tower: TowerSpec) -> ProjectorSpec:
    act = top.get("projector_hidden_act", str)
    if act != "gelu":
        raise top.error(
            "projector_hidden_act", f"{act!r} is not supported; mmtrain's projector uses gelu"
        )
    if not top.get("multimodal_projector_bias", bool):
        raise top.error(
            "multimodal_projector_bias", "false is not supported; the projector has biases"
        )
    layer = top.values.get("vision_feature_layer")
    if isinstance(layer, list):
        raise top.error(
            "vision_feature_layer",
            f"a list of layers ({layer}) is not supported; mmtrain reads one feature layer",
        )
    layer = top.get("vision_feature_layer", int)
    strategy = top.get("vision_feature_select_strategy", str)
    if strategy not in STRATEGIES:
        raise top.error(
            "vision_feature_select_strategy",
            f"{strategy!r} is not supported; use default (drop the class token) or full",
        )
    if strategy == "default" and not tower.has_cls_token():
        raise top.error(
            "vision_feature_select_strategy",
            "default drops the first token, but this vision tower (SigLIP) has no class token: "
            "it would drop an image patch; use full",
        )
    return ProjectorSpec(
        image_token_id=_image_token_id(config, top),
        kind="mlp",
        feature_layer=layer,
        keep_cls=STRATEGIES[strategy],
        tower=IMAGE_TOWER,
    )


# ModelSpec field path -> the config.json field behind it (for error messages)
SPEC_TO_HF = {
    "projector.feature_layer": "vision_feature_layer",
    "projector.image_token_id": "image_token_index",
}


def spec_from_config(config: dict[str, Any], file: Path, name: str) -> ModelSpec:
    """The vision-language ModelSpec of a HF LlavaForConditionalGeneration config.json."""
    _check_architecture(config, file)
    top = _section(config, file)
    tower = _vision_tower(config, file)
    decoder = _decoder(config, file)
    projector = _projector(config, top, tower)
    try:
        spec = ModelSpec(
            name=name,
            embed_dim=tower.width,  # the tower has no output projection
            towers={IMAGE_TOWER: tower},
            objective="next_token",
            decoder=decoder,
            projector=projector,
        )
    except FieldError as err:
        field = SPEC_TO_HF.get(err.path, "")
        raise HFFolderError(file, err.message if field else str(err), field) from None
    seq = top.values.get("image_seq_length")
    if seq is not None and seq != spec.image_tokens():
        raise top.error(
            "image_seq_length",
            f"{seq}, but the vision tower gives {spec.image_tokens()} tokens per image "
            f"({tower.stem.patches()} patches, vision_feature_select_strategy "
            f"{top.values['vision_feature_select_strategy']!r})",
        )
    return spec


# ----------------------------------------------------------------------------- the key map
def _vision_layout(spec: ModelSpec, prefix: str) -> hf_clip.HFLayout:
    """hf_clip's layout of the image tower alone, its keys under `prefix`."""
    family = hf_clip.image_family(spec.towers[IMAGE_TOWER])
    arch = hf_clip.ARCHITECTURES["SiglipVisionModel" if family == "siglip" else "CLIPVisionModel"]
    return hf_clip.HFLayout(arch, image=IMAGE_TOWER, text=None, vision_prefix=prefix)


def _strip(key: str, prefixes: tuple[str, ...] | dict[str, str]) -> str | None:
    """`key` without the first of `prefixes` it starts with (renamed where `prefixes` maps)."""
    for prefix in prefixes:
        if key.startswith(prefix):
            new = prefixes[prefix] if isinstance(prefixes, dict) else ""
            return new + key[len(prefix) :]
    return None


def split_parts(state: dict[str, Tensor], where: Path) -> tuple[dict, dict, dict]:
    """(vision model, language model, projector) tensors of a LLaVA state dict, each named as
    its own module names them (`embeddings.*`; `model.*` and `lm_head.weight`; `linear_1.*`)."""
    parts: tuple[dict, dict, dict] = ({}, {}, {})
    stray = []
    for key, tensor in state.items():
        for part, prefixes in zip(
            parts, (VISION_PREFIXES, LM_PREFIXES, PROJECTOR_PREFIXES), strict=True
        ):
            name = _strip(key, prefixes)
            if name is not None:
                if name in part:  # two spellings of one tensor
                    raise HFFolderError(where, f"holds {key} and another spelling of it")
                part[name] = tensor
                break
        else:
            stray.append(key)
    if stray:
        raise HFFolderError(
            where,
            f"holds tensors outside LLaVA's vision_tower / multi_modal_projector / "
            f"language_model: {', '.join(stray[:4])}{' ...' if len(stray) > 4 else ''}",
        )
    return parts


def _projector_pairs(spec: ModelSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(our key, LLaVA's projector key, shape) of every projector tensor."""
    vision, lm = spec.towers[IMAGE_TOWER].width, spec.decoder.width
    shapes = {"fc1": (lm, vision), "fc2": (lm, lm)}
    return [
        (f"projector.{ours}.{p}", f"{theirs}.{p}", shapes[ours] if p == "weight" else (lm,))
        for ours, theirs in PROJECTOR_LAYERS.items()
        for p in ("weight", "bias")
    ]


def hf_to_mmtrain(state: dict[str, Tensor], spec: ModelSpec, where: Path) -> dict[str, Tensor]:
    """A LLaVA state dict (any spelling) -> the LanguageModel's; CheckpointMismatch lists every
    key of a part that does not fit."""
    vision, lm, projector = split_parts(state, where)
    out = hf_clip.hf_to_mmtrain(vision, spec, _vision_layout(spec, ""))
    decoder = hf_llama.hf_to_mmtrain(lm, spec.decoder)
    out.update({f"towers.{TEXT_TOWER}.{k}": t for k, t in decoder.items()})
    pairs = _projector_pairs(spec)
    check_keys(
        projector,
        {theirs: shape for _, theirs, shape in pairs},
        what="the multi_modal_projector weights do not match config.json",
        hint="LLaVA's projector is linear_1 (vision width -> LM width), gelu, linear_2.",
    )
    out.update({ours: projector[theirs] for ours, theirs, _ in pairs})
    return out


def export_groups(spec: ModelSpec) -> list[KeyGroup]:
    """Every tensor of the LanguageModel with its LLaVA tensors in the published layout: the
    vision tower's groups (hf_clip), the decoder's (hf_llama), the projector's renames."""
    groups = hf_clip.key_map(spec, _vision_layout(spec, OUT_VISION))
    for group in hf_llama.export_groups(spec.decoder, f"towers.{TEXT_TOWER}."):
        theirs = tuple((_strip(name, OUT_LM), shape) for name, shape in group.theirs)
        groups.append(KeyGroup(group.ours, theirs))
    for ours, theirs, shape in _projector_pairs(spec):
        groups.append(KeyGroup(((ours, shape),), ((OUT_PROJECTOR + theirs, shape),)))
    return groups


def _check_export(meta: dict[str, Tensor], groups: list[KeyGroup]) -> None:
    check_keys(
        meta,
        {name: shape for g in groups for name, shape in g.ours},
        what="the state dict does not match the spec",
        hint="Export with the spec the model was built from.",
    )


def mmtrain_to_hf(state: Mapping[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """The LanguageModel's state dict -> LLaVA's, in the published layout (in memory)."""
    groups = export_groups(spec)
    _check_export(meta_state(state), groups)
    return {k: t.clone() for k, t in stream_groups(state, groups)}


# ----------------------------------------------------------------------------- reading
def is_llava_config(config: dict[str, Any]) -> bool:
    names = config.get("architectures")
    return names == [ARCHITECTURE] or (names is None and config.get("model_type") == MODEL_TYPE)


def read_hf_llava(path: str | Path) -> tuple[ModelSpec, dict[str, Tensor]]:
    """(spec, state dict) of a HF LLaVA folder, the state dict in the LanguageModel's names,
    ready for `load_state_dict(state, strict=True)`; dtypes are kept.

    Raises HFFolderError (a FieldError) naming the file, and the config field where one is to
    blame, for anything it cannot read.
    """
    folder, config_path, config = open_hf_folder(path)
    spec = spec_from_config(config, config_path, folder.resolve().name)
    weights = read_hf_weights(folder)
    weights = {k: t for k, t in weights.items() if not k.endswith(hf_clip.IGNORED_SUFFIXES)}
    weights = {k: t for k, t in weights.items() if not k.endswith(hf_llama.IGNORED_SUFFIXES)}
    try:
        _check_tied(weights, spec, folder)
        state = hf_to_mmtrain(weights, spec, folder)
    except CheckpointMismatch as err:
        raise HFFolderError(folder, str(err)) from None
    log.info("read %s (%s, %d tensors)", folder, ARCHITECTURE, len(weights))
    return spec, state


def _check_tied(weights: dict[str, Tensor], spec: ModelSpec, folder: Path) -> None:
    """A tied checkpoint that repeats the LM head must repeat it exactly."""
    if not spec.decoder.tie_embeddings:
        return
    lm = split_parts(weights, folder)[1]
    if "lm_head.weight" in lm:
        hf_llama.check_tied(lm, folder)


# ----------------------------------------------------------------------------- writing
def llava_layout(spec: ModelSpec) -> str:
    """The hf_clip class of the vision tower, checking that LLaVA can express `spec`.

    Raises NoHFCounterpart listing every reason it cannot.
    """
    problems = []
    if spec.decoder is None or spec.projector is None or set(spec.towers) != {IMAGE_TOWER}:
        raise NoHFCounterpart(
            f"model {spec.name!r}: LLaVA is an image tower {IMAGE_TOWER!r}, a projector and a "
            "decoder LM"
        )
    if spec.projector.kind != "mlp":
        problems.append(f"projector.kind: LLaVA needs mlp, got {spec.projector.kind!r}")
    try:
        layout = hf_clip.hf_layout(vision_encoder_spec(spec), headless_ok=True)
    except NoHFCounterpart as err:
        problems.append(str(err))
        layout = None
    if layout is not None and layout.arch.projection:
        problems.append(f"towers.{IMAGE_TOWER}.output_proj: LLaVA needs false, got true")
    if problems:
        raise NoHFCounterpart(
            f"model {spec.name!r} has no HF LLaVA counterpart:\n  " + "\n  ".join(problems)
        )
    return layout.arch.name


def vision_encoder_spec(spec: ModelSpec) -> ModelSpec:
    """The image tower alone as an encoder spec (what hf_clip checks and configures)."""
    return ModelSpec(name=spec.name, embed_dim=spec.embed_dim, towers=dict(spec.towers))


def hf_config(spec: ModelSpec, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for `spec` as transformers' LlavaForConditionalGeneration reads it."""
    vision_spec = vision_encoder_spec(spec)
    vision = hf_clip.vision_config(vision_spec, hf_clip.hf_layout(vision_spec, headless_ok=True))
    text = {
        k: v
        for k, v in hf_llama.hf_config(spec.decoder, dtype).items()
        if k not in ("architectures", "dtype", "torch_dtype")
    }
    tower, projector = spec.towers[IMAGE_TOWER], spec.projector
    drops_cls = tower.has_cls_token() and not projector.keep_cls
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vision_config": vision,
        "text_config": text,
        "image_token_index": projector.image_token_id,
        "image_seq_length": spec.image_tokens(),
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": projector.feature_layer,
        "vision_feature_select_strategy": "default" if drops_cls else "full",
        "tie_word_embeddings": spec.decoder.tie_embeddings,
        # transformers 5 reads `dtype`, 4 `torch_dtype`
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_hf_llava(
    spec: ModelSpec,
    state: Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a HF LLaVA folder for the LanguageModel's state dict (in memory, or a lazy reader
    of a model folder: then one tensor is read at a time): model.safetensors or shards of at
    most `max_shard_bytes` with the index, then config.json, each atomically (config.json last:
    a folder that has it has its weights).

    Raises NoHFCounterpart when LLaVA cannot express `spec`."""
    llava_layout(spec)
    groups = export_groups(spec)
    meta = meta_state(state)
    _check_export(meta, groups)
    config = hf_config(spec, meta[f"towers.{TEXT_TOWER}.embed.weight"].dtype)
    return write_hf_groups(
        out_dir, state, groups, config, ARCHITECTURE, max_shard_bytes=max_shard_bytes
    )
