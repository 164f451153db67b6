"""The checkpointer: when a checkpoint is due, what goes into one and how it comes back.

It owns the run's checkpoint folder and policy (every N steps, every M minutes, the last step,
a signal), the format (full: gathered to rank 0, `model.safetensors`; sharded: each rank
writes its own shards through `torch.distributed.checkpoint`) and the time spent writing.
What the rest of the run keeps (schedule, scaler, loader position, counters, EMA) comes in as
one `state` dict the trainer assembles; every rank's RNG states join it here. Files are
written atomically by checkpoint.py: the newest folder whose manifest verifies is the
checkpoint, so a crash while writing never costs the last good one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmtrain import distributed
from mmtrain.checkpoint import (
    Checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_sharded,
    save_checkpoint,
    save_sharded_checkpoint,
)
from mmtrain.config import RunConfig
from mmtrain.folders import CHECKPOINT_DIR
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.ema import Ema
from mmtrain.train.rng import gather_rng_states

EMA_KEY = "ema"  # the average's entry in a checkpoint (state.pt, or beside "model" in dcp/)

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, config: RunConfig, spec: ModelSpec, out: Path, rank: int, world: int):
        self.config, self.spec = config, spec
        self.where = out / CHECKPOINT_DIR
        self.rank, self.world = rank, world
        self.format = config.checkpoint.format_for(config.train.parallel, world)
        self.every_steps = config.checkpoint.every_steps
        self.every_minutes = config.checkpoint.every_minutes
        self.last_save_time = time.monotonic()
        self.seconds_total = 0.0  # spent writing checkpoints in this process (for metrics)

    def latest(self) -> Checkpoint | None:
        """The resume point: the newest checkpoint whose manifest verifies (`latest_checkpoint`
        has just verified it: loading does not hash the files again)."""
        path = latest_checkpoint(self.where)
        return load_checkpoint(path, verify=False) if path is not None else None

    def due(self, step: int, total_steps: int, stop_requested: bool) -> tuple[bool, bool]:
        """(save now, a signal asked to stop). Every rank must take the same branch: rank 0's
        clock and any rank's signal decide (a collective)."""
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        by_time_here = bool(self.every_minutes) and (
            time.monotonic() - self.last_save_time >= 60 * self.every_minutes
        )
        by_time, signalled = distributed.agree_any([by_time_here, stop_requested])
        return signalled or by_time or by_steps or step == total_steps, signalled

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        samples_seen: int,
        ema: Ema | None = None,
    ) -> None:
        """Every rank takes part. Full: FSDP gathers the weights, the optimizer state and the
        EMA to rank 0, which writes them. Sharded: each rank writes its own shards of all three,
        in place (no gather)."""
        started = time.monotonic()
        if self.format == "sharded":
            shards = parallel.sharded_state_dict(model, optimizer)
            check_finite_weights(shards["model"], sharded=True)
            if ema is not None:
                shards[EMA_KEY] = ema.state_dict()
        else:
            weights = full_weights(model, self.rank)
            optimizer_state = parallel.optimizer_state_dict(model, optimizer)
            if ema is not None:
                state = {**state, EMA_KEY: ema.full_state_dict()}
        state = {**state, "rng": gather_rng_states()}  # one entry per rank
        meta = {
            "config": self.config.to_dict(),
            "spec": self.spec.to_dict(),  # self-describing: `mmtrain eval` needs no run folder
            "samples_seen": samples_seen,
            "world_size": self.world,
        }
        keep = self.config.checkpoint.keep
        if self.format == "sharded":
            save_sharded_checkpoint(self.where, step, shards, state, meta, keep)
        elif self.rank == 0:
            check_finite_weights(weights)
            state["optimizer"] = optimizer_state
            save_checkpoint(self.where, step, weights, state, meta, keep)
        parallel.barrier()
        self.last_save_time = time.monotonic()
        self.seconds_total += self.last_save_time - started

    def restore(
        self,
        ckpt: Checkpoint,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ema: Ema | None = None,
    ) -> None:
        """A sharded checkpoint's weights, the optimizer state and the EMA (a full checkpoint's
        weights load before the model is wrapped). They may have been saved under any strategy
        on any number of ranks; under FSDP each rank keeps its shards, DCP reading for each
        rank what its shards cover."""
        if ckpt.format == "sharded":
            shards = parallel.sharded_state_dict(model, optimizer)  # this run's layout
            if ema is not None:
                shards[EMA_KEY] = ema.state_dict()  # read in place
            read_sharded(ckpt.path, shards)
            parallel.load_sharded_state_dict(model, optimizer, shards)
        else:
            parallel.load_optimizer_state_dict(model, optimizer, ckpt.state["optimizer"])
            if ema is not None and EMA_KEY in ckpt.state:
                ema.load_state_dict(ckpt.state[EMA_KEY])

    def rollback_point(self, step: int, in_a_row: int, rollbacks: int) -> Checkpoint:
        """The checkpoint to roll back to after `in_a_row` non-finite steps, or
        FloatingPointError when the run has rolled back too often or has nothing to roll back
        to."""
        guards = self.config.guards
        if rollbacks >= guards.max_rollbacks:
            raise FloatingPointError(
                f"{in_a_row} non-finite steps in a row at step {step} after {rollbacks} "
                f"rollbacks (guards.max_rollbacks): the run diverges. Lower train.lr, set "
                f"guards.rollback_lr_factor, or use bf16/fp32; the last good checkpoint is in "
                f"{self.where}"
            )
        # steps step-in_a_row+1 .. step were bad: resume from before the first of them
        path = latest_checkpoint(self.where, at_most_step=step - in_a_row)
        if path is None:
            raise FloatingPointError(
                f"{in_a_row} non-finite steps in a row at step {step} and no checkpoint to roll "
                "back to yet: lower checkpoint.every_steps or train.lr"
            )
        factor = guards.rollback_lr_factor
        log.warning(
            "step %d: %d non-finite steps in a row; rolling back to %s%s",
            step, in_a_row, path.name,
            f" with learning rates x{factor}" if factor != 1.0 else "",
        )  # fmt: skip
        return load_checkpoint(path, verify=False)  # verified by latest_checkpoint


def full_weights(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The full weights on the CPU for rank 0 to save. Under FSDP a collective every rank must
    call (the others get an empty dict); otherwise only rank 0 copies them."""
    if parallel.is_fsdp(model) or rank == 0:
        return parallel.full_model_state_dict(model)
    return {}


def check_finite_weights(weights: dict[str, torch.Tensor], sharded: bool = False) -> None:
    """Refuse to checkpoint NaN or infinite weights. `sharded`: each rank checks its own
    shards and all agree (a collective), so every rank raises alike."""
    bad = parallel.nonfinite_names(weights)
    if sharded and distributed.agree_any([bool(bad)])[0] and not bad:
        bad = ["(in another rank's shards)"]
    if bad:
        raise FloatingPointError(f"refusing to save non-finite weights: {', '.join(bad[:5])}")
