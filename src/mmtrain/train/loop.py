"""The training loop: `train(config)` reads top to bottom.

    set up ranks and device -> find the newest valid checkpoint -> build the model from its spec
    (a fresh run with `init`: a baseline's weights, train/init.py)
    -> LoRA adapters / freeze / precision / resolution / compile / activation checkpointing
    -> DDP or FSDP2
    -> optimizer and schedule -> data -> restore state when resuming -> log the memory plan
    -> loop over steps:
         input size for this step -> next K micro-batches -> contrastive-correct forward/backward
         (+ the fusion head's loss) -> skip non-finite steps -> clip -> optimizer step -> validate
         when due -> metrics -> roll back after K non-finite steps in a row -> checkpoint
    -> final checkpoint, OUT/model.safetensors + OUT/spec.yaml (LoRA: adapters merged, and
       alone in OUT/lora.safetensors), OUT/eval.json

Everything a resumed run needs is in the checkpoint (weights, optimizer, schedule, scaler, the
loader's position, each rank's RNG states, counters), so running the same command again
continues where the last valid checkpoint left off; on a CPU the result is bitwise identical to
a run that was never interrupted.

RNG states are saved per rank (`state["rng"]` is a list indexed by rank). Resumed on the same
number of ranks, each rank restores its own. On a different number, rank r restores entry r when
the checkpoint has one, and ranks beyond the saved count seed their global generators from
(seed, rank, step). mmtrain's own randomness (initialisation, data order, augmentation) comes
from explicit generators derived from the seed and the sample's position, never from these
global states, so the data stream and the weights do not depend on the choice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mmtrain import __version__
from mmtrain.atomic import atomic_write_text
from mmtrain.config import RunConfig, diff_configs, parse_yaml
from mmtrain.data.shards import ShardSet
from mmtrain.losses import ContrastiveLoss, logit_scale_value
from mmtrain.models import MultimodalModel, create_model, save_model
from mmtrain.models.build import model_with_weights
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError
from mmtrain.train import parallel
from mmtrain.train.checkpoint import (
    Checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_sharded,
    save_checkpoint,
    save_sharded_checkpoint,
)
from mmtrain.train.comm_timing import CommTimer, timed_collective
from mmtrain.train.data import LABEL_KEY, TrainData, source_towers
from mmtrain.train.init import start_from_init
from mmtrain.train.lora import (
    LORA_FILE,
    adapter_weights,
    apply_lora,
    lora_scales,
    lora_towers,
    merge_lora_state,
    write_lora_file,
)
from mmtrain.train.metrics import (
    LossSpikes,
    MetricsWriter,
    detect_peak_flops,
    memory_gib,
    planned_memory,
    reset_peak_memory,
    throughput,
    train_flops_per_sample,
)
from mmtrain.train.optim import (
    freeze_parameters,
    make_optimizer,
    make_scheduler,
    scale_learning_rates,
)
from mmtrain.train.precision import Precision, at_least_fp32, convert_to_fp8, make_precision
from mmtrain.train.resolution import allow_any_resolution, check_schedules, spec_at
from mmtrain.train.rng import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
EVAL_FILE = "eval.json"
EVAL_SCHEMA_VERSION = 1


@dataclass
class TrainResult:
    """What a call to `train` did (rank 0's view)."""

    out: Path
    step: int  # optimizer steps done in total (including before a resume)
    samples_seen: int
    resumed_from: int | None  # checkpoint step resumed from, None for a fresh start
    stopped_by_signal: bool = False
    skipped_steps: int = 0  # non-finite loss or gradients, fp16 overflows
    rollbacks: int = 0  # returns to the last checkpoint after non-finite steps in a row
    corrupt_samples: int = 0
    last_loss: float = math.nan
    history: list[dict[str, Any]] = field(default_factory=list)  # rows written to metrics.jsonl
    eval: dict[str, Any] | None = None  # the final validation report (eval.json)


def train(
    config: RunConfig,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    halt_after_step: int | None = None,
) -> TrainResult:
    """Train (or resume training) the run described by `config`; returns a summary.

    `on_step(row)` sees each step's metrics row (the CLI draws its progress from it).
    `halt_after_step` stops dead after that step, writing nothing more, as a crash would: the
    fault-injection tests use it to show that resuming reproduces an uninterrupted run.
    """
    # -- ranks, device, run folder -------------------------------------------------------------
    env = parallel.init_distributed(config.train.device)
    device, rank, world = env.device, env.rank, env.world_size
    config.validate(world_size=world)
    t = config.train
    if t.ema and t.parallel == "fsdp" and world > 1:
        # The average is kept of full, unsharded weights; FSDP leaves each rank a shard only.
        raise FieldError(
            "train.ema", "is not supported with train.parallel=fsdp; set it to null or use ddp"
        )
    spec = load_spec(config.model)
    check_schedules(spec, t.resolution_schedule, t.frames_schedule)
    precision = make_precision(t.precision, device)  # fails early where it cannot run
    out = Path(config.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    parallel.barrier()
    micro_batch = config.micro_batch_for(world)
    accumulation = config.accumulation_steps(world)

    # -- resume point: the newest checkpoint whose manifest verifies ------------------------------
    ckpt_path = latest_checkpoint(out / CHECKPOINT_DIR)
    # latest_checkpoint has just verified it: loading does not hash the files again.
    ckpt = load_checkpoint(ckpt_path, verify=False) if ckpt_path is not None else None
    if ckpt is None:
        _seed_everything(config.seed)

    # -- data ---------------------------------------------------------------------------------
    data = TrainData(config, spec, rank=rank, world_size=world, micro_batch=micro_batch)

    # -- model --------------------------------------------------------------------------------
    model = create_model(spec, seed=config.seed, dtype=precision.param_dtype)
    # `init`: a baseline's weights, loaded once before step 0 (a resume restores its checkpoint).
    config = start_from_init(model, config, ckpt.meta if ckpt is not None else None)
    # LoRA adapters join before a checkpoint loads (it holds them) and before any wrapper.
    apply_lora(model, lora_towers(t), seed=config.seed)
    lora_scale = lora_scales(model)  # per adapted linear, to merge the final weights
    if ckpt is not None and ckpt.format == "full":  # sharded: loaded into the wrapped model below
        model.load_state_dict(ckpt.model)
    frozen = freeze_parameters(model, t)
    model.to(device)
    if t.precision == "fp8":
        convert_to_fp8(model, t.fp8_keep_bf16)
    if t.resolution_schedule or t.frames_schedule:
        allow_any_resolution(model)  # position embeddings follow the input's size
    recompute = [n for n, tower in t.towers.items() if tower.activation_checkpointing]
    parallel.apply_activation_checkpointing(model, "full", recompute)
    if t.compile:
        for tower in model.towers.values():
            tower.compile()  # in place: parameter names (and checkpoints) stay the same
    # FSDP shards `model` in place (then `trained is model`): the optimizer comes after.
    # Sources of different modalities leave some towers out of a step (mixed by step): DDP
    # must then look for parameters without gradients.
    trained = parallel.wrap_data_parallel(
        model, env, t.parallel, t.precision, unused_parameters=bool(data.idle_towers())
    )

    optimizer = make_optimizer(model, t, device)
    scheduler = make_scheduler(optimizer, t)
    loss_fn = ContrastiveLoss.from_spec(spec) if spec.pairs else None
    ema = _Ema(model, t.ema) if t.ema else None

    validation = _Validation(config, spec, out, rank, world) if config.data.val else None

    # -- restore everything else a resumed run needs ---------------------------------------------
    step, samples_seen, skipped, corrupt_before, rollbacks = 0, 0, 0, 0, 0
    if ckpt is not None:
        counters = _restore_state(
            ckpt, model, optimizer, scheduler, precision, data, ema, config, rank
        )
        step, samples_seen = counters["step"], counters["samples_seen"]
        skipped, corrupt_before = counters["skipped_steps"], counters["corrupt_samples"]
        rollbacks = counters.get("rollbacks", 0)
        log.info("resuming from %s (step %d, %d samples seen)", ckpt.path, step, samples_seen)
    resumed_from = ckpt.step if ckpt is not None else None
    del ckpt  # the weights now live in the model and optimizer

    # -- metrics (and the resolved config, now that everything above accepted it) -------------
    if rank == 0:
        _save_resolved_config(config, out)
    metrics = MetricsWriter(
        out, enabled=rank == 0, tensorboard=config.metrics.tensorboard, resume_step=step
    )
    # The planner's prediction for this run, to set beside the measured peak of each step.
    if t.precision != "fp64":  # the planner knows the training precisions, not the reference
        metrics.record(
            "plan",
            step,
            planned_memory(spec, config, world_size=world, recompute=recompute, device=device),
        )
    peak_flops = (config.metrics.peak_tflops or 0) * 1e12 or detect_peak_flops(device, t.precision)
    result = TrainResult(out=out, step=step, samples_seen=samples_seen, resumed_from=resumed_from)
    log.info(
        "training %s: %d ranks x %d micro-batch x %d accumulation = %d per step, %d steps, %s on %s "
        "(%d frozen parameters)",
        spec.name, world, micro_batch, accumulation, t.batch_size, t.steps, t.precision, device,
        frozen,
    )  # fmt: skip

    checkpoint_format = config.checkpoint.format_for(t.parallel, world)

    def save(at_step: int) -> None:
        # Every rank takes part. Full: FSDP gathers the weights and optimizer state to rank 0,
        # which writes them. Sharded: each rank writes its own shards, in place (no gather).
        if checkpoint_format == "sharded":
            shards = parallel.sharded_state_dict(model, optimizer)
            _check_finite_weights(shards["model"], sharded=True)
        else:
            weights = _full_weights(model, rank)
            optimizer_state = parallel.optimizer_state_dict(model, optimizer)
        state = {
            "scheduler": scheduler.state_dict(),
            "scaler": precision.scaler.state_dict() if precision.scaler is not None else {},
            "loader": data.state_dict(),
            "rng": _gather_rng_states(),  # one entry per rank
            "counters": {
                "step": at_step,
                "samples_seen": samples_seen,
                "skipped_steps": skipped,
                "corrupt_samples": corrupt,
                "rollbacks": rollbacks,
            },
        }
        if ema is not None:
            state["ema"] = ema.state_dict()
        meta = {
            "config": config.to_dict(),
            "spec": spec.to_dict(),  # self-describing: `mmtrain eval` needs no run folder
            "samples_seen": samples_seen,
            "world_size": world,
        }
        keep = config.checkpoint.keep
        if checkpoint_format == "sharded":
            save_sharded_checkpoint(out / CHECKPOINT_DIR, at_step, shards, state, meta, keep)
        elif rank == 0:
            _check_finite_weights(weights)
            state["optimizer"] = optimizer_state
            save_checkpoint(out / CHECKPOINT_DIR, at_step, weights, state, meta, keep)
        parallel.barrier()

    # -- the loop -----------------------------------------------------------------------------
    last_save_time = time.monotonic()
    checkpoint_s = 0.0  # time spent writing checkpoints in this process (overhead, for metrics)
    spikes = LossSpikes()
    nonfinite_in_a_row = 0
    injected: set[int] = set()  # fault injection: each listed step corrupted once
    corrupt = corrupt_before
    stop = _StopOnSignal()
    # Times DDP's/FSDP's collectives and the loss's gathers per step (no synchronisation added).
    comm = CommTimer(device, world if config.metrics.comm_timing else 1)
    if config.metrics.comm_timing:
        comm.attach(trained)
    with stop, comm:
        while step < t.steps:
            # Progressive resolution: the input size of this step (a pure function of the step).
            step_spec = spec_at(spec, step, t.resolution_schedule, t.frames_schedule)
            data.set_input_spec(step_spec)
            flops_per_sample = train_flops_per_sample(step_spec.forward_flops(), bool(recompute))
            reset_peak_memory(device)

            t0 = time.perf_counter()
            micro_batches, step_keys = [], []
            for _ in range(accumulation):
                micro_batches.append(_to_device(data.next_batch(), device, precision.param_dtype))
                step_keys += data.last_keys
            if step + 1 in config.guards.inject_nan_steps and step + 1 not in injected:
                injected.add(step + 1)
                _inject_nan(micro_batches[0])
            t1 = time.perf_counter()
            comm.start_step()

            optimizer.zero_grad(set_to_none=True)
            loss, part_losses = forward_backward(
                trained, model, loss_fn, micro_batches, precision, fusion_weight=t.fusion_weight
            )
            # One all-reduce: mean losses over ranks (each holds its share), summed corrupt counts.
            with timed_collective():
                losses, corrupt_now = _reduce_over_ranks(
                    [loss, *part_losses.values()], data.corrupt_samples()
                )
            corrupt = corrupt_before + corrupt_now
            _sync(device)
            t2 = time.perf_counter()

            finite_loss = math.isfinite(losses[0])  # the same on every rank
            grad_norm, stepped = optimizer_step(
                model, optimizer, precision, t.grad_clip, skip=not finite_loss
            )
            with warnings.catch_warnings():
                # A skipped step still uses up its place in the schedule (by design, not a bug).
                warnings.filterwarnings(
                    "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
                )
                scheduler.step()
            if ema is not None and stepped:
                ema.update(model)
            _sync(device)
            t3 = time.perf_counter()
            comm_times = comm.finish_step()  # reads CUDA events only after the sync above

            step += 1
            samples_seen += t.batch_size
            # fp16 overflows are the loss scaler's business; a non-finite loss, or a non-finite
            # gradient without a scaler, is a step the guard counts towards a rollback.
            bad = not finite_loss or (precision.scaler is None and not stepped)
            nonfinite_in_a_row = nonfinite_in_a_row + 1 if bad else 0
            if not stepped:
                skipped += 1
                log.warning(
                    "step %d skipped: loss %s, gradient norm %s; samples: %s",
                    step, losses[0], grad_norm, ", ".join(step_keys[:8]),
                )  # fmt: skip
            if spikes.check(losses[0]):
                log.warning(
                    "step %d: loss spike %.4f; samples: %s", step, losses[0], ", ".join(step_keys)
                )
            times = {"data": t1 - t0, "compute": t2 - t1, "optimizer": t3 - t2}
            row = {
                "loss": losses[0],
                **{f"loss/{k}": v for k, v in zip(part_losses, losses[1:], strict=True)},
                "lr": scheduler.get_last_lr()[0],
                **{f"lr/{g['name']}": g["lr"] for g in optimizer.param_groups},
                "grad_norm": float(grad_norm),
                "samples_seen": samples_seen,
                "skipped_steps": skipped,
                "rollbacks": rollbacks,
                "corrupt_samples": corrupt,
                "checkpoint_s_total": checkpoint_s,
                **throughput(
                    t.batch_size,
                    times,
                    flops_per_sample=flops_per_sample,
                    peak_flops=peak_flops,
                    world_size=world,
                    comm=comm_times,
                ),  # fmt: skip
                **memory_gib(device),
            }
            if hasattr(model, "logit_scale"):
                row["logit_scale"] = float(logit_scale_value(model.logit_scale.detach()))
            if step_spec is not spec:
                row.update({f"input_size/{k}": v for k, v in _input_sizes(step_spec).items()})
            if precision.scaler is not None:
                row["loss_scale"] = float(precision.scaler.get_scale())
            if validation is not None and validation.due(step, t.steps):
                with precision.autocast():
                    row.update(validation.run(trained, step))
            metrics.write(step, row)
            result.history.append({"step": step, **row})
            if on_step is not None and rank == 0:
                on_step({"step": step, **row})

            if halt_after_step is not None and step >= halt_after_step:
                metrics.close()
                data.close()
                if validation is not None:
                    validation.close()
                result.step, result.samples_seen = step, samples_seen
                return result  # as a crash would: nothing more written

            if nonfinite_in_a_row >= config.guards.max_nonfinite_in_a_row:
                # Roll back: every rank reloads the newest valid checkpoint (weights, optimizer,
                # schedule, scaler, data position, RNG) and trains on from there.
                ckpt = _rollback_checkpoint(out, step, nonfinite_in_a_row, rollbacks, config)
                if ckpt.format == "full":  # a sharded one's weights load in _restore_state
                    parallel.load_full_model_state_dict(model, ckpt.model)
                counters = _restore_state(
                    ckpt, model, optimizer, scheduler, precision, data, ema, config, rank
                )
                if config.guards.rollback_lr_factor != 1.0:
                    scale_learning_rates(optimizer, scheduler, config.guards.rollback_lr_factor)
                step, samples_seen = counters["step"], counters["samples_seen"]
                corrupt_before, corrupt = counters["corrupt_samples"], counters["corrupt_samples"]
                rollbacks += 1
                nonfinite_in_a_row = 0
                metrics.rewind(step)
                result.history = [r for r in result.history if r["step"] <= step]
                del ckpt
                continue

            due_by_steps = (
                config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0
            )
            due_by_time = config.checkpoint.every_minutes and (
                time.monotonic() - last_save_time >= 60 * config.checkpoint.every_minutes
            )
            # Every rank must take the same branch: rank 0's clock and any rank's signal decide.
            by_time, signalled = parallel.agree_any([bool(due_by_time), stop.requested])
            if signalled or by_time or due_by_steps or step == t.steps:
                started = time.monotonic()
                save(step)
                last_save_time = time.monotonic()
                checkpoint_s += last_save_time - started
            if signalled:
                log.warning("stopped by a signal after step %d; checkpoint written, exiting", step)
                result.stopped_by_signal = True
                break

    # -- final weights and validation report -----------------------------------------------------
    if step >= t.steps:
        weights = _full_weights(model, rank)  # a collective under FSDP
        if rank == 0:
            _check_finite_weights(weights)
            if lora_scale:  # OUT/lora.safetensors: the adapters alone; the model: them merged
                write_lora_file(adapter_weights(weights), lora_towers(t), out / LORA_FILE)
                weights = merge_lora_state(weights, lora_scale)
            save_model(model_with_weights(model.spec, weights), out)
            if ema is not None:
                save_model(ema.model(model), out / "ema")
    if validation is not None:
        if step >= t.steps:
            result.eval = validation.write_report(spec)
        validation.close()
    parallel.barrier()
    metrics.close()
    result.step, result.samples_seen, result.skipped_steps = step, samples_seen, skipped
    result.rollbacks = rollbacks
    result.corrupt_samples = corrupt_before + _reduce_over_ranks([], data.corrupt_samples())[1]
    result.last_loss = result.history[-1]["loss"] if result.history else math.nan
    data.close()
    # Free the DDP wrapper while the process group is still alive. Its C++ reducer frees
    # without releasing the GIL; were it to hold the group's last reference, the group's
    # destructor would join a gloo thread that waits for the GIL: a deadlock seen under load.
    # (shutdown collects garbage first; the CLI then ends a rank without finalization.)
    del trained
    parallel.shutdown(env)
    return result


# ----------------------------------------------------------------------------- one step
def forward_backward(
    trained: nn.Module,
    model: MultimodalModel,
    loss_fn: ContrastiveLoss | None,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    precision: Precision,
    fusion_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward over K micro-batches, with the gradient of ONE batch of all of them.

    A contrastive loss couples samples (every sample is a negative for every other), so summing
    K independent micro-batch losses would train on K small batches. Instead (as OpenCLIP's
    accum-freq): embed every micro-batch without gradient first, then recompute each micro-batch
    with gradient and take the loss of the whole accumulated batch, the other micro-batches'
    cached embeddings joining as `extra_negatives`. Each backward yields exactly that
    micro-batch's share of the full-batch gradient; their sum (no division by K) is the
    full-batch gradient. Costs one extra forward per micro-batch when K > 1.

    A fusion head's loss (cross-entropy for `classify`, mean squared error for `regress`,
    against `batch["label"]`) is per sample: each micro-batch adds its mean / K, so the sum is
    the mean over the whole batch; `fusion_weight` scales it beside the contrastive loss.

    `trained` is what runs the forward (the DDP/compiled wrapper), `model` the plain module
    (for the logit scale and bias). Gradients accumulate in `.grad`; DDP synchronises them on
    the last micro-batch only. Returns the total loss and the loss per pair and of the fusion
    head ("fusion"), detached.
    """
    spec = model.spec
    # Sources of different modalities are mixed by step (train/data.py): every micro-batch of
    # a step holds the same towers, and the step aligns the pairs it holds both towers of.
    present = micro_batches[0].keys()
    pairs = [p for p in spec.pairs if p[0] in present and p[1] in present]
    pairs = pairs if loss_fn is not None else []
    names = sorted({name for pair in pairs for name in pair})
    scale = getattr(model, "logit_scale", None)
    bias = getattr(model, "logit_bias", None)
    k = len(micro_batches)
    cached: list[dict[str, torch.Tensor]] = []
    if pairs and k > 1:
        with torch.no_grad(), precision.autocast():
            cached = [_features(trained({n: b[n] for n in names}), names) for b in micro_batches]
    contrastive = None
    pair_losses: dict[str, torch.Tensor] = {}
    head_total = torch.zeros(())
    for j, batch in enumerate(micro_batches):
        inputs = {name: value for name, value in batch.items() if name != LABEL_KEY}
        sync = contextlib.nullcontext() if j == k - 1 else parallel.no_sync(trained)
        with sync:
            with precision.autocast():
                out = trained(inputs)
            loss = torch.zeros((), device=next(iter(inputs.values())).device)
            if pairs:
                extra = None
                if k > 1:
                    extra = {
                        n: torch.cat([cached[i][n] for i in range(k) if i != j]) for n in names
                    }
                contrastive, pair_losses = loss_fn(
                    _features(out, names), pairs, scale, bias, extra_negatives=extra
                )
                loss = loss + contrastive
            if spec.fusion is not None:
                head = fusion_loss(at_least_fp32(out["fusion"]), batch[LABEL_KEY], spec.fusion.task)
                loss = loss + fusion_weight * head / k
                head_total = head_total + head.detach().cpu() / k
            if trained is not model:
                # Embeddings no loss reads (a fused tower's projection): a zero term keeps their
                # parameters in the graph, so DDP's reducer gets a (zero) gradient for each.
                for name in sorted(out.keys() - set(names) - {"fusion"}):
                    loss = loss + 0.0 * at_least_fp32(out[name]).sum()
            if precision.scaler is not None:
                precision.scaler.scale(loss).backward()
            else:
                loss.backward()
    parts = {name: value.detach() for name, value in pair_losses.items()}
    total = contrastive.detach() if contrastive is not None else torch.zeros(())
    if spec.fusion is not None:
        parts["fusion"] = head_total
        total = total.cpu() + fusion_weight * head_total
    return total, parts


def fusion_loss(output: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Cross-entropy of class logits [B, C] against int64 labels [B] (`classify`), or the mean
    squared error of values [B, C] against float targets [B, C] (`regress`)."""
    if task == "classify":
        return F.cross_entropy(output, labels)
    return F.mse_loss(output, labels.to(output.dtype).reshape(output.shape))


def _features(out: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    # The loss runs in fp32 whatever the autocast dtype: logits of a large batch need the range.
    return {name: at_least_fp32(out[name]) for name in names}


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    grad_clip: float | None,
    skip: bool = False,
) -> tuple[float, bool]:
    """Unscale (fp16), clip, and step unless a gradient is not finite; returns (norm, stepped).

    With fp16 the GradScaler skips overflowing steps itself and lowers its scale; otherwise a
    non-finite norm (or `skip`: the caller saw a non-finite loss) skips the step here, so a
    single bad batch cannot poison the weights.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scaler = precision.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = grad_clip if grad_clip is not None else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if scaler is not None:
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return float(norm), scaler.get_scale() >= before
    if skip or not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return float(norm), False
    optimizer.step()
    return float(norm), True


# ----------------------------------------------------------------------------- state
def _restore_state(
    ckpt: Checkpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    precision: Precision,
    data: TrainData,
    ema: _Ema | None,
    config: RunConfig,
    rank: int,
) -> dict[str, int]:
    """Load everything but a full checkpoint's weights from `ckpt`; returns its counters.

    The optimizer state may have been saved under any strategy on any number of ranks; under
    FSDP each rank keeps its shard of it. A sharded checkpoint holds the weights beside the
    optimizer state: both load here, DCP reading for each rank what its shards cover.
    """
    if ckpt.format == "sharded":
        shards = parallel.sharded_state_dict(model, optimizer)  # this run's layout
        read_sharded(ckpt.path, shards)
        parallel.load_sharded_state_dict(model, optimizer, shards)
    else:
        parallel.load_optimizer_state_dict(model, optimizer, ckpt.state["optimizer"])
    scheduler.load_state_dict(ckpt.state["scheduler"])
    if precision.scaler is not None and ckpt.state.get("scaler"):
        precision.scaler.load_state_dict(ckpt.state["scaler"])
    data.load_state_dict(ckpt.state["loader"])
    if ema is not None and "ema" in ckpt.state:
        ema.load_state_dict(ckpt.state["ema"])
    counters = ckpt.state["counters"]
    _restore_rng_states(ckpt.state["rng"], rank, config.seed, counters["step"])
    return counters


def _rollback_checkpoint(
    out: Path, step: int, in_a_row: int, rollbacks: int, config: RunConfig
) -> Checkpoint:
    """The checkpoint to roll back to after `in_a_row` non-finite steps, or FloatingPointError
    when the run has rolled back too often or has nothing to roll back to."""
    where = out / CHECKPOINT_DIR
    if rollbacks >= config.guards.max_rollbacks:
        raise FloatingPointError(
            f"{in_a_row} non-finite steps in a row at step {step} after {rollbacks} rollbacks "
            f"(guards.max_rollbacks): the run diverges. Lower train.lr, set "
            f"guards.rollback_lr_factor, or use bf16/fp32; the last good checkpoint is in {where}"
        )
    # steps step-in_a_row+1 .. step were bad: resume from before the first of them
    path = latest_checkpoint(where, at_most_step=step - in_a_row)
    if path is None:
        raise FloatingPointError(
            f"{in_a_row} non-finite steps in a row at step {step} and no checkpoint to roll back "
            "to yet: lower checkpoint.every_steps or train.lr"
        )
    log.warning(
        "step %d: %d non-finite steps in a row; rolling back to %s%s",
        step, in_a_row, path.name,
        f" with learning rates x{config.guards.rollback_lr_factor}"
        if config.guards.rollback_lr_factor != 1.0 else "",
    )  # fmt: skip
    return load_checkpoint(path, verify=False)  # verified by latest_checkpoint


def _gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, indexed by rank (a collective under torch.distributed)."""
    mine = capture_rng_state()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def _restore_rng_states(saved: Any, rank: int, seed: int, step: int) -> None:
    """This rank's entry of the saved list (a dict: a checkpoint of a single-state format);
    ranks the checkpoint has no entry for seed from (seed, rank, step)."""
    states = [saved] if isinstance(saved, dict) else list(saved)
    if rank < len(states):
        restore_rng_state(states[rank])
    else:
        log.info("rank %d has no saved RNG state (saved by %d ranks): seeding", rank, len(states))
        _seed_everything(seed * 1_000_003 + rank * 7_919 + step)


# ----------------------------------------------------------------------------- validation
def _pairs_held_by(path: str, spec: ModelSpec) -> list[tuple[str, str]] | None:
    """The pairs of `spec` whose towers the shards at `path` both hold (a validation set of
    one modality pair, as when training mixes sources of different modalities); None when the
    model has no pairs (a fusion head is evaluated instead)."""
    if not spec.pairs:
        return None
    try:
        towers = source_towers(ShardSet.open(path), spec)
    except (FileNotFoundError, ValueError) as err:
        raise FieldError("", f"{path!r}: {err}") from None
    held = [(a, b) for a, b in spec.pairs if a in towers and b in towers]
    if not held:
        raise FieldError("", f"holds only {', '.join(towers)}: no pair of the model to evaluate")
    return held


class _Validation:
    """Periodic evaluation on `data.val` with the eval package's `Evaluator`, on every rank
    (each embeds its share); rows get `val/...` metrics, the run folder gets eval.json."""

    def __init__(self, config: RunConfig, spec: ModelSpec, out: Path, rank: int, world: int):
        from mmtrain.eval.run import Evaluator

        self.every = config.eval.every_steps
        self.out, self.rank, self.world = out, rank, world
        self.sources = [source.path for source in config.data.val]
        self.evaluators = []
        for i, path in enumerate(self.sources):
            try:
                self.evaluators.append(
                    Evaluator(
                        spec,
                        path,
                        pairs=_pairs_held_by(path, spec),
                        batch_size=config.eval.batch_size,
                        tokenizer=config.data.tokenizer,
                        label_field=config.data.label_field,
                        num_workers=config.data.workers,
                        rank=rank,
                        world_size=world,
                    )  # fmt: skip
                )
            except FieldError as err:
                raise FieldError(f"data.val[{i}].path", err.message) from None
        self.last: tuple[int, list[dict[str, Any]]] | None = None

    def due(self, step: int, total: int) -> bool:
        return step == total or bool(self.every and step % self.every == 0)

    def run(self, model: nn.Module, step: int) -> dict[str, float]:
        """Evaluate now; flat `val/...` metrics (`val/N/...` for the N-th of several sets)."""
        from mmtrain.eval.run import flatten_metrics

        reports = [evaluator.report(model) for evaluator in self.evaluators]
        self.last = (step, reports)
        flat: dict[str, float] = {}
        for i, report in enumerate(reports):
            prefix = "val" if len(reports) == 1 else f"val/{i}"
            flat.update(flatten_metrics(report, prefix))
        return flat

    def write_report(self, spec: ModelSpec) -> dict[str, Any] | None:
        """OUT/eval.json from the evaluation at the final step (rank 0 writes; all return it)."""
        if self.last is None:
            return None
        step, reports = self.last
        sets = [
            {
                "schema_version": EVAL_SCHEMA_VERSION,
                "model": str(self.out),
                "model_name": spec.name,
                "data": path,
                "world_size": self.world,
                "mmtrain_version": __version__,
                "step": step,
                **report,
            }  # fmt: skip
            for path, report in zip(self.sources, reports, strict=True)
        ]
        document = dict(sets[0])
        if len(sets) > 1:
            document["other_sets"] = sets[1:]
        if self.rank == 0:
            text = json.dumps(document, indent=2, default=str) + "\n"
            atomic_write_text(self.out / EVAL_FILE, text)
        return document

    def close(self) -> None:
        for evaluator in self.evaluators:
            evaluator.close()


# ----------------------------------------------------------------------------- helpers
def _seed_everything(seed: int) -> None:
    """Seed the global generators once per fresh run, for code we do not control; mmtrain's
    own randomness (init, data order, augmentation) comes from explicit generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _to_device(
    batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The batch on `device`, float inputs in `dtype` (the weights' dtype; labels keep theirs)."""

    def move(name: str, value: torch.Tensor) -> torch.Tensor:
        if device.type != "cpu":
            value = value.to(device, non_blocking=True)
        if name != LABEL_KEY and value.is_floating_point() and value.dtype != dtype:
            value = value.to(dtype)
        return value

    return {name: move(name, value) for name, value in batch.items()}


def _inject_nan(batch: dict[str, torch.Tensor]) -> None:
    """Fault injection (`guards.inject_nan_steps`): overwrite the float inputs with NaN."""
    for name, value in batch.items():
        if name != LABEL_KEY and value.is_floating_point():
            batch[name] = torch.full_like(value, math.nan)
    log.warning("fault injection: NaN inputs in this step's first micro-batch")


def _input_sizes(spec: ModelSpec) -> dict[str, int]:
    """Image size (and frames) per image/video tower of the step's input spec, for the row."""
    sizes = {}
    for name, tower in spec.towers.items():
        if hasattr(tower.stem, "image_size"):
            sizes[name] = tower.stem.image_size
        if hasattr(tower.stem, "frames"):
            sizes[f"{name}_frames"] = tower.stem.frames
    return sizes


def _save_resolved_config(config: RunConfig, out: Path) -> None:
    path = out / CONFIG_FILE
    new = config.to_dict()
    if path.exists():
        old = parse_yaml(path.read_text(), str(path)) or {}
        changed = diff_configs(old, new)
        if changed:
            log.warning("resuming with changed settings (was in %s): %s", path, ", ".join(changed))
    text = f"# resolved config written by mmtrain {__version__}\n" + config.to_yaml()
    atomic_write_text(path, text)


def _full_weights(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The full weights on the CPU for rank 0 to save. Under FSDP a collective every rank must
    call (the others get an empty dict); otherwise only rank 0 copies them."""
    if parallel.is_fsdp(model) or rank == 0:
        return parallel.full_model_state_dict(model)
    return {}


def _check_finite_weights(weights: dict[str, torch.Tensor], sharded: bool = False) -> None:
    """Refuse to checkpoint NaN or infinite weights. `sharded`: each rank checks its own
    shards and all agree (a collective), so every rank raises alike."""
    bad = parallel.nonfinite_names(weights)
    if sharded and parallel.agree_any([bool(bad)])[0] and not bad:
        bad = ["(in another rank's shards)"]
    if bad:
        raise FloatingPointError(f"refusing to save non-finite weights: {', '.join(bad[:5])}")


def _reduce_over_ranks(means: list[torch.Tensor], count: int) -> tuple[list[float], int]:
    """Means over ranks of scalar tensors and the sum of an integer count, in one all-reduce."""
    values = torch.tensor([*(float(m) for m in means), float(count)], dtype=torch.float64)
    world = 1
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        if dist.get_backend() == "nccl":
            values = values.cuda()
        dist.all_reduce(values)
        values = values.cpu()
    out = values.tolist()
    return [v / world for v in out[:-1]], int(round(out[-1]))


def _sync(device: torch.device) -> None:
    # Honest step-time split: CUDA runs asynchronously.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StopOnSignal:
    """SIGTERM/SIGINT set `requested` (finish the step, checkpoint, exit 0); a second one exits
    at once. Installed only in the main thread (signals cannot be handled elsewhere)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise SystemExit(128 + signum)
        self.requested = True
        log.warning(
            "received %s: finishing this step and writing a checkpoint", signal.Signals(signum).name
        )

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class _Ema:
    """Exponential moving average of the trainable weights, kept in fp32 on the model's device."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.shadow = {
            k: v.detach().clone().float()
            for k, v in model.state_dict().items()
            if v.is_floating_point()
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, value in model.state_dict().items():
            if name in self.shadow:
                self.shadow[name].lerp_(value.float(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            self.shadow[name].copy_(value)

    def model(self, model: MultimodalModel) -> MultimodalModel:
        """A copy of `model` (on the CPU) holding the averaged weights."""
        copy = create_model(model.spec, device="meta")
        state = {k: self.shadow.get(k, v).to("cpu", v.dtype) for k, v in model.state_dict().items()}
        copy.load_state_dict(state, assign=True)
        copy.reset_buffers()
        return copy
