"""The training loop: `train(config)` reads top to bottom, in five parts.

    set-up (`_set_up`): ranks and device -> the newest valid checkpoint -> data -> the model
        from its spec (a fresh run with `init`: a baseline's weights, train/init.py; LoRA,
        freezing, precision, resolution, activation checkpointing, compile) -> DDP or FSDP2
        -> optimizer, schedule, the objectives -> restored state -> metrics and the memory plan
    one step (`_train_step`): input size for this step -> next K micro-batches -> forward and
        backward of every objective (train/objectives.py: contrastive, fusion, next-token; the
        gradient of one batch of all K x ranks) -> skip a non-finite step -> clip -> optimizer
        -> validate when due -> the metrics row
    rollback (`_roll_back`): after K non-finite steps in a row, back to the last checkpoint
    checkpoint (`_checkpoint_when_due`): every N steps / M minutes, at the end, on a signal
    finish (`_finish`): OUT/model.safetensors + OUT/spec.yaml (LoRA: adapters merged, and
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
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mmtrain import __version__, distributed
from mmtrain.atomic import atomic_write_text
from mmtrain.config import RunConfig, diff_configs, parse_yaml
from mmtrain.data.shards import ShardSet
from mmtrain.distributed import sum_over_ranks
from mmtrain.losses import logit_scale_value
from mmtrain.models import create_model, save_model
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
from mmtrain.train.comm_timing import CommTimer
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
from mmtrain.train.objectives import NextTokenObjective, Objective, model_inputs, objectives_for
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


@dataclass
class _Run:
    """Everything the steps of one `train` call share: what `_set_up` built and the counters
    the steps advance. The parts of the loop below read and update it."""

    config: RunConfig
    spec: ModelSpec
    env: Any  # parallel.DistributedEnv
    out: Path
    precision: Precision
    micro_batch: int
    accumulation: int
    data: TrainData
    model: nn.Module  # the plain module (FSDP shards it in place)
    trained: nn.Module  # what runs the forward: the DDP wrapper, or `model`
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    objectives: list[Objective]
    ema: _Ema | None
    validation: _Validation | None
    metrics: MetricsWriter
    recompute: list[str]  # towers whose blocks recompute activations in backward
    lora_scale: dict[str, float]  # per adapted linear, to merge the final weights
    checkpoint_format: str
    peak_flops: float | None
    result: TrainResult
    step: int = 0
    samples_seen: int = 0
    skipped: int = 0
    corrupt_before: int = 0  # corrupt samples counted before this process (from checkpoints)
    corrupt: int = 0
    rollbacks: int = 0
    nonfinite_in_a_row: int = 0
    checkpoint_s: float = 0.0  # time spent writing checkpoints in this process (for metrics)
    last_save_time: float = field(default_factory=time.monotonic)
    spikes: LossSpikes = field(default_factory=LossSpikes)
    injected: set[int] = field(default_factory=set)  # fault injection: each step corrupted once
    stop: _StopOnSignal = field(default_factory=lambda: _StopOnSignal())
    comm: CommTimer | None = None

    @property
    def t(self) -> Any:
        return self.config.train

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world(self) -> int:
        return self.env.world_size


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
    run = _set_up(config)
    with run.stop, run.comm:
        while run.step < run.t.steps:
            row = _train_step(run)
            _record(run, row, on_step)
            if halt_after_step is not None and run.step >= halt_after_step:
                return _halt(run)
            if run.nonfinite_in_a_row >= config.guards.max_nonfinite_in_a_row:
                _roll_back(run)
                continue
            if _checkpoint_when_due(run):
                break  # stopped by a signal, checkpoint written
    return _finish(run)


# ----------------------------------------------------------------------------- set-up
def _set_up(config: RunConfig) -> _Run:
    """Ranks and device, the resume point, data, model (init, LoRA, freezing, precision,
    checkpointing, wrappers), optimizer, objectives, restored state and the metrics writer."""
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

    # The resume point: the newest checkpoint whose manifest verifies (latest_checkpoint has
    # just verified it: loading does not hash the files again).
    ckpt_path = latest_checkpoint(out / CHECKPOINT_DIR)
    ckpt = load_checkpoint(ckpt_path, verify=False) if ckpt_path is not None else None
    if ckpt is None:
        _seed_everything(config.seed)

    data = TrainData(config, spec, rank=rank, world_size=world, micro_batch=micro_batch)
    model, config, lora_scale, recompute = _build_model(config, spec, precision, device, ckpt)
    # FSDP shards `model` in place (then `trained is model`): the optimizer comes after.
    trained = parallel.wrap_data_parallel(
        model, env, t.parallel, t.precision, unused_parameters=_has_unused_parameters(data)
    )
    optimizer = make_optimizer(model, t, device)
    run = _Run(
        config=config,
        spec=spec,
        env=env,
        out=out,
        precision=precision,
        micro_batch=micro_batch,
        accumulation=config.accumulation_steps(world),
        data=data,
        model=model,
        trained=trained,
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer, t),
        objectives=objectives_for(model, spec, fusion_weight=t.fusion_weight, world_size=world),
        ema=_Ema(model, t.ema) if t.ema else None,
        validation=_Validation(config, spec, out, rank, world) if config.data.val else None,
        metrics=None,  # type: ignore[arg-type]  # opened below, once the counters are known
        recompute=recompute,
        lora_scale=lora_scale,
        checkpoint_format=config.checkpoint.format_for(t.parallel, world),
        peak_flops=(config.metrics.peak_tflops or 0) * 1e12
        or detect_peak_flops(device, t.precision),
        result=None,  # type: ignore[arg-type]
    )
    if ckpt is not None:
        _restore_state(run, ckpt)
        log.info(
            "resuming from %s (step %d, %d samples seen)", ckpt.path, run.step, run.samples_seen
        )
    run.result = TrainResult(
        out=out,
        step=run.step,
        samples_seen=run.samples_seen,
        resumed_from=ckpt.step if ckpt is not None else None,
    )
    del ckpt  # the weights now live in the model and optimizer
    _open_metrics(run)
    # Times DDP's/FSDP's collectives and the loss's gathers per step (no synchronisation added).
    run.comm = CommTimer(device, world if config.metrics.comm_timing else 1)
    if config.metrics.comm_timing:
        run.comm.attach(trained)
    log.info(
        "training %s: %d ranks x %d micro-batch x %d accumulation = %d per step, %d steps, %s on %s "
        "(%d frozen parameters)",
        spec.name, world, micro_batch, run.accumulation, t.batch_size, t.steps, t.precision,
        device, sum(p.numel() for p in model.parameters() if not p.requires_grad),
    )  # fmt: skip
    return run


def _build_model(
    config: RunConfig,
    spec: ModelSpec,
    precision: Precision,
    device: torch.device,
    ckpt: Checkpoint | None,
) -> tuple[nn.Module, RunConfig, dict[str, float], list[str]]:
    """The model from its spec: a baseline's weights (`init`, a fresh run only), LoRA adapters,
    a full checkpoint's weights, freezing, device, fp8, any-resolution position embeddings,
    activation checkpointing and compile. Returns (model, config with init recorded, LoRA
    scales, towers that recompute)."""
    t = config.train
    model = create_model(spec, seed=config.seed, dtype=precision.param_dtype)
    # `init`: a baseline's weights, loaded once before step 0 (a resume restores its checkpoint).
    config = start_from_init(model, config, ckpt.meta if ckpt is not None else None)
    # LoRA adapters join before a checkpoint loads (it holds them) and before any wrapper.
    apply_lora(model, lora_towers(t), seed=config.seed)
    lora_scale = lora_scales(model)
    if ckpt is not None and ckpt.format == "full":  # sharded: loaded into the wrapped model
        model.load_state_dict(ckpt.model)
    freeze_parameters(model, t)
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
    return model, config, lora_scale, recompute


def _has_unused_parameters(data: TrainData) -> bool:
    """Whether some trainable parameters may get no gradient in a step, which DDP must then
    look for: sources of different modalities leave towers out of a step (mixed by step).
    (A vision-language model's batches always hold "image", [0, ...] when text-only, and the
    model freezes the vision blocks past its feature layer: every trainable parameter gets a
    gradient.)"""
    return bool(data.idle_towers())


def _open_metrics(run: _Run) -> None:
    """The metrics writer, the resolved config (now that everything accepted it) and the
    planner's prediction for this run, to set beside each step's measured peak."""
    config, t = run.config, run.config.train
    if run.rank == 0:
        _save_resolved_config(config, run.out)
    run.metrics = MetricsWriter(
        run.out, enabled=run.rank == 0, tensorboard=config.metrics.tensorboard, resume_step=run.step
    )
    if t.precision != "fp64":  # the planner knows the training precisions, not the reference
        run.metrics.record(
            "plan",
            run.step,
            planned_memory(
                run.spec,
                config,
                world_size=run.world,
                recompute=run.recompute,
                device=run.env.device,
            ),
        )


# ----------------------------------------------------------------------------- one step
def _train_step(run: _Run) -> dict[str, Any]:
    """One optimizer step: next K micro-batches -> forward/backward of every objective ->
    skip a non-finite step -> clip -> optimizer and schedule -> EMA; returns the metrics row."""
    t, device, precision = run.t, run.env.device, run.precision
    # Progressive resolution: the input size of this step (a pure function of the step).
    step_spec = spec_at(run.spec, run.step, t.resolution_schedule, t.frames_schedule)
    run.data.set_input_spec(step_spec)
    reset_peak_memory(device)

    t0 = time.perf_counter()
    micro_batches, step_keys = [], []
    for _ in range(run.accumulation):
        micro_batches.append(_to_device(run.data.next_batch(), device, precision.param_dtype))
        step_keys += run.data.last_keys
    if run.step + 1 in run.config.guards.inject_nan_steps and run.step + 1 not in run.injected:
        run.injected.add(run.step + 1)
        _inject_nan(micro_batches[0])
    t1 = time.perf_counter()
    run.comm.start_step()

    run.optimizer.zero_grad(set_to_none=True)
    loss, part_losses = forward_backward(run.trained, run.objectives, micro_batches, precision)
    # One all-reduce: mean losses over ranks (each holds its share), summed corrupt counts.
    losses, corrupt_now = _reduce_over_ranks(
        [loss, *part_losses.values()], run.data.corrupt_samples()
    )
    run.corrupt = run.corrupt_before + corrupt_now
    _sync(device)
    t2 = time.perf_counter()

    finite_loss = math.isfinite(losses[0])  # the same on every rank
    grad_norm, stepped = optimizer_step(
        run.model, run.optimizer, precision, t.grad_clip, skip=not finite_loss
    )
    with warnings.catch_warnings():
        # A skipped step still uses up its place in the schedule (by design, not a bug).
        warnings.filterwarnings(
            "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
        )
        run.scheduler.step()
    if run.ema is not None and stepped:
        run.ema.update(run.model)
    _sync(device)
    t3 = time.perf_counter()
    comm_times = run.comm.finish_step()  # reads CUDA events only after the sync above

    run.step += 1
    run.samples_seen += t.batch_size
    _count_bad_step(run, losses[0], grad_norm, stepped, finite_loss, step_keys)
    times = {"data": t1 - t0, "compute": t2 - t1, "optimizer": t3 - t2}
    flops = _step_train_flops(run, step_spec, micro_batches)
    row = {
        "loss": losses[0],
        **{f"loss/{k}": v for k, v in zip(part_losses, losses[1:], strict=True)},
        "lr": run.scheduler.get_last_lr()[0],
        **{f"lr/{g['name']}": g["lr"] for g in run.optimizer.param_groups},
        "grad_norm": float(grad_norm),
        "samples_seen": run.samples_seen,
        "skipped_steps": run.skipped,
        "rollbacks": run.rollbacks,
        "corrupt_samples": run.corrupt,
        **run.data.cache_stats(),  # s3:// sources: hit rate, network wait, downloads
        "checkpoint_s_total": run.checkpoint_s,
        **throughput(
            t.batch_size,
            times,
            flops_per_sample=flops // t.batch_size,
            peak_flops=run.peak_flops,
            world_size=run.world,
            comm=comm_times,
        ),  # fmt: skip
        **memory_gib(device),
    }
    row.update(_model_metrics(run, step_spec, times))
    if run.validation is not None and run.validation.due(run.step, t.steps):
        with precision.autocast():
            row.update(run.validation.run(run.trained, run.step))
    return row


def _count_bad_step(
    run: _Run, loss: float, grad_norm: float, stepped: bool, finite_loss: bool, keys: list[str]
) -> None:
    """Skipped steps, the rollback guard's count, loss spikes (with the samples to blame)."""
    # fp16 overflows are the loss scaler's business; a non-finite loss, or a non-finite
    # gradient without a scaler, is a step the guard counts towards a rollback.
    bad = not finite_loss or (run.precision.scaler is None and not stepped)
    run.nonfinite_in_a_row = run.nonfinite_in_a_row + 1 if bad else 0
    if not stepped:
        run.skipped += 1
        log.warning(
            "step %d skipped: loss %s, gradient norm %s; samples: %s",
            run.step, loss, grad_norm, ", ".join(keys[:8]),
        )  # fmt: skip
    if run.spikes.check(loss):
        log.warning("step %d: loss spike %.4f; samples: %s", run.step, loss, ", ".join(keys))


def _step_train_flops(
    run: _Run, step_spec: ModelSpec, micro_batches: Sequence[dict[str, torch.Tensor]]
) -> int:
    """Training FLOPs of the step over all ranks. A language model counts the positions and
    images of this rank's rows (they vary from step to step) and scales by the ranks."""
    recompute = bool(run.recompute)
    if step_spec.decoder is None:
        return train_flops_per_sample(step_spec.forward_flops(), recompute) * run.t.batch_size
    forward = sum(_language_model_flops(step_spec, batch) for batch in micro_batches)
    return train_flops_per_sample(forward, recompute) * run.world


def _language_model_flops(spec: ModelSpec, batch: dict[str, torch.Tensor]) -> int:
    """Forward FLOPs of one batch of a language model: each row at its length once its images
    are spliced in (padding included: it is computed), plus the images' vision tower and
    projector."""
    ids = batch["text"]
    images = int(batch["image"].shape[0]) if "image" in batch else 0
    if spec.projector is None or images == 0:
        return ids.shape[0] * spec.sequence_flops(ids.shape[1])
    per_row = (ids == spec.projector.image_token_id).sum(dim=1).tolist()
    extra = spec.image_tokens() - 1
    rows = sum(spec.decoder.forward_flops(ids.shape[1] + n * extra) for n in per_row)
    return rows + images * spec.image_flops()


def _model_metrics(run: _Run, step_spec: ModelSpec, times: dict[str, float]) -> dict[str, float]:
    """What only some models have: the contrastive temperature, the changing input size, the
    fp16 loss scale, target tokens per second of a language model."""
    row: dict[str, float] = {}
    if hasattr(run.model, "logit_scale"):
        row["logit_scale"] = float(logit_scale_value(run.model.logit_scale.detach()))
    if step_spec is not run.spec:
        row.update({f"input_size/{k}": v for k, v in _input_sizes(step_spec).items()})
    if run.precision.scaler is not None:
        row["loss_scale"] = float(run.precision.scaler.get_scale())
    for objective in run.objectives:
        if isinstance(objective, NextTokenObjective):
            row["target_tokens"] = objective.targets
            row["target_tokens_per_s"] = objective.targets / max(sum(times.values()), 1e-9)
    return row


def _record(run: _Run, row: dict[str, Any], on_step: Callable[[dict[str, Any]], None] | None):
    run.metrics.write(run.step, row)
    run.result.history.append({"step": run.step, **row})
    if on_step is not None and run.rank == 0:
        on_step({"step": run.step, **row})


def forward_backward(
    trained: nn.Module,
    objectives: Sequence[Objective],
    micro_batches: Sequence[dict[str, torch.Tensor]],
    precision: Precision,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward over K micro-batches, with the gradient of ONE batch of all of them
    (each objective normalises its share so; train/objectives.py says how).

    `trained` is what runs the forward (the DDP/compiled wrapper). Gradients accumulate in
    `.grad`; DDP synchronises them on the last micro-batch only. Returns the step's total loss
    and the named parts of the objectives (loss per pair, "fusion"), detached.
    """
    for objective in objectives:
        objective.prepare(trained, micro_batches, precision)
    k = len(micro_batches)
    for j, batch in enumerate(micro_batches):
        sync = contextlib.nullcontext() if j == k - 1 else parallel.no_sync(trained)
        with sync:
            with precision.autocast():
                out = trained(model_inputs(batch))
            loss = torch.zeros((), device=next(iter(out.values())).device)
            read: set[str] = set()
            for objective in objectives:
                loss = loss + objective.loss(out, batch, j)
                read |= objective.reads(batch)
            if trained is not _unwrap_model(trained):
                # Outputs no loss reads (a fused tower's projection): a zero term keeps their
                # parameters in the graph, so DDP's reducer gets a (zero) gradient for each.
                for name in sorted(out.keys() - read):
                    loss = loss + 0.0 * at_least_fp32(out[name]).sum()
            if precision.scaler is not None:
                precision.scaler.scale(loss).backward()
            else:
                loss.backward()
    total = torch.zeros(())
    parts: dict[str, torch.Tensor] = {}
    for objective in objectives:
        for name, value in objective.report().items():
            if name:
                parts[name] = value
            else:
                total = total + value.cpu()
    return total, parts


def _unwrap_model(trained: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 and compile work in place: the module itself)."""
    return trained.module if isinstance(trained, DistributedDataParallel) else trained


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


# ----------------------------------------------------------------------------- checkpoint
def _checkpoint_when_due(run: _Run) -> bool:
    """Write a checkpoint when one is due (every N steps, every M minutes, the last step, a
    signal); returns True when a signal asked the run to stop (the checkpoint is written)."""
    config, step = run.config, run.step
    due_by_steps = config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0
    due_by_time = config.checkpoint.every_minutes and (
        time.monotonic() - run.last_save_time >= 60 * config.checkpoint.every_minutes
    )
    # Every rank must take the same branch: rank 0's clock and any rank's signal decide.
    by_time, signalled = parallel.agree_any([bool(due_by_time), run.stop.requested])
    if signalled or by_time or due_by_steps or step == run.t.steps:
        started = time.monotonic()
        _save_checkpoint(run)
        run.last_save_time = time.monotonic()
        run.checkpoint_s += run.last_save_time - started
    if signalled:
        log.warning("stopped by a signal after step %d; checkpoint written, exiting", step)
        run.result.stopped_by_signal = True
    return signalled


def _save_checkpoint(run: _Run) -> None:
    """Every rank takes part. Full: FSDP gathers the weights and optimizer state to rank 0,
    which writes them. Sharded: each rank writes its own shards, in place (no gather)."""
    model, optimizer, precision = run.model, run.optimizer, run.precision
    if run.checkpoint_format == "sharded":
        shards = parallel.sharded_state_dict(model, optimizer)
        _check_finite_weights(shards["model"], sharded=True)
    else:
        weights = _full_weights(model, run.rank)
        optimizer_state = parallel.optimizer_state_dict(model, optimizer)
    state = {
        "scheduler": run.scheduler.state_dict(),
        "scaler": precision.scaler.state_dict() if precision.scaler is not None else {},
        "loader": run.data.state_dict(),
        "rng": _gather_rng_states(),  # one entry per rank
        "counters": {
            "step": run.step,
            "samples_seen": run.samples_seen,
            "skipped_steps": run.skipped,
            "corrupt_samples": run.corrupt,
            "rollbacks": run.rollbacks,
        },
    }
    if run.ema is not None:
        state["ema"] = run.ema.state_dict()
    meta = {
        "config": run.config.to_dict(),
        "spec": run.spec.to_dict(),  # self-describing: `mmtrain eval` needs no run folder
        "samples_seen": run.samples_seen,
        "world_size": run.world,
    }
    keep, where = run.config.checkpoint.keep, run.out / CHECKPOINT_DIR
    if run.checkpoint_format == "sharded":
        save_sharded_checkpoint(where, run.step, shards, state, meta, keep)
    elif run.rank == 0:
        _check_finite_weights(weights)
        state["optimizer"] = optimizer_state
        save_checkpoint(where, run.step, weights, state, meta, keep)
    parallel.barrier()


# ----------------------------------------------------------------------------- rollback
def _roll_back(run: _Run) -> None:
    """After K non-finite steps in a row, every rank reloads the newest valid checkpoint from
    before them (weights, optimizer, schedule, scaler, data position, RNG) and trains on."""
    ckpt = _rollback_checkpoint(
        run.out, run.step, run.nonfinite_in_a_row, run.rollbacks, run.config
    )
    if ckpt.format == "full":  # a sharded one's weights load in _restore_state
        parallel.load_full_model_state_dict(run.model, ckpt.model)
    rollbacks, skipped = run.rollbacks, run.skipped  # steps that happened, rolled back or not
    _restore_state(run, ckpt)
    run.skipped = skipped
    if run.config.guards.rollback_lr_factor != 1.0:
        scale_learning_rates(run.optimizer, run.scheduler, run.config.guards.rollback_lr_factor)
    run.rollbacks = rollbacks + 1
    run.nonfinite_in_a_row = 0
    run.metrics.rewind(run.step)
    run.result.history = [r for r in run.result.history if r["step"] <= run.step]


# ----------------------------------------------------------------------------- finish
def _halt(run: _Run) -> TrainResult:
    """Stop dead (`halt_after_step`), as a crash would: nothing more written."""
    run.metrics.close()
    run.data.close()
    if run.validation is not None:
        run.validation.close()
    run.result.step, run.result.samples_seen = run.step, run.samples_seen
    return run.result


def _finish(run: _Run) -> TrainResult:
    """The final weights (OUT/model.safetensors + spec.yaml; LoRA: merged, and the adapters
    alone in OUT/lora.safetensors; EMA in OUT/ema), the validation report, the summary."""
    model, rank, result = run.model, run.rank, run.result
    done = run.step >= run.t.steps
    if done:
        weights = _full_weights(model, rank)  # a collective under FSDP
        if rank == 0:
            _check_finite_weights(weights)
            if run.lora_scale:
                write_lora_file(adapter_weights(weights), lora_towers(run.t), run.out / LORA_FILE)
                weights = merge_lora_state(weights, run.lora_scale)
            save_model(model_with_weights(model.spec, weights), run.out)
            if run.ema is not None:
                save_model(run.ema.model(model), run.out / "ema")
    if run.validation is not None:
        if done:
            result.eval = run.validation.write_report(run.spec)
        run.validation.close()
    parallel.barrier()
    run.metrics.close()
    result.step, result.samples_seen, result.skipped_steps = run.step, run.samples_seen, run.skipped
    result.rollbacks = run.rollbacks
    result.corrupt_samples = (
        run.corrupt_before + _reduce_over_ranks([], run.data.corrupt_samples())[1]
    )
    result.last_loss = result.history[-1]["loss"] if result.history else math.nan
    run.data.close()
    # Free the DDP wrapper while the process group is still alive. Its C++ reducer frees
    # without releasing the GIL; were it to hold the group's last reference, the group's
    # destructor would join a gloo thread that waits for the GIL: a deadlock seen under load.
    # (shutdown collects garbage first; the CLI then ends a rank without finalization.)
    run.trained = None  # type: ignore[assignment]
    parallel.shutdown(run.env)
    return result


# ----------------------------------------------------------------------------- state
def _restore_state(run: _Run, ckpt: Checkpoint) -> None:
    """Load everything but a full checkpoint's weights from `ckpt` and set the run's counters.

    The optimizer state may have been saved under any strategy on any number of ranks; under
    FSDP each rank keeps its shard of it. A sharded checkpoint holds the weights beside the
    optimizer state: both load here, DCP reading for each rank what its shards cover.
    """
    model, optimizer = run.model, run.optimizer
    if ckpt.format == "sharded":
        shards = parallel.sharded_state_dict(model, optimizer)  # this run's layout
        read_sharded(ckpt.path, shards)
        parallel.load_sharded_state_dict(model, optimizer, shards)
    else:
        parallel.load_optimizer_state_dict(model, optimizer, ckpt.state["optimizer"])
    run.scheduler.load_state_dict(ckpt.state["scheduler"])
    if run.precision.scaler is not None and ckpt.state.get("scaler"):
        run.precision.scaler.load_state_dict(ckpt.state["scaler"])
    run.data.load_state_dict(ckpt.state["loader"])
    if run.ema is not None and "ema" in ckpt.state:
        run.ema.load_state_dict(ckpt.state["ema"])
    counters = ckpt.state["counters"]
    _restore_rng_states(ckpt.state["rng"], run.rank, run.config.seed, counters["step"])
    run.step, run.samples_seen = counters["step"], counters["samples_seen"]
    run.skipped = counters["skipped_steps"]
    run.corrupt_before = run.corrupt = counters["corrupt_samples"]
    run.rollbacks = counters.get("rollbacks", 0)


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


def _conversation_settings(config: RunConfig, spec: ModelSpec) -> Any:
    from mmtrain.data.conversation_batches import ConversationBatcher

    return ConversationBatcher(config.data, spec)


def _language_model_evaluator(
    config: RunConfig, spec: ModelSpec, settings: Any, path: str, rank: int, world: int
) -> Any:
    """Perplexity and generated answers on validation conversations, with the run's tokenizer,
    chat template and sequence length (`settings`: a ConversationBatcher)."""
    from mmtrain.eval.generation import VLMEvaluator

    return VLMEvaluator(
        spec,
        path,
        batch_size=config.eval.batch_size,
        tokenizer=settings.tokenizer,
        chat_template=settings.template,
        max_length=settings.sequence_length,
        seed=config.seed,
        rank=rank,
        world_size=world,
    )


class _Validation:
    """Periodic evaluation on `data.val` with the eval package's `Evaluator`, on every rank
    (each embeds its share); rows get `val/...` metrics, the run folder gets eval.json."""

    def __init__(self, config: RunConfig, spec: ModelSpec, out: Path, rank: int, world: int):
        from mmtrain.eval.run import Evaluator

        self.every = config.eval.every_steps
        self.out, self.rank, self.world = out, rank, world
        self.sources = [source.path for source in config.data.val]
        self.evaluators = []
        # A language model's settings (tokenizer, chat template) are checked once, naming
        # their own fields; each evaluator then reads its conversations.
        settings = _conversation_settings(config, spec) if spec.decoder is not None else None
        for i, path in enumerate(self.sources):
            try:
                if settings is not None:
                    self.evaluators.append(
                        _language_model_evaluator(config, spec, settings, path, rank, world)
                    )
                    continue
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
    *sums, total = sum_over_ranks([*(float(m) for m in means), float(count)])
    world = distributed.world_size()
    return [v / world for v in sums], int(round(total))


def _sync(device: torch.device) -> None:
    # Honest step-time split: CUDA runs asynchronously.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StopOnSignal:
    """SIGTERM/SIGINT set `requested` (finish the step, checkpoint, exit 0); a second one exits
    at once. Installed only in the main thread (signals cannot be handled elsewhere).

    A copy that arrives within `ECHO_S` of the first is taken for the same request: under plain
    torchrun on Slurm a rank gets Slurm's SIGTERM and torchrun's forwarded one milliseconds
    apart, and must not lose its checkpoint to that echo (a person's second Ctrl-C is slower)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    ECHO_S = 1.0

    def __init__(self) -> None:
        self.requested = False
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            if time.monotonic() - self._first_at < self.ECHO_S:
                return
            raise SystemExit(128 + signum)
        self.requested = True
        self._first_at = time.monotonic()
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

    def model(self, model: nn.Module) -> nn.Module:
        """A copy of `model` (on the CPU) holding the averaged weights."""
        copy = create_model(model.spec, device="meta")
        state = {k: self.shadow.get(k, v).to("cpu", v.dtype) for k, v in model.state_dict().items()}
        copy.load_state_dict(state, assign=True)
        copy.reset_buffers()
        return copy
