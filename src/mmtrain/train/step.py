"""One optimizer step's device work: forward and backward over K micro-batches, then the
gradient check, clipping and the optimizer.

The step never waits on the device but once: `optimizer_step` reads two flags (is the loss
finite on every rank, is the gradient finite) to decide whether to step, as GradScaler does.
Losses, the gradient norm and the objectives' counts stay on the device; the metrics recorder
(train/recorder.py) reads them on logging steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mmtrain.data.stream.transforms import ImageTransform
from mmtrain.distributed import sum_tensor_over_ranks
from mmtrain.losses import at_least_fp32
from mmtrain.models.build import unwrap_model
from mmtrain.train import parallel
from mmtrain.train.data import LABEL_KEY
from mmtrain.train.objectives import Objective, model_inputs
from mmtrain.train.precision import Precision

log = logging.getLogger(__name__)


def forward_backward(
    trained: nn.Module,
    objectives: Sequence[Objective],
    micro_batches: Sequence[dict[str, torch.Tensor]],
    precision: Precision,
    step: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward over K micro-batches, with the gradient of ONE batch of all of them
    (each objective normalises its share so; train/objectives.py says how).

    `trained` is what runs the forward (the DDP/compiled wrapper). Gradients accumulate in
    `.grad`; DDP synchronises them on the last micro-batch only, FSDP2 reduce-scatters each
    micro-batch's into the shards (`parallel.no_sync` says why). Returns this rank's share of
    the step's total loss and the named parts of the objectives (loss per pair, "fusion"),
    detached, on the device: reading them is the caller's choice.
    """
    for objective in objectives:
        objective.prepare(trained, micro_batches, precision, step)
    k = len(micro_batches)
    plain = unwrap_model(trained)
    for j, batch in enumerate(micro_batches):
        sync = contextlib.nullcontext() if j == k - 1 else parallel.no_sync(trained)
        with sync:
            inputs = model_inputs(batch)
            for objective in objectives:
                inputs = objective.inputs(inputs, j)
            with precision.autocast():
                out = trained(inputs)
            loss = torch.zeros((), device=next(iter(out.values())).device)
            read: set[str] = set()
            for objective in objectives:
                loss = loss + objective.loss(out, batch, j)
                read |= objective.reads(batch)
            if trained is not plain:
                # Outputs no loss reads (a fused tower's projection): a zero term keeps their
                # parameters in the graph, so DDP's reducer gets a (zero) gradient for each.
                for name in sorted(out.keys() - read):
                    loss = loss + 0.0 * at_least_fp32(out[name]).sum()
            if precision.scaler is not None:
                precision.scaler.scale(loss).backward()
            else:
                loss.backward()
    total: torch.Tensor | None = None
    parts: dict[str, torch.Tensor] = {}
    for objective in objectives:
        for name, value in objective.report().items():
            if name:
                parts[name] = value
            else:
                total = value if total is None else total + value
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    return total, parts


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    grad_clip: float | None,
    loss: torch.Tensor | None = None,
    skip: bool = False,
) -> tuple[torch.Tensor, bool, bool]:
    """Unscale (fp16), clip, and step unless the loss (on any rank) or the gradient is not
    finite; returns (gradient norm on the device, stepped, loss finite on every rank).

    The one device->host read of the step is here: both flags in one transfer, after one
    all-reduce of them (the ranks must agree to skip, and to count a bad step towards a
    rollback). With fp16 the scaler still lowers its scale after an overflow (`update` reads
    the unscale's inf checks on the device), so a skipped step costs no other read.
    `skip`: the caller wants this step skipped whatever the flags say.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scaler = precision.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = clip_gradients(params, grad_clip)
    bad_loss = torch.zeros((), device=norm.device) if loss is None else ~torch.isfinite(loss)
    flags = torch.stack([bad_loss.to(norm.device, torch.float32), (~torch.isfinite(norm)).float()])
    loss_bad, grad_bad = sum_tensor_over_ranks(flags).tolist()  # the step's one read
    stepped = not (skip or loss_bad or grad_bad)
    if stepped:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.update()
    return norm.detach(), stepped, not loss_bad


def clip_gradients(params: Sequence[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` (a plain tensor on the device) after
    scaling them down to `max_norm` when it is exceeded (None: measure only, scale nothing).

    Both passes use the foreach kernels (a few fused launches instead of one norm and one
    multiply per parameter), asked for explicitly as torchtitan does: `foreach=None` takes
    them only while every gradient is a plain tensor or a DTensor, and otherwise falls back to
    the loop silently. FSDP2's gradients are DTensors (their norm is one too, of the shards):
    the full norm is gathered before the clip coefficient is formed from it."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def move_batch(
    batch: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    pixels: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The batch on `device`, float inputs in `dtype` (the weights' dtype; labels keep theirs).
    A pinned host tensor is copied without blocking the host. `pixels`: {batch key: (mean,
    inv_std) on `device`} of uint8 pixels to normalise there (`TrainData.pixel_normalisation`)."""

    def move(name: str, value: Any) -> Any:
        if isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
            return [move(name, v) for v in value]  # a native VLM's images / clips, own sizes
        if not isinstance(value, torch.Tensor):
            return value  # a host value the layout computed (models.vlm.SPLICE_SIZES)
        if device.type != "cpu":
            value = value.to(device, non_blocking=value.is_pinned())
        if pixels and name in pixels and value.dtype == torch.uint8:
            value = ImageTransform.to_float(value, *pixels[name])
        if name != LABEL_KEY and value.is_floating_point() and value.dtype != dtype:
            value = value.to(dtype)
        return value

    return {name: move(name, value) for name, value in batch.items()}


OVERFLOW_FACTOR = 1e5  # inputs of a few units become ~1e5: finite in fp32/bf16, not in fp16


def inject_fault(batch: dict[str, torch.Tensor], fault: str) -> None:
    """Fault injection (`guards.inject_nan_steps`, `guards.inject_overflow_steps`): overwrite
    the float inputs with NaN, or scale them past fp16's range (65504) but not bf16's."""
    for name, value in batch.items():
        if name != LABEL_KEY and isinstance(value, torch.Tensor) and value.is_floating_point():
            batch[name] = (
                torch.full_like(value, math.nan) if fault == "nan" else value * OVERFLOW_FACTOR
            )
    log.warning("fault injection: %s inputs in this step's first micro-batch", fault)
