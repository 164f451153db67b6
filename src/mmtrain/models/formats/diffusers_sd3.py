"""diffusers' `SD3Transformer2DModel` folders <-> mmtrain's MMDiT (models/mmdit.py), through
the KeyGroups of diffusers.py (config.json + diffusion_pytorch_model.safetensors, or shards).

One mapping, tested against diffusers' own forward. The numbers are the same under other
names, with two differences of layout: diffusers' attention has separate q, k and v
projections for each stream (ours: one `qkv` and one `context_qkv`, rows q, k, v), and its
folder holds the fixed position table (`pos_embed.pos_embed`, the whole larger grid SD3 crops)
that ours computes: reading checks the folder's table is the one mmtrain computes (to the
rounding of its dtype) and refuses it otherwise; writing puts the computed table in.

What an SD3 folder does not say: how long its text is (the planner's `text_tokens`; SD3's
pipeline: 77 CLIP tokens and 256 T5 tokens, 333, assumed and said) and how it was trained (SD3
is rectified flow, the velocity). SD3.5's dual attention blocks (`dual_attention_layers`) are
not built by mmtrain and are refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmtrain.denoiser_spec import TIMESTEP_FREQUENCIES, DenoiserSpec
from mmtrain.models.dit import position_table
from mmtrain.models.formats.diffusers import (
    DIFFUSERS_VERSION,
    OURS,
    WEIGHTS_PREFIX,
    _linear,
    _ours,
    _weights_file,
)
from mmtrain.models.formats.hf_common import (
    CONFIG_FILE,
    HFFolderError,
    KeyGroup,
    NoHFCounterpart,
    Section,
    read_json,
    write_hf_groups,
)
from mmtrain.models.formats.keys import CheckpointMismatch, check_keys
from mmtrain.models.safetensors_files import (
    MAX_SHARD_BYTES,
    WeightsFileError,
    meta_state,
    open_weights,
)
from mmtrain.spec import ModelSpec

log = logging.getLogger(__name__)

SD3_CLASS = "SD3Transformer2DModel"
SD3_TEXT_TOKENS = 77 + 256  # SD3's pipeline: CLIP's 77 tokens, then T5's max_sequence_length
POSITIONS = "pos_embed.pos_embed"  # diffusers keeps SD3's position table in its state dict
QK_NORMS = {None: "none", "rms_norm": "rms_norm"}


# ----------------------------------------------------------------------------- the key map
def _fused(ours: str, theirs: tuple[str, ...], w: int) -> list[KeyGroup]:
    """Our fused q/k/v [3w, w] from three of theirs, weight and bias."""
    groups = []
    for kind, shape in (("weight", (w, w)), ("bias", (w,))):
        parts = tuple((f"{name}.{kind}", shape) for name in theirs)
        groups.append(KeyGroup(((f"{ours}.{kind}", (3 * shape[0], *shape[1:])),), parts))
    return groups


def _qk_norms(d: DenoiserSpec, ours: str, theirs: str) -> list[KeyGroup]:
    if d.qk_norm == "none":
        return []
    pairs = (("q_norm", "norm_q"), ("k_norm", "norm_k"),
             ("context_q_norm", "norm_added_q"), ("context_k_norm", "norm_added_k"))  # fmt: skip
    shape = (d.head_dim(),)
    return [KeyGroup(((f"{ours}attn.{a}.weight", shape),), ((f"{theirs}attn.{b}.weight", shape),))
            for a, b in pairs]  # fmt: skip


def _block_groups(d: DenoiserSpec, i: int) -> list[KeyGroup]:
    w, h = d.width, d.mlp_hidden()
    ours, theirs = f"{OURS}blocks.{i}.", f"transformer_blocks.{i}."
    pre_only = d.is_context_pre_only(i)
    pairs = [
        ("modulation", "norm1.linear", (6 * w, w)),
        ("context_modulation", "norm1_context.linear", ((2 if pre_only else 6) * w, w)),
        ("attn.out", "attn.to_out.0", (w, w)),
        ("mlp.fc1", "ff.net.0.proj", (h, w)),
        ("mlp.fc2", "ff.net.2", (w, h)),
    ]
    if not pre_only:  # the last block's text stream ends at the attention
        pairs += [
            ("attn.context_out", "attn.to_add_out", (w, w)),
            ("context_mlp.fc1", "ff_context.net.0.proj", (h, w)),
            ("context_mlp.fc2", "ff_context.net.2", (w, h)),
        ]
    groups = [g for a, b, shape in pairs for g in _linear(ours + a, theirs + b, shape)]
    attn = f"{theirs}attn."
    groups += _fused(f"{ours}attn.qkv", tuple(f"{attn}to_{x}" for x in "qkv"), w)
    groups += _fused(f"{ours}attn.context_qkv", tuple(f"{attn}add_{x}_proj" for x in "qkv"), w)
    return groups + _qk_norms(d, ours, theirs)


def sd3_groups(d: DenoiserSpec) -> list[KeyGroup]:
    """Every tensor of diffusers' SD3 transformer (its position table aside) with the tensor(s)
    of ours holding its numbers."""
    w, p, c = d.width, d.patch_size, d.channels
    groups = [
        KeyGroup(((f"{OURS}patch.weight", (w, c, p, p)),), (("pos_embed.proj.weight", (w, c, p, p)),)),
        KeyGroup(((f"{OURS}patch.bias", (w,)),), (("pos_embed.proj.bias", (w,)),)),
    ]  # fmt: skip
    embed = "time_text_embed."
    groups += _linear(f"{OURS}time_fc1", f"{embed}timestep_embedder.linear_1",
                      (w, TIMESTEP_FREQUENCIES))  # fmt: skip
    groups += _linear(f"{OURS}time_fc2", f"{embed}timestep_embedder.linear_2", (w, w))
    groups += _linear(f"{OURS}pooled_fc1", f"{embed}text_embedder.linear_1", (w, d.pooled_width))
    groups += _linear(f"{OURS}pooled_fc2", f"{embed}text_embedder.linear_2", (w, w))
    groups += _linear(f"{OURS}context_embed", "context_embedder", (w, d.text_width))
    for i in range(d.layers):
        groups += _block_groups(d, i)
    groups += _linear(f"{OURS}modulation_out", "norm_out.linear", (2 * w, w))
    groups += _linear(f"{OURS}out", "proj_out", (p * p * d.out_channels(), w))
    return groups


def positions_shape(d: DenoiserSpec) -> tuple[int, ...] | None:
    """The shape of the position table in an SD3 folder; None where there is none (diffusers
    keeps it only when it crops a larger grid)."""
    return (1, d.position_grid() ** 2, d.width) if d.pos_embed_max_size else None


def sd3_positions(d: DenoiserSpec) -> Tensor:
    side = d.position_grid()
    return position_table(d.width, side, side, d.grid())[None]


# ----------------------------------------------------------------------------- reading
def spec_from_sd3_config(config: dict[str, Any], file: Path) -> ModelSpec:
    """The ModelSpec of an `SD3Transformer2DModel` config.json (HFFolderError naming the field
    for what mmtrain's MMDiT cannot express)."""
    s = Section(file, "", config)
    if config.get("dual_attention_layers"):
        raise s.error("dual_attention_layers", "SD3.5's dual attention blocks are not built by "
                      f"mmtrain (got {config['dual_attention_layers']}); only () reads")  # fmt: skip
    qk_norm = config.get("qk_norm")
    if qk_norm not in QK_NORMS:
        raise s.error("qk_norm", f"mmtrain's MMDiT has none or rms_norm, got {qk_norm!r}")
    heads, head_dim = s.get("num_attention_heads", int), s.get("attention_head_dim", int)
    width = heads * head_dim
    if s.get("caption_projection_dim", int) != width:
        raise s.error("caption_projection_dim", f"{config['caption_projection_dim']} is not the "
                      f"width ({heads} x {head_dim}): the text stream has the image's width")  # fmt: skip
    channels = s.get("in_channels", int)
    if (config.get("out_channels") or channels) != channels:
        raise s.error("out_channels", f"{config['out_channels']} is not in_channels ({channels})")
    max_size = config.get("pos_embed_max_size") or 0
    log.info("%s: text of %d tokens assumed (SD3's 77 CLIP + 256 T5)", file, SD3_TEXT_TOKENS)
    denoiser = DenoiserSpec(
        architecture="mmdit",
        sample_size=s.square("sample_size"),
        channels=channels,
        patch_size=s.get("patch_size", int),
        width=width,
        layers=s.get("num_layers", int),
        heads=heads,
        text_width=s.get("joint_attention_dim", int),
        pooled_width=s.get("pooled_projection_dim", int),
        text_tokens=SD3_TEXT_TOKENS,
        qk_norm=QK_NORMS[qk_norm],
        pos_embed_max_size=int(max_size),
        prediction="velocity",
        input="image" if channels == 3 else "latent",
    )
    name = file.parent.resolve().name
    return ModelSpec(name=name, embed_dim=width, towers={}, objective="flow_matching",
                     denoiser=denoiser)  # fmt: skip


def read_diffusers_sd3(path: str | Path) -> tuple[ModelSpec, dict[str, Tensor]]:
    """(spec, state dict in our names) of a diffusers SD3 transformer folder; dtypes kept."""
    folder = Path(path)
    file = folder / CONFIG_FILE
    spec = spec_from_sd3_config(read_json(file), file)
    d = spec.denoiser
    groups = sd3_groups(d)
    expected = {name: shape for g in groups for name, shape in g.theirs}
    if positions_shape(d) is not None:
        expected[POSITIONS] = positions_shape(d)
    try:
        with open_weights(_weights_file(folder)) as reader:
            check_keys(reader.meta_state(), expected, what="the weights do not match config.json",
                       hint="Were config.json and the safetensors files saved together?")  # fmt: skip
            if POSITIONS in expected:
                _check_positions(reader[POSITIONS], d, folder)
            state = _ours(reader, groups, folder)
    except WeightsFileError as err:
        raise HFFolderError(err.path, err.message) from None
    except CheckpointMismatch as err:
        raise HFFolderError(folder, str(err)) from None
    return spec, state


def _check_positions(table: Tensor, d: DenoiserSpec, folder: Path) -> None:
    """The folder's position table must be the sine-cosine one mmtrain computes, up to the
    rounding of the dtype it was saved in (values in [-1, 1]: a few units of its eps)."""
    tolerance = 4 * torch.finfo(table.dtype).eps
    error = (table.double() - sd3_positions(d).double()).abs().max().item()
    if error > tolerance:
        raise HFFolderError(folder, f"{POSITIONS} is not SD3's sine-cosine table (off by {error:.3g}; "
                            "mmtrain computes its positions and cannot keep others)")  # fmt: skip


# ----------------------------------------------------------------------------- writing
def sd3_config(spec: ModelSpec) -> dict[str, Any]:
    """The config.json of diffusers' SD3 transformer for `spec`; NoHFCounterpart where there
    is none."""
    d = spec.denoiser
    if d is None or not d.is_mmdit():
        raise NoHFCounterpart(f"{spec.name} has no MMDiT")
    reasons = []
    if d.norm_eps != 1e-6 or d.mlp_norm_eps != 1e-6:
        reasons.append(f"its norms have eps 1e-6, not {d.norm_eps} / {d.mlp_norm_eps}")
    if d.mlp_ratio != 4.0:
        reasons.append(f"its MLP is 4x the width, not {d.mlp_ratio}x")
    if reasons:
        raise NoHFCounterpart(f"{spec.name}: " + "; ".join(reasons))
    return {
        "_class_name": SD3_CLASS,
        "_diffusers_version": DIFFUSERS_VERSION,
        "sample_size": d.sample_size,
        "patch_size": d.patch_size,
        "in_channels": d.channels,
        "out_channels": d.out_channels(),
        "num_layers": d.layers,
        "attention_head_dim": d.head_dim(),
        "num_attention_heads": d.heads,
        "joint_attention_dim": d.text_width,
        "caption_projection_dim": d.width,
        "pooled_projection_dim": d.pooled_width,
        "pos_embed_max_size": d.pos_embed_max_size or None,
        "dual_attention_layers": [],
        "qk_norm": None if d.qk_norm == "none" else d.qk_norm,
    }


class _WithPositions(Mapping):
    """A state dict (or a lazy reader) plus the computed position table under one more name."""

    def __init__(self, source: Mapping[str, Tensor], name: str, table: Tensor):
        self.source, self.name, self.table = source, name, table

    def meta_state(self) -> dict[str, Tensor]:
        return {**meta_state(self.source), self.name: self.table.to("meta")}

    def __getitem__(self, key: str) -> Tensor:
        return self.table if key == self.name else self.source[key]

    def __iter__(self) -> Iterator[str]:
        yield from self.source
        yield self.name

    def __len__(self) -> int:
        return len(self.source) + 1


def write_diffusers_sd3(
    spec: ModelSpec,
    state: Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """diffusers' SD3 transformer folder of the MMDiT `create_model(spec)` builds, from its
    state dict (in memory, or a lazy reader of a model folder, read one tensor at a time)."""
    config = sd3_config(spec)
    d = spec.denoiser
    groups = sd3_groups(d)
    expected = {name: shape for g in groups for name, shape in g.ours}
    check_keys(meta_state(state), expected, what="the weights do not fit the spec", hint="")
    if positions_shape(d) is not None:
        ours = "(the computed positions)"
        dtype = meta_state(state)[f"{OURS}patch.weight"].dtype
        state = _WithPositions(state, ours, sd3_positions(d).to(dtype))
        shape = positions_shape(d)
        groups = [KeyGroup(((ours, shape),), ((POSITIONS, shape),)), *groups]
    return write_hf_groups(out_dir, state, groups, config, SD3_CLASS,
                           max_shard_bytes=max_shard_bytes, prefix=WEIGHTS_PREFIX)  # fmt: skip
