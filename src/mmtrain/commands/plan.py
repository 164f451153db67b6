"""`mmtrain plan`: predict memory, time and cost of training (or serving) a model on GPUs.

Modes: a single strategy (default), `--recommend` (search and rank strategies), `--inference`
(serving memory, KV cache, MIG), `--measure` (run one CPU training step and print what autograd
really saved beside the prediction), `--workloads default|FILE` (the practitioners' table).
A language model's plan is of next-token training (`--objective sft`) or of preference pairs
(`--objective dpo`: a sample is a pair of rows; plan/preference.py).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from mmtrain.cli import UsageError
from mmtrain.commands._args import add_ownership_arguments, count, ownership_given
from mmtrain.commands._data_args import add_budget_argument
from mmtrain.hardware import GIB, PRICE_SOURCE, load_catalog
from mmtrain.hub_spec import DENOISER_FAMILIES, HubShape
from mmtrain.plan.comm import COMM_SHARE_LIMIT
from mmtrain.plan.compute import TimeEstimate
from mmtrain.plan.config import (
    AC_MODES,
    ATTENTION,
    OPTIMIZERS,
    PRECISIONS,
    SP_ATTENTION,
    PlanConfig,
)
from mmtrain.plan.estimate import Plan, make_plan
from mmtrain.plan.hub import (
    check_denoiser_class,
    check_hub_strategy,
    denoiser_class,
    denoiser_plan_model,
    hub_plan_model,
    hub_source,
)
from mmtrain.plan.model import Rows, from_spec, native_rows
from mmtrain.plan.native_vision import describe, parse_visual
from mmtrain.plan.preference import OBJECTIVES, REFERENCES, check_preference
from mmtrain.plan.preference import describe as preference_note
from mmtrain.plan.recommend import DEFAULT_DEADLINE_H
from mmtrain.plan.workloads import load_model, load_workloads, workload_names
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError

ORDER = 20
HUB_CONTEXT = 4096  # a hub model's planned row: positions (--context)
HUB_IMAGE_SIZE = 1024  # and its images' side in pixels before the processor (--image-size)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict memory, time and cost of training or serving a model")
    p.add_argument(
        "--model",
        default="ViT-B-32",
        help="preset, spec YAML or workload preset (default ViT-B-32)",
    )
    p.add_argument(
        "--gpu",
        default=None,
        help="GPU name or alias (b300, h100, a100-40g, ...; default h100); with --recommend a comma list (default: every GPU)",
    )
    p.add_argument("--gpus", type=count, default=1, help="total GPUs")
    p.add_argument("--gpus-per-node", type=count, default=None)
    p.add_argument(
        "--precision",
        default="bf16",
        choices=PRECISIONS,
        help="bf16: torch autocast (fp32 residual stream); bf16-weights: the model in bf16 with "
        "fp32 master weights and Adam states (DeepSpeed bf16, FSDP2 bf16 parameters); "
        "bf16-pure: no fp32 copy at all (docs/PLANNER.md)",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument(
        "--bytes-per-param",
        type=int,
        default=16,
        help="mixed-precision AdamW convention: 16 (16-bit grads), 18 (fp32 grads), 20 (+fp32 accumulation)",
    )
    p.add_argument(
        "--zero",
        type=int,
        default=0,
        help="ZeRO/FSDP stage 0-3 over the data-parallel ranks (mmtrain train runs 0, DDP, and "
        "3, FSDP2; 1 and 2 are what-ifs)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="CPU offload, as train.offload: FSDP2's CPUOffloadPolicy keeps the shards of "
        "weights, gradients and optimizer states in host memory (implies --zero 3; any --gpus)",
    )
    p.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="with --offload: a server's host memory (default: the catalog's reference server)",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor parallel size (a what-if for training; serving)"
    )
    p.add_argument(
        "--sp",
        action="store_true",
        help="Megatron-LM sequence parallelism inside the TP group (with --tp: splits the norm "
        "and MLP inputs over it); not --sequence-parallel",
    )
    p.add_argument(
        "--sequence-parallel",
        type=count,
        default=1,
        metavar="N",
        help="context parallelism, as train.sequence_parallel: N consecutive ranks split each "
        "row of the decoder / denoiser, T/N positions each (default 1)",
    )
    p.add_argument(
        "--sequence-parallel-attention",
        default="auto",
        choices=SP_ATTENTION,
        help="its attention, as train.sequence_parallel_attention: all_to_all "
        "(DeepSpeed-Ulysses), ring, or auto (all_to_all when N divides the heads)",
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel stages")
    p.add_argument("--ac", default="none", choices=AC_MODES, help="activation checkpointing")
    p.add_argument("--attention", default="flash", choices=ATTENTION)
    p.add_argument(
        "--objective",
        default="sft",
        choices=OBJECTIVES,
        help="what a language model trains on, as train.objective: sft (next-token, the "
        "default) or dpo (preference pairs: two rows a pair, a native VLM's images once a "
        "pair, the reference: --reference). Under dpo, --micro-batch, --global-batch and "
        "--samples count PAIRS",
    )
    p.add_argument(
        "--reference",
        default="auto",
        choices=REFERENCES,
        help="dpo's reference, as train.dpo.reference: adapters (the model without its LoRA "
        "adapters: one more forward a step), copy (a frozen copy: its weights and one more "
        "forward a step), cache (scored once before training: one forward a row of every "
        "pair, nothing a step), auto (adapters with --lora / --qlora, else cache)",
    )
    p.add_argument(
        "--micro-batch", type=count, default=1, help="samples per GPU per forward (dpo: pairs)"
    )
    p.add_argument(
        "--global-batch", type=count, default=None, help="samples per optimizer step (dpo: pairs)"
    )
    p.add_argument(
        "--samples", type=count, default=0, help="samples to train (time and cost; dpo: pairs)"
    )
    p.add_argument(
        "--price-per-gpu-hour",
        type=float,
        default=None,
        help="USD per GPU-hour, or --currency with --own (default: the catalog's indicative "
        "on-demand list price)",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="achievable fraction of peak (default: the published figure of the model's "
        "workload family, moved to the GPU by its MAMF; docs/PLANNER.md)",
    )
    p.add_argument("--headroom", type=float, default=0.07, help="share of usable memory kept free")
    p.add_argument(
        "--network", default=None, help="inter-node interconnect (ib-ndr, ib-xdr, roce-400, ...)"
    )
    p.add_argument(
        "--hardware", default=None, help="YAML adding or overriding GPUs and interconnects"
    )
    p.add_argument(
        "--freeze", action="append", default=[], metavar="TOWER", help="freeze a tower (repeatable)"
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="TOWER",
        help="LoRA-adapt a tower (repeatable)",
    )
    p.add_argument(
        "--freeze-blocks",
        action="append",
        default=[],
        metavar="TOWER=N",
        help="freeze a tower's stem and first N blocks, as train.towers.TOWER.freeze_blocks",
    )
    p.add_argument(
        "--unlocked-blocks",
        action="append",
        default=[],
        metavar="TOWER=N",
        help="freeze all but a tower's last N blocks (LiT), as train.towers.TOWER.unlocked_blocks",
    )
    p.add_argument(
        "--qlora",
        action="append",
        default=[],
        metavar="TOWER",
        help="QLoRA: LoRA-adapt a tower and hold its blocks' frozen linears in 4-bit NF4, as "
        "train.towers.TOWER.lora.quantize_base: nf4 (repeatable)",
    )
    p.add_argument("--lora-rank", type=count, default=16)
    p.add_argument(
        "--lora-targets",
        default="attn,mlp",
        help="linears LoRA adapts in every block: attn (qkv, out), mlp (fc1, fc2) or both "
        "(default attn,mlp: what train.towers.NAME.lora adapts by default)",
    )
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument(
        "--frames",
        type=int,
        default=None,
        help="video frames per sample (a diffusers video denoiser: 1 + 4k for Wan, default 81)",
    )
    p.add_argument(
        "--height",
        type=count,
        default=None,
        help="a diffusers denoiser's sample height in pixels (default the pipeline's; "
        "--image-size sets height and width)",
    )
    p.add_argument("--width", type=count, default=None, help="its width in pixels (see --height)")
    p.add_argument(
        "--context",
        type=count,
        default=None,
        help="text/decoder context (with --inference: tokens per sequence)",
    )
    p.add_argument(
        "--images",
        type=count,
        default=None,
        help="language models: images per row (default 1 for a vision-language model; for a "
        "native-resolution one, pages at the spec's max_pixels: see --visual)",
    )
    p.add_argument(
        "--visual",
        action="append",
        default=[],
        metavar="SPEC",
        help="native-resolution VLMs (Qwen2-VL family): an input of the row, HxW (an image of "
        "that original size) or FxHxW (a clip of F frames), resized by the processor's rule "
        "(repeatable: one row holds them all; default one page at the spec's max_pixels)",
    )
    p.add_argument(
        "--packed",
        action="store_true",
        help="language models: rows packed with several documents (a block-diagonal mask)",
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="language models: plan from the token lengths of these conversation shards (a "
        "native-resolution VLM's: from each page's and clip's size under --budget)",
    )
    add_budget_argument(p, "with --data of a native-resolution VLM")
    p.add_argument(
        "--tokenizer", default=None, help="with --data: a tokenizer.json or the folder holding it"
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="with --data: vicuna-v1, chatml, llama-3, plain, or a tokenizer_config.json",
    )
    p.add_argument(
        "--data-samples",
        type=count,
        default=None,
        metavar="N",
        help="with --data: count N samples spread over the shards (default all)",
    )
    p.add_argument(
        "--pad-to",
        default="longest",
        choices=("longest", "max"),
        help="with --data: pad rows to the micro-batch's longest sample or to the sequence length",
    )
    p.add_argument(
        "--sequence-length",
        type=count,
        default=None,
        help="with --data: row length in LM positions (default the decoder's max_positions)",
    )
    p.add_argument(
        "--recommend",
        action="store_true",
        help="search GPU type and count, ZeRO, TP, AC and micro-batch",
    )
    p.add_argument(
        "--rank-by",
        default=None,
        choices=("cost", "time"),
        help="--recommend order (default: cost within --deadline when --samples is given, else time)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="HOURS",
        help=f"--recommend: keep strategies that train --samples within HOURS (default {DEFAULT_DEADLINE_H:g} when ranking by cost)",
    )
    p.add_argument("--max-gpus", type=count, default=512)
    p.add_argument(
        "--inference", action="store_true", help="serving memory: weights, KV cache, max batch, MIG"
    )
    p.add_argument(
        "--batch",
        type=count,
        default=1,
        help="sequences (or images) served at once by each replica (--inference)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=count,
        default=None,
        metavar="N",
        help="--inference: prompt length for the time to first token (default: --context)",
    )
    p.add_argument(
        "--sampling-steps",
        type=count,
        default=50,
        help="--inference of a denoiser: sampler steps per image (default 50)",
    )
    p.add_argument(
        "--no-guidance",
        action="store_true",
        help="--inference of a denoiser: one forward per step (default: two, classifier-free "
        "guidance)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="run one CPU training step (fp32) and compare with the prediction",
    )
    p.add_argument(
        "--workloads", default=None, metavar="default|FILE", help="print the workload table"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_own_arguments(p)
    p.set_defaults(func=run)


def _add_own_arguments(p: argparse.ArgumentParser) -> None:
    """`--own`: rent on demand vs rent servers by the month vs buy (plan/ownership.py). The
    price flags are shared with `mmtrain report` (_args.add_ownership_arguments)."""
    g = p.add_argument_group("--own: rent or buy (docs/PLANNER.md, Rent or buy)")
    g.add_argument(
        "--own",
        action="store_true",
        help="price the plan's GPU-hours on demand, by the month and bought",
    )
    g.add_argument(
        "--projects",
        default=None,
        metavar="FILE.yaml",
        help="with --own: a year's runs (model + samples, or gpu_hours) and inference services",
    )
    g.add_argument(
        "--runs-per-year", type=count, default=1, metavar="N", help="repetitions of the run a year"
    )
    add_ownership_arguments(g, on_demand=False)  # --price-per-gpu-hour is the planner's
    g.add_argument(
        "--servers", type=count, default=None, metavar="N", help="servers bought (default: enough)"
    )
    g.add_argument(
        "--deadline-days",
        type=float,
        default=None,
        metavar="DAYS",
        help="each training run finishes within this many days",
    )


def _config(args: argparse.Namespace) -> PlanConfig:
    return PlanConfig(
        gpu=args.gpu,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        precision=args.precision,
        optimizer=args.optimizer,
        bytes_per_param=args.bytes_per_param,
        zero=3 if args.offload and args.zero == 0 else args.zero,
        offload=args.offload,
        host_memory_gib=args.host_memory_gib,
        tp=args.tp,
        sp=args.sp,
        pp=args.pp,
        ac=args.ac,
        attention=args.attention,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        samples=args.samples,
        price_per_gpu_hour=args.price_per_gpu_hour,
        mfu=args.mfu,
        headroom=args.headroom,
        network=args.network,
        sequence_parallel=args.sequence_parallel,
        sequence_parallel_attention=args.sequence_parallel_attention,
        objective=args.objective,
        reference=args.reference,
    )


def _model(args: argparse.Namespace, visual: tuple | None = None):
    """The plan model of `args.model`; a native-resolution VLM's rows hold `visual`
    (`_visual_inputs`)."""
    if visual is not None:
        spec = load_spec(args.model)
        positions = None if args.inference else args.context
        rows = Rows(positions or spec.decoder.max_positions, visual_inputs=visual,
                    packed=args.packed)  # fmt: skip
        return _adapted(from_spec(spec, rows), args)
    model = load_model(
        args.model,
        image_size=args.image_size,
        frames=args.frames,
        context=None if args.inference else args.context,
        images=args.images,
        packed=args.packed,
    )
    return _adapted(model, args)


def _native_spec(args: argparse.Namespace) -> ModelSpec | None:
    """The spec of `args.model` when it has a native-resolution tower (spec.vision), else
    None (other specs, workload presets, names load_model reports as unknown)."""
    if args.model.lower() in {n.lower() for n in workload_names()}:
        return None
    try:
        spec = load_spec(args.model)
    except FieldError:
        return None
    return spec if spec.vision is not None else None


def _visual_inputs(args: argparse.Namespace) -> tuple | None:
    """A native VLM's row inputs at the tower's size: each --visual resized, else --images
    default pages (one by default); None for other models, which take no --visual."""
    spec = _native_spec(args)
    if spec is None:
        if args.visual:
            raise FieldError(
                "--visual",
                f"{args.model} has no native-resolution vision tower (spec.vision): --visual "
                "sizes a Qwen2-VL-style model's images and clips (a LLaVA-style VLM's images "
                "have one size: --images, --image-size)",
            )
        return None
    if args.visual and args.images is not None:
        raise UsageError("give the row's inputs as --visual or as --images default pages, not both")
    if args.visual:
        return tuple(parse_visual(spec.vision, text) for text in args.visual)
    images = 1 if args.images is None else args.images
    return native_rows(spec, Rows(spec.decoder.max_positions, images=images)).visual_inputs


def _visual_summary(args: argparse.Namespace, visual: tuple, model) -> dict:
    """What a native VLM's row holds, for --json: each input at the tower's size, its
    patches and LM tokens, and the row's visual tokens and text ids."""
    v = load_spec(args.model).vision
    tokens = sum(v.tokens(h, w, f) for f, h, w in visual)
    positions = model.stack("text").tokens
    return {
        "inputs": [
            {"kind": "image" if f == 1 else "clip", "frames": f, "height": h, "width": w}
            | {"patches": v.patches(h, w, f), "tokens": v.tokens(h, w, f)}
            for f, h, w in visual
        ],
        "tokens_per_row": tokens,
        "patches_per_row": sum(v.patches(h, w, f) for f, h, w in visual),
        "positions_per_row": positions,
        "text_ids_per_row": positions - tokens + len(visual),
        "vision_forward_flops_per_row": model.stack("vision").forward_flops,
    }


def _adapted(model, args: argparse.Namespace):
    """`model` trained as --freeze, --lora, --qlora, --freeze-blocks and --unlocked-blocks say."""
    adapted = [*args.lora, *args.qlora]
    modes = {name: "frozen" for name in args.freeze} | {name: "lora" for name in adapted}
    if args.lora_rank < 1:
        raise UsageError(f"--lora-rank must be at least 1, got {args.lora_rank}")
    if args.qlora and args.precision == "fp8":
        raise FieldError(
            "--qlora",
            "a 4-bit base cannot also run fp8 matmuls (train.towers.NAME.lora.quantize_base "
            "refuses train.precision fp8): use --precision bf16",
        )
    if modes:
        model = model.with_modes(modes, args.lora_rank, _lora_targets(args))
    if args.qlora:
        model = model.with_quantized_base(args.qlora)
    freeze_blocks, unlocked = _tower_counts(args)
    frozen = {name: n for name, n in freeze_blocks.items() if n > 0}  # 0: nothing, as in train
    for name, n in unlocked.items():
        layers = model.stack(name).layers
        if n > layers:
            raise UsageError(f"--unlocked-blocks {name}={n}: the tower has {layers} blocks")
        frozen[name] = layers - n
    return model.with_frozen_blocks(frozen) if frozen else model


def _lora_targets(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())


def _tower_counts(args: argparse.Namespace) -> tuple[dict[str, int], dict[str, int]]:
    """`--freeze-blocks` and `--unlocked-blocks` as {tower: N}; UsageError when malformed."""
    parsed = []
    for flag, items in (
        ("--freeze-blocks", args.freeze_blocks),
        ("--unlocked-blocks", args.unlocked_blocks),
    ):
        counts = {}
        for item in items:
            name, _, n = item.partition("=")
            if not name or not n.isdigit():
                raise UsageError(f"{flag} takes TOWER=N (e.g. image=2), got {item!r}")
            counts[name] = int(n)
        parsed.append(counts)
    return parsed[0], parsed[1]


def _check_objective_mode(args: argparse.Namespace) -> None:
    """`--objective dpo` plans one training run of a language model; the modes that plan
    something else (or measure a next-token step) refuse it, naming their flag; --reference
    is dpo's alone."""
    if args.objective != "dpo":
        if args.reference != "auto":
            raise FieldError(
                "--reference",
                f"{args.reference}: the reference is dpo's (train.dpo.reference); add "
                "--objective dpo or leave it out",
            )
        return
    refusals = (
        ("--inference", args.inference, "serving has no training objective"),
        ("--measure", args.measure, "it runs one next-token step; a DPO step's FLOPs are "
         "held to the plan by tests/test_plan_dpo.py"),
        ("--data", args.data, "it counts conversation shards' lengths, not pairs' yet; give "
         "the rows with --context (and --images)"),
        ("--workloads", args.workloads, "the workload table plans next-token rows"),
        ("--own", args.own or args.projects, "it prices next-token runs"),
    )  # fmt: skip
    for flag, given, why in refusals:
        if given:
            raise FieldError(flag, f"not with --objective dpo: {why}; plan without {flag}")


def run(args: argparse.Namespace) -> int:
    catalog = load_catalog(args.hardware)
    _check_objective_mode(args)
    if args.own or args.projects:
        return _own(args, catalog)
    if args.workloads:
        return _workloads(args, catalog)
    if args.data:
        return _data(replace_gpu(args, args.gpu or "h100"), catalog)
    if args.budget:
        raise UsageError(
            "--budget sets the pixel budget of the pages and clips --data reads; without "
            "--data give a row's inputs with --visual HxW / FxHxW"
        )
    hub = hub_source(args.model)
    if (args.height or args.width) and (hub is None or denoiser_class(hub[0]) is None):
        raise UsageError(
            "--height and --width size a diffusers denoiser's sample (a pipeline folder or a "
            "preset such as Wan2.1-T2V-14B); other models take --image-size"
        )
    if hub is not None:
        visual, model = None, _hub_model(args, hub)
    else:
        visual = _visual_inputs(args)
        model = _model(args, visual)
    check_preference(model, _config(replace_gpu(args, args.gpu or "h100")))
    if args.recommend:
        return _recommend(args, model, _config(replace_gpu(args, "h100")), catalog)
    args = replace_gpu(args, args.gpu or "h100")
    cfg = _config(args)
    if args.inference:
        return _inference(args, model, catalog)
    if args.measure:
        cfg = replace(cfg, precision="fp32") if args.precision == "bf16" else cfg
        if cfg.precision != "fp32":
            raise UsageError(
                "--measure runs on the CPU in fp32; leave --precision at its default or pass fp32"
            )
    plan = make_plan(model, cfg, catalog)
    result = plan.to_dict()
    if args.measure and hub is not None:
        result["measured"] = _hub_measured(args, hub, plan)
    elif args.measure:
        from mmtrain.train.measure_step import measure_training_step  # imports torch

        measured = measure_training_step(
            args.model,
            plan,
            image_size=args.image_size,
            frames=args.frames,
            context=args.context,
            images=args.images,
            packed=args.packed,
            freeze=args.freeze,
            lora=args.lora,
            lora_rank=args.lora_rank,
            lora_targets=_lora_targets(args),
            freeze_blocks=_tower_counts(args)[0],
            unlocked_blocks=_tower_counts(args)[1],
            visual_inputs=visual,
        )
        result["measured"] = measured.to_dict()
    if visual is not None:
        result["visual"] = _visual_summary(args, visual, model)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_plan(plan, result.get("measured"), result.get("visual"))
    return 0


def _hub_shape(args: argparse.Namespace, has_vision: bool) -> HubShape:
    """The row a hub model is planned (and traced) for: --context positions (default
    HUB_CONTEXT), --images images (default one for a VLM) of --image-size px square (default
    HUB_IMAGE_SIZE, before the processor's resizing)."""
    images = (1 if has_vision else 0) if args.images is None else args.images
    if images and not has_vision:
        raise UsageError(f"--images: {args.model} is a language model without a vision tower")
    size = args.image_size or HUB_IMAGE_SIZE
    return HubShape(args.context or HUB_CONTEXT, images, size if images else 0,
                    size if images else 0)  # fmt: skip


def _hub_frozen(args: argparse.Namespace, blocks: dict[str, int]) -> tuple[str, ...]:
    """The parts the trace freezes: --freeze towers, and a tower's stem and first N blocks
    (--freeze-blocks, --unlocked-blocks)."""
    frozen = list(args.freeze)
    freeze_blocks, unlocked = _tower_counts(args)
    counts = [*freeze_blocks.items(), *((k, blocks.get(k, 0) - v) for k, v in unlocked.items())]
    for name, n in counts:
        if name not in blocks:
            raise FieldError("--freeze-blocks", f"no tower {name!r}; towers: {', '.join(blocks)}")
        if n > 0:
            frozen.append(f"{name}:{n}")
    return tuple(frozen)


def _hub_model(args: argparse.Namespace, hub: tuple[Path, bool]):
    """The plan model of a hub model (a folder, org/name or hub preset): traced at the planned
    row with the parts --freeze and --freeze-blocks freeze (models/hub/trace.py, cached)."""
    from mmtrain.models.hub.trace import traced_for_plan  # imports torch and transformers

    check_hub_strategy(args.sequence_parallel)
    for flag, value in (("--visual", args.visual), ("--data", args.data),
                        ("--packed", args.packed), ("--inference", args.inference)):  # fmt: skip
        if value:
            raise UsageError(
                f"{flag} plans mmtrain's native models; a hub model ({args.model}) "
                "is planned at --context positions with --images of --image-size"
            )
    folder, preset = hub
    architecture = denoiser_class(folder)
    if architecture is not None:
        return _denoiser_model(args, folder, architecture)
    trace = traced_for_plan(
        args.model,
        folder,
        preset,
        lambda towers: _hub_shape(args, "vision" in towers),
        lambda blocks: _hub_frozen(args, blocks),
    )
    model = hub_plan_model(Path(args.model).name or args.model, trace, args.model)
    return _adapted(model, args)


def _denoiser_shape(args: argparse.Namespace, architecture: str) -> HubShape:
    """A diffusers denoiser's planned sample: --frames x --height x --width pixels (default
    the pipeline's sample; --image-size sets both sides) and --context text tokens (default
    the pipeline's)."""
    family = DENOISER_FAMILIES[architecture]
    if args.images is not None:
        raise UsageError("--images: a denoiser's row is one sample (--micro-batch sets how many)")
    height = args.height or args.image_size or family.height
    width = args.width or args.image_size or family.width
    frames = family.frames if args.frames is None else args.frames
    return HubShape(args.context or family.text_tokens, 1, height, width, frames)


def _denoiser_model(args: argparse.Namespace, folder: Path, architecture: str):
    """The plan model of a diffusers denoiser (a pipeline folder, its transformer folder or a
    preset), traced at the planned sample (models/hub/denoiser_trace.py, cached); --lora,
    --qlora and --freeze `denoiser` apply to all of its blocks' kinds."""
    from mmtrain.models.hub.denoiser_trace import trace_denoiser  # imports torch and diffusers

    check_denoiser_class(architecture, folder)
    if args.freeze_blocks or args.unlocked_blocks:
        raise UsageError(
            "--freeze-blocks / --unlocked-blocks: a diffusers denoiser is planned whole (full "
            "fine-tune, --lora denoiser or --qlora denoiser)"
        )
    trace = trace_denoiser(folder, _denoiser_shape(args, architecture))
    name = folder.parent.name if folder.name == "transformer" else folder.name
    model = denoiser_plan_model(name or args.model, trace, args.model)
    names = [s.name for s in model.stacks]

    def every_stack(towers: list[str]) -> list[str]:
        return [n for t in towers for n in (names if t == names[0] else [t])]

    tower_args = {k: every_stack(getattr(args, k)) for k in ("lora", "qlora", "freeze")}
    return _adapted(model, argparse.Namespace(**{**vars(args), **tower_args}))


def _denoiser_measured(args: argparse.Namespace, folder: Path, plan: Plan) -> dict:
    """One real CPU step of a diffusers denoiser (`measure_denoiser_step`) beside the plan."""
    from mmtrain.models.hub.denoiser_trace import measure_denoiser_step
    from mmtrain.plan.memory import training_memory

    if args.lora or args.qlora or args.freeze or plan.config.micro_batch != 1:
        raise UsageError("--measure of a diffusers denoiser runs one full sample (no --lora, "
                         "--freeze, --micro-batch)")  # fmt: skip
    measured = measure_denoiser_step(folder, _denoiser_shape(args, denoiser_class(folder)))
    measured["activations_bytes"] = measured["float_elements"] * 4 + measured["other_bytes"]
    predicted = training_memory(plan.model, plan.config, None).saved_activations_bytes
    return {
        **measured,
        "predicted_activations_bytes": int(predicted),
        "activations_error": round(predicted / measured["activations_bytes"] - 1, 5),
        "predicted_forward_flops": plan.model.forward_flops(),
        "predicted_trainable_params": plan.model.trainable_params(),
        "ac": plan.config.ac,
        "device": "cpu",
        "dtype": "float32",
    }


def _hub_measured(args: argparse.Namespace, hub: tuple[Path, bool], plan: Plan) -> dict:
    """One real CPU step of the hub model (models/hub/trace.py's `measure_hub_step`) beside
    the plan's CPU prediction, in the keys a native measurement has."""
    from mmtrain.models.hub.trace import measure_hub_step, resolved_folder
    from mmtrain.plan.memory import training_memory

    if denoiser_class(hub[0]) is not None:
        return _denoiser_measured(args, hub[0], plan)
    if args.lora or args.qlora:
        raise UsageError("--measure of a hub model runs full or frozen towers (no --lora yet)")
    folder = resolved_folder(args.model, *hub)
    trace_model = plan.model
    frozen = _hub_frozen(args, {s.name: s.layers for s in trace_model.stacks})
    shape = _hub_shape(args, any(s.name == "vision" for s in trace_model.stacks))
    measured = measure_hub_step(folder, shape, frozen)
    predicted = training_memory(plan.model, plan.config, None)
    pred_act, pred_states = predicted.saved_activations_bytes, predicted.model_state_bytes
    return {
        **measured,
        "predicted_activations_bytes": int(pred_act),
        "predicted_model_state_bytes": int(pred_states),
        "activations_error": round(pred_act / measured["activations_bytes"] - 1, 5),
        "model_state_error": round(pred_states / measured["model_state_bytes"] - 1, 6),
        "predicted_trainable_params": plan.model.trainable_params(),
        "predicted_forward_flops": plan.model.forward_flops(),
        "micro_batch": plan.config.micro_batch,
        "ac": plan.config.ac,
        "device": "cpu",
        "dtype": "float32",
    }


def replace_gpu(args: argparse.Namespace, gpu: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "gpu": gpu})


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def _flops(n: float) -> str:
    """`9.49 TFLOPs`, `6.77 MFLOPs`: three significant figures in the nearest unit."""
    for unit, scale in (("PFLOPs", 1e15), ("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:,.0f} FLOPs"


def _usd(n: float) -> str:
    return f"${n:,.0f}" if n >= 100 else f"${n:,.2f}"


def _price(t) -> str:
    """`$2.50 per GPU-hour (indicative on-demand list price, ...)`: the price and its source."""
    return f"${t.price_per_gpu_hour:,.2f} per GPU-hour ({t.price_source})"


def _sequence_label(c: PlanConfig) -> str:
    """`, SP 4 (all_to_all)` for a plan with sequence parallelism, else nothing."""
    n = c.sequence_parallel
    return f", SP {n} ({c.sequence_parallel_attention})" if n > 1 else ""


def _sp_exposed(c: PlanConfig, t) -> str:
    """`, SP comm exposed 0.088` in the step's breakdown under sequence parallelism."""
    return f", SP comm exposed {t.sp_exposed_s:.3g}" if c.sequence_parallel > 1 else ""


def _layout(c: PlanConfig) -> str:
    """`ZeRO-3 (FSDP2 + CPU offload)`, `ZeRO-0 (DDP)`, `ZeRO-1`: the stage and what runs it."""
    from mmtrain.plan.recommend import layout_name

    name = layout_name(c)
    return f"ZeRO-{c.zero}" + (f" ({name})" if not name.startswith("ZeRO") else "")


def _print_host(console, plan: Plan) -> None:
    """CPU offload: the host memory of a rank and of its server, and the host link's traffic."""
    h = plan.host
    fits = {True: "[green]fits[/]", False: "[red]does not fit[/]", None: "not checked"}[h.fits]
    server = (
        f"of its {_gib(h.server_memory_bytes)} GiB (budget {_gib(h.server_budget_bytes)} GiB "
        f"after {h.headroom:.0%} headroom): {fits}"
        if h.server_memory_bytes is not None
        else f"({h.server_memory_source})"
    )
    console.print(
        f"host memory (CPU offload, GiB a rank): parameters {_gib(h.params_bytes)} + gradients "
        f"{_gib(h.grads_bytes)} pinned, as the pinned allocator rounds them "
        f"{_gib(h.pinned_bytes)}; optimizer states {_gib(h.optimizer_bytes)}; "
        f"{_gib(h.rank_bytes)} in all. A server of {h.ranks_per_server} ranks needs "
        f"{_gib(h.server_bytes)} GiB {server}"
    )
    if h.server_memory_bytes is not None:
        console.print(f"host memory source: {h.server_memory_source}")
    console.print(
        f"host link {h.link}, a GPU per step: {h.h2d_bytes / 1e9:,.1f} GB in "
        f"({h.h2d_s:.3g} s), {h.d2h_bytes / 1e9:,.1f} GB out ({h.d2h_s:.3g} s), "
        f"{h.exposed_s:.3g} s not hidden by compute; the optimizer steps on the host "
        f"({h.optimizer_traffic_bytes / 1e9:,.1f} GB of host memory read and written a rank, "
        "not in the step time)"
    )


def _input_label(item: dict) -> str:
    size = f"{item['height']}x{item['width']}"
    return f"image {size}" if item["frames"] == 1 else f"clip {item['frames']}x{size}"


def _print_plan(plan: Plan, measured: dict | None, visual: dict | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m, c, mem, t = plan.model, plan.config, plan.memory, plan.time
    per = "row" if c.objective == "dpo" else "sample"  # a dpo sample is a pair of rows
    console.print(
        f"[bold]{m.name}[/]: {m.params() / 1e6:,.1f}M params ({m.trainable_params() / 1e6:,.1f}M trainable), {m.forward_flops() / 1e9:,.2f} forward GFLOPs/{per}, tokens {m.tokens_per_sample()}"
    )
    if visual:
        inputs = ", ".join(f"{_input_label(i)} ({i['tokens']:,} tokens)" for i in visual["inputs"])
        console.print(
            f"row: {inputs or 'no image'}: {visual['tokens_per_row']:,} visual tokens "
            f"({visual['patches_per_row']:,} patches) + {visual['text_ids_per_row']:,} text ids "
            f"= {visual['positions_per_row']:,} positions"
        )
    dpo = c.objective == "dpo"
    unit = "pairs" if dpo else "samples"
    pairs = f" pairs ({2 * c.micro_batch} rows a micro-batch)" if dpo else ""
    console.print(
        f"{c.gpus} x {plan.gpu.name} ({plan.gpu.memory_usable_gib} GiB usable of {plan.gpu.memory_nominal_gb:g} GB nominal); {c.precision}, {c.optimizer}, {_layout(c)}, TP {c.tp}{' + SP' if c.sp else ''}, PP {c.pp}{_sequence_label(c)}, AC {c.ac}, {c.attention} attention; micro-batch {c.micro_batch} x DP {c.dp} x accumulation {c.accumulation} = global {c.effective_global_batch}{pairs}"
    )
    if dpo:
        console.print(preference_note(m, c))
    if plan.not_run_by_train:
        console.print(
            "[yellow]what-if[/]: not run by mmtrain train: "
            + ", ".join(plan.not_run_by_train)
            + " (it trains with DDP or FSDP2, CPU offload, sequence parallelism, AC, LoRA/QLoRA)"
        )
    table = Table(title="memory per GPU (GiB)")
    table.add_column("item")
    table.add_column("predicted", justify="right")
    if measured:
        table.add_column("measured (CPU step)", justify="right")
    rows = [
        ("weights", mem.weights_bytes),
        ("gradients", mem.gradients_bytes),
        ("optimizer states", mem.optimizer_bytes),
    ]
    for name, value in mem.activations_by_stack.items():
        rows.append((f"activations: {name}", value))
    if mem.loss_bytes:  # contrastive logits; a language model's loss is in its text stack
        rows.append(("activations: loss", mem.loss_bytes))
    if dpo:  # in its decoder's row above
        rows.append(("  of which the loss's targets and dpo's per-target NLL", mem.logits_bytes))
    if mem.reference_bytes:
        rows.append(("dpo reference (frozen copy)", mem.reference_bytes))
    if mem.dequantized_bytes:
        rows.append(("dequantized NF4 weight (QLoRA)", mem.dequantized_bytes))
    rows += [
        ("recompute working set", mem.recompute_bytes),
        ("communication buffers", mem.comm_buffers_bytes),
        ("CUDA context", mem.cuda_context_bytes),
        ("allocator fragmentation (10%)", mem.fragmentation_bytes),
        ("total", mem.total_bytes),
        (f"budget (usable - {mem.headroom:.0%} headroom)", mem.budget_bytes),
    ]
    for name, value in rows:
        cells = [name, _gib(value)]
        if measured:
            cells.append({"total": "", "optimizer states": ""}.get(name, ""))
        table.add_row(*cells)
    if measured:
        table.add_row(
            "saved activations (autograd)",
            _gib(mem.saved_activations_bytes),
            _gib(measured["activations_bytes"]),
        )
        table.add_row(
            "model states", _gib(mem.model_state_bytes), _gib(measured["model_state_bytes"])
        )
    console.print(table)
    console.print(f"states convention: {mem.convention}")
    console.print(
        ("[green]fits[/]" if mem.fits else "[red]does not fit[/]")
        + f": {mem.total_bytes / mem.usable_bytes:.0%} of usable memory"
    )
    if plan.host is not None:
        _print_host(console, plan)
    offload = f", host copies exposed {t.offload_exposed_s:.3g}" if c.offload else ""
    console.print(
        f"step {t.step_time_s:.4g} s (compute {t.compute_s:.4g}, TP comm {t.tp_comm_s:.3g}, DP comm {t.dp_comm_s:.3g} of which exposed {t.dp_exposed_s:.3g}{_sp_exposed(c, t)}{offload}, bubble {t.bubble_s:.3g}); {t.samples_per_s:,.4g} {unit}/s; MFU {t.mfu:.1%}"
    )
    if c.sequence_parallel > 1:
        console.print(
            f"sequence parallel {c.sequence_parallel} ({c.sequence_parallel_attention}) over "
            f"{t.sp_link}: {t.sp_comm_bytes / 1e9:,.3g} GB sent per GPU per step, "
            f"{t.sp_comm_s:.3g} s on the link, {t.sp_exposed_s:.3g} s exposed: "
            f"{t.sp_comm_share:.1%} of the step (the run warns above "
            f"{COMM_SHARE_LIMIT:.0%} measured)"
        )
    console.print(
        f"achievable fraction {t.achievable_fraction:.3f} of peak, family {t.efficiency_family}: {t.efficiency_source}"
    )
    if t.reference_pass_samples_per_s:
        console.print(_reference_pass_line(c, t))
    if c.samples:
        console.print(
            f"{c.samples:,} {unit}: {t.time_to_train_s / 3600:,.2f} h, {_usd(t.cost)} at {_price(t)}; --price-per-gpu-hour overrides"
        )
    if measured:
        console.print(
            f"measured: activations {measured['activations_error']:+.1%}, model states {measured['model_state_error']:+.2%} against the prediction"
        )
        console.print(
            f"trainable parameters: planned {measured['predicted_trainable_params']:,}, "
            f"with a gradient {measured['trainable_params']:,}, "
            f"with optimizer state {measured['optimizer_state_params']:,}"
        )


def _reference_pass_line(c: PlanConfig, t: TimeEstimate) -> str:
    """DPO's cached reference: its one pass before the first step (plan/preference.py)."""
    line = (
        f"reference pass (once, before the first step): one forward of each pair, without "
        f"gradients, {t.reference_pass_samples_per_s:,.4g} pairs/s"
    )
    if not c.samples:
        return line + "; --samples times it"
    return (
        f"{line}: {c.samples:,} pairs in {t.reference_pass_s / 3600:,.2f} h, "
        f"{_usd(t.reference_pass_cost)} (in the time and cost below)"
    )


def _data(args: argparse.Namespace, catalog) -> int:
    """`--data DIR`: tokens per sample from conversation shards, then padded and packed plans.
    A native-resolution VLM's samples keep their pages' and clips' sizes under `--budget`
    (each sample's own visual tokens and tower FLOPs; plan/lengths.py)."""
    from mmtrain.commands._data_args import visual_budget
    from mmtrain.data.ingest.inspect import conversation_counts, open_shards
    from mmtrain.data.stream.chat_templates import get_template
    from mmtrain.data.stream.tokenizer import get_tokenizer
    from mmtrain.lengths import Lengths, summarize
    from mmtrain.plan.data_plan import plan_from_data
    from mmtrain.spec import with_input_sizes

    spec = with_input_sizes(load_spec(args.model), args.image_size, None, None)
    if not spec.is_language_model():
        raise UsageError(f"--data plans a language model; {spec.name!r} has no decoder")
    native = spec.vision is not None
    if args.budget and not native:
        raise UsageError(
            f"--budget sets a native-resolution VLM's pixel budget (spec.vision); {spec.name!r} "
            "has none (its images have one size: --image-size)"
        )
    choice = visual_budget(spec, args.budget) if native else None
    if args.tokenizer is None or args.chat_template is None:
        raise UsageError(
            "--data needs --tokenizer (a tokenizer.json or its folder) and --chat-template "
            "(vicuna-v1, chatml, llama-3, plain or a tokenizer_config.json) to count tokens"
        )
    try:
        sources = open_shards(args.data)[2]
    except FileNotFoundError as err:
        raise UsageError(f"--data {args.data}: {err}") from None
    counts = conversation_counts(
        sources,
        get_tokenizer(args.tokenizer, language_model=True),
        get_template(args.chat_template),
        spec.image_tokens(),
        max_samples=args.data_samples,
        budget=choice.budget if choice else None,
        wrap=choice.wrap if choice else False,
    )
    lengths = Lengths(
        tuple(counts.positions),
        tuple(counts.images),
        source=str(args.data),
        visual_shapes=tuple(counts.visual_shapes) if native else (),
    )
    length = args.sequence_length or args.context or spec.decoder.max_positions
    plans = plan_from_data(
        spec,
        lengths,
        _config(args),
        catalog,
        sequence_length=length,
        samples=args.samples or None,
        pad_to=args.pad_to,
        adapt=lambda model: _adapted(model, args),
    )
    data = {
        "path": str(args.data),
        "samples": len(counts.positions),
        "refused": counts.refused,
        "positions": summarize(counts.positions),
        "text_ids": summarize(counts.text_ids),
        "images": summarize(counts.images),
    }
    if choice is not None:
        data |= {
            "videos": summarize(counts.videos),
            "visual_tokens": summarize(counts.visual_tokens),
            "page_tokens": summarize(counts.page_tokens),
            "budget": choice.to_dict(),
        }
    result = {
        "model": {
            "name": spec.name,
            "params": spec.params(),
            "image_tokens": "per page (budget)" if native else spec.image_tokens(),
        },
        "data": data,
        "sequence_length": length,
        "layouts": [p.to_dict() for p in plans],
        "plans": [p.plan.to_dict() for p in plans],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_data_plan(result, plans)
    return 0


def _print_data_plan(result: dict, plans) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    d = result["data"]
    console.print(
        f"[bold]{result['model']['name']}[/] on {d['path']}: {d['samples']:,} conversations"
        + (f" ({sum(d['refused'].values()):,} refused: {d['refused']})" if d["refused"] else "")
    )
    native = "budget" in d
    spliced = ("each input's own tokens" if native
               else f"images x {result['model']['image_tokens']}")  # fmt: skip
    dist = Table(title=f"tokens per sample (LM positions: text ids + {spliced})")
    for col in ("", "mean", "p50", "p90", "p99", "max"):
        dist.add_column(col, justify="right")
    names = ("positions", "text_ids", "images", "videos", "visual_tokens", "page_tokens")
    for name in names if native else names[:3]:
        row = d[name]
        dist.add_row(name, *(f"{row[k]:,}" for k in ("mean", "p50", "p90", "p99", "max")))
    console.print(dist)
    if native:
        b = d["budget"]
        given = ", ".join(f"{k}={v}" for k, v in b["settings"].items() if v is not None)
        cap = b["sample_max_tokens"]
        console.print(
            f"budget (--budget, as data.vision): {given}; pages of {b['image_min_pixels']:,} "
            f"to {b['image_max_pixels']:,} pixels, "
            + (f"at most {cap:,} visual tokens a sample" if cap else "no cap per sample")
        )
    c = plans[0].plan.config
    table = Table(
        title=f"{c.gpus} x {plans[0].plan.gpu.name}, {c.precision}, ZeRO-{c.zero}, AC {c.ac}; "
        f"rows of {result['sequence_length']} positions, {plans[0].samples:,} samples"
    )
    for col in ("layout", "rows", "samples/row", "fill", "useful FLOPs", "mem GiB", "fits",
                "global rows", "MFU", "time h", "cost USD"):  # fmt: skip
        table.add_column(col, justify="right")
    for p in plans:
        lay, mem, t = p.layout, p.plan.memory, p.plan.time
        table.add_row(
            lay.name,
            f"{p.plan.config.samples:,}",
            f"{lay.samples_per_row:.2f}",
            f"{lay.fill:.1%}",
            f"{lay.useful_flops / lay.computed_flops:.1%}",
            _gib(mem.total_bytes),
            "yes" if mem.fits else "NO",
            str(p.plan.config.effective_global_batch),
            f"{t.mfu:.0%}",
            f"{p.hours:,.2f}",
            _usd(t.cost),
        )
    console.print(table)
    for p in plans:
        t = p.plan.time
        console.print(
            f"{p.layout.name}: achievable fraction {t.achievable_fraction:.3f} of peak, family "
            f"{t.efficiency_family}: {t.efficiency_source}"
        )
    for p in plans:
        lay = p.layout
        inputs = lay.max_visual_inputs
        if inputs:
            held = describe(inputs) if len(inputs) <= 3 else f"{len(inputs)} inputs"
            console.print(
                f"{lay.name}: the tower's {_flops(lay.vision_flops / lay.rows)} a row on average "
                f"(each sample's own pages and clips); memory for the heaviest row: {held}, "
                f"{lay.max_visual_patches:,} patches"
            )
    console.print(
        "padded: each micro-batch's rows padded to its longest sample; packed: rows filled "
        "first-fit (data/stream/packing.py). Memory is planned for the worst micro-batch, time from "
        "the computed FLOPs of the mean row; costs at " + _price(plans[0].plan.time)
    )


def _recommend(args, model, cfg, catalog) -> int:
    from mmtrain.plan.recommend import layout_name, recommend

    gpus = [g for g in args.gpu.split(",") if g] if args.gpu and args.gpu != "all" else None
    cfg = replace(cfg, global_batch=cfg.global_batch or 256)
    rec = recommend(model, cfg, catalog, gpus, args.max_gpus, args.rank_by, args.deadline)
    if not rec.ranked:
        raise UsageError(_nothing_fits(args, model, cfg, catalog, gpus, rec))
    prices = _prices_line(rec.ranked[0])
    if args.json:
        print(
            json.dumps(
                {
                    "by": rec.by,
                    "policy": rec.policy,
                    "deadline_h": rec.deadline_h,
                    "met_deadline": rec.met_deadline,
                    "fitting": rec.fitting,
                    "explanation": rec.explanation,
                    "prices": prices,
                    "searched": rec.searched,
                    "ranked": [p.to_dict() for p in rec.ranked[:10]],
                },
                indent=2,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{model.name}: strategies that fit, by {rec.by} ({rec.searched} searched)")
    for col in (
        "#",
        "GPU",
        "GPUs",
        "layout",
        "SP",
        "AC",
        "micro",
        "mem GiB",
        "host GiB",
        "samples/s",
        "MFU",
        "time h",
        "cost USD",
    ):
        table.add_column(col, justify="right")
    for i, p in enumerate(rec.ranked[:10], 1):
        c, t = p.config, p.time
        table.add_row(
            str(i),
            p.gpu.key,
            str(c.gpus),
            layout_name(c),
            f"{c.sequence_parallel} {c.sequence_parallel_attention}"
            if c.sequence_parallel > 1
            else "1",
            c.ac,
            str(c.micro_batch),
            _gib(p.memory.total_bytes),
            _gib(p.host.server_bytes) if p.host else "-",
            f"{t.samples_per_s:,.4g}",
            f"{t.mfu:.0%}",
            f"{t.time_to_train_s / 3600:,.1f}" if c.samples else "-",
            _usd(t.cost) if c.samples else "-",
        )
    console = Console(width=max(Console().width, 160))
    console.print(table)
    if cfg.objective == "dpo":
        console.print("dpo: a sample is a preference pair (two rows): samples/s, --samples and "
                      "--global-batch count pairs")  # fmt: skip
    console.print(rec.policy)
    console.print(prices)
    console.print(rec.explanation)
    console.print(
        "searched: what mmtrain train runs (DDP, FSDP2, FSDP2 + CPU offload, sequence "
        "parallelism, AC), the towers trained as given; host GiB: a server's host memory for "
        "its ranks' offloaded states; TP and ZeRO-1/2 are what-ifs for mmtrain plan --tp/--zero"
    )
    return 0


def _nothing_fits(args, model, cfg, catalog, gpus, rec) -> str:
    """Why nothing fits (the nearest miss) and the cheapest changes that fit (plan/changes.py)."""
    from mmtrain.plan.changes import cheapest_changes
    from mmtrain.plan.recommend import describe

    near = rec.closest
    msg = "nothing fits"
    if near is not None:
        msg += f"; closest: {describe(near)} needs {_gib(near.memory.total_bytes)} GiB of a {_gib(near.memory.budget_bytes)} GiB budget (over by {near.memory.total_bytes / near.memory.budget_bytes - 1:.0%})"
    changes = cheapest_changes(model, cfg, catalog, gpus, args.max_gpus, rec, args.deadline,
                               args.lora_rank, _lora_targets(args))  # fmt: skip
    if not changes:
        return (
            msg + "; no change fits either (LoRA, QLoRA, CPU offload, more GPUs, more host memory)"
        )
    best, *others = changes
    text = [f"{c.what} ({' '.join(c.flags)}): {_per_thousand(c)}" for c in others]
    same = "" if best.same_training else ", which trains adapters instead of the whole tower"
    return (
        msg + f"; cheapest change that fits: {best.what} ({' '.join(best.flags)}{same}): "
        f"{describe(best.plan)}, {_per_thousand(best)}"
        + ("; also: " + "; ".join(text) if text else "")
    )


def _per_thousand(change) -> str:
    return (
        f"${change.cost_per_sample * 1000:,.2f} per 1,000 samples at "
        f"${change.plan.time.price_per_gpu_hour:,.2f} per GPU-hour"
    )


def _prices_line(plan: Plan) -> str:
    if plan.config.price_per_gpu_hour is not None:
        return f"costs in USD at ${plan.config.price_per_gpu_hour:,.2f} per GPU-hour (--price-per-gpu-hour), the same for every GPU type"
    if plan.time.price_source != PRICE_SOURCE:
        return f"costs in USD per GPU-hour from {plan.time.price_source}; --price-per-gpu-hour overrides"
    return "costs in USD at each GPU's indicative on-demand list price per GPU-hour (catalog of 2026-11; docs/PLANNER.md), not a quote; --price-per-gpu-hour overrides"


def _inference(args, model, catalog) -> int:
    """--inference: memory per GPU of each replica (--tp GPUs; --gpus / --tp replicas), decode
    tokens/s and time to first token (plan/inference.py, plan/serving.py)."""
    from mmtrain.plan.inference import inference_memory
    from mmtrain.plan.serving import serving_speed

    gpu = catalog.gpu(args.gpu)
    precision = "bf16" if args.precision in ("bf16-weights", "bf16-pure") else args.precision
    if any(s.kind == "diffusion" for s in model.stacks):
        return _sampling(args, model, gpu, precision)
    context = args.context or 4096
    gpus = max(args.gpus, args.tp)  # `--tp 8` alone: one group of 8 (--gpus defaults to 1)
    est = inference_memory(model, gpu, context, args.batch, precision, args.tp, gpus)
    if args.prompt_tokens is not None and not 1 <= args.prompt_tokens <= context:
        raise FieldError("--prompt-tokens", f"must be between 1 and --context {context}")
    speed = serving_speed(model, gpu, catalog, est, precision, args.prompt_tokens, args.mfu)
    result = {
        "model": {"name": model.name, "params": model.params()},
        "gpu": gpu.key,
        "inference": est.to_dict(),
        "serving": speed.to_dict(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    layout = f"{gpus} x {gpu.name}: {est.replicas} replica(s) of TP {est.tp}"
    print(f"{model.name} on {layout} ({gpu.memory_usable_gib} GiB usable each), {precision}, "
          f"{est.batch} x {est.context} tokens a replica")  # fmt: skip
    print(
        f"  a GPU holds: weights {_gib(est.weights_bytes)} GiB ({est.weights_bytes / 1e9:,.1f} GB); KV cache {_gib(est.kv_cache_bytes)} GiB ({est.kv_bytes_per_token:,.0f} B/token); activations {_gib(est.activations_bytes)} GiB; CUDA context {_gib(est.overhead_bytes)} GiB"
    )
    print(
        f"  total {_gib(est.total_bytes)} GiB: {'fits' if est.total_bytes <= est.usable_bytes else 'does not fit'}; largest batch a replica holds at this context: {est.max_batch}"
    )
    if gpu.mig_profiles and est.tp == 1:
        print(
            f"  MIG: {est.mig_profile} holds it, {est.mig_instances} per GPU"
            if est.mig_profile
            else "  MIG: no profile holds it"
        )
    s = speed
    print(
        f"  decode at {est.context:,} tokens: {s.decode_bytes_per_gpu / 1e9:,.2f} GB read a GPU "
        f"a step at {s.hbm_bytes_per_s / 1e12:g} TB/s: {s.decode_step_s * 1e3:,.1f} ms a step, "
        f"{s.tokens_per_s_per_sequence:,.1f} tokens/s a sequence, "
        f"{s.tokens_per_s:,.0f} tokens/s over {est.replicas} replica(s) at batch {est.batch}"
        + (f", {s.max_batch_tokens_per_s:,.0f} at the largest batch" if est.max_batch else "")
    )
    print(
        f"  time to first token: {s.prompt_tokens:,}-token prompt, {_flops(s.prefill_flops)} "
        f"on {est.tp} GPU(s) at {s.achievable_fraction:.1%} of peak: {s.ttft_s:,.3g} s"
    )
    print("  assumptions: " + "; ".join(s.assumptions))
    return 0


def _sampling(args, model, gpu, precision: str) -> int:
    """--inference of a denoiser: a sampler's time, images/s and cost per image on one GPU."""
    from mmtrain.plan.sampling import sampling_estimate

    est = sampling_estimate(
        model, gpu, steps=args.sampling_steps, guidance=not args.no_guidance, batch=args.batch,
        precision=precision, mfu=args.mfu, price_per_gpu_hour=args.price_per_gpu_hour,
    )  # fmt: skip
    result = {
        "model": {"name": model.name, "params": model.params()},
        "gpu": gpu.key,
        "sampling": est.to_dict(),
    }
    if args.samples:
        result["sampling"]["images"] = args.samples
        result["sampling"]["gpu_hours"] = est.gpu_hours(args.samples)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    d = result["sampling"]
    guidance = "with guidance (2 forwards a step)" if est.forwards_per_step == 2 else "no guidance"
    print(f"{model.name} on {gpu.name}, {precision}, {est.steps} sampling steps {guidance}")
    print(
        f"  {d['flops_per_image'] / 1e12:,.3g} TFLOPs an image; {est.images_per_s:,.3g} images/s "
        f"per GPU at {est.achievable_fraction:.1%} of peak ({est.efficiency_source})"
    )
    cost = d["cost_per_million_images"]
    print(
        f"  {d['gpu_hours_per_million_images']:,.1f} GPU-hours per million images"
        + (f", ${cost:,.0f} at ${est.price_per_gpu_hour:,.2f} per GPU-hour" if cost else "")
    )
    if args.samples:
        print(f"  {args.samples:,} images: {d['gpu_hours']:,.1f} GPU-hours")
    print(
        f"  memory for {est.batch} image{'s' if est.batch > 1 else ''}: weights {_gib(est.weights_bytes)} GiB, activations "
        f"{_gib(est.activations_bytes)} GiB, CUDA context {_gib(est.overhead_bytes)} GiB: "
        f"{'fits' if d['fits'] else 'does not fit'}; largest batch {est.max_batch}"
    )
    return 0


def _workloads(args, catalog) -> int:
    from mmtrain.plan.recommend import layout_name, recommend

    gpu = catalog.gpu(args.gpu or "b300")
    rows = []
    for w in load_workloads(args.workloads):
        model = load_model(w.model, context=w.context)
        if w.freeze:
            model = model.with_modes({name: "frozen" for name in w.freeze})
        cfg = PlanConfig(
            gpu=gpu.key,
            precision=w.precision,
            global_batch=w.global_batch,
            samples=w.samples,
            headroom=args.headroom,
        )
        rec = recommend(model, cfg, catalog, [gpu.key], args.max_gpus, args.rank_by, args.deadline)
        best = rec.ranked[0] if rec.ranked else None
        rows.append((w, model, best, rec))
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "task": w.task,
                        "model": w.model,
                        "params": m.params(),
                        "policy": rec.policy,
                        "plan": p.to_dict() if p else None,
                    }
                    for w, m, p, rec in rows
                ],
                indent=2,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    deadline = args.deadline or DEFAULT_DEADLINE_H
    order = (
        f"cheapest within {deadline:,.0f} h (fastest where none is)"
        if args.rank_by != "time"
        else "fastest"
    )
    table = Table(title=f"workloads on {gpu.name}: {order}; up to {args.max_gpus} GPUs")
    for col in (
        "task",
        "model",
        "params",
        "GiB/GPU",
        "configuration",
        "samples/s",
        "MFU",
        "time h",
        "cost USD",
    ):
        table.add_column(col)
    for w, m, p, rec in rows:
        if p is None:
            table.add_row(
                w.task,
                w.model,
                f"{m.params() / 1e9:.1f}B",
                "-",
                f"does not fit on {args.max_gpus} GPUs",
                "-",
                "-",
                "-",
                "-",
            )
            continue
        c, t = p.config, p.time
        sp = f" SP{c.sequence_parallel}" if c.sequence_parallel > 1 else ""
        conf = f"{c.gpus} GPUs {layout_name(c)}{sp} AC {c.ac} mb {c.micro_batch}"
        table.add_row(
            w.task,
            w.model,
            f"{m.params() / 1e9:.1f}B",
            _gib(p.memory.total_bytes),
            conf,
            f"{t.samples_per_s:,.4g}",
            f"{t.mfu:.0%}",
            f"{t.time_to_train_s / 3600:,.1f}" + ("" if rec.met_deadline else " (late)"),
            _usd(t.cost),
        )
    console = Console(width=max(Console().width, 160))
    console.print(table)
    if rows and rows[0][2] is not None:
        console.print(_prices_line(rows[0][2]))
    return 0


def _own(args: argparse.Namespace, catalog) -> int:
    """`--own`: the plan's (or `--projects`') GPU-hours on demand, by the month and bought."""
    from mmtrain.plan import ownership as own

    gpu, jobs = _own_jobs(args, catalog)
    given = ownership_given(args)
    decision = own.compare(jobs, own.resolve_inputs(catalog.gpu(gpu), given), given)
    if args.json:
        print(json.dumps(decision.to_dict(), indent=2))
        return 0
    _print_own(decision)
    return 0


def _own_jobs(args: argparse.Namespace, catalog) -> tuple[str, tuple]:
    """(GPU key, the year's jobs): the projects file's, or one run of the usual flags (its
    GPU-hours are the planner's time to train --samples on --gpus) --runs-per-year times."""
    from mmtrain.plan import ownership as own

    if args.projects:
        if args.samples:  # the file says each run's samples; a second source would be ignored
            raise FieldError("--samples", "with --projects give each run's samples in the file")
        return own.load_projects(args.projects, args.gpu, catalog)
    if not args.samples:
        raise FieldError("--samples", "--own prices the GPU-hours of training N samples: "
                         "give --samples N (or --projects FILE.yaml)")  # fmt: skip
    if args.runs_per_year < 1:
        raise FieldError("--runs-per-year", "must be at least 1")
    args = replace_gpu(args, args.gpu or "h100")
    plan = make_plan(_model(args, _visual_inputs(args)), _config(args), catalog)
    job = own.Job(plan.model.name, args.gpus, own.plan_gpu_hours(plan), args.runs_per_year)
    return plan.gpu.key, (job,)


def _print_own(d) -> None:
    """The decision as text: the work, the three totals, why the cheapest wins, when buying
    pays back, and which figures were the catalog's defaults (with the flag to override)."""
    from mmtrain.plan.ownership import explain

    i = d.inputs
    print(f"a year on {i.gpu}: " + "; ".join(_job_text(j) for j in d.jobs))
    print(f"over {i.horizon_months:g} months: {d.useful_gpu_hours:,.0f} useful GPU-hours; "
          f"bought: {d.servers_owned} x {i.gpus_per_server}-GPU server(s), "
          f"{d.utilisation:.1%} busy")  # fmt: skip
    if d.deadline_days:
        print(f"deadline: each training run within {d.deadline_days:g} days")
    print(f"  {'option':10} {'total':>18} {'per useful GPU-hour':>20}  deadline")
    for o in d.options:
        total = "never" if o.total is None else f"{o.total:,.0f} {i.currency}"
        per = "never" if o.per_useful_gpu_hour is None else f"{o.per_useful_gpu_hour:,.3f}"
        late = "-" if not d.deadline_days else ("met" if o.meets_deadline else "missed")
        print(f"  {o.name:10} {total:>18} {per:>20}  {late}")
    print(f"cheapest: {d.cheapest or 'none'}")
    print(f"why: {explain(d)}")
    be = _break_even(d.break_even_utilisation)
    print(f"buying breaks even at a utilisation of: {be} (this plan: {d.utilisation:.1%})")
    what_if = d.sensitivity
    be = _break_even(what_if["break_even_utilisation"])
    counted = f"this plan counts {i.residual_value:.0%}: --residual-value"
    print(f"with a {what_if['residual_value']:.0%} residual value, buying breaks even at a "
          f"utilisation of: {be} ({counted})")  # fmt: skip
    for mode, month in d.break_even_month.items():
        when = "never" if month is None else f"in month {month}"
        if month is not None and month > i.horizon_months:  # the saving outlives the horizon
            when += f", after the {i.horizon_months:g}-month horizon"
        print(f"buying pays back in cash against {mode} for this plan: {when}")
    print("defaults used (flag to override):" if i.defaults_used else "defaults used: none")
    for f in i.defaults_used:
        if f.kind == "left out":
            print(f"  {f.name}: none ({f.flag}): {f.source}")
        elif f.kind == "assumed":
            print(f"  {f.name} = {f.value:g} ({f.flag}): assumed: {f.source}")
        else:
            print(f"  {f.name} = {f.value:g} ({f.flag}): {f.source} [as of {f.as_of}]")


def _break_even(utilisation: dict[str, float | None]) -> str:
    """`on_demand 23.8%, monthly never`: the break-even utilisation against each rental."""
    return ", ".join(f"{mode} {'never' if u is None else f'{u:.1%}'}"
                     for mode, u in utilisation.items())  # fmt: skip


def _job_text(j) -> str:
    if j.service_months:
        return f"{j.name}: {j.gpus} GPUs x {j.service_months:g} months"
    return f"{j.name}: {j.gpu_hours:,.0f} GPU-hours on {j.gpus} GPUs x {j.repetitions}"
