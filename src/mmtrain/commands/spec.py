"""`mmtrain spec NAME|FILE`: show a model description with its parameter, token and FLOP counts,
and the input its FLOPs per sample count (`counted_input`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mmtrain.commands.plan import HUB_CONTEXT, HUB_IMAGE_SIZE
from mmtrain.hub_spec import DENOISER_FAMILIES, HubShape
from mmtrain.plan.hub import check_denoiser_class, denoiser_class, hub_preset_names, hub_source
from mmtrain.spec import (
    AudioStem,
    ImageStem,
    ModelSpec,
    TextStem,
    TimeSeriesStem,
    TowerSpec,
    VideoStem,
    load_spec,
    preset_names,
)

ORDER = 10


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="show a model spec (preset or file) and its analytic counts")
    p.add_argument(
        "model",
        nargs="?",
        help="preset name, spec YAML/JSON, or a transformers model "
        "folder / org/name / hub preset; omit to list presets",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def counted_input(spec: ModelSpec) -> dict[str, Any]:
    """The one sample `spec.forward_flops()` counts: a language model's `ModelSpec.counted_row`,
    its images at the projector tower's stem size; a denoiser's `denoiser.size()` (and an
    MMDiT's `text_tokens`); one input per tower at its stem's size."""
    if spec.decoder is not None:
        positions, count = spec.counted_row()
        images = []
        if count:
            assert spec.projector is not None
            tower = spec.towers[spec.projector.tower]
            image = {"tower": spec.projector.tower, **tower_input(tower)}
            images = [image | {"positions": spec.image_tokens()}] * count
        return {"rows": 1, "positions": positions, "images": images,
                "native_images": spec.vision is not None}  # fmt: skip
    if spec.denoiser is not None:
        d = spec.denoiser
        sample = {"input": d.input, "channels": d.channels, "size": list(d.size()),
                  "tokens": d.tokens()}  # fmt: skip
        return sample | ({"text_tokens": d.text_tokens} if d.is_mmdit() else {})
    return {"towers": {name: tower_input(t) for name, t in spec.towers.items()}}


def tower_input(tower: TowerSpec) -> dict[str, Any]:
    """One input of a tower at its stem's size, and the tokens it makes."""
    s = tower.stem
    if isinstance(s, ImageStem):
        shape = {"size": [s.image_size, s.image_size]}
    elif isinstance(s, VideoStem):
        shape = {"frames": s.frames, "size": [s.image_size, s.image_size]}
    elif isinstance(s, AudioStem):
        shape = {"seconds": s.clip_seconds, "sample_rate": s.sample_rate}
    elif isinstance(s, TimeSeriesStem):
        shape = {"channels": s.channels, "length": s.length}
    else:
        assert isinstance(s, TextStem), type(s)
        shape = {"context_length": s.context_length}
    return {"modality": tower.modality, **shape, "tokens": tower.tokens()}


def describe_input(counted: dict[str, Any]) -> str:
    """`counted_input` in words: '1 row of 4,096 positions (decoder.max_positions) with 1 image
    336x336 px', 'image 224x224 px, text 77 tokens', 'latent 4x32x32 (channels x height x
    width)'."""
    if "positions" in counted:
        row = f"1 row of {counted['positions']:,} positions (decoder.max_positions)"
        images = counted["images"]
        if not images:
            return row + ", no image"
        sizes = sorted({_sides(image["size"]) for image in images})
        return row + f" with {len(images)} image{'s' * (len(images) > 1)} {', '.join(sizes)} px"
    if "towers" in counted:
        return ", ".join(_describe_tower(t) for t in counted["towers"].values())
    axes = "channels x frames x height x width" if len(counted["size"]) == 3 else (
        "channels x height x width")  # fmt: skip
    text = f"{counted['input']} {_sides([counted['channels'], *counted['size']])} ({axes})"
    if "text_tokens" in counted:
        text += f" and {counted['text_tokens']:,} text tokens"
    return text


def _sides(size: list[int]) -> str:
    return "x".join(str(n) for n in size)


def _describe_tower(t: dict[str, Any]) -> str:
    m = t["modality"]
    if m == "image":
        return f"image {_sides(t['size'])} px"
    if m == "video":
        return f"video {t['frames']} frames of {_sides(t['size'])} px"
    if m == "audio":
        return f"audio {t['seconds']:g} s at {t['sample_rate']:,} Hz"
    if m == "timeseries":
        return f"timeseries {t['channels']} channels x {t['length']} steps"
    return f"{m} {t['context_length']} tokens"


def _gflops(flops: float) -> str:
    """GFLOPs with two decimals, or three significant digits where two decimals say 0.00."""
    return f"{flops / 1e9:,.2f}" if flops >= 1e7 else f"{flops / 1e9:.3g}"


def _per_position(spec: ModelSpec, counted: dict[str, Any]) -> float | None:
    """A language model's FLOPs per position of its counted row (attention included: at a long
    row most of it); None for other models."""
    return spec.forward_flops() / counted["positions"] if "positions" in counted else None


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        for name in preset_names():
            print(_listing_line(name, load_spec(name)))
        print(f"hub presets (transformers' and diffusers' classes, `mmtrain spec NAME`): "
              f"{', '.join(hub_preset_names())}")  # fmt: skip
        return 0
    hub = hub_source(args.model)
    if hub is not None:
        return _hub(args, *hub)
    spec = load_spec(args.model)
    counted = counted_input(spec)
    per_position = _per_position(spec, counted)
    summary = {
        "name": spec.name,
        "params": spec.params(),
        "tower_params": spec.tower_params(),
        "tokens_per_sample": spec.tokens_per_sample(),
        "forward_flops_per_sample": spec.forward_flops(),
        "forward_flops_input": counted,
        **({"forward_flops_per_position": per_position} if per_position is not None else {}),
        "tower_forward_flops": spec.tower_flops(),
        "spec": spec.to_dict(),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_summary(spec, summary)
    return 0


def hub_summary(model: str, folder: Path, preset: bool) -> dict[str, Any]:
    """A hub model (a folder, org/name or hub preset): its class, towers with parameters and
    blocks, and the trace's forward FLOPs at the planner's default row (commands/plan.py's
    HUB_CONTEXT positions, one image of HUB_IMAGE_SIZE px for a VLM)."""
    from mmtrain.models.hub.trace import traced_for_plan  # imports torch and transformers

    def shape(towers: tuple[str, ...]) -> HubShape:
        size = HUB_IMAGE_SIZE if "vision" in towers else 0
        return HubShape(HUB_CONTEXT, 1 if size else 0, size, size)

    trace = traced_for_plan(model, folder, preset, shape, lambda _blocks: ())
    shape_used = asdict(trace.shape)
    return {
        "name": model,
        "hub": True,
        "architecture": trace.architecture,
        "params": sum(t.params for t in trace.towers),
        "tower_params": {t.name: t.params for t in trace.towers},
        "towers": {
            t.name: {
                "params": t.params,
                "blocks": t.blocks,
                "block_params": t.block_params,
                "tokens": t.tokens,
                "forward_flops": t.forward_flops,
            }  # fmt: skip
            for t in trace.towers
        },
        "forward_flops_per_sample": trace.forward_flops(),
        "forward_flops_input": shape_used | {"image_tokens": trace.image_tokens},
    }


def denoiser_summary(model: str, folder: Path) -> dict[str, Any]:
    """A diffusers denoiser (a pipeline or transformer folder, or a preset): its class, towers
    and the trace's forward FLOPs at its pipeline's default sample (commands/plan.py's row)."""
    from mmtrain.models.hub.denoiser_trace import trace_denoiser  # imports torch and diffusers

    architecture = denoiser_class(folder)
    check_denoiser_class(architecture, folder)
    family = DENOISER_FAMILIES[architecture]
    shape = HubShape(family.text_tokens, 1, family.height, family.width, family.frames)
    trace = trace_denoiser(folder, shape)
    towers = {t.name: {"params": t.params, "blocks": t.blocks, "block_params": t.block_params,
                       "tokens": t.tokens, "forward_flops": t.forward_flops}
              for t in trace.towers}  # fmt: skip
    return {
        "name": model,
        "hub": True,
        "architecture": architecture,
        "pipeline": family.pipeline,
        "params": sum(t.params for t in trace.towers),
        "tower_params": {t.name: t.params for t in trace.towers},
        "towers": towers,
        "forward_flops_per_sample": trace.forward_flops(),
        "forward_flops_input": asdict(shape)
        | {
            "latent_shape": list(trace.latent_shape),
            "latent_tokens": trace.image_tokens,
        },  # fmt: skip
    }


def _denoiser(args: argparse.Namespace, folder: Path) -> int:
    summary = denoiser_summary(args.model, folder)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    shape = summary["forward_flops_input"]
    print(f"{summary['name']}: {summary['architecture']} (diffusers' class, {summary['pipeline']}), "
          f"{summary['params']:,} parameters, {summary['forward_flops_per_sample'] / 1e9:,.2f} "
          "forward GFLOPs per sample")  # fmt: skip
    latent = "x".join(str(n) for n in shape["latent_shape"])
    print(f"  counted at: {shape['frames']} frame(s) of {shape['image_height']}x"
          f"{shape['image_width']} px (latent {latent}, {shape['latent_tokens']:,} tokens), "
          f"{shape['positions']} text tokens (traced; `mmtrain plan --model` takes --frames, "
          "--height, --width, --context)")  # fmt: skip
    for name, t in summary["towers"].items():
        print(f"  {name:16s} {t['blocks']:4d} blocks  {t['params'] / 1e6:11.2f}M params  "
              f"{t['forward_flops'] / 1e9:13.2f} GFLOPs")  # fmt: skip
    return 0


def _hub(args: argparse.Namespace, folder: Path, preset: bool) -> int:
    if denoiser_class(folder) is not None:
        return _denoiser(args, folder)
    summary = hub_summary(args.model, folder, preset)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    shape = summary["forward_flops_input"]
    print(f"{summary['name']}: {summary['architecture']} (hub model: transformers' class), "
          f"{summary['params']:,} parameters, {summary['forward_flops_per_sample'] / 1e9:,.2f} "
          "forward GFLOPs per sample")  # fmt: skip
    row = f"1 row of {shape['positions']:,} positions"
    if shape["images"]:
        row += (f" with {shape['images']} image {shape['image_height']}x{shape['image_width']} "
                f"px ({shape['image_tokens']} tokens)")  # fmt: skip
    print(
        f"  counted at: {row} (traced; `mmtrain plan --model` takes --context, --images, "
        "--image-size)"
    )
    for name, t in summary["towers"].items():
        print(
            f"  {name:8s} {t['blocks']:4d} blocks  {t['tokens']:7d} tokens  "
            f"{t['params'] / 1e6:11.2f}M params  {t['forward_flops'] / 1e9:11.2f} GFLOPs"
        )
    return 0


def _listing_line(name: str, spec: ModelSpec) -> str:
    counted = counted_input(spec)
    flops = f"{spec.forward_flops() / 1e9:9.2f} GFLOPs/sample"
    line = f"{name:28s} {spec.params() / 1e6:10.2f}M params  {flops}  at {describe_input(counted)}"
    per_position = _per_position(spec, counted)
    if per_position is not None:
        line += f" ({_gflops(per_position)} GFLOPs/position)"
    return line


def _print_summary(spec: ModelSpec, summary: dict[str, Any]) -> None:
    counted = summary["forward_flops_input"]
    print(f"{spec.name}: {spec.params():,} parameters, "
          f"{spec.forward_flops() / 1e9:.2f} forward GFLOPs per sample")  # fmt: skip
    line = f"  counted at: {describe_input(counted)}"
    if counted.get("native_images"):
        line += " (native-resolution images have no fixed size: `mmtrain plan --visual HxW`"
        line += " counts them)"
    if "forward_flops_per_position" in summary:
        line += f"; {_gflops(summary['forward_flops_per_position'])} GFLOPs per position"
    print(line)
    for name, tower in spec.towers.items():
        print(
            f"  {name:12s} {tower.modality:10s} width {tower.width:5d} x {tower.layers:3d} layers  "
            f"{tower.tokens():6d} tokens  {summary['tower_params'][name] / 1e6:9.2f}M params  "
            f"{summary['tower_forward_flops'][name] / 1e9:9.2f} GFLOPs"
        )
    if spec.pairs:
        print(f"  objective {spec.objective} over {', '.join('-'.join(p) for p in spec.pairs)}")
    if spec.fusion is not None:
        fused = ", ".join(spec.fused_towers())
        print(f"  fusion head: {spec.fusion.task}, {spec.fusion.num_outputs} outputs over {fused}")
