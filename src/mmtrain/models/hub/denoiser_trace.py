"""What a diffusers denoiser computes and keeps at a planned sample, traced without its weights.

The diffusers transformer of a pipeline (Wan 2.1's WanTransformer3DModel, FLUX.1's
FluxTransformer2DModel, SD3's SD3Transformer2DModel) is built from its config.json on the meta
device and one training step's forward runs at the planned latent: the noisy latent of a sample
of frames x height x width pixels after the pipeline's VAE (hub_spec.DENOISER_FAMILIES: Wan 4x
in time, 1 + (F - 1) / 4 latent frames, all 8x in space, 16 channels), the text encoders'
outputs as the pipeline feeds them (shapes from the config's text widths and the pipeline's
token count), the timestep (and FLUX-dev's guidance), and the flow-matching loss: the mean
squared error of the prediction against the velocity target. As models/hub/trace.py does for a
transformers model, torch's FLOP counter counts the forward FLOPs per block and the saved-tensor
hooks what autograd keeps, per block, per attention module and outside the blocks.

Towers: a denoiser is one tower, `denoiser`, whose blocks are the class's `_no_split_modules`
(Wan's 40 `blocks`, SD3's joint `transformer_blocks`); a class with a second kind of block
(FLUX's 38 single-stream blocks after its 19 double-stream ones) gets a second tower,
`denoiser_single`, holding those blocks only, so each tower's blocks are alike (the planner
sizes FSDP units, LoRA adapters and checkpointing per block). Everything outside the blocks
(patch embedding, timestep and text projections, final norm and projection, the loss) is the
first tower's.

The trace runs in float32 (the planner prices the float elements at the plan's precision);
traces are cached as trace.py's, under `$MMTRAIN_CACHE/traces/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmtrain.hub_spec import DENOISER_FAMILIES, TRACE_VERSION, HubShape, HubTrace, TowerTrace
from mmtrain.models.hub import trace as hub_trace
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
DENOISER_TOWER = "denoiser"


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
    """The transformer's lists of blocks (children whose blocks are `_no_split_modules`), in
    the order its forward runs them."""
    kinds = set(getattr(transformer, "_no_split_modules", None) or ())
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
def sample_inputs(
    transformer: nn.Module, shape: HubShape, make: Callable[..., Tensor]
) -> tuple[dict[str, Tensor], Tensor, tuple[int, ...]]:
    """The forward's inputs for one sample at `shape` (each float tensor made by `make(*size)`),
    the target, and the latent shape."""
    config = transformer.config
    name = type(transformer).__name__
    family = DENOISER_FAMILIES[name]
    try:
        latent = family.latent(shape.frames, shape.image_height, shape.image_width)
    except ValueError as err:
        raise DenoiserError("--frames/--height/--width", str(err)) from None
    text = shape.positions
    if name == "WanTransformer3DModel":
        noisy = make(1, *latent)
        inputs = {"hidden_states": noisy, "timestep": make(1),
                  "encoder_hidden_states": make(1, text, config.text_dim)}  # fmt: skip
        return inputs, make(*noisy.shape), latent
    channels, h, w = latent
    if name == "FluxTransformer2DModel":
        tokens = (h // 2) * (w // 2)  # the pipeline packs 2 x 2 latent pixels per token
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
        return inputs, make(1, tokens, channels * 4), latent
    grid = max(h, w) // config.patch_size
    if config.pos_embed_max_size is not None and grid > config.pos_embed_max_size:
        raise DenoiserError(
            "--height/--width",
            f"{name}'s position table holds {config.pos_embed_max_size} patches a side; "
            f"{shape.image_height}x{shape.image_width} px needs {grid}",
        )
    inputs = {"hidden_states": make(1, *latent),
              "encoder_hidden_states": make(1, text, config.joint_attention_dim),
              "pooled_projections": make(1, config.pooled_projection_dim),
              "timestep": make(1)}  # fmt: skip
    return inputs, make(1, *latent), latent


def _meta(*size: int) -> Tensor:
    return torch.empty(size, device="meta")


# ----------------------------------------------------------------------------- the trace
def trace_denoiser(folder: Path, shape: HubShape, *, cache: bool = True) -> HubTrace:
    """The trace of `folder`'s denoiser at `shape`; from the cache when it holds it."""
    return hub_trace.cached_trace(_cache_path(folder, shape), cache, lambda: _trace(folder, shape))


def _cache_path(folder: Path, shape: HubShape) -> Path:
    config = json.dumps(denoiser_config(folder), sort_keys=True)
    key = f"denoiser|{config}|{shape.key()}|v{TRACE_VERSION}|torch {torch.__version__}"
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
    joint = 0 if family.temporal else shape.positions  # text tokens in the joint attention
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
        shared_inputs=saved(list(recorder.shared[tower.name].values())),
        outside=saved([t for t, w in mine if w[1] is None]),
    )


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
