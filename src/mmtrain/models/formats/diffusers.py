"""diffusers folders <-> mmtrain: the DiT of `DiTTransformer2DModel` and the autoencoder of
`AutoencoderKL` (config.json + diffusion_pytorch_model.safetensors, or shards with their
index). The autoencoder (models/vae.py) keeps diffusers' own names: its mapping renames nothing.
SD3's `SD3Transformer2DModel` (an MMDiT) has its mapping in diffusers_sd3.py; the readers and
writers of denoisers here dispatch to it by the folder's class or the spec's architecture.

One mapping, tested against diffusers' own forward: the numbers are the same under other
names, with two differences of layout. diffusers' attention has separate q, k and v
projections (ours are one `qkv`, rows q, k, v), and every one of its blocks holds a copy of
the timestep MLP and the class table (`norm1.emb`; the final layer reads block 0's), where
DiT has one: reading takes block 0's copy and refuses a folder whose copies differ, writing
puts the same tensors in every block.

A DiT folder does not say how it was trained. Its learned-sigma output (out_channels = 2 x
in_channels) is DiT's DDPM with epsilon prediction; a `scheduler/scheduler_config.json` beside
the folder (a pipeline's layout) gives `prediction_type`; otherwise epsilon is assumed and said.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmtrain.denoiser_spec import TIMESTEP_FREQUENCIES, DenoiserSpec
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
from mmtrain.models.vae import AutoencoderKL, VaeConfig
from mmtrain.spec import ModelSpec

log = logging.getLogger(__name__)

DIT_CLASS = "DiTTransformer2DModel"
WEIGHTS_PREFIX = "diffusion_pytorch_model"
OURS = "towers.denoiser."
DIFFUSERS_VERSION = "0.42.1"  # the version the written config.json is laid out for
PREDICTIONS = {"epsilon": "epsilon", "v_prediction": "v"}


def is_diffusers_folder(path: str | Path) -> bool:
    """A folder whose config.json names a diffusers class (`_class_name`)."""
    config = Path(path) / CONFIG_FILE
    return config.is_file() and "_class_name" in read_json(config)


# ----------------------------------------------------------------------------- the key map
def _block_groups(d: DenoiserSpec, i: int) -> list[KeyGroup]:
    w, h = d.width, d.mlp_hidden()
    ours, theirs = f"{OURS}blocks.{i}.", f"transformer_blocks.{i}."
    pairs = [
        ("modulation", "norm1.linear", (6 * w, w)),
        ("attn.out", "attn1.to_out.0", (w, w)),
        ("mlp.fc1", "ff.net.0.proj", (h, w)),
        ("mlp.fc2", "ff.net.2", (w, h)),
    ]
    groups = [g for a, b, shape in pairs for g in _linear(ours + a, theirs + b, shape)]
    for kind, shape in (("weight", (w, w)), ("bias", (w,))):
        qkv = tuple((f"{theirs}attn1.to_{x}.{kind}", shape) for x in "qkv")
        groups.append(KeyGroup(((f"{ours}attn.qkv.{kind}", (3 * shape[0], *shape[1:])),), qkv))
    return groups


def _linear(ours: str, theirs: str, shape: tuple[int, ...]) -> list[KeyGroup]:
    return [
        KeyGroup(((f"{ours}.weight", shape),), ((f"{theirs}.weight", shape),)),
        KeyGroup(((f"{ours}.bias", shape[:1]),), ((f"{theirs}.bias", shape[:1]),)),
    ]


def _embedding_groups(d: DenoiserSpec, i: int) -> list[KeyGroup]:
    """Block i's copy of the timestep MLP and class table (ours: the one of the model)."""
    w, emb = d.width, f"transformer_blocks.{i}.norm1.emb."
    groups = _linear(
        f"{OURS}time_fc1", f"{emb}timestep_embedder.linear_1", (w, TIMESTEP_FREQUENCIES)
    )
    groups += _linear(f"{OURS}time_fc2", f"{emb}timestep_embedder.linear_2", (w, w))
    table = (d.num_classes + 1, w)
    groups.append(KeyGroup(((f"{OURS}classes.weight", table),),
                           ((f"{emb}class_embedder.embedding_table.weight", table),)))  # fmt: skip
    return groups


def dit_groups(d: DenoiserSpec) -> list[KeyGroup]:
    """Every tensor of diffusers' DiT with the tensor(s) of ours holding its numbers, in the
    order diffusers' state dict lists them."""
    w, p, c = d.width, d.patch_size, d.channels
    groups = [
        KeyGroup(((f"{OURS}patch.weight", (w, c, p, p)),), (("pos_embed.proj.weight", (w, c, p, p)),)),
        KeyGroup(((f"{OURS}patch.bias", (w,)),), (("pos_embed.proj.bias", (w,)),)),
    ]  # fmt: skip
    for i in range(d.layers):
        groups += _embedding_groups(d, i) + _block_groups(d, i)
    out = p * p * d.out_channels()
    groups += _linear(f"{OURS}modulation_out", "proj_out_1", (2 * w, w))
    groups += _linear(f"{OURS}out", "proj_out_2", (out, w))
    return groups


# ----------------------------------------------------------------------------- reading
def spec_from_dit_config(config: dict[str, Any], file: Path) -> ModelSpec:
    """The ModelSpec of a `DiTTransformer2DModel` config.json (HFFolderError naming the field
    for what mmtrain's DiT cannot express)."""
    s = Section(file, "", config)
    for key, wanted in (("norm_type", "ada_norm_zero"), ("activation_fn", "gelu-approximate")):
        if config.get(key, wanted) != wanted:
            raise s.error(key, f"mmtrain's DiT has {wanted}, got {config[key]!r}")
    if config.get("norm_elementwise_affine", False) or not config.get("attention_bias", True):
        raise s.error(
            "norm_elementwise_affine", "mmtrain's DiT has weightless norms and q/k/v biases"
        )
    heads, head_dim = s.get("num_attention_heads", int), s.get("attention_head_dim", int)
    channels = s.get("in_channels", int)
    out = config.get("out_channels") or channels
    if out not in (channels, 2 * channels):
        raise s.error("out_channels", f"{out} is neither in_channels ({channels}) nor twice it")
    if config.get("num_embeds_ada_norm") is None:
        raise s.error("num_embeds_ada_norm", "a DiT is class-conditional: give the class count")
    prediction = _prediction(file.parent)
    denoiser = DenoiserSpec(
        sample_size=s.get("sample_size", int),
        channels=channels,
        patch_size=s.get("patch_size", int),
        width=heads * head_dim,
        layers=s.get("num_layers", int),
        heads=heads,
        num_classes=s.get("num_embeds_ada_norm", int),
        learn_sigma=out == 2 * channels,
        prediction=prediction,
        input="latent" if channels == 4 else "image",
        mlp_norm_eps=float(config.get("norm_eps", 1e-5)),
    )
    name = file.parent.resolve().name
    return ModelSpec(name=name, embed_dim=denoiser.width, towers={}, objective="diffusion",
                     denoiser=denoiser)  # fmt: skip


def _prediction(folder: Path) -> str:
    scheduler = folder.parent / "scheduler" / "scheduler_config.json"
    if not scheduler.is_file():
        log.info("%s: no scheduler config beside it; DiT's epsilon prediction is assumed", folder)
        return "epsilon"
    kind = read_json(scheduler).get("prediction_type", "epsilon")
    if kind not in PREDICTIONS:
        raise HFFolderError(scheduler, f"{kind!r} is not one of {', '.join(PREDICTIONS)}",
                            field="prediction_type")  # fmt: skip
    return PREDICTIONS[kind]


def read_diffusers_dit(path: str | Path) -> tuple[ModelSpec, dict[str, Tensor]]:
    """(spec, state dict in our names) of a diffusers denoiser folder: a DiT, or SD3's MMDiT
    (diffusers_sd3.py); dtypes are kept."""
    # diffusers_sd3.py builds on this module: imported when needed, not while either loads
    from mmtrain.models.formats.diffusers_sd3 import SD3_CLASS, read_diffusers_sd3

    folder = Path(path)
    config = read_json(folder / CONFIG_FILE)
    if config.get("_class_name") == SD3_CLASS:
        return read_diffusers_sd3(folder)
    if config.get("_class_name") != DIT_CLASS:
        raise HFFolderError(folder / CONFIG_FILE, f"mmtrain reads {DIT_CLASS} or {SD3_CLASS}, "
                            f"got {config.get('_class_name')!r}", field="_class_name")  # fmt: skip
    spec = spec_from_dit_config(config, folder / CONFIG_FILE)
    groups = dit_groups(spec.denoiser)
    try:
        with open_weights(_weights_file(folder)) as reader:
            expected = {name: shape for g in groups for name, shape in g.theirs}
            check_keys(reader.meta_state(), expected, what="the weights do not match config.json",
                       hint="Were config.json and the safetensors files saved together?")  # fmt: skip
            state = _ours(reader, groups, folder)
    except WeightsFileError as err:
        raise HFFolderError(err.path, err.message) from None
    except CheckpointMismatch as err:
        raise HFFolderError(folder, str(err)) from None
    return spec, state


def _weights_file(folder: Path) -> Path:
    for name in (f"{WEIGHTS_PREFIX}.safetensors", f"{WEIGHTS_PREFIX}.safetensors.index.json"):
        if (folder / name).is_file():
            return folder / name
    raise HFFolderError(folder, f"has no {WEIGHTS_PREFIX}.safetensors (or its index); "
                        "pickled .bin weights are not read")  # fmt: skip


def _ours(reader: Mapping[str, Tensor], groups: list[KeyGroup], folder: Path) -> dict[str, Tensor]:
    """Our tensors from theirs: concatenated where a group has several; a tensor of ours that
    several groups give (the blocks' embedding copies) must get the same numbers from each."""
    state: dict[str, Tensor] = {}
    for group in groups:
        ((name, shape),) = group.ours
        parts = [reader[theirs] for theirs, _ in group.theirs]
        value = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(shape)
        if name in state:
            if not torch.equal(state[name], value):
                raise HFFolderError(folder, f"{group.theirs[0][0]} differs from block 0's copy: "
                                    "mmtrain's DiT has one timestep MLP and class table")  # fmt: skip
            continue
        state[name] = value
    return state


# ----------------------------------------------------------------------------- writing
def dit_config(spec: ModelSpec) -> dict[str, Any]:
    """The config.json of diffusers' DiT for `spec`; NoHFCounterpart where there is none."""
    d = spec.denoiser
    reasons = []
    if d is None:
        raise NoHFCounterpart(f"{spec.name} has no denoiser")
    if not d.num_classes:
        reasons.append("diffusers' DiT is class-conditional (num_classes > 0)")
    if d.norm_eps != 1e-6:
        reasons.append(f"its attention and output norms have eps 1e-6, not {d.norm_eps}")
    if d.mlp_ratio != 4.0:
        reasons.append(f"its MLP is 4x the width, not {d.mlp_ratio}x")
    if reasons:
        raise NoHFCounterpart(f"{spec.name}: " + "; ".join(reasons))
    return {
        "_class_name": DIT_CLASS,
        "_diffusers_version": DIFFUSERS_VERSION,
        "num_attention_heads": d.heads,
        "attention_head_dim": d.width // d.heads,
        "in_channels": d.channels,
        "out_channels": d.out_channels(),
        "num_layers": d.layers,
        "sample_size": d.sample_size,
        "patch_size": d.patch_size,
        "num_embeds_ada_norm": d.num_classes,
        "norm_eps": d.mlp_norm_eps,
        "activation_fn": "gelu-approximate",
        "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False,
        "attention_bias": True,
    }


def write_diffusers_dit(
    spec: ModelSpec,
    state: Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """diffusers' DiT folder (an MMDiT's: SD3's, diffusers_sd3.py) of the model
    `create_model(spec)` builds, from its state dict (in memory, or a lazy reader of a model
    folder, read one tensor at a time)."""
    if spec.denoiser is not None and spec.denoiser.is_mmdit():
        from mmtrain.models.formats.diffusers_sd3 import write_diffusers_sd3

        return write_diffusers_sd3(spec, state, out_dir, max_shard_bytes=max_shard_bytes)
    config = dit_config(spec)
    groups = dit_groups(spec.denoiser)
    expected = {name: shape for g in groups for name, shape in g.ours}
    check_keys(meta_state(state), expected, what="the weights do not fit the spec", hint="")
    return write_hf_groups(out_dir, state, groups, config, DIT_CLASS,
                           max_shard_bytes=max_shard_bytes, prefix=WEIGHTS_PREFIX)  # fmt: skip


# ----------------------------------------------------------------------------- the VAE
VAE_CLASS = "AutoencoderKL"
VAE_FIELDS = ("in_channels", "out_channels", "block_out_channels", "layers_per_block",
              "latent_channels", "norm_num_groups", "scaling_factor", "shift_factor",
              "mid_block_add_attention", "use_quant_conv", "use_post_quant_conv")  # fmt: skip


def vae_config_from(config: dict[str, Any], file: Path) -> VaeConfig:
    """The VaeConfig of an `AutoencoderKL` config.json (HFFolderError naming the field for
    what mmtrain's autoencoder does not build)."""
    s = Section(file, "", config)
    blocks = len(config.get("block_out_channels") or ())
    for key, wanted in (
        ("down_block_types", "DownEncoderBlock2D"),
        ("up_block_types", "UpDecoderBlock2D"),
    ):
        kinds = config.get(key) or [wanted] * blocks
        if any(kind != wanted for kind in kinds) or len(kinds) != blocks:
            raise s.error(key, f"mmtrain's autoencoder has {blocks} x {wanted}, got {kinds}")
    if config.get("act_fn", "silu") != "silu":
        raise s.error("act_fn", f"mmtrain's autoencoder uses silu, got {config['act_fn']!r}")
    values = {k: config[k] for k in VAE_FIELDS if config.get(k) is not None}
    values["block_out_channels"] = tuple(values.get("block_out_channels", ()))
    return VaeConfig(**values, extra={k: v for k, v in config.items() if k not in VAE_FIELDS})


def read_diffusers_vae(path: str | Path) -> AutoencoderKL:
    """The autoencoder of a diffusers `AutoencoderKL` folder, with its weights (dtypes kept)."""
    folder = Path(path)
    config = read_json(folder / CONFIG_FILE)
    if config.get("_class_name") != VAE_CLASS:
        raise HFFolderError(folder / CONFIG_FILE, f"mmtrain reads {VAE_CLASS} here, got "
                            f"{config.get('_class_name')!r}", field="_class_name")  # fmt: skip
    vae_config = vae_config_from(config, folder / CONFIG_FILE)
    with torch.device("meta"):
        vae = AutoencoderKL(vae_config)
    expected = {name: tuple(t.shape) for name, t in vae.state_dict().items()}
    try:
        with open_weights(_weights_file(folder)) as reader:
            check_keys(reader.meta_state(), expected, what="the weights do not match config.json",
                       hint="Were config.json and the safetensors files saved together?")  # fmt: skip
            state = {name: reader[name] for name in expected}
    except WeightsFileError as err:
        raise HFFolderError(err.path, err.message) from None
    except CheckpointMismatch as err:
        raise HFFolderError(folder, str(err)) from None
    vae.load_state_dict(state, assign=True)
    return vae


def write_diffusers_vae(vae: AutoencoderKL, out_dir: str | Path) -> Path:
    """The diffusers folder of `vae` (the same names: a rename of nothing)."""
    c = vae.config
    config = {**c.extra, "_class_name": VAE_CLASS, "_diffusers_version": DIFFUSERS_VERSION}
    config.update({k: getattr(c, k) for k in VAE_FIELDS})
    config["block_out_channels"] = list(c.block_out_channels)
    blocks = len(c.block_out_channels)
    config.setdefault("down_block_types", ["DownEncoderBlock2D"] * blocks)
    config.setdefault("up_block_types", ["UpDecoderBlock2D"] * blocks)
    state = vae.state_dict()
    groups = [KeyGroup(((k, tuple(t.shape)),), ((k, tuple(t.shape)),)) for k, t in state.items()]
    return write_hf_groups(out_dir, state, groups, config, VAE_CLASS, prefix=WEIGHTS_PREFIX)
