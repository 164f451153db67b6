"""What a diffusers denoiser computes and keeps at a planned sample, traced without its weights.

The diffusers transformer of a pipeline (Wan 2.1's WanTransformer3DModel, FLUX.1's
FluxTransformer2DModel, SD3's SD3Transformer2DModel, LTX-Video's LTXVideoTransformer3DModel,
CogVideoX's CogVideoXTransformer3DModel, HunyuanVideo's HunyuanVideoTransformer3DModel) is built
from its config.json on the meta device and one training step's forward runs at the planned
latent: the noisy latent of a sample of frames x height x width pixels after the pipeline's VAE
(hub_spec.DENOISER_FAMILIES: its factors in time and space and its channels), the text
encoders' outputs as the pipeline feeds them (shapes from the config's text widths and the
pipeline's token count, with the masks, pooled vectors, guidance scale and rotary positions the
pipeline passes: `FEEDS`), the timestep, and the loss: the mean squared error of the prediction
against its target (flow matching's velocity; CogVideoX's v-prediction is the same shape). As
models/hub/trace.py does for a transformers model, torch's FLOP counter counts the forward
FLOPs per block and the saved-tensor hooks what autograd keeps, per block, per attention module
and outside the blocks.

Towers: a denoiser is one tower, `denoiser`, whose blocks are the class's `_no_split_modules`
or `_repeated_blocks` (Wan's 40 `blocks`, SD3's joint `transformer_blocks`); a class with a
second kind of block (FLUX's 38 single-stream blocks after its 19 double-stream ones,
HunyuanVideo's 40 after its 20) gets a second tower, `denoiser_single`, holding those blocks
only, so each tower's blocks are alike (the planner sizes FSDP units, LoRA adapters and
checkpointing per block). Everything outside the blocks (patch embedding, timestep and text
projections, HunyuanVideo's token refiner, final norm and projection, the loss) is the first
tower's.

The trace runs in float32 (the planner prices the float elements at the plan's precision);
traces are cached as trace.py's, under `$MMTRAIN_CACHE/traces/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from mmtrain.hub_spec import (
    DENOISER_FAMILIES,
    TRACE_VERSION,
    HubShape,
    HubTrace,
    Saved,
    TowerTrace,
)
from mmtrain.models.hub import trace as hub_trace
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
DENOISER_TOWER = "denoiser"
# Bumped when what a denoiser trace counts changes (2: the single-stream blocks' text slices
# counted once under full checkpointing), so traces cached before are redone.
DENOISER_TRACE_VERSION = 2


class DenoiserError(FieldError):
    """A denoiser folder or row the planner cannot trace; `path` names the flag or file."""


# ----------------------------------------------------------------------------- building
def denoiser_config(folder: Path) -> dict[str, Any]:
    """The transformer's config.json of `folder` (a transformer folder or a preset)."""
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DenoiserError("--model", f"{path}: cannot read it as JSON ({err})") from None
    name = config.get("_class_name") if isinstance(config, dict) else None
    if name not in DENOISER_FAMILIES:
        raise DenoiserError(
            "--model",
            f"{path}: _class_name {name!r} is not a denoiser the planner traces yet; supported: "
            f"{', '.join(DENOISER_FAMILIES)}",
        )
    return config


def build_denoiser(folder: Path, device: str = "meta") -> nn.Module:
    """diffusers' own class built from `folder`'s config.json on `device` (float32)."""
    import diffusers

    config = denoiser_config(folder)
    cls = getattr(diffusers, config["_class_name"])
    with torch.device(device):
        return cls.from_config(config)


def _block_lists(transformer: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The transformer's lists of blocks (children whose blocks are `_no_split_modules` or
    `_repeated_blocks`: LTX-Video's class names its blocks only there), in the order its
    forward runs them."""
    kinds = {*(getattr(transformer, "_no_split_modules", None) or ()),
             *(getattr(transformer, "_repeated_blocks", None) or ())}  # fmt: skip
    return [
        (name, child)
        for name, child in transformer.named_children()
        if isinstance(child, nn.ModuleList) and len(child) and type(child[0]).__name__ in kinds
    ]


def _tower_name(index: int, attribute: str) -> str:
    if index == 0:
        return DENOISER_TOWER
    kind = attribute.removesuffix("_blocks").removesuffix("_transformer")
    return f"{DENOISER_TOWER}_{kind}"


class _Tower:
    """The parts of a denoiser one tower holds (what models/hub/trace.py's recorder hooks)."""

    def __init__(self, name: str, parts: dict[str, nn.Module], blocks: nn.ModuleList):
        self.name, self.parts, self.blocks = name, parts, blocks


class DenoiserStep(nn.Module):
    """One training step's forward: the transformer's prediction at the noisy latent and the
    flow-matching loss against the velocity target (mean squared error)."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.transformer = transformer

    def forward(self, inputs: dict[str, Tensor], target: Tensor) -> Tensor:
        prediction = self.transformer(**inputs, return_dict=False)[0]
        error = prediction.float() - target.float()
        return (error * error).mean()


def towers_of(step: DenoiserStep) -> dict[str, _Tower]:
    lists = _block_lists(step.transformer)
    if not lists:
        raise DenoiserError("--model", f"{type(step.transformer).__name__} has no blocks to plan")
    towers = {}
    for i, (attribute, blocks) in enumerate(lists):
        name = _tower_name(i, attribute)
        towers[name] = _Tower(name, {"": step} if i == 0 else {}, blocks)
    return towers


# ----------------------------------------------------------------------------- inputs
# What each family's pipeline feeds its transformer for one sample, read off the pipeline's
# __call__ in diffusers: `(config, shape, latent, make) -> (inputs, target)`, `latent` the VAE
# latent ([C, T, H, W] of a video, [C, H, W] of an image), `make(*size)` a float tensor (masks
# and integer timesteps are made on its device). What is counted depends on the inputs' shapes
# and dtypes only; values the pipeline fixes (frame rate, rotary tables) are the pipeline's.
InputsOf = Callable[[Any, HubShape, tuple[int, ...], Callable[..., Tensor]], tuple[dict, Tensor]]
LTX_FRAME_RATE = 25  # LTXPipeline's default frame_rate: it scales the rotary positions in time
COGVIDEOX_TIMESTEP = 500  # one of the DDIM scheduler's integer timesteps (the dtype is what counts)


def _takes(config: Any, width: int) -> None:
    """Refuse a transformer whose input is not `width`, the latent channels per token its
    text-to-video or text-to-image pipeline feeds (an image-to-video, fill or control variant
    concatenates a condition latent to it)."""
    if config.in_channels != width:
        raise DenoiserError(
            "--model",
            f"{config['_class_name']} with in_channels {config.in_channels}: its text-to-video "
            f"or text-to-image pipeline feeds it {width} latent channels per token (an "
            "image-to-video, fill or control variant widens its input: not planned yet)",
        )


def _wan_inputs(config: Any, shape: HubShape, latent: tuple[int, ...], make: Callable) -> tuple:
    """WanPipeline: the latent [1, C, T, H, W], the timestep, UMT5's hidden states."""
    _takes(config, latent[0])
    inputs = {"hidden_states": make(1, *latent), "timestep": make(1),
              "encoder_hidden_states": make(1, shape.positions, config.text_dim)}  # fmt: skip
    return inputs, make(1, *latent)


def _flux_inputs(config: Any, shape: HubShape, latent: tuple[int, ...], make: Callable) -> tuple:
    """FluxPipeline: 2 x 2 latent pixels packed per token, T5's hidden states, CLIP-L's pooled
    vector, the timestep, the positions of both, and FLUX-dev's guidance scale."""
    channels, h, w = latent
    _takes(config, channels * 4)
    tokens, text = (h // 2) * (w // 2), shape.positions
    inputs = {
        "hidden_states": make(1, tokens, channels * 4),
        "encoder_hidden_states": make(1, text, config.joint_attention_dim),
        "pooled_projections": make(1, config.pooled_projection_dim),
        "timestep": make(1),
        "img_ids": make(tokens, 3),
        "txt_ids": make(text, 3),
    }
    if config.guidance_embeds:
        inputs["guidance"] = make(1)
    return inputs, make(1, tokens, channels * 4)


def _sd3_inputs(config: Any, shape: HubShape, latent: tuple[int, ...], make: Callable) -> tuple:
    """StableDiffusion3Pipeline: the latent [1, C, H, W], the CLIPs' and T5's hidden states
    (one sequence), the pooled CLIPs, the timestep."""
    _takes(config, latent[0])
    grid = max(latent[1:]) // config.patch_size
    if config.pos_embed_max_size is not None and grid > config.pos_embed_max_size:
        raise DenoiserError(
            "--height/--width",
            f"SD3Transformer2DModel's position table holds {config.pos_embed_max_size} patches "
            f"a side; {shape.image_height}x{shape.image_width} px needs {grid}",
        )
    inputs = {"hidden_states": make(1, *latent),
              "encoder_hidden_states": make(1, shape.positions, config.joint_attention_dim),
              "pooled_projections": make(1, config.pooled_projection_dim),
              "timestep": make(1)}  # fmt: skip
    return inputs, make(1, *latent)


def _ltx_inputs(config: Any, shape: HubShape, latent: tuple[int, ...], make: Callable) -> tuple:
    """LTXPipeline: the latent packed into tokens ([1, T x H x W, C] at its 1 x 1 x 1 patch),
    T5's hidden states with their boolean mask, the timestep, the latent's frames, height and
    width and the rotary positions' scale (the VAE's factors over the frame rate)."""
    channels, frames, h, w = latent
    p, p_t = config.patch_size, config.patch_size_t
    tokens, width = (frames // p_t) * (h // p) * (w // p), channels * p_t * p * p
    _takes(config, width)
    noisy = make(1, tokens, width)
    family = DENOISER_FAMILIES["LTXVideoTransformer3DModel"]
    inputs = {
        "hidden_states": noisy,
        "encoder_hidden_states": make(1, shape.positions, config.caption_channels),
        "timestep": make(1),
        "encoder_attention_mask": torch.ones(1, shape.positions, dtype=torch.bool,
                                             device=noisy.device),
        "num_frames": frames,
        "height": h,
        "width": w,
        "rope_interpolation_scale": (family.temporal / LTX_FRAME_RATE, family.spatial,
                                     family.spatial),
    }  # fmt: skip
    return inputs, make(1, tokens, config.out_channels * p_t * p * p)


def _cogvideox_inputs(
    config: Any, shape: HubShape, latent: tuple[int, ...], make: Callable
) -> tuple:
    """CogVideoXPipeline: the latent frames first ([1, T, C, H, W]), T5's hidden states, the
    DDIM scheduler's integer timestep and (CogVideoX-5B) the 3-D rotary tables the pipeline
    computes for the latent's patch grid."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    if config.patch_size_t is not None:
        raise DenoiserError(
            "--model",
            "CogVideoXTransformer3DModel with patch_size_t (CogVideoX 1.5) is not traced yet; "
            "CogVideoX 1.0 (patch_size_t null, as CogVideoX-5B) is",
        )
    channels, frames, h, w = latent
    _takes(config, channels)
    noisy = make(1, frames, channels, h, w)
    inputs = {
        "hidden_states": noisy,
        "encoder_hidden_states": make(1, shape.positions, config.text_embed_dim),
        "timestep": torch.full((1,), COGVIDEOX_TIMESTEP, dtype=torch.long, device=noisy.device),
    }
    if config.use_rotary_positional_embeddings:
        p = config.patch_size
        grid = (h // p, w // p)
        crops = get_resize_crop_region_for_grid(
            grid, config.sample_width // p, config.sample_height // p
        )
        inputs["image_rotary_emb"] = get_3d_rotary_pos_embed(
            embed_dim=config.attention_head_dim, crops_coords=crops, grid_size=grid,
            temporal_size=frames, device=noisy.device,
        )  # fmt: skip
    return inputs, make(1, frames, channels, h, w)


def _hunyuan_inputs(config: Any, shape: HubShape, latent: tuple[int, ...], make: Callable) -> tuple:
    """HunyuanVideoPipeline: the latent [1, C, T, H, W], the timestep, the Llama encoder's
    hidden states (the prompt template's tokens cropped) with their mask (cast to the
    transformer's dtype), CLIP-L's pooled vector and the embedded guidance scale."""
    _takes(config, latent[0])
    noisy = make(1, *latent)
    inputs = {
        "hidden_states": noisy,
        "timestep": make(1),
        "encoder_hidden_states": make(1, shape.positions, config.text_embed_dim),
        "encoder_attention_mask": torch.ones(1, shape.positions, dtype=noisy.dtype,
                                             device=noisy.device),
        "pooled_projections": make(1, config.pooled_projection_dim),
        "guidance": make(1),
    }  # fmt: skip
    return inputs, make(1, *latent)


@dataclass(frozen=True)
class Feed:
    """How a family's pipeline feeds its transformer: the inputs, and whether the text tokens
    join the blocks' attention sequence (an MMDiT's joint attention) or enter through a
    cross-attention (Wan, LTX)."""

    inputs: InputsOf
    joint_text: bool


FEEDS = {
    "WanTransformer3DModel": Feed(_wan_inputs, joint_text=False),
    "FluxTransformer2DModel": Feed(_flux_inputs, joint_text=True),
    "SD3Transformer2DModel": Feed(_sd3_inputs, joint_text=True),
    "LTXVideoTransformer3DModel": Feed(_ltx_inputs, joint_text=False),
    "CogVideoXTransformer3DModel": Feed(_cogvideox_inputs, joint_text=True),
    "HunyuanVideoTransformer3DModel": Feed(_hunyuan_inputs, joint_text=True),
}


def sample_inputs(
    transformer: nn.Module, shape: HubShape, make: Callable[..., Tensor]
) -> tuple[dict[str, Any], Tensor, tuple[int, ...]]:
    """The forward's inputs for one sample at `shape` (each float tensor made by `make(*size)`),
    the target, and the VAE latent's shape."""
    name = type(transformer).__name__
    try:
        latent = DENOISER_FAMILIES[name].latent(shape.frames, shape.image_height, shape.image_width)
    except ValueError as err:
        raise DenoiserError("--frames/--height/--width", str(err)) from None
    inputs, target = FEEDS[name].inputs(transformer.config, shape, latent, make)
    return inputs, target, latent


def _meta(*size: int) -> Tensor:
    return torch.empty(size, device="meta")


# ----------------------------------------------------------------------------- the trace
def trace_denoiser(folder: Path, shape: HubShape, *, cache: bool = True) -> HubTrace:
    """The trace of `folder`'s denoiser at `shape`; from the cache when it holds it."""
    return hub_trace.cached_trace(_cache_path(folder, shape), cache, lambda: _trace(folder, shape))


def _cache_path(folder: Path, shape: HubShape) -> Path:
    config = json.dumps(denoiser_config(folder), sort_keys=True)
    key = (f"denoiser|{config}|{shape.key()}|v{TRACE_VERSION}.{DENOISER_TRACE_VERSION}|"
           f"torch {torch.__version__}")  # fmt: skip
    return hub_trace.cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _trace(folder: Path, shape: HubShape) -> HubTrace:
    transformer = build_denoiser(folder, "meta")
    step = DenoiserStep(transformer)
    towers = towers_of(step)
    inputs, target, latent = sample_inputs(transformer, shape, _meta)
    recorder = hub_trace.Recorder(step, towers)
    flops = hub_trace.flop_counter()
    with recorder.attributing(), flops, hub_trace.FlashOnMeta():
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            loss = step(inputs, target)
        held = recorder.held()
    reached = hub_trace.reached_parameters(loss)
    del loss
    counts = hub_trace.flops_by_module(flops, step)
    names = {id(m): n for n, m in step.named_modules()}
    others = {name: sum(counts.get(names[id(b)], 0) for b in t.blocks)
              for name, t in towers.items() if name != DENOISER_TOWER}  # fmt: skip
    forward = {DENOISER_TOWER: counts.get("", 0) - sum(others.values()), **others}
    family = DENOISER_FAMILIES[type(transformer).__name__]
    joint = shape.positions if FEEDS[type(transformer).__name__].joint_text else 0
    traced = []
    for name, tower in towers.items():
        t = _tower_trace(tower, held, counts, recorder, names, forward[name], joint)
        inside = [p for b in tower.blocks for p in b.parameters()]
        mine = inside if name != DENOISER_TOWER else _first_tower_params(step, towers)
        traced.append(_with_params(t, tower, mine, reached, transformer))
    return HubTrace(
        architecture=type(transformer).__name__,
        shape=shape,
        towers=tuple(traced),
        image_tokens=family.tokens(latent),
        latent_shape=latent,
    )


def _first_tower_params(step: DenoiserStep, towers: dict[str, _Tower]) -> list[nn.Parameter]:
    """The first tower's parameters: all but the other towers' blocks'."""
    others = {id(p) for name, t in towers.items() if name != DENOISER_TOWER
              for b in t.blocks for p in b.parameters()}  # fmt: skip
    return [p for p in step.parameters() if id(p) not in others]


def _tower_trace(
    tower: _Tower,
    held: list[tuple[Tensor, tuple]],
    counts: dict[str, int],
    recorder: Any,
    names: dict[int, str],
    forward: int,
    joint_text: int,
) -> TowerTrace:
    blocks = len(tower.blocks)
    mine = [(t, w) for t, w in held if w[0] == tower.name]
    saved = hub_trace.saved_of
    inputs = recorder.block_inputs[tower.name]
    attn_inputs = recorder.attention_inputs[tower.name]
    return TowerTrace(
        name=tower.name,
        tokens=hub_trace.tokens_of(inputs[0]) + joint_text if inputs else 0,
        forward_flops=forward,
        block_flops=tuple(counts.get(names[id(b)], 0) for b in tower.blocks),
        block_saved=tuple(saved([t for t, w in mine if w[1] == i]) for i in range(blocks)),
        attention_saved=tuple(
            saved([t for t, w in mine if w[1] == i and w[2]]) for i in range(blocks)
        ),
        attention_input=attn_inputs[0].numel() if attn_inputs else 0,
        block_input=inputs[0].numel() if inputs else 0,
        shared_inputs=_shared_inputs(recorder, tower.name),
        outside=saved([t for t, w in mine if w[1] is None]),
    )


def _shared_inputs(recorder: Any, tower: str) -> Saved:
    """What the blocks' inputs other than their hidden states hold, once each (full
    checkpointing keeps them beside each block's hidden-state input). An input that is a view
    into a block's hidden-state input's storage counts its own elements only: a single-stream
    block (FLUX's, HunyuanVideo's) returns its text and image tokens as two slices of one joint
    sequence, and the image slice's elements are counted per block already."""
    hidden = {StorageWeakRef(t.untyped_storage()).cdata for t in recorder.block_inputs[tower]}
    apart, views = [], Saved()
    for t in recorder.shared[tower].values():
        if StorageWeakRef(t.untyped_storage()).cdata not in hidden:
            apart.append(t)
        elif t.dtype.is_floating_point:
            views += Saved(t.numel(), 0)
        else:
            views += Saved(0, t.numel() * t.element_size())
    return hub_trace.saved_of(apart) + views


def _with_params(
    t: TowerTrace, tower: _Tower, params: list[nn.Parameter], reached: set[int], hf: nn.Module
) -> TowerTrace:
    """`t` with the tower's parameters, one block's linears by LoRA group and its shape."""
    from dataclasses import replace

    first = tower.blocks[0]
    in_blocks = {id(p) for b in tower.blocks for p in b.parameters()}
    config = hf.config
    linears = _linears(first)
    return replace(
        t,
        params=sum(p.numel() for p in params),
        unused_params=sum(p.numel() for p in params if id(p) not in reached),
        block_params=sum(p.numel() for p in first.parameters()),
        stem_params=sum(p.numel() for p in params if id(p) not in in_blocks),
        norm_params=_norm_params(tower, params),
        linears=linears,
        width=int(config.num_attention_heads * config.attention_head_dim),
        heads=int(config.num_attention_heads),
        kv_heads=int(config.num_attention_heads),
        head_dim=int(config.attention_head_dim),
        mlp_hidden=max((max(o, i) for g, o, i in linears if g == "mlp"), default=0),
    )


def _linears(block: nn.Module) -> tuple[tuple[str, int, int], ...]:
    """(group, out, in) of a block's linears: "attn" in its attention modules (q, k, v, out of
    each stream, a Wan block's cross-attention too), "mlp" its feed-forward (and a FLUX single
    block's MLP and output projections), "modulation" its adaLN projections, which LoRA's
    `attn` and `mlp` targets leave alone."""
    out = []
    for name, module in block.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        head = name.split(".")[0]
        if head.rstrip("0123456789") == "attn":
            group = "attn"
        elif head.startswith(("ff", "proj_")):
            group = "mlp"
        else:
            group = "modulation"
        out.append((group, module.out_features, module.in_features))
    return tuple(out)


def _norm_params(tower: _Tower, params: list[nn.Parameter]) -> int:
    """Of `params`, those of norms (held in fp32 when frozen under autocast)."""
    mine = {id(p) for p in params}
    roots = [*tower.parts.values(), *tower.blocks]
    seen: set[int] = set()
    total = 0
    for root in roots:
        for module in root.modules():
            if "norm" not in type(module).__name__.lower():
                continue
            for p in module.parameters(recurse=False):
                if id(p) in mine and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


# ----------------------------------------------------------------------------- measured
def measure_denoiser_step(folder: Path, shape: HubShape, seed: int = 0) -> dict[str, int]:
    """One real training forward and backward of `folder`'s denoiser on the CPU in float32 at
    `shape`, random weights and inputs: the float elements autograd keeps (deduplicated by
    storage, parameters left out, held at the end of the forward) and the forward FLOPs; what
    the trace must equal."""
    torch.manual_seed(seed)
    transformer = build_denoiser(folder, "cpu")
    step = DenoiserStep(transformer)
    generator = torch.Generator().manual_seed(seed)

    def make(*size: int) -> Tensor:
        return torch.randn(size, generator=generator)

    inputs, target, _ = sample_inputs(transformer, shape, make)
    recorder = hub_trace.Recorder(step, towers_of(step))
    flops = hub_trace.flop_counter()
    with flops, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        loss = step(inputs, target)
    saved = hub_trace.saved_of([t for t, _ in recorder.held()])
    loss.backward()
    return {
        "float_elements": saved.floats,
        "other_bytes": saved.other_bytes,
        "forward_flops": int(flops.get_total_flops()),
        "trained_params": sum(p.numel() for p in step.parameters() if p.grad is not None),
    }
