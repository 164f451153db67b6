"""The GPU benchmark behind bench/gpu.sh: ViT-B-16 CLIP training in bf16 on synthetic data,
a 1B-parameter Llama-shaped LM on packed-length rows, Qwen2.5-VL-7B's vision tower on letter
pages at their own size, and DiT-XL/2 on 256 px latents.

Measured in one run: samples/s and MFU of mmtrain's training step (the trainer's own
`forward_backward` + `optimizer_step`), the same for OpenCLIP's ViT-B-16 when open_clip is
importable, peak CUDA memory beside the planner's prediction at several batch sizes, compiled
(per block, `train.compile`) against eager, fp8 matmuls through torchao when importable (loss
after the timed steps beside bf16's), the device->host synchronisations of a step (counted
under `torch.cuda.set_sync_debug_mode("warn")`), the LM's tokens/s, MFU and peak memory, and
the time to write a checkpoint, doctor's memory finding (memory_doctor.py), and issue 41's
checks of the GPU path: attention kernels and dtypes, ring blocks (gpu_attention.py), an FSDP2
step with accumulation, clipping, event timing and a DCP round trip (gpu_step.py), a frozen
LM's stage-1 memory (gpu_frozen.py), a native VLM's syncs and recompiles (gpu_vlm_syncs.py),
eight Qwen2.5-7B layers' MFU and the loss's share (gpu_lm_layers.py), the VLM loader's pages/s
(gpu_loader.py), CPU offload and QLoRA against full training (gpu_offload.py) and offload's GPU
and pinned host memory against the plan (gpu_offload_plan.py).
MFU uses the trainer's definition (`spec.train_flops`: every
part trained here, 3x the forward; recomputation not counted). Writes OUT/gpu_results.json and
OUT/gpu_results.md and prints the table.

    python bench/gpu_bench.py --out DIR [--batch 256] [--steps 20]
    python bench/gpu_bench.py --out DIR --dry-run     # tiny-clip, tiny sizes, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from common import command, count_syncs, machine, median_seconds
from gpu_attention import attention_note
from gpu_dpo import dpo_note
from gpu_frozen import frozen_note
from gpu_lm_layers import lm_layers_note
from gpu_loader import vlm_loader_note
from gpu_offload import offload_note
from gpu_offload_plan import offload_plan_note
from gpu_step import step_note
from gpu_vlm_syncs import vlm_syncs_note
from memory_doctor import memory_doctor_note

import mmtrain
from mmtrain.checkpoint import save_checkpoint
from mmtrain.hardware import default_catalog
from mmtrain.losses import ContrastiveLoss
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.workloads import load_model
from mmtrain.spec import load_spec
from mmtrain.train.loop import forward_backward, optimizer_step
from mmtrain.train.measure_step import random_batch
from mmtrain.train.metrics import detect_peak_flops
from mmtrain.train.objectives import LABELS_KEY, ContrastiveObjective, NextTokenObjective
from mmtrain.train.parallel import apply_activation_checkpointing, apply_compile
from mmtrain.train.precision import convert_to_fp8, make_precision


def model_flops(spec) -> float:
    """Model FLOPs per sample of training every part (the trainer's MFU definition)."""
    return spec.train_flops(spec.forward_flops_by_part())


def mmtrain_case(
    args, device, precision: str, batch: int, ac: str = "none", compiled: bool = False
) -> dict:
    """mmtrain's step for args.model at `batch`: step time, samples/s, MFU, peak memory."""
    spec = load_spec(args.model)
    model = mmtrain.create_model(spec, seed=0).to(device)
    if precision == "fp8":
        convert_to_fp8(model)
    apply_activation_checkpointing(model, ac)
    if compiled:
        apply_compile(model)
    prec = make_precision(precision, device) if device.type == "cuda" else _cpu(precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    objectives = [ContrastiveObjective(model, ContrastiveLoss.from_spec(spec, distributed=False))]
    data = {
        k: v.to(device)
        for k, v in random_batch(spec, batch, torch.Generator().manual_seed(0)).items()
    }

    losses = []

    def step():
        optimizer.zero_grad(set_to_none=True)
        losses.append(forward_backward(model, objectives, [data], prec)[0])
        optimizer_step(model, optimizer, prec, 1.0)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s = median_seconds(step, device, args.steps, args.warmup)
    flops = model_flops(spec)
    peak = detect_peak_flops(device, precision)
    row = {
        "impl": "mmtrain" + (" compiled" if compiled else ""),
        "syncs": count_syncs(step, device),
        "loss": float(losses[-1]),
        "model": spec.name,
        "precision": precision,
        "ac": ac,
        "batch": batch,
        "step_s": step_s,
        "samples_s": batch / step_s,
        "mfu": batch / step_s * flops / peak if peak else None,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
    }
    row["predicted_gib"] = _predicted_gib(args, spec.name, batch, ac)
    row["_model"], row["_optimizer"] = model, optimizer
    return row


def _cpu(precision: str):
    # fp8 and CUDA-only checks do not apply to the dry run; bf16 autocast works on CPUs.
    return make_precision("bf16" if precision == "fp8" else precision, torch.device("cpu"))


def _predicted_gib(args, name: str, batch: int, ac: str) -> float | None:
    """The planner's allocator-level prediction (states + activations + loss; without the CUDA
    context and fragmentation allowance, which max_memory_allocated does not see)."""
    try:
        cfg = PlanConfig(gpu=args.gpu, precision="bf16", bytes_per_param=18, micro_batch=batch)
        plan = make_plan(load_model(name), replace(cfg, ac=ac), default_catalog())
    except Exception as err:  # noqa: BLE001 - a benchmark reports and goes on
        print(f"planner: {err}", file=sys.stderr)
        return None
    m = plan.memory
    return (m.total_bytes - m.cuda_context_bytes - m.fragmentation_bytes) / 2**30


def openclip_case(args, device, batch: int) -> dict | None:
    """OpenCLIP's same model and step (AdamW, bf16 autocast, its ClipLoss), if installed."""
    try:
        import open_clip
    except ImportError:
        return None
    name = "ViT-B-16" if not args.dry_run else "ViT-B-32"
    model = open_clip.create_model(name).to(device)
    loss_fn = open_clip.ClipLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    size = model.visual.image_size
    size = size[0] if isinstance(size, tuple) else size
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=g).to(device)
    texts = torch.randint(1, 49407, (batch, 77), generator=g).to(device)
    dtype = torch.bfloat16

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            image_f, text_f, scale = model(images, texts)
        loss = loss_fn(image_f.float(), text_f.float(), scale)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s = median_seconds(step, device, args.steps, args.warmup)
    flops = model_flops(load_spec(name))
    peak = detect_peak_flops(device, "bf16")
    return {
        "impl": f"open_clip {open_clip.__version__}",
        "model": name,
        "precision": "bf16",
        "ac": "none",
        "batch": batch,
        "step_s": step_s,
        "samples_s": batch / step_s,
        "mfu": batch / step_s * flops / peak if peak else None,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "predicted_gib": None,
    }


def _next_token_step(spec, batch: dict, device, lr: float = 1e-5, prepare=None):
    """One bf16 training step (the trainer's forward_backward + optimizer_step, AC per
    block) of a fresh model of `spec` on `batch` (its tensors, and lists of them, moved);
    `prepare(model)` after the checkpointing (e.g. `apply_compile`, in the trainer's order)."""
    model = mmtrain.create_model(spec, seed=0).to(device)
    apply_activation_checkpointing(model, "full")
    if prepare is not None:
        prepare(model)
    prec = make_precision("bf16", device) if device.type == "cuda" else _cpu("bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
    data = {k: [x.to(device) for x in v] if isinstance(v, list) else v.to(device)
            for k, v in batch.items()}  # fmt: skip
    objectives = [NextTokenObjective()]

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, objectives, [data], prec)
        optimizer_step(model, optimizer, prec, 1.0)

    step.model = model  # a caller may compile it in place after timing it eager
    return step


def language_model_case(args, device, batch: int, positions: int) -> dict:
    """A random-init Llama-shaped LM of ~1B parameters (width 2048, 16 blocks, GQA 16/8 heads,
    128k ids, untied head) on rows of `positions` random ids, every one a target, bf16, the
    chunked next-token loss: tokens/s, MFU, peak memory against the planner."""
    from mmtrain.decoder_spec import DecoderSpec
    from mmtrain.spec import ModelSpec

    if args.dry_run:
        decoder = DecoderSpec(vocab_size=512, width=64, layers=2, heads=4, kv_heads=2,
                              mlp_hidden=160, max_positions=positions, tie_embeddings=False)  # fmt: skip
    else:
        decoder = DecoderSpec(vocab_size=128_256, width=2048, layers=16, heads=16, kv_heads=8,
                              mlp_hidden=8192, max_positions=positions, tie_embeddings=False)  # fmt: skip
    spec = ModelSpec(name="lm-1b", embed_dim=decoder.width, towers={}, objective="next_token",
                     decoder=decoder)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, decoder.vocab_size, (batch, positions), generator=g)
    step = _next_token_step(spec, {"text": ids, LABELS_KEY: ids}, device, lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s = median_seconds(step, device, max(args.steps // 4, 2), 2)
    flops = spec.train_flops(spec.sequence_flops_by_part([positions] * batch, 0))
    peak = detect_peak_flops(device, "bf16")
    return {
        "impl": "mmtrain LM", "model": f"{spec.params() / 1e9:.2f}B LM x {positions}",
        "precision": "bf16", "ac": "full", "batch": batch, "step_s": step_s,
        "samples_s": batch / step_s, "tokens_s": batch * positions / step_s,
        "mfu": flops / step_s / peak if peak else None, "syncs": count_syncs(step, device),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda" else None,
        "predicted_gib": None,
    }  # fmt: skip


def dit_case(args, device, batch: int) -> dict:
    """DiT-XL/2 on 32 x 32 x 4 latents (256 px images through SD's VAE), class-conditional,
    flow matching, bf16, through the trainer's objective and step: images/s, MFU, peak memory
    against the planner. Published: about 107 images/s on one A100 with cached latents and
    mixed precision (fast-DiT, the figure issue 18 cites)."""
    from mmtrain.config import DiffusionConfig
    from mmtrain.spec import ModelSpec
    from mmtrain.train.diffusion import DiffusionObjective

    name = "tiny-dit" if args.dry_run else "DiT-XL-2"
    base = load_spec(name).to_dict()
    base.update(objective="flow_matching")
    base["denoiser"].update(prediction="velocity", learn_sigma=False)
    spec = ModelSpec.from_dict(base)
    model = mmtrain.create_model(spec, seed=0).to(device)
    prec = make_precision("bf16", device) if device.type == "cuda" else _cpu("bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    d = spec.denoiser
    g = torch.Generator().manual_seed(0)
    data = {
        d.input: torch.randn(batch, d.channels, d.sample_size, d.sample_size, generator=g).to(
            device
        ),
        "class": torch.randint(0, d.num_classes, (batch,), generator=g).to(device),
    }
    objectives = [DiffusionObjective(spec, DiffusionConfig(), seed=0)]
    state = {"step": 0}

    def step():
        state["step"] += 1
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, objectives, [data], prec, state["step"])
        optimizer_step(model, optimizer, prec, 1.0)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s = median_seconds(step, device, max(args.steps // 2, 2), 2)
    peak = detect_peak_flops(device, "bf16")
    flops = spec.train_flops(spec.forward_flops_by_part()) * batch
    return {
        "impl": "mmtrain DiT", "model": name, "precision": "bf16", "ac": "none", "batch": batch,
        "step_s": step_s, "samples_s": batch / step_s,
        "mfu": flops / step_s / peak if peak else None, "syncs": count_syncs(step, device),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda" else None,
        "predicted_gib": _predicted_gib(args, name, batch, "none"),
    }  # fmt: skip


def native_vlm_case(args, device, pages: int) -> dict:
    """Qwen2.5-VL-7B's vision tower (32 blocks, windows, merger) in full beside the first 4 of
    its LM's 28 blocks, one packed row of `pages` letter pages (2200 x 1700 resized by the
    processor's rule: 1120 x 868, 1,240 tokens each) and text, bf16, AC per block: pages/s,
    MFU (each page's tower FLOPs at its size, `spec.train_flops`) and peak memory against the
    planner's plan of the same row (`--visual`)."""
    from mmtrain.plan.model import Rows, from_spec
    from mmtrain.spec import ModelSpec

    base = load_spec("tiny-qwen2-vl" if args.dry_run else "Qwen2.5-VL-7B").to_dict()
    if not args.dry_run:
        base["decoder"].update(layers=4)
    name = base["name"] if args.dry_run else "Qwen2.5-VL-7B tower + 4 LM blocks"
    spec = ModelSpec.from_dict({**base, "name": name})
    v, tokens = spec.vision, spec.vision_tokens
    h, w = v.resized(2200, 1700)
    page_tokens = v.tokens(h, w)
    positions = pages * (page_tokens + 64)
    g = torch.Generator().manual_seed(0)
    ids = min(tokens.image_token_id, tokens.video_token_id, 1000)  # text ids below both
    text = torch.randint(0, ids, (1, positions - pages * (page_tokens - 1)), generator=g)
    text[0, torch.arange(pages) * 64] = tokens.image_token_id  # a page every 64 text ids
    images = [torch.randn(3, h, w, generator=g) for _ in range(pages)]
    step = _next_token_step(spec, {"text": text, LABELS_KEY: text, "image": images}, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s = median_seconds(step, device, max(args.steps // 4, 2), 2)
    visual = [(1, h, w)] * pages
    flops = spec.train_flops(spec.sequence_flops_by_part([positions], 0, visual))
    peak = detect_peak_flops(device, "bf16")
    predicted = None
    try:
        rows = Rows(positions=positions, visual_inputs=tuple(visual))
        cfg = PlanConfig(gpu=args.gpu, precision="bf16", bytes_per_param=18, micro_batch=1,
                         ac="full")  # fmt: skip
        m = make_plan(from_spec(spec, rows), cfg, default_catalog()).memory
        predicted = (m.total_bytes - m.cuda_context_bytes - m.fragmentation_bytes) / 2**30
    except Exception as err:  # noqa: BLE001 - a benchmark reports and goes on
        print(f"planner: {err}", file=sys.stderr)
    return {
        "impl": "mmtrain native VLM", "model": f"{spec.name}, {pages} pages of {h}x{w}",
        "precision": "bf16", "ac": "full", "batch": 1, "step_s": step_s,
        "samples_s": pages / step_s, "mfu": flops / step_s / peak if peak else None,
        "syncs": count_syncs(step, device),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda" else None,
        "predicted_gib": predicted,
    }  # fmt: skip


def checkpoint_seconds(model, optimizer) -> float:
    """Seconds to write one full checkpoint (weights, optimizer, manifest) to local disk."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        state = {"optimizer": optimizer.state_dict()}
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        save_checkpoint(Path(folder), 1, weights, state, {"bench": True}, keep=1)
        return time.perf_counter() - start


def data_path_note(device: torch.device) -> str:
    """The training data path on this device: micro shards through `TrainData` with 2 workers,
    uint8 pixels pinned by the DataLoader's pin thread (on CUDA), copied without blocking and
    normalised on the device, against the workers' float32 pixels: equal bit for bit?"""
    import yaml

    from mmtrain.config import config_from_dict
    from mmtrain.train.data import TrainData
    from mmtrain.train.step import move_batch

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from micro import MICRO_SPEC, make_shards

    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.yaml"
        spec_file.write_text(yaml.safe_dump(MICRO_SPEC))
        shards = make_shards(Path(tmp) / "shards", 32)
        config = config_from_dict(
            {"model": str(spec_file), "data": {"train": shards, "workers": 2},
             "train": {"steps": 1, "batch_size": 8}, "out": str(Path(tmp) / "run")}
        )  # fmt: skip
        spec = load_spec(str(spec_file))
        on_cuda = device.type == "cuda"
        fast = TrainData(config, spec, rank=0, world_size=1, micro_batch=8, uint8_pixels=True,
                         pin_memory=on_cuda)  # fmt: skip
        plain = TrainData(config, spec, rank=0, world_size=1, micro_batch=8)
        pixels = {k: tuple(torch.as_tensor(v, device=device) for v in vs)
                  for k, vs in fast.pixel_normalisation().items()}  # fmt: skip
        equal, pinned = True, True
        for _ in range(4):
            a, b = fast.next_batch(), plain.next_batch()
            pinned &= all(t.is_pinned() for t in a.values()) if on_cuda else True
            got = move_batch(a, device, torch.float32, pixels)
            want = move_batch(b, device, torch.float32)
            equal &= all(torch.equal(got[k], want[k]) for k in want)
        fast.close(), plain.close()
    return (
        f"data path ({'pinned ' if on_cuda else ''}uint8 pixels normalised on {device.type}, "
        f"2 workers): {'equal' if equal else 'DIFFERENT'} to the workers' float32 pixels; "
        f"batches pinned: {pinned}"
    )


def sequence_parallel_note(device: torch.device) -> str:
    """Sequence parallelism's path on this device, on one GPU: tiny-vlm's packed rows (an image
    in each) split by a group of one rank (train/sequence_parallel.py: the all-to-all kernel
    with the unsplit path's mask over the padded row, flex's BlockMask on CUDA; the ring's
    block math), loss and gradients against the unsplit model in fp32, TF32 off."""
    from mmtrain.models.build import create_model
    from mmtrain.train.measure_step import language_batch
    from mmtrain.train.sequence_comm import SequenceGroup
    from mmtrain.train.sequence_parallel import ALL_TO_ALL, RING, SequenceShard

    spec = load_spec("tiny-vlm")
    model = create_model(spec, seed=0).to(device)
    rows = language_batch(spec, 2, 512, 1, torch.Generator().manual_seed(0), packed=True)
    batch = {k: v.to(device) for k, v in rows.items()}

    def loss_and_grads(split) -> tuple[float, list[torch.Tensor]]:
        model.sequence_split = split
        model.zero_grad(set_to_none=True)
        loss = model(batch)["nll_sum"]
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        whole_loss, whole = loss_and_grads(None)
        parts = []
        for attention in (ALL_TO_ALL, RING):
            loss, grads = loss_and_grads(SequenceShard(SequenceGroup.single(), attention))
            worst = max(
                ((g - w).abs().max() / w.abs().max().clamp(min=1e-30)).item()
                for g, w in zip(grads, whole, strict=True)
            )
            parts.append(f"{attention} loss {abs(loss / whole_loss - 1):.1e}, grads {worst:.1e}")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        model.sequence_split = None
    return (
        f"sequence parallelism on {device.type} (a 1-rank group, tiny-vlm packed rows, fp32): "
        "relative difference to the unsplit step: " + "; ".join(parts)
    )


def _or_dash(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(rows: list[dict]) -> list[str]:
    out = [
        "| impl | model | precision | AC | batch | step ms | samples/s | MFU | peak GiB | plan GiB | syncs/step | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        plan = f"{r['predicted_gib']:.2f}" if r.get("predicted_gib") is not None else "-"
        out.append(
            f"| {r['impl']} | {r['model']} | {r['precision']} | {r['ac']} | {r['batch']} "
            f"| {1e3 * r['step_s']:.1f} | {r['samples_s']:.1f} | {mfu} | {peak} | {plan} "
            f"| {_or_dash(r.get('syncs'), '{}')} | {_or_dash(r.get('loss'), '{:.4f}')} |"
        )
    return out


def other_cases(args, device, run, notes, within_budget) -> None:
    """The step cases beside the main one: OpenCLIP's, memory at several batch sizes with and
    without checkpointing, compiled, the LM, the native VLM, DiT, fp8."""
    if within_budget("open_clip") and run("open_clip", openclip_case, args, device,
                                          args.batch) is None:  # fmt: skip
        if not any(n.startswith("open_clip") for n in notes):  # none failed: not installed
            notes.append("open_clip: not installed (carry its wheels in .whl/ to compare)")
    for batch in [int(b) for b in args.memory_batches.split(",")]:
        for ac in ("none", "full"):
            label = f"memory b={batch} ac={ac}"
            row = within_budget(label) and run(label, mmtrain_case, args, device, "bf16",
                                               batch, ac)  # fmt: skip
            if row:
                row.pop("_model"), row.pop("_optimizer")
    row = within_budget("mmtrain compiled") and run(
        "mmtrain compiled", mmtrain_case, args, device, "bf16", args.batch, compiled=True
    )
    if row:
        row.pop("_model"), row.pop("_optimizer")
    positions = 64 if args.dry_run else 2048
    lm = within_budget("LM") and run("LM", language_model_case, args, device,
                                     2 if args.dry_run else 8, positions)  # fmt: skip
    if lm:
        notes.append(f"LM: {lm['tokens_s']:,.0f} tokens/s")
    vlm = within_budget("native VLM") and run("native VLM", native_vlm_case, args, device,
                                              1 if args.dry_run else 4)  # fmt: skip
    if vlm:
        notes.append(f"native VLM: {vlm['samples_s']:,.2f} pages/s ({vlm['model']})")
    dit = within_budget("DiT") and run("DiT", dit_case, args, device,
                                       4 if args.dry_run else 64)  # fmt: skip
    if dit:
        notes.append(f"DiT: {dit['samples_s']:,.1f} images/s (fast-DiT: ~107 on one A100)")
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        notes.append("fp8: torchao not installed (carry its wheels in .whl/ to measure)")
    elif within_budget("mmtrain fp8"):
        row = run("mmtrain fp8", mmtrain_case, args, device, "fp8", args.batch)
        if row is not None:
            row.pop("_model"), row.pop("_optimizer")


def _catalog_gpu(device: torch.device) -> tuple[str, str]:
    """The catalog's key of the card the benchmark runs on, and how it was found; h200 (the
    lent machines' larger card) for a CPU dry run or a card the catalog does not know."""
    if device.type != "cuda":
        return "h200", "a dry run on the CPU"
    name = torch.cuda.get_device_name(device)
    try:
        return default_catalog().resolve_device(name)[0].key, f"the driver's {name!r}"
    except Exception:  # noqa: BLE001 - an unknown card: plan a known one and say so
        return "h200", f"{name!r} is not in the catalog"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_results.json/.md")
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument(
        "--gpu", default=None, help="catalog name for the planner (default: the card it runs on)"
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--memory-batches", default="64,128,256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="tiny-clip, tiny sizes, CPU")
    parser.add_argument(
        "--part", choices=("all", "gpu-path", "cases"), default="all",
        help="gpu-path: issue 41's checks of the GPU path; cases: the step cases and the "
        "other notes; all: the main step, then gpu-path, then cases",
    )  # fmt: skip
    parser.add_argument(
        "--budget-s", type=float, default=400.0,
        help="seconds after which the cases and notes not yet begun are skipped and named "
        "(gpu.sh's timeout is 450 s; run what was skipped with --part)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.dry_run:
        args.model, args.batch, args.memory_batches = "tiny-clip", 4, "2,4"
        args.steps, args.warmup = 2, 1
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA GPU visible: use --dry-run on a CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, notes = [], []
    where = machine()
    header = [f"command: `{command()}`", f"machine: {where}", ""]

    def save() -> list[str]:
        """Write gpu_results.md and .json as they stand (after every case and note, so that a
        run gpu.sh's timeout stops keeps what it measured); returns the table's lines."""
        kept = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        lines = table(kept)
        (out / "gpu_results.md").write_text("\n".join([*header, *lines, "", *notes, ""]))
        (out / "gpu_results.json").write_text(
            json.dumps({"machine": where, "rows": kept, "notes": notes}, indent=1)
        )
        return lines

    if args.gpu is None:  # plan the card it runs on, as the trainer names it
        args.gpu, how = _catalog_gpu(device)
        notes.append(f"planned for {args.gpu} ({how})")

    def run(label: str, fn, *a, **kw):
        try:
            row = fn(*a, **kw)
        except Exception as err:  # noqa: BLE001 - report the case and go on with the others
            notes.append(f"{label}: failed: {type(err).__name__}: {err}")
            print(notes[-1], file=sys.stderr, flush=True)
            save()
            return None
        if row is not None:
            rows.append(row)
            print(table([row])[-1], flush=True)
        save()
        return row

    dry = args.dry_run
    gpu_path = (  # issue 41's checks of the GPU path: what this machine is lent for first
        ("attention", lambda: attention_note(device, dry)),  # kernels, q/k/v dtypes, ring
        ("FSDP2 step", lambda: step_note(device, dry)),  # accumulation, clip, timing, DCP
        ("frozen LM", lambda: frozen_note(device, dry)),  # stage 1 memory vs the plan
        ("VLM syncs", lambda: vlm_syncs_note(device, dry)),  # sync debug mode, recompiles
        ("LM layers", lambda: lm_layers_note(device, dry)),  # 7B layers: MFU, compile, loss
        ("offload and QLoRA", lambda: offload_note(device, dry)),  # peak GPU memory, ms/step
        ("offload plan", lambda: offload_plan_note(device, dry)),  # GPU + pinned host vs plan
        ("DPO step", lambda: dpo_note(device, dry)),  # 3 references: ms, peak vs plan, syncs
        ("VLM loader", lambda: vlm_loader_note(device, dry)),  # pages/s with 14 workers
    )
    others = (
        ("data path", lambda: data_path_note(device)),
        ("sequence parallelism", lambda: sequence_parallel_note(device)),
        ("doctor memory", lambda: memory_doctor_note(device)),
    )
    started = time.monotonic()

    def within_budget(label: str) -> bool:
        """False, with a note, once the run spent --budget-s: what is left is named, and
        `--part` runs it in a call of its own."""
        spent = time.monotonic() - started
        if spent < args.budget_s:
            return True
        notes.append(f"{label}: skipped, {spent:.0f} s of the {args.budget_s:.0f} s budget spent")
        save()
        return False

    def take_notes(items) -> None:
        for label, note in items:
            if not within_budget(label):
                continue
            try:
                notes.append(note())
            except Exception as err:  # noqa: BLE001 - report and go on
                notes.append(f"{label}: failed: {type(err).__name__}: {err}")
            print(notes[-1], flush=True)
            save()

    if args.part in ("all", "cases"):
        main_row = run("mmtrain bf16", mmtrain_case, args, device, "bf16", args.batch)
        if main_row is not None:
            seconds = checkpoint_seconds(main_row["_model"], main_row["_optimizer"])
            notes.append(f"checkpoint save (weights + AdamW state + manifest): {seconds:.2f} s")
            print(notes[-1], flush=True)
            main_row.pop("_model"), main_row.pop("_optimizer")
    if args.part in ("all", "gpu-path"):
        take_notes(gpu_path)
    if args.part in ("all", "cases"):
        other_cases(args, device, run, notes, within_budget)
        take_notes(others)
    for r in rows:
        r.pop("_model", None), r.pop("_optimizer", None)
    lines = save()
    print("\n".join(["", *lines, "", *notes]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
