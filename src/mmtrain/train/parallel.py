"""Parallelism applied to a built model from outside its code.

For now: activation checkpointing per transformer block of each tower. The training issue adds
DDP/FSDP here, in the order compile -> checkpointing -> FSDP.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmtrain.structured import FieldError

AC_MODES = ("none", "selective", "full")


def _checkpointed(forward):
    """`forward` run under non-reentrant checkpointing: only its inputs are kept for backward;
    everything inside is recomputed when the gradient reaches it."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _blocks(model: nn.Module) -> list[nn.Module]:
    """Every transformer block of every tower (`towers.NAME.blocks[i]`), in order."""
    towers = getattr(model, "towers", None)
    if towers is None:
        raise TypeError(
            f"expected a model with .towers (MultimodalModel), got {type(model).__name__}"
        )
    return [block for tower in towers.values() for block in tower.blocks]


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint each block of each tower in place and return the model.

    - "full": the whole block is recomputed in backward; autograd keeps only the block input
      (Korthikanti et al. 2022's "full recompute", about one extra forward pass of compute).
    - "selective": each block's attention sub-module (`block.attn`: q/k/v projection, attention
      core, output projection) is recomputed; the MLP keeps its activations. This is the part
      Korthikanti's selective recompute targets (the attention core, whose s^2 softmax dominates
      without a fused kernel); the projections come along because the core cannot be separated
      from outside the model code.
    - "none": nothing changes.

    The wrapped `forward` is set on the module instance, so parameter names (and checkpoints)
    are unchanged. Applying a mode twice is an error (checkpoint inside checkpoint).
    """
    if mode not in AC_MODES:
        raise ValueError(
            f"activation checkpointing mode {mode!r} is not one of {', '.join(AC_MODES)}"
        )
    if mode == "none":
        return model
    for block in _blocks(model):
        target = block if mode == "full" else block.attn
        if getattr(target, "_mmtrain_checkpointed", False):
            raise ValueError("activation checkpointing is already applied to this model")
        target.forward = _checkpointed(target.forward)
        target._mmtrain_checkpointed = True
    return model


# ----------------------------------------------------------------------------- training loop
# Added for `mmtrain train` (train/loop.py): process groups, data parallelism, per-tower
# checkpointing. The same code runs in one process, under torchrun on CPUs (gloo) and on GPUs
# (nccl).


@dataclass(frozen=True)
class DistributedEnv:
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    owns_group: bool  # this module created the process group (and destroys it at the end)


def init_distributed(device: str = "auto") -> DistributedEnv:
    """Pick the device and, under torchrun (WORLD_SIZE > 1), join the default process group:
    nccl when training on CUDA, gloo on CPU. Reuses a group that already exists."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise FieldError(
            "train.device", "cuda was asked for but no CUDA GPU is visible; use cpu or auto"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
        owns = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    return DistributedEnv(dev, rank, world, local_rank, owns)


def shutdown(env: DistributedEnv) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def agree_any(flags: list[bool]) -> list[bool]:
    """Per flag: True if it is True on any rank (one tiny all-reduce), so every rank branches alike."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(flags)
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


def wrap_data_parallel(model: nn.Module, env: DistributedEnv, strategy: str = "auto") -> nn.Module:
    """The module the training loop calls: the model itself on one rank, DDP across ranks.

    DDP keeps a full replica per rank and averages gradients (bucketed, overlapped with the
    backward). Buffers are derived from the spec (mel filterbanks), identical on every rank, so
    they are not broadcast at each forward.
    """
    if env.world_size == 1:
        return model
    if strategy == "fsdp":
        raise FieldError("train.parallel", "fsdp is not available in `mmtrain train` yet; use ddp")
    device_ids = [env.local_rank] if env.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, broadcast_buffers=False
    )


def no_sync(module: nn.Module):
    """DDP's `no_sync()` (skip the gradient all-reduce of a non-final micro-batch), else a no-op."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()


def checkpoint_tower_blocks(model: nn.Module, towers: list[str]) -> nn.Module:
    """Full activation checkpointing of every block of the named towers only (per-tower flag)."""
    for name in towers:
        if name not in model.towers:
            raise FieldError(
                f"train.towers.{name}",
                f"the model has no tower {name!r}; towers: {', '.join(model.towers)}",
            )
        for block in model.towers[name].blocks:
            if getattr(block, "_mmtrain_checkpointed", False):
                raise ValueError("activation checkpointing is already applied to this model")
            block.forward = _checkpointed(block.forward)
            block._mmtrain_checkpointed = True
    return model
