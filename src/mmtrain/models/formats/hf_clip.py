"""Hugging Face CLIP and SigLIP interop: a transformers model folder <-> an mmtrain spec and weights.

`read_hf_folder` reads a HF folder (`hf_common`: config.json, model.safetensors or shards): it
infers the `ModelSpec` from config.json and maps every tensor by name onto `MultimodalModel(spec)`
(towers `image` and `text`); `write_hf_folder` does the reverse, so transformers' `from_pretrained`
loads the result with no missing or unexpected key. transformers is never imported here:
config.json and the safetensors files are read directly.

Architectures: CLIPModel and SiglipModel (both towers); CLIPVisionModel,
CLIPVisionModelWithProjection and SiglipVisionModel (an image tower alone, a spec without pairs).

Where the layouts differ (everything else is a rename), a `KeyGroup` (`hf_common`) holds the same
numbers under both names, each side concatenated flat in order:
- HF keeps the q, k and v projections apart; our `attn.qkv` stacks them (rows q, k, v).
- SigLIP's MAP head is an `nn.MultiheadAttention` whose `in_proj` stacks q, k, v where our
  `CrossAttention` has `q` and `kv`; its probe is [1, 1, width] where ours is [width].
- SigLIP's `logit_scale` and `logit_bias` are [1] where ours are scalars.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

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
from mmtrain.models.formats.keys import CheckpointMismatch, Shape, check_keys
from mmtrain.models.safetensors_files import MAX_SHARD_BYTES, meta_state
from mmtrain.spec import ImageStem, ModelSpec, TextStem, TowerSpec
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

# Older transformers versions saved the `position_ids` buffers (an arange, no learned values).
IGNORED_SUFFIXES = ("embeddings.position_ids",)

# hidden_act in config.json -> TowerSpec.activation. gelu_new is the tanh approximation too.
ACTIVATIONS = {
    "quick_gelu": "quick_gelu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
HF_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}

# HF CLIP reads eos_token_id 2 as "configs from before the end-of-text id was fixed" and pools
# at the largest id instead (OpenAI's rule); TextStem.eot_token "argmax" is that rule.
LEGACY_EOS_TOKEN_ID = 2

# SigLIP's initial temperature and bias (Zhai et al. 2023); the weights carry the trained values.
SIGLIP_LOGIT_SCALE_INIT = math.log(10.0)
SIGLIP_LOGIT_BIAS_INIT = -10.0

# Defaults of transformers' config classes: config.json files written by older versions leave
# out every value equal to its default, so a missing key means this value.
CLIP_DEFAULTS = {"projection_dim": 512, "logit_scale_init_value": 2.6592}
CLIP_TEXT_DEFAULTS = {
    "vocab_size": 49408,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "projection_dim": 512,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "eos_token_id": 49407,
}
CLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 512,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
SIGLIP_TEXT_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "projection_size": None,  # None: hidden_size
}
SIGLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}
TEXT_DEFAULTS = {"clip": CLIP_TEXT_DEFAULTS, "siglip": SIGLIP_TEXT_DEFAULTS}
VISION_DEFAULTS = {"clip": CLIP_VISION_DEFAULTS, "siglip": SIGLIP_VISION_DEFAULTS}


# ----------------------------------------------------------------------------- architectures
@dataclass(frozen=True)
class Architecture:
    """One transformers class we read and write: its family and which parts it has."""

    name: str
    family: str  # "clip" or "siglip"
    model_types: tuple[str, ...]  # config.json model_type values it is saved with
    text: bool  # has a text tower (and the logit scale)
    projection: bool  # the image tower ends in a projection (visual_projection)


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("CLIPModel", "clip", ("clip",), text=True, projection=True),
        Architecture("SiglipModel", "siglip", ("siglip",), text=True, projection=False),
        Architecture(
            "CLIPVisionModel", "clip", ("clip_vision_model", "clip"), text=False, projection=False
        ),
        Architecture(
            "CLIPVisionModelWithProjection",
            "clip",
            ("clip_vision_model", "clip"),
            text=False,
            projection=True,
        ),
        Architecture(
            "SiglipVisionModel",
            "siglip",
            ("siglip_vision_model", "siglip"),
            text=False,
            projection=False,
        ),
    )
}
# config.json without `architectures`: the class its model_type stands for
BY_MODEL_TYPE = {
    "clip": "CLIPModel",
    "siglip": "SiglipModel",
    "clip_vision_model": "CLIPVisionModel",
    "siglip_vision_model": "SiglipVisionModel",
}


@dataclass(frozen=True)
class HFLayout:
    """Where each tower lives on both sides: our tower names and HF's key prefix of the vision
    model (transformers 5 saves a bare vision model's keys without `vision_model.`)."""

    arch: Architecture
    image: str = "image"
    text: str | None = "text"
    vision_prefix: str = "vision_model."


# ----------------------------------------------------------------------------- the key map
def _same(ours: str, theirs: str, shape: Shape) -> KeyGroup:
    return KeyGroup(((ours, shape),), ((theirs, shape),))


def _norm(ours: str, theirs: str, width: int) -> list[KeyGroup]:
    return [_same(f"{ours}.{p}", f"{theirs}.{p}", (width,)) for p in ("weight", "bias")]


def _linear(ours: str, theirs: str, out: int, inp: int, bias: bool = True) -> list[KeyGroup]:
    groups = [_same(f"{ours}.weight", f"{theirs}.weight", (out, inp))]
    return groups + ([_same(f"{ours}.bias", f"{theirs}.bias", (out,))] if bias else [])


def _blocks(ours: str, theirs: str, tower: TowerSpec) -> list[KeyGroup]:
    w, h = tower.width, tower.mlp_hidden()
    groups = []
    for i in range(tower.layers):
        o, t = f"{ours}.{i}", f"{theirs}.{i}"
        groups += [
            *_norm(f"{o}.norm1", f"{t}.layer_norm1", w),
            KeyGroup(
                ((f"{o}.attn.qkv.weight", (3 * w, w)),),
                tuple((f"{t}.self_attn.{x}_proj.weight", (w, w)) for x in "qkv"),
            ),
            KeyGroup(
                ((f"{o}.attn.qkv.bias", (3 * w,)),),
                tuple((f"{t}.self_attn.{x}_proj.bias", (w,)) for x in "qkv"),
            ),
            *_linear(f"{o}.attn.out", f"{t}.self_attn.out_proj", w, w),
            *_norm(f"{o}.norm2", f"{t}.layer_norm2", w),
            *_linear(f"{o}.mlp.fc1", f"{t}.mlp.fc1", h, w),
            *_linear(f"{o}.mlp.fc2", f"{t}.mlp.fc2", w, h),
        ]
    return groups


def _map_head(ours: str, theirs: str, tower: TowerSpec) -> list[KeyGroup]:
    w, h = tower.width, tower.mlp_hidden()
    attn = f"{theirs}.attention"
    return [
        KeyGroup(((f"{ours}.probe", (w,)),), ((f"{theirs}.probe", (1, 1, w)),)),
        KeyGroup(
            ((f"{ours}.attn.q.weight", (w, w)), (f"{ours}.attn.kv.weight", (2 * w, w))),
            ((f"{attn}.in_proj_weight", (3 * w, w)),),
        ),
        KeyGroup(
            ((f"{ours}.attn.q.bias", (w,)), (f"{ours}.attn.kv.bias", (2 * w,))),
            ((f"{attn}.in_proj_bias", (3 * w,)),),
        ),
        *_linear(f"{ours}.attn.out", f"{attn}.out_proj", w, w),
        *_norm(f"{ours}.norm", f"{theirs}.layernorm", w),
        *_linear(f"{ours}.mlp.fc1", f"{theirs}.mlp.fc1", h, w),
        *_linear(f"{ours}.mlp.fc2", f"{theirs}.mlp.fc2", w, h),
    ]


def _image_groups(spec: ModelSpec, layout: HFLayout) -> list[KeyGroup]:
    tower = spec.towers[layout.image]
    o, v = f"towers.{layout.image}", layout.vision_prefix
    w, stem = tower.width, tower.stem
    p = stem.patch_size
    groups = [
        _same(
            f"{o}.stem.patch_embed.weight",
            f"{v}embeddings.patch_embedding.weight",
            (w, stem.channels, p, p),
        )
    ]
    if stem.patch_bias:
        groups.append(
            _same(f"{o}.stem.patch_embed.bias", f"{v}embeddings.patch_embedding.bias", (w,))
        )
    if tower.has_cls_token():
        groups.append(_same(f"{o}.stem.cls_token", f"{v}embeddings.class_embedding", (w,)))
    groups.append(
        _same(
            f"{o}.stem.pos_embed", f"{v}embeddings.position_embedding.weight", (tower.tokens(), w)
        )
    )
    if tower.has_pre_norm():
        groups += _norm(f"{o}.norm_pre", f"{v}pre_layrnorm", w)  # sic: HF's spelling
    groups += _blocks(f"{o}.blocks", f"{v}encoder.layers", tower)
    groups += _norm(f"{o}.norm_final", f"{v}post_layernorm", w)
    if tower.pooling == "map":
        groups += _map_head(f"{o}.pool", f"{v}head", tower)
    if tower.output_proj:
        groups += _linear(f"{o}.proj", "visual_projection", spec.embed_dim, w, bias=False)
    return groups


def _text_groups(spec: ModelSpec, layout: HFLayout) -> list[KeyGroup]:
    tower = spec.towers[layout.text]
    o, t = f"towers.{layout.text}", "text_model"
    w, stem = tower.width, tower.stem
    groups = [
        _same(
            f"{o}.stem.token_embed.weight",
            f"{t}.embeddings.token_embedding.weight",
            (stem.vocab_size, w),
        ),
        _same(
            f"{o}.stem.pos_embed",
            f"{t}.embeddings.position_embedding.weight",
            (stem.context_length, w),
        ),
        *_blocks(f"{o}.blocks", f"{t}.encoder.layers", tower),
        *_norm(f"{o}.norm_final", f"{t}.final_layer_norm", w),
    ]
    if layout.arch.family == "siglip":  # the text tower's own `head`, with a bias
        return groups + _linear(f"{o}.proj", f"{t}.head", spec.embed_dim, w)
    return groups + _linear(f"{o}.proj", "text_projection", spec.embed_dim, w, bias=False)


def key_map(spec: ModelSpec, layout: HFLayout) -> list[KeyGroup]:
    """Every tensor of `MultimodalModel(spec)` under our names and HF's, for `layout`."""
    groups = _image_groups(spec, layout)
    if layout.text is None:
        return groups
    groups += _text_groups(spec, layout)
    # SigLIP keeps its scalars as [1] tensors.
    scalar: Shape = (1,) if layout.arch.family == "siglip" else ()
    groups.append(KeyGroup((("logit_scale", ()),), (("logit_scale", scalar),)))
    if spec.logit_bias_init is not None:
        groups.append(KeyGroup((("logit_bias", ()),), (("logit_bias", scalar),)))
    return groups


def hf_to_mmtrain(
    state: Mapping[str, Tensor], spec: ModelSpec, layout: HFLayout
) -> dict[str, Tensor]:
    """HF state dict -> mmtrain state dict for `spec`; CheckpointMismatch lists every key that
    does not fit (after dropping the saved `position_ids` buffers of old exports)."""
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    groups = key_map(spec, layout)
    check_keys(
        state,
        {name: shape for g in groups for name, shape in g.theirs},
        what=f"the {layout.arch.name} weights do not match the model config.json describes",
        hint="Were config.json and the safetensors files saved from the same model?",
    )
    return regroup(state, groups, "theirs", "ours")


def mmtrain_to_hf(
    state: Mapping[str, Tensor], spec: ModelSpec, layout: HFLayout
) -> dict[str, Tensor]:
    """mmtrain state dict -> the state dict transformers' `layout.arch` class loads."""
    groups = key_map(spec, layout)
    check_keys(
        state,
        {name: shape for g in groups for name, shape in g.ours},
        what=f"the mmtrain state dict does not match model {spec.name!r}",
        hint="Export with the spec the model was built from (the spec.yaml next to its weights).",
    )
    return regroup(state, groups, "ours", "theirs")


# ----------------------------------------------------------------------------- config.json -> spec
def _architecture(config: dict[str, Any], file: Path) -> Architecture:
    model_type = config.get("model_type")
    names = config.get("architectures")
    if names is None and model_type in BY_MODEL_TYPE:
        names = [BY_MODEL_TYPE[model_type]]
    supported = ", ".join(ARCHITECTURES)
    if not isinstance(names, list) or len(names) != 1 or names[0] not in ARCHITECTURES:
        raise HFFolderError(
            file, f"{names!r} is not supported; mmtrain reads {supported}", field="architectures"
        )
    arch = ARCHITECTURES[names[0]]
    if model_type not in arch.model_types:
        raise HFFolderError(
            file,
            f"{model_type!r} does not go with architectures {names}; expected "
            f"{' or '.join(map(repr, arch.model_types))}",
            field="model_type",
        )
    return arch


def _mlp_ratio(width: int, hidden: int) -> float:
    """A ratio whose `int(width * ratio)` (TowerSpec.mlp_hidden) is exactly `hidden`."""
    ratio = hidden / width
    while int(width * ratio) < hidden:  # hidden / width rounded down: one ulp up fixes it
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def _stack(section: Section) -> dict[str, Any]:
    """The TowerSpec fields every tower has: sizes, activation, norm epsilon."""
    width = section.get("hidden_size", int)
    act = section.get("hidden_act", str)
    if act not in ACTIVATIONS:
        raise section.error("hidden_act", f"{act!r} is not supported; use {', '.join(ACTIVATIONS)}")
    return {
        "width": width,
        "layers": section.get("num_hidden_layers", int),
        "heads": section.get("num_attention_heads", int),
        "mlp_ratio": _mlp_ratio(width, section.get("intermediate_size", int)),
        "activation": ACTIVATIONS[act],
        "norm_eps": section.get("layer_norm_eps", float),
    }


def image_tower(vision: Section, arch: Architecture, headless_ok: bool = False) -> TowerSpec:
    """The image TowerSpec of a vision (sub-)config of `arch`'s family (CLIP: class token and
    pre-norm; SigLIP: MAP head, patch bias). Used by hf_llava for LLaVA's vision tower, where
    a SigLIP tower without its head (`vision_use_head: false`, LLaVA-OneVision's layout: the
    features of a layer, no pooled output) is read with `headless_ok` as mean pooling, a
    pooling without weights that a LLaVA never runs."""
    siglip = arch.family == "siglip"
    use_head = not siglip or vision.get("vision_use_head", bool)
    if not use_head and not headless_ok:
        raise vision.error(
            "vision_use_head",
            "false (no pooled output) is read inside a LLaVA folder only: a SigLIP encoder "
            "alone needs its MAP head",
        )
    stem = ImageStem(
        image_size=vision.square("image_size"),
        patch_size=vision.square("patch_size"),
        channels=vision.get("num_channels", int),
        patch_bias=siglip,
    )
    return TowerSpec(
        modality="image",
        stem=stem,
        **_stack(vision),
        pooling=("map" if use_head else "mean") if siglip else "cls",  # SigLIP: no class token
        output_proj=arch.projection,
        pre_norm=False if siglip else None,  # SigLIP has no norm before the blocks
    )


def _eot_token(text: Section, vocab_size: int) -> int | str:
    eos = text.get("eos_token_id", int)
    if eos == LEGACY_EOS_TOKEN_ID:
        return "argmax"
    if not 0 <= eos < vocab_size:
        raise text.error("eos_token_id", f"{eos} is not an id of the {vocab_size}-token vocabulary")
    return eos


def _text_tower(text: Section, arch: Architecture) -> TowerSpec:
    siglip = arch.family == "siglip"
    vocab_size = text.get("vocab_size", int)
    stem = TextStem(
        vocab_size=vocab_size,
        context_length=text.get("max_position_embeddings", int),
        causal=not siglip,  # SigLIP's text tower attends both ways, to padding too
        eot_token=None if siglip else _eot_token(text, vocab_size),
    )
    return TowerSpec(
        modality="text",
        stem=stem,
        **_stack(text),
        pooling="last" if siglip else "eot",
        proj_bias=siglip,
    )


def _embed_dim(arch: Architecture, top: Section, vision: Section, text: Section | None) -> int:
    if arch.name == "CLIPModel":
        return top.get("projection_dim", int)
    if arch.projection:  # CLIPVisionModelWithProjection
        return vision.get("projection_dim", int)
    width = vision.get("hidden_size", int)
    if text is not None:  # SigLIP: the text head maps onto the vision width
        # transformers reads a missing projection_size as the text tower's own width
        size = text.values.get("projection_size") or text.get("hidden_size", int)
        if size != width:
            raise text.error(
                "projection_size", f"{size} differs from vision_config.hidden_size {width}"
            )
    return width


def _sections(
    config: dict[str, Any], arch: Architecture, file: Path
) -> tuple[Section, Section | None, Section]:
    """(vision, text or None, top level) sections of config.json for `arch`."""
    top = Section(file, "", {**CLIP_DEFAULTS, **config} if arch.family == "clip" else config)
    vision_defaults = VISION_DEFAULTS[arch.family]
    nested = config.get("model_type") in ("clip", "siglip")  # a full model's config
    if nested:
        vision = sub_config(config, "vision_config", vision_defaults, file)
    else:
        vision = Section(file, "", {**vision_defaults, **config})
    text = None
    if arch.text:
        text = sub_config(config, "text_config", TEXT_DEFAULTS[arch.family], file)
    return vision, text, top


def spec_from_config(
    config: dict[str, Any], file: Path, name: str
) -> tuple[ModelSpec, Architecture]:
    """The ModelSpec (towers `image` and `text`) of a HF CLIP/SigLIP config.json, and its class."""
    arch = _architecture(config, file)
    vision, text, top = _sections(config, arch, file)
    towers = {"image": image_tower(vision, arch)}
    siglip = arch.family == "siglip"
    fields: dict[str, Any] = {}
    if text is not None:
        towers["text"] = _text_tower(text, arch)
        fields = {
            "pairs": [("image", "text")],
            "objective": "siglip" if siglip else "clip",
            "logit_scale_init": SIGLIP_LOGIT_SCALE_INIT
            if siglip
            else top.get("logit_scale_init_value", float),
            "logit_bias_init": SIGLIP_LOGIT_BIAS_INIT if siglip else None,
        }
    embed_dim = _embed_dim(arch, top, vision, text)
    try:
        spec = ModelSpec(name=name, embed_dim=embed_dim, towers=towers, **fields)
    except FieldError as err:
        raise HFFolderError(file, f"describes a model mmtrain cannot build: {err}") from None
    return spec, arch


# ----------------------------------------------------------------------------- files
def _vision_prefix(arch: Architecture, state: Mapping[str, Tensor]) -> str:
    # A full model nests the vision model; a bare one saved by transformers 5 does not.
    if arch.text or any(k.startswith("vision_model.") for k in state):
        return "vision_model."
    return ""


def read_hf_folder(path: str | Path) -> tuple[ModelSpec, dict[str, Tensor]]:
    """(spec, state dict) of a HF CLIP/SigLIP folder: the state dict is in mmtrain's names, ready
    for `MultimodalModel(spec).load_state_dict(state, strict=True)`; dtypes are kept.

    Raises HFFolderError (a FieldError) naming the file, and the config field where one is to
    blame, for anything it cannot read.
    """
    folder, config_path, config = open_hf_folder(path)
    spec, arch = spec_from_config(config, config_path, folder.resolve().name)
    weights = read_hf_weights(folder)
    layout = HFLayout(
        arch, text="text" if arch.text else None, vision_prefix=_vision_prefix(arch, weights)
    )
    try:
        state = hf_to_mmtrain(weights, spec, layout)
    except CheckpointMismatch as err:
        raise HFFolderError(folder, str(err)) from None
    log.info("read %s (%s, %d tensors)", folder, arch.name, len(weights))
    return spec, state


# ----------------------------------------------------------------------------- spec -> HF
def _problems(path: str, tower: TowerSpec, wanted: dict[str, Any]) -> list[str]:
    """`path.field: HF needs X, got Y` for each dotted field of `tower` that is not as wanted."""
    problems = []
    for key, value in wanted.items():
        actual = tower.has_pre_norm() if key == "pre_norm" else operator.attrgetter(key)(tower)
        if actual != value:
            problems.append(f"{path}.{key}: HF needs {value!r}, got {actual!r}")
    if tower.activation not in HF_ACTIVATIONS:
        problems.append(
            f"{path}.activation: HF needs one of {', '.join(HF_ACTIVATIONS)}, got {tower.activation!r}"
        )
    return problems


def _image_needs(family: str, with_text: bool) -> dict[str, Any]:
    common = {"norm": "layernorm", "qkv_bias": True}
    if family == "siglip":
        return {
            **common,
            "pooling": "map",
            "pre_norm": False,
            "stem.patch_bias": True,
            "output_proj": False,
        }
    needs = {
        **common,
        "pooling": "cls",
        "pre_norm": True,
        "stem.patch_bias": False,
        "proj_bias": False,
    }
    return {**needs, "output_proj": True} if with_text else needs


def _text_problems(path: str, tower: TowerSpec, family: str) -> list[str]:
    common = {"norm": "layernorm", "qkv_bias": True, "pre_norm": False, "output_proj": True}
    if family == "siglip":
        wanted = {**common, "stem.causal": False, "pooling": "last", "proj_bias": True}
        return _problems(path, tower, wanted)
    wanted = {**common, "stem.causal": True, "pooling": "eot", "proj_bias": False}
    problems = _problems(path, tower, wanted)
    eot = tower.stem.eot_token
    if eot is None or eot == LEGACY_EOS_TOKEN_ID:
        problems.append(
            f"{path}.stem.eot_token: HF's CLIP text model pools at the first eos_token_id "
            f"(or, for id {LEGACY_EOS_TOKEN_ID}, at the largest id); set it to the tokenizer's "
            f"end-of-text id (49407 for OpenAI's CLIP tokenizer) or argmax, got {eot!r}"
        )
    return problems


def image_family(tower: TowerSpec) -> str:
    """ "siglip" for a MAP-pooled image tower, or a head-less one with SigLIP's patch bias
    (LLaVA-OneVision's), else "clip"."""
    headless_siglip = tower.pooling == "mean" and tower.stem.patch_bias
    return "siglip" if tower.pooling == "map" or headless_siglip else "clip"


def hf_layout(spec: ModelSpec, headless_ok: bool = False) -> HFLayout:
    """The HF class and tower names for `spec`: SigLIP for a MAP-pooled image tower (with
    `headless_ok`, hf_llava's: or a head-less SigLIP one), else CLIP.

    Raises NoHFCounterpart listing every field the HF class cannot express.
    """
    images = [n for n, t in spec.towers.items() if t.modality == "image"]
    texts = [n for n, t in spec.towers.items() if t.modality == "text"]
    if len(images) != 1 or len(texts) > 1 or len(spec.towers) != len(images) + len(texts):
        towers = ", ".join(f"{n} ({t.modality})" for n, t in spec.towers.items())
        raise NoHFCounterpart(
            f"model {spec.name!r}: HF CLIP/SigLIP have one image tower and at most one text "
            f"tower, got {towers}"
        )
    image, text = images[0], (texts[0] if texts else None)
    tower = spec.towers[image]
    family = image_family(tower)
    needs = _image_needs(family, text is not None)
    if family == "siglip" and headless_ok and tower.pooling == "mean":
        needs["pooling"] = "mean"
    problems = _problems(f"towers.{image}", tower, needs)
    if text is not None:
        problems += _text_problems(f"towers.{text}", spec.towers[text], family)
        if family == "siglip" and spec.logit_bias_init is None:
            problems.append("logit_bias_init: SiglipModel has a learned logit bias; set one")
        if family == "clip" and spec.logit_bias_init is not None:
            problems.append("logit_bias_init: CLIPModel has no logit bias; set null")
    if spec.fusion is not None:
        problems.append("fusion: HF CLIP/SigLIP have no fusion head")
    if problems:
        raise NoHFCounterpart(
            f"model {spec.name!r} has no HF {family} counterpart:\n  " + "\n  ".join(problems)
        )
    arch = _arch_for(family, text is not None, spec.towers[image].output_proj)
    return HFLayout(arch, image=image, text=text)


def module_prefixes(layout: HFLayout) -> dict[str, str]:
    """The written key prefixes that are not where transformers 5 builds the modules (the
    names PEFT gives adapters, models/formats/peft_adapter.py): its CLIPVisionModel and
    SiglipVisionModel hold the encoder at the top, without the `vision_model.` level they
    are still saved with."""
    flat = layout.text is None and not layout.arch.projection
    return {layout.vision_prefix: ""} if flat and layout.vision_prefix else {}


def _arch_for(family: str, with_text: bool, projection: bool) -> Architecture:
    if with_text:
        return ARCHITECTURES["SiglipModel" if family == "siglip" else "CLIPModel"]
    if family == "siglip":
        return ARCHITECTURES["SiglipVisionModel"]
    return ARCHITECTURES["CLIPVisionModelWithProjection" if projection else "CLIPVisionModel"]


def _stack_config(tower: TowerSpec) -> dict[str, Any]:
    return {
        "hidden_size": tower.width,
        "intermediate_size": tower.mlp_hidden(),
        "num_hidden_layers": tower.layers,
        "num_attention_heads": tower.heads,
        "hidden_act": HF_ACTIVATIONS[tower.activation],
        "layer_norm_eps": tower.norm_eps,
    }


def vision_config(spec: ModelSpec, layout: HFLayout) -> dict[str, Any]:
    """The `vision_config` transformers reads for `spec`'s image tower (or a bare vision
    model's whole config). Used by hf_llava, whose config nests one."""
    tower = spec.towers[layout.image]
    stem = tower.stem
    config = {
        "model_type": f"{layout.arch.family}_vision_model",
        **_stack_config(tower),
        "num_channels": stem.channels,
        "image_size": stem.image_size,
        "patch_size": stem.patch_size,
    }
    if layout.arch.family == "siglip":
        return {**config, "vision_use_head": tower.pooling == "map"}
    return {**config, "projection_dim": spec.embed_dim}


def _text_config(spec: ModelSpec, layout: HFLayout) -> dict[str, Any]:
    tower = spec.towers[layout.text]
    config = {
        "model_type": f"{layout.arch.family}_text_model",
        **_stack_config(tower),
        "vocab_size": tower.stem.vocab_size,
        "max_position_embeddings": tower.stem.context_length,
    }
    if layout.arch.family == "siglip":
        return {**config, "projection_size": spec.embed_dim}
    eot = tower.stem.eot_token
    eos = LEGACY_EOS_TOKEN_ID if eot == "argmax" else eot
    return {**config, "projection_dim": spec.embed_dim, "eos_token_id": eos}


def hf_config(spec: ModelSpec, layout: HFLayout, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for `spec` as transformers' `layout.arch` class reads it."""
    arch = layout.arch
    head = {"architectures": [arch.name], "torch_dtype": str(dtype).removeprefix("torch.")}
    if layout.text is None:
        return {**head, **vision_config(spec, layout)}
    config = {
        **head,
        "model_type": arch.family,
        "text_config": _text_config(spec, layout),
        "vision_config": vision_config(spec, layout),
    }
    if arch.family == "clip":
        config.update(projection_dim=spec.embed_dim, logit_scale_init_value=spec.logit_scale_init)
    return config


def write_hf_folder(
    model: nn.Module, out_dir: str | Path, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Path:
    """Write `model` (a MultimodalModel) as a HF folder (`write_hf_encoder`)."""
    return write_hf_encoder(
        model.spec, model.state_dict(), out_dir, max_shard_bytes=max_shard_bytes
    )


def write_hf_encoder(
    spec: ModelSpec,
    state: Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the HF CLIP/SigLIP folder of `MultimodalModel(spec)`'s state dict (in memory, or a
    lazy reader of a model folder: then one tensor is read at a time): model.safetensors or
    shards, then config.json, each atomically. Returns the folder.

    Raises NoHFCounterpart when the spec has no HF CLIP/SigLIP counterpart, CheckpointMismatch
    when `state` does not fit it.
    """
    layout = hf_layout(spec)
    groups = key_map(spec, layout)
    meta = meta_state(state)
    check_keys(
        meta,
        {name: shape for g in groups for name, shape in g.ours},
        what=f"the mmtrain state dict does not match model {spec.name!r}",
        hint="Export with the spec the model was built from (the spec.yaml next to its weights).",
    )
    dtype = meta[groups[0].ours[0][0]].dtype
    config = hf_config(spec, layout, dtype)
    return write_hf_groups(
        out_dir, state, groups, config, layout.arch.name, max_shard_bytes=max_shard_bytes
    )
