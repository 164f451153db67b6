"""The training loop: `train(config)` reads top to bottom.

    set up ranks and device -> find the newest valid checkpoint -> build the model from its spec
    -> freeze / precision / compile / activation checkpointing / DDP -> optimizer and schedule
    -> data -> restore state when resuming -> loop over optimizer steps:
         next K micro-batches -> contrastive-correct forward/backward -> guard non-finite
         gradients -> clip -> optimizer step -> metrics -> checkpoint when due or on a signal
    -> final checkpoint and OUT/model.safetensors + OUT/spec.yaml

Everything a resumed run needs is in the checkpoint (weights, optimizer, schedule, scaler, the
loader's position, RNG states, counters), so running the same command again continues where
the last valid checkpoint left off; on a CPU the result is bitwise identical to a run that was
never interrupted.
"""

from __future__ import annotations

import contextlib
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

from mmtrain import __version__
from mmtrain.atomic import atomic_write_text
from mmtrain.config import RunConfig, diff_configs, parse_yaml
from mmtrain.losses import ContrastiveLoss, logit_scale_value
from mmtrain.models import MultimodalModel, create_model, save_model
from mmtrain.spec import load_spec
from mmtrain.structured import FieldError
from mmtrain.train import parallel
from mmtrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mmtrain.train.data import TrainData
from mmtrain.train.metrics import (
    LossSpikes,
    MetricsWriter,
    detect_peak_flops,
    memory_gib,
    throughput,
    train_flops_per_sample,
)
from mmtrain.train.optim import freeze_parameters, make_optimizer, make_scheduler
from mmtrain.train.precision import Precision, convert_to_fp8, make_precision
from mmtrain.train.rng import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"
MAX_NONFINITE_IN_A_ROW = 10  # then stop: the run diverged, resuming would repeat it


@dataclass
class TrainResult:
    """What a call to `train` did (rank 0's view)."""

    out: Path
    step: int  # optimizer steps done in total (including before a resume)
    samples_seen: int
    resumed_from: int | None  # checkpoint step resumed from, None for a fresh start
    stopped_by_signal: bool = False
    skipped_steps: int = 0  # non-finite gradients or fp16 overflows
    corrupt_samples: int = 0
    last_loss: float = math.nan
    history: list[dict[str, Any]] = field(default_factory=list)  # rows written to metrics.jsonl


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
    spec = load_spec(config.model)
    if not spec.pairs:
        raise FieldError(
            "model",
            f"{spec.name!r} has no contrastive pairs; `mmtrain train` does not train a "
            "fusion-only head yet",
        )
    precision = make_precision(config.train.precision, device)  # fails early where it cannot run
    out = Path(config.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    parallel.barrier()
    micro_batch = config.micro_batch_for(world)
    accumulation = config.accumulation_steps(world)

    # -- resume point: the newest checkpoint whose manifest verifies ------------------------------
    ckpt_path = latest_checkpoint(out / CHECKPOINT_DIR)
    ckpt = load_checkpoint(ckpt_path) if ckpt_path is not None else None
    if ckpt is None:
        _seed_everything(config.seed)

    # -- model --------------------------------------------------------------------------------
    model = create_model(spec, seed=config.seed)
    if ckpt is not None:
        model.load_state_dict(ckpt.model)
    frozen = freeze_parameters(model, config.train)
    model.to(device)
    if config.train.precision == "fp8":
        convert_to_fp8(model, config.train.fp8_keep_bf16)
    recompute = [n for n, t in config.train.towers.items() if t.activation_checkpointing]
    parallel.checkpoint_tower_blocks(model, recompute)
    if config.train.compile:
        for tower in model.towers.values():
            tower.compile()  # in place: parameter names (and checkpoints) stay the same
    trained = parallel.wrap_data_parallel(model, env, config.train.parallel)

    optimizer = make_optimizer(model, config.train, device)
    scheduler = make_scheduler(optimizer, config.train)
    loss_fn = ContrastiveLoss.from_spec(spec)
    ema = _Ema(model, config.train.ema) if config.train.ema else None

    # -- data ---------------------------------------------------------------------------------
    data = TrainData(config, spec, rank=rank, world_size=world, micro_batch=micro_batch)

    # -- restore everything else a resumed run needs ---------------------------------------------
    step, samples_seen, skipped, corrupt_before, nonfinite_in_a_row = 0, 0, 0, 0, 0
    if ckpt is not None:
        optimizer.load_state_dict(ckpt.state["optimizer"])
        scheduler.load_state_dict(ckpt.state["scheduler"])
        if precision.scaler is not None and ckpt.state.get("scaler"):
            precision.scaler.load_state_dict(ckpt.state["scaler"])
        data.load_state_dict(ckpt.state["loader"])
        if ema is not None and "ema" in ckpt.state:
            ema.load_state_dict(ckpt.state["ema"])
        restore_rng_state(ckpt.state["rng"])
        counters = ckpt.state["counters"]
        step, samples_seen = counters["step"], counters["samples_seen"]
        skipped, corrupt_before = counters["skipped_steps"], counters["corrupt_samples"]
        log.info("resuming from %s (step %d, %d samples seen)", ckpt.path, step, samples_seen)
    resumed_from = ckpt.step if ckpt is not None else None
    del ckpt  # the weights now live in the model and optimizer

    # -- metrics (and the resolved config, now that everything above accepted it) -------------
    if rank == 0:
        _save_resolved_config(config, out)
    metrics = MetricsWriter(
        out, enabled=rank == 0, tensorboard=config.metrics.tensorboard, resume_step=step
    )
    peak_flops = (config.metrics.peak_tflops or 0) * 1e12 or detect_peak_flops(
        device, config.train.precision
    )
    flops_per_sample = train_flops_per_sample(spec.forward_flops(), recompute=bool(recompute))
    result = TrainResult(out=out, step=step, samples_seen=samples_seen, resumed_from=resumed_from)
    log.info(
        "training %s: %d ranks x %d micro-batch x %d accumulation = %d per step, %d steps, %s on %s "
        "(%d frozen parameters)",
        spec.name,
        world,
        micro_batch,
        accumulation,
        config.train.batch_size,
        config.train.steps,
        config.train.precision,
        device,
        frozen,
    )

    def save(at_step: int) -> None:
        state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": precision.scaler.state_dict() if precision.scaler is not None else {},
            "loader": data.state_dict(),
            "rng": capture_rng_state(),
            "counters": {
                "step": at_step,
                "samples_seen": samples_seen,
                "skipped_steps": skipped,
                "corrupt_samples": corrupt,
            },
        }
        if ema is not None:
            state["ema"] = ema.state_dict()
        if rank == 0:
            _check_finite_weights(model)
            meta = {"config": config.to_dict(), "samples_seen": samples_seen, "world_size": world}
            save_checkpoint(
                out / CHECKPOINT_DIR,
                at_step,
                model.state_dict(),
                state,
                meta,
                keep=config.checkpoint.keep,
            )
        parallel.barrier()

    # -- the loop -----------------------------------------------------------------------------
    last_save_time = time.monotonic()
    checkpoint_s = 0.0  # time spent writing checkpoints in this process (overhead, for metrics)
    spikes = LossSpikes()
    stop = _StopOnSignal()
    with stop:
        while step < config.train.steps:
            t0 = time.perf_counter()
            micro_batches, step_keys = [], []
            for _ in range(accumulation):
                micro_batches.append(data.next_batch())
                step_keys += data.last_keys
            t1 = time.perf_counter()

            optimizer.zero_grad(set_to_none=True)
            loss, pair_losses = forward_backward(trained, model, loss_fn, micro_batches, precision)
            _sync(device)
            t2 = time.perf_counter()

            grad_norm, stepped = optimizer_step(model, optimizer, precision, config.train.grad_clip)
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

            step += 1
            samples_seen += config.train.batch_size
            if not stepped:
                skipped += 1
                nonfinite_in_a_row += 1
                log.warning("step %d: non-finite gradient (norm %s); step skipped", step, grad_norm)
            else:
                nonfinite_in_a_row = 0
            if nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
                raise FloatingPointError(
                    f"{nonfinite_in_a_row} steps in a row had non-finite gradients (step {step}); "
                    f"the run diverged. Lower train.lr or use bf16/fp32; the last good checkpoint "
                    f"is in {out / CHECKPOINT_DIR}"
                )

            # One all-reduce: mean losses over ranks (each holds its share), summed corrupt counts.
            losses, corrupt_now = _reduce_over_ranks(
                [loss, *pair_losses.values()], data.corrupt_samples()
            )
            corrupt = corrupt_before + corrupt_now
            if spikes.check(losses[0]):
                log.warning(
                    "step %d: loss spike %.4f; samples: %s", step, losses[0], ", ".join(step_keys)
                )
            times = {"data": t1 - t0, "compute": t2 - t1, "optimizer": t3 - t2}
            row = {
                "loss": losses[0],
                **{f"loss/{k}": v for k, v in zip(pair_losses, losses[1:], strict=True)},
                "lr": scheduler.get_last_lr()[0],
                **{f"lr/{g['name']}": g["lr"] for g in optimizer.param_groups},
                "logit_scale": float(logit_scale_value(model.logit_scale.detach())),
                "grad_norm": float(grad_norm),
                "samples_seen": samples_seen,
                "skipped_steps": skipped,
                "corrupt_samples": corrupt,
                "checkpoint_s_total": checkpoint_s,
                **throughput(
                    config.train.batch_size,
                    times,
                    flops_per_sample=flops_per_sample,
                    peak_flops=peak_flops,
                    world_size=world,
                ),
                **memory_gib(device),
            }
            if precision.scaler is not None:
                row["loss_scale"] = float(precision.scaler.get_scale())
            metrics.write(step, row)
            result.history.append({"step": step, **row})
            if on_step is not None and rank == 0:
                on_step({"step": step, **row})

            if halt_after_step is not None and step >= halt_after_step:
                metrics.close()
                data.close()
                result.step, result.samples_seen = step, samples_seen
                return result  # as a crash would: nothing more written

            due_by_steps = (
                config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0
            )
            due_by_time = config.checkpoint.every_minutes and (
                time.monotonic() - last_save_time >= 60 * config.checkpoint.every_minutes
            )
            # Every rank must take the same branch: rank 0's clock and any rank's signal decide.
            by_time, signalled = parallel.agree_any([bool(due_by_time), stop.requested])
            if signalled or by_time or due_by_steps or step == config.train.steps:
                started = time.monotonic()
                save(step)
                last_save_time = time.monotonic()
                checkpoint_s += last_save_time - started
            if signalled:
                log.warning("stopped by a signal after step %d; checkpoint written, exiting", step)
                result.stopped_by_signal = True
                break

    # -- final weights ------------------------------------------------------------------------
    if rank == 0 and step >= config.train.steps:
        _check_finite_weights(model)
        save_model(model, out)
        if ema is not None:
            save_model(ema.model(model), out / "ema")
    parallel.barrier()
    metrics.close()
    result.step, result.samples_seen, result.skipped_steps = step, samples_seen, skipped
    result.corrupt_samples = corrupt_before + _reduce_over_ranks([], data.corrupt_samples())[1]
    result.last_loss = result.history[-1]["loss"] if result.history else math.nan
    data.close()
    parallel.shutdown(env)
    return result


# ----------------------------------------------------------------------------- one step
def forward_backward(
    trained: nn.Module,
    model: MultimodalModel,
    loss_fn: ContrastiveLoss,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    precision: Precision,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward over K micro-batches, with the gradient of ONE batch of all of them.

    A contrastive loss couples samples (every sample is a negative for every other), so summing
    K independent micro-batch losses would train on K small batches. Instead (as OpenCLIP's
    accum-freq): embed every micro-batch without gradient first, then recompute each micro-batch
    with gradient and take the loss of the whole accumulated batch, the other micro-batches'
    cached embeddings joining as `extra_negatives`. Each backward yields exactly that
    micro-batch's share of the full-batch gradient; their sum (no division by K) is the
    full-batch gradient. Costs one extra forward per micro-batch when K > 1.

    `trained` is what runs the forward (the DDP/compiled wrapper), `model` the plain module
    (for the logit scale and bias). Gradients accumulate in `.grad`; DDP synchronises them on
    the last micro-batch only. Returns the loss and the per-pair losses (detached).
    """
    pairs = model.spec.pairs
    names = sorted({name for pair in pairs for name in pair})
    scale = model.logit_scale
    bias = getattr(model, "logit_bias", None)
    k = len(micro_batches)
    cached: list[dict[str, torch.Tensor]] = []
    if k > 1:
        with torch.no_grad(), precision.autocast():
            cached = [_features(trained(batch), names) for batch in micro_batches]
    loss = pair_losses = None
    for j, batch in enumerate(micro_batches):
        sync = contextlib.nullcontext() if j == k - 1 else parallel.no_sync(trained)
        with sync:
            with precision.autocast():
                features = _features(trained(batch), names)
            extra = None
            if k > 1:
                extra = {n: torch.cat([cached[i][n] for i in range(k) if i != j]) for n in names}
            loss, pair_losses = loss_fn(features, pairs, scale, bias, extra_negatives=extra)
            if precision.scaler is not None:
                precision.scaler.scale(loss).backward()
            else:
                loss.backward()
    return loss.detach(), {name: value.detach() for name, value in pair_losses.items()}


def _features(out: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    # The loss runs in fp32 whatever the autocast dtype: logits of a large batch need the range.
    return {name: out[name].float() for name in names}


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    grad_clip: float | None,
) -> tuple[float, bool]:
    """Unscale (fp16), clip, and step unless a gradient is not finite; returns (norm, stepped).

    With fp16 the GradScaler skips overflowing steps itself and lowers its scale; otherwise a
    non-finite norm skips the step here, so a single bad batch cannot poison the weights.
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
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return float(norm), False
    optimizer.step()
    return float(norm), True


# ----------------------------------------------------------------------------- helpers
def _seed_everything(seed: int) -> None:
    """Seed the global generators once per fresh run, for code we do not control; mmtrain's
    own randomness (init, data order, augmentation) comes from explicit generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


def _check_finite_weights(model: nn.Module) -> None:
    bad = [
        name
        for name, p in model.state_dict().items()
        if p.is_floating_point() and not torch.isfinite(p).all()
    ]
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
