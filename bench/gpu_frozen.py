"""LLaVA's stage 1 on one GPU: the projector trains through a frozen LM, and the peak memory of a
step is set beside the plan the trainer records for the run (`planned_memory`).

A LLaVA-shaped model (a ViT of width 1024 at 224 px / patch 14, 256 image tokens; a Llama-shaped
decoder of width 2048, 12 blocks, GQA 16/8 heads, 32k ids; rows of 2,048 positions with one image,
4 rows) built by the trainer (`build_model`, one process), image tower and LM frozen, bf16:
- with the LM's blocks checkpointed (`train.towers.text.activation_checkpointing`, the recipe's
  setting) and without: measured peak allocated memory against the planned allocation (model
  states + activations + buffers), which now counts the frozen LM's activations;
- the frozen weights held in fp32 (what the trainer did before): the peak grows by the fp32
  weights' extra 2 bytes a parameter plus the bf16 copies of the LM's block weights autograd
  kept for the gradient; the note gives both the measured growth and that expectation.

On a CPU (`dry_run`) the same code on tiny-vlm's sizes: it proves the note runs (no allocator to
read, so no peak).

    from gpu_frozen import frozen_note; print(frozen_note(torch.device("cuda"), dry_run=False))
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import torch
from torch import nn

from mmtrain.config import config_from_dict
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.train import parallel
from mmtrain.train.measure_step import language_batch, next_token_loss
from mmtrain.train.metrics import planned_memory
from mmtrain.train.model_setup import build_model
from mmtrain.train.precision import make_precision

GIB = 2**30


def _spec(dry_run: bool) -> ModelSpec:
    spec = load_spec("tiny-vlm").to_dict()
    if not dry_run:
        spec["towers"]["image"].update(
            stem={"image_size": 224, "patch_size": 14}, width=1024, layers=12, heads=16
        )
        spec["decoder"].update(vocab_size=32_000, width=2048, layers=12, heads=16, kv_heads=8,
                               mlp_hidden=5632, max_positions=2048, tie_embeddings=False)  # fmt: skip
        spec["projector"]["image_token_id"] = 31_999
        spec["embed_dim"] = 1024  # a tower without output projection: its width
    return ModelSpec.from_dict(spec)


def _config(folder: Path, micro: int, positions: int, recompute: bool):
    text = {"freeze": True, "activation_checkpointing": recompute}
    config = config_from_dict({
        "model": "tiny-vlm", "data": {"train": str(folder), "sequence_length": positions},
        "train": {"steps": 1, "batch_size": micro, "micro_batch": micro, "precision": "bf16",
                  "towers": {"image": {"freeze": True}, "text": text}},
        "out": str(folder / "run"),
    })  # fmt: skip
    config.validate(world_size=1)
    return config


def _peak(device: torch.device, spec: ModelSpec, config, fp32_frozen: bool) -> tuple[int, int]:
    """(peak allocated bytes of the second step, planned allocated bytes) of one variant."""
    precision = make_precision("bf16", device)
    env = parallel.DistributedEnv(device, 0, 1, 0, False, 1)
    built = build_model(config, spec, precision, env, None)
    model = built.model
    if fp32_frozen:  # as the trainer held them before: fp32, cast by autocast at every call
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.float()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    positions, micro = config.data.sequence_length, config.train.micro_batch
    batch = language_batch(spec, micro, positions, 1, torch.Generator().manual_seed(0))
    batch = {k: v.to(device) for k, v in batch.items()}
    peak = 0
    for step in range(2):  # the optimizer's state exists from the second step on
        if step == 1 and device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with precision.autocast():
            loss = next_token_loss(model(batch), batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    plan = planned_memory(spec, config, world_size=1, recompute=built.recompute, device=device)
    del model, optimizer, built, batch, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak, plan["predicted_allocated_bytes"]


def _lm_block_weights(spec: ModelSpec) -> int:
    from mmtrain.models import create_model

    model = create_model(spec, device="meta")
    blocks = model.towers["text"].blocks
    return sum(m.weight.numel() for m in blocks.modules() if isinstance(m, nn.Linear))


def _frozen_matmul_params(spec: ModelSpec) -> int:
    from mmtrain.models import create_model
    from mmtrain.train.model_setup import CAST_BY_AUTOCAST

    model = create_model(spec, device="meta")
    towers = model.towers
    return sum(p.numel() for m in towers.modules() if isinstance(m, CAST_BY_AUTOCAST)
               for p in m.parameters(recurse=False))  # fmt: skip


def frozen_note(device: torch.device, dry_run: bool) -> str:
    spec = _spec(dry_run)
    micro, positions = (2, 160) if dry_run else (4, 2048)
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for recompute in (True, False):
            config = _config(Path(tmp), micro, positions, recompute)
            peak, plan = _peak(device, spec, config, fp32_frozen=False)
            label = "LM recomputed" if recompute else "LM not recomputed"
            if device.type != "cuda":
                parts.append(f"{label}: plan {plan / GIB:.3f} GiB (no peak on {device.type})")
                continue
            parts.append(f"{label}: peak {peak / GIB:.2f} GiB vs plan {plan / GIB:.2f} GiB "
                         f"({100 * (peak / plan - 1):+.1f}%)")  # fmt: skip
        config = _config(Path(tmp), micro, positions, recompute=False)
        old, _ = _peak(device, spec, config, fp32_frozen=True)
    expected = 2 * _frozen_matmul_params(spec) + 2 * _lm_block_weights(spec)
    if device.type == "cuda":
        grown = old - peak
        parts.append(f"frozen weights in fp32 (before): peak +{grown / GIB:.2f} GiB "
                     f"(expected +{expected / GIB:.2f}: fp32 weights and the LM's kept bf16 "
                     "weight copies)")  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    head = f"stage-1 frozen LM on {name} ({micro} x {positions} positions, bf16)"
    return f"{head}: {'; '.join(parts)}"
