"""Hugging Face Llama and Qwen2 interop: a `LlamaForCausalLM` / `Qwen2ForCausalLM` folder <->
a `DecoderSpec` and the state dict of `mmtrain.models.decoder.Decoder`.

A HF folder holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`). `read_hf_decoder` infers the spec from config.json (transformers
4's `rope_theta` / `rope_scaling` or transformers 5's `rope_parameters`) and maps every tensor by
an explicit key map; `write_hf_decoder` does the reverse, tensor by tensor into shards past 5 GB,
so transformers' `from_pretrained` loads the result with no missing or unexpected key. transformers is never imported here.

Layouts differ in two places, both concatenations along the output rows:
- our `attn.qkv` stacks HF's `q_proj`, `k_proj`, `v_proj` (weights, and Qwen2's biases);
- our `mlp.fc1` stacks HF's `gate_proj` and `up_proj` (gate first).
Everything else is a rename. A tied LM head is stored once, as the embedding (HF leaves
`lm_head.weight` out of tied checkpoints; some older ones repeat it, and it must then be equal).

Refused, naming config.json and the field: activations other than silu, biases on o_proj or the
MLP (Llama's `attention_bias`, `mlp_bias`), sliding-window attention, rotary types other than
default / linear / llama3, partial rotary embeddings.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmtrain.decoder_spec import ROPE_TYPES, DecoderSpec, RopeScaling
from mmtrain.models.decoder import Decoder
from mmtrain.models.formats.hf_common import (
    CONFIG_FILE,
    HFFolderError,
    KeyGroup,
    open_hf_folder,
    read_hf_weights,
    write_hf_groups,
)
from mmtrain.models.formats.keys import CheckpointMismatch, Shape, check_keys
from mmtrain.models.safetensors_files import MAX_SHARD_BYTES, meta_state
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

# architectures in config.json -> model_type
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
BY_MODEL_TYPE = {model_type: name for name, model_type in ARCHITECTURES.items()}

# transformers 4 saved the rotary table of each layer in some Llama checkpoints (no weights).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

DEFAULT_ROPE_THETA = 10000.0

# Defaults of transformers' config classes: a key missing from config.json means this value.
COMMON_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
DEFAULTS = {
    "llama": {
        **COMMON_DEFAULTS,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "num_key_value_heads": None,  # None: num_attention_heads
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": {
        **COMMON_DEFAULTS,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
    },
}

# DecoderSpec field -> the config.json field it comes from (to name it in errors).
SPEC_TO_HF = {
    "vocab_size": "vocab_size",
    "width": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "mlp_hidden": "intermediate_size",
    "head_dim": "head_dim",
    "rope_theta": "rope_theta",
    "rms_eps": "rms_norm_eps",
    "max_positions": "max_position_embeddings",
    "bos_id": "bos_token_id",
    "eos_ids": "eos_token_id",
}


# ----------------------------------------------------------------------------- the key map
@dataclass(frozen=True)
class KeyPair:
    """One tensor of ours and the HF tensors it holds, concatenated along dim 0 in order
    (one of them for a rename)."""

    ours: str
    theirs: tuple[tuple[str, Shape], ...]

    def shape(self) -> Shape:
        rows = sum(shape[0] for _, shape in self.theirs)
        return (rows, *self.theirs[0][1][1:])


def _rename(ours: str, theirs: str, shape: Shape) -> KeyPair:
    return KeyPair(ours, ((theirs, shape),))


def _block_keys(spec: DecoderSpec, i: int) -> list[KeyPair]:
    o, t = f"blocks.{i}", f"model.layers.{i}"
    w, q, kv, f = spec.width, spec.q_width(), spec.kv_width(), spec.mlp_hidden
    rows = {"q": q, "k": kv, "v": kv}
    pairs = [
        _rename(f"{o}.norm1.weight", f"{t}.input_layernorm.weight", (w,)),
        KeyPair(
            f"{o}.attn.qkv.weight",
            tuple((f"{t}.self_attn.{x}_proj.weight", (n, w)) for x, n in rows.items()),
        ),
    ]
    if spec.qkv_bias:
        pairs.append(
            KeyPair(
                f"{o}.attn.qkv.bias",
                tuple((f"{t}.self_attn.{x}_proj.bias", (n,)) for x, n in rows.items()),
            )
        )
    return pairs + [
        _rename(f"{o}.attn.out.weight", f"{t}.self_attn.o_proj.weight", (w, q)),
        _rename(f"{o}.norm2.weight", f"{t}.post_attention_layernorm.weight", (w,)),
        KeyPair(
            f"{o}.mlp.fc1.weight",
            ((f"{t}.mlp.gate_proj.weight", (f, w)), (f"{t}.mlp.up_proj.weight", (f, w))),
        ),
        _rename(f"{o}.mlp.fc2.weight", f"{t}.mlp.down_proj.weight", (w, f)),
    ]


def key_map(spec: DecoderSpec) -> list[KeyPair]:
    """Every tensor of `Decoder(spec)` with the HF tensors it holds."""
    v, w = spec.vocab_size, spec.width
    pairs = [_rename("embed.weight", "model.embed_tokens.weight", (v, w))]
    for i in range(spec.layers):
        pairs += _block_keys(spec, i)
    pairs.append(_rename("norm.weight", "model.norm.weight", (w,)))
    if not spec.tie_embeddings:
        pairs.append(_rename("lm_head.weight", "lm_head.weight", (v, w)))
    return pairs


def hf_to_mmtrain(state: dict[str, Tensor], spec: DecoderSpec) -> dict[str, Tensor]:
    """HF state dict -> `Decoder(spec)`'s; CheckpointMismatch lists every key that does not fit."""
    state = {k: t for k, t in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    pairs = key_map(spec)
    expected = {name: shape for p in pairs for name, shape in p.theirs}
    if spec.tie_embeddings and "lm_head.weight" in state:
        expected["lm_head.weight"] = (spec.vocab_size, spec.width)  # checked equal below
    check_keys(
        state,
        expected,
        what="the weights do not match the model config.json describes",
        hint="Were config.json and the safetensors files saved from the same model?",
    )
    out = {}
    for pair in pairs:
        parts = [state[name] for name, _ in pair.theirs]
        out[pair.ours] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out


def mmtrain_to_hf(state: dict[str, Tensor], spec: DecoderSpec) -> dict[str, Tensor]:
    """`Decoder(spec)`'s state dict -> the state dict transformers' class loads."""
    pairs = key_map(spec)
    check_keys(
        state,
        {p.ours: p.shape() for p in pairs},
        what="the state dict does not match the decoder spec",
        hint="Export with the spec the model was built from.",
    )
    out = {}
    for pair in pairs:
        rows = [shape[0] for _, shape in pair.theirs]
        for (name, _), part in zip(pair.theirs, state[pair.ours].split(rows), strict=True):
            out[name] = part.contiguous()  # own storage: safetensors refuses shared views
    return out


# ----------------------------------------------------------------------------- config.json -> spec
@dataclass(frozen=True)
class _Config:
    """config.json with the class defaults filled in, read with errors naming the field."""

    file: Path
    values: dict[str, Any]

    def get(self, key: str, kind: type, optional: bool = False) -> Any:
        value = self.values.get(key)
        if value is None and optional:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(key, f"expected {kind.__name__}, got {value!r}")
        return value

    def error(self, key: str, message: str) -> HFFolderError:
        return HFFolderError(self.file, message, field=key)


def _architecture(config: dict[str, Any], file: Path) -> str:
    """The model_type ("llama" / "qwen2") of a config.json we read."""
    model_type = config.get("model_type")
    names = config.get("architectures")
    if names is None and model_type in BY_MODEL_TYPE:
        names = [BY_MODEL_TYPE[model_type]]
    if not isinstance(names, list) or len(names) != 1 or names[0] not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise HFFolderError(
            file, f"{names!r} is not supported; mmtrain reads {supported}", field="architectures"
        )
    if model_type != ARCHITECTURES[names[0]]:
        raise HFFolderError(
            file,
            f"{model_type!r} does not go with architectures {names}; "
            f"expected {ARCHITECTURES[names[0]]!r}",
            field="model_type",
        )
    return model_type


def _refuse_unsupported(config: _Config, model_type: str) -> None:
    """Features our decoder does not have: refuse them rather than compute something else."""
    if config.get("hidden_act", str) != "silu":
        raise config.error(
            "hidden_act", f"{config.values['hidden_act']!r} is not supported; use silu"
        )
    if model_type == "llama":
        if config.get("attention_bias", bool):
            raise config.error(
                "attention_bias",
                "true puts a bias on q/k/v and on o_proj; mmtrain's decoder has biases on "
                "q/k/v only (Qwen2's layout)",
            )
        if config.get("mlp_bias", bool):
            raise config.error("mlp_bias", "true (biases in the MLP) is not supported")
    if model_type == "qwen2":
        if config.get("use_sliding_window", bool):
            raise config.error(
                "use_sliding_window", "true (sliding-window attention) is not supported"
            )
        layer_types = config.values.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise config.error(
                "layer_types", f"only full_attention layers are supported, got {layer_types}"
            )


def _rope_section(config: _Config) -> tuple[str, dict[str, Any]]:
    """(field name, rotary parameters): transformers 5's `rope_parameters`, or transformers 4's
    `rope_scaling`, which wins where both are set (as transformers 5 reads them)."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.values.get(key)
        if value is None or value == {}:
            continue
        if not isinstance(value, dict):
            raise config.error(key, f"expected a mapping, got {value!r}")
        # transformers 5 may nest the parameters by layer type; we build full attention only
        if isinstance(value.get("full_attention"), dict):
            return f"{key}.full_attention", value["full_attention"]
        return key, value
    return "rope_parameters", {}


def _rope(config: _Config) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of config.json."""
    field, params = _rope_section(config)
    section = _Config(config.file, {f"{field}.{k}": v for k, v in params.items()})
    theta = params.get("rope_theta", config.values.get("rope_theta", DEFAULT_ROPE_THETA))
    if not isinstance(theta, int | float) or isinstance(theta, bool):
        raise config.error(f"{field}.rope_theta", f"expected a number, got {theta!r}")
    partial = params.get("partial_rotary_factor", config.values.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise config.error(
            f"{field}.partial_rotary_factor", f"{partial} (partial rotary) is not supported"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        raise config.error(
            f"{field}.rope_type",
            f"{rope_type!r} is not supported; use default, {', '.join(ROPE_TYPES)}",
        )
    scaling = {"rope_type": rope_type, "factor": section.get(f"{field}.factor", float)}
    if rope_type == "llama3":
        scaling["low_freq_factor"] = section.get(f"{field}.low_freq_factor", float)
        scaling["high_freq_factor"] = section.get(f"{field}.high_freq_factor", float)
        # transformers falls back to max_position_embeddings where this is missing
        key = f"{field}.original_max_position_embeddings"
        scaling["original_max_position_embeddings"] = (
            section.get(key, int)
            if section.values.get(key) is not None
            else config.get("max_position_embeddings", int)
        )
    return float(theta), RopeScaling(**scaling)


def _eos_ids(config: _Config) -> tuple[int, ...]:
    eos = config.values.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise config.error("eos_token_id", f"expected an id or a list of ids, got {eos!r}")
    return tuple(ids)


def _hf_field(path: str, rope_field: str) -> str:
    """The config.json field behind a DecoderSpec field path (for error messages)."""
    head, _, rest = path.partition(".")
    if head == "rope_scaling":
        return f"{rope_field}.{rest}" if rest else rope_field
    return SPEC_TO_HF.get(head, path)


def spec_from_config(config: dict[str, Any], file: Path) -> DecoderSpec:
    """The DecoderSpec of a HF LlamaForCausalLM / Qwen2ForCausalLM config.json."""
    model_type = _architecture(config, file)
    c = _Config(file, {**DEFAULTS[model_type], **config})
    _refuse_unsupported(c, model_type)
    theta, scaling = _rope(c)
    heads = c.get("num_attention_heads", int)
    fields = {
        "vocab_size": c.get("vocab_size", int),
        "width": c.get("hidden_size", int),
        "layers": c.get("num_hidden_layers", int),
        "heads": heads,
        "kv_heads": c.get("num_key_value_heads", int, optional=True),
        "mlp_hidden": c.get("intermediate_size", int),
        "head_dim": c.get("head_dim", int, optional=True),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rms_eps": c.get("rms_norm_eps", float),
        "qkv_bias": model_type == "qwen2",
        "tie_embeddings": c.get("tie_word_embeddings", bool),
        "max_positions": c.get("max_position_embeddings", int),
        "bos_id": c.get("bos_token_id", int, optional=True),
        "eos_ids": _eos_ids(c),
    }
    try:
        return DecoderSpec(**fields)
    except FieldError as err:
        rope_field = _rope_section(c)[0]
        raise c.error(_hf_field(err.path, rope_field), err.message) from None


# ----------------------------------------------------------------------------- reading
def read_hf_decoder(path: str | Path) -> tuple[DecoderSpec, dict[str, Tensor]]:
    """(spec, state dict) of a HF Llama / Qwen2 folder, the state dict in `Decoder`'s names,
    ready for `Decoder(spec).load_state_dict(state, strict=True)`; dtypes are kept.

    Raises HFFolderError (a FieldError) naming the file, and the config field where one is to
    blame, for anything it cannot read.
    """
    folder, config_path, config = open_hf_folder(path)
    spec = spec_from_config(config, config_path)
    weights = read_hf_weights(folder)
    if spec.tie_embeddings and "lm_head.weight" in weights:
        check_tied(weights, folder)
    try:
        state = hf_to_mmtrain(weights, spec)
    except CheckpointMismatch as err:
        raise HFFolderError(folder, str(err)) from None
    log.info("read %s (%d layers, %d tensors)", folder, spec.layers, len(weights))
    return spec, state


def check_tied(weights: dict[str, Tensor], folder: Path) -> None:
    """A config that ties the LM head but whose weights repeat `lm_head.weight` must repeat
    `model.embed_tokens.weight` exactly; raises HFFolderError naming tie_word_embeddings.
    `weights` are a causal LM's own keys (hf_llava passes its language model's)."""
    embed, head = weights.get("model.embed_tokens.weight"), weights["lm_head.weight"]
    if embed is not None and not torch.equal(embed, head):
        raise HFFolderError(
            folder / CONFIG_FILE,
            "true, but the weights hold an lm_head.weight that differs from "
            "model.embed_tokens.weight; set it to false to keep both",
            field="tie_word_embeddings",
        )


def load_hf_decoder(path: str | Path, dtype: torch.dtype | None = None) -> Decoder:
    """A `Decoder` holding the weights of the HF folder at `path` (in `dtype` if given)."""
    spec, state = read_hf_decoder(path)
    if dtype is not None:
        state = {k: t.to(dtype) for k, t in state.items()}
    with torch.device("meta"):  # no random init: every tensor is replaced
        model = Decoder(spec)
    model.load_state_dict(state, strict=True, assign=True)
    return model


# ----------------------------------------------------------------------------- writing
def hf_architecture(spec: DecoderSpec) -> str:
    """Qwen2 is Llama with q/k/v biases: the spec's `qkv_bias` picks the class."""
    return "Qwen2ForCausalLM" if spec.qkv_bias else "LlamaForCausalLM"


def _rope_config(spec: DecoderSpec) -> dict[str, Any]:
    """Rotary fields in both spellings: transformers 5's `rope_parameters`, and `rope_theta`
    plus `rope_scaling` for transformers 4 (transformers 5 reads them as the same values)."""
    scaling = None
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        scaling = {"rope_type": s.rope_type, "factor": s.factor}
        if s.rope_type == "llama3":
            scaling.update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": spec.rope_theta}
    return {"rope_parameters": parameters, "rope_theta": spec.rope_theta, "rope_scaling": scaling}


def hf_config(spec: DecoderSpec, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for `spec` as transformers' Llama / Qwen2 class reads it."""
    arch = hf_architecture(spec)
    eos = list(spec.eos_ids)
    config = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.width,
        "intermediate_size": spec.mlp_hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": spec.rms_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": spec.bos_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        **_rope_config(spec),
        # transformers 5 reads `dtype`, 4 `torch_dtype`
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch == "LlamaForCausalLM":
        return {**config, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    return {**config, "use_sliding_window": False, "sliding_window": None}


def export_groups(spec: DecoderSpec, prefix: str = "") -> list[KeyGroup]:
    """The key map as `KeyGroup`s (ours `prefix + name`): a row split along dim 0 is a split
    of the row-major flat tensor, which is what `hf_common.stream_groups` does."""
    return [KeyGroup(((prefix + p.ours, p.shape()),), p.theirs) for p in key_map(spec)]


def check_decoder_state(meta: Mapping[str, Tensor], groups: list[KeyGroup], prefix: str) -> None:
    """CheckpointMismatch listing every tensor under `prefix` that does not fit the spec."""
    check_keys(
        {k: t for k, t in meta.items() if k.startswith(prefix)},
        {name: shape for g in groups for name, shape in g.ours},
        what="the state dict does not match the decoder spec",
        hint="Export with the spec the model was built from.",
    )


def write_hf_decoder(
    spec: DecoderSpec,
    state: Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    prefix: str = "",
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a HF folder for `Decoder(spec)`'s state dict, its tensors named `prefix + name`
    in `state` (in memory, or a lazy reader of a model folder: then one tensor is read at a
    time): model.safetensors or shards of at most `max_shard_bytes` with the index, then
    config.json, each atomically (config.json last: a folder that has it has its weights).
    Returns the folder."""
    groups = export_groups(spec, prefix)
    meta = meta_state(state)
    check_decoder_state(meta, groups, prefix)
    config = hf_config(spec, meta[prefix + "embed.weight"].dtype)
    return write_hf_groups(
        out_dir, state, groups, config, hf_architecture(spec), max_shard_bytes=max_shard_bytes
    )


def save_hf_decoder(model: Decoder, out_dir: str | Path) -> Path:
    """`write_hf_decoder` for a built model."""
    return write_hf_decoder(model.spec, model.state_dict(), out_dir)
