"""The training loop: `train(config)` builds a `Trainer` from small components and runs it.

    set-up (`Trainer.__init__`): ranks and device -> the newest valid checkpoint -> data ->
        the model (train/model_setup.py) -> DDP or FSDP2 -> optimizer, schedule, objectives
        -> the checkpoint's state -> the metrics recorder and the memory plan
    one step (`Trainer.step`): input size for this step -> next K micro-batches -> forward
        and backward of every objective (train/step.py) -> the one host read: skip a
        non-finite step, else clip and step -> EMA -> the step's row to the recorder
    after each step: rows written every `metrics.log_every` steps (train/recorder.py),
        validation when due (train/validator.py), a rollback after K non-finite steps in a
        row, a checkpoint when due (train/checkpointer.py), a signal's stop (train/signals.py)
    finish (`Trainer.finish`): OUT/model.safetensors + OUT/spec.yaml (LoRA: adapters merged,
        and alone in OUT/lora.safetensors; EMA in OUT/ema), OUT/eval.json

Each component owns its state: the counters (`TrainState`), the checkpoint policy and timing
(`Checkpointer`), the pending rows and the loss-spike statistics (`MetricsRecorder`), the
averaged weights (`Ema`), the validation sets (`Validator`). Everything a resumed run needs is
in the checkpoint (weights, optimizer, schedule, scaler, the loader's position, each rank's RNG
states, counters), so running the same command again continues where the last valid
checkpoint left off; on a CPU the result is bitwise identical to a run never interrupted.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmtrain import __version__
from mmtrain.atomic import atomic_write_text
from mmtrain.checkpoint import Checkpoint
from mmtrain.config import RunConfig, diff_configs, parse_yaml
from mmtrain.distributed import default_allocator_settings, sum_over_ranks
from mmtrain.folders import CONFIG_FILE
from mmtrain.losses import logit_scale_value
from mmtrain.models.formats.peft_adapter import peft_base_name
from mmtrain.models.model_source import load_model_spec
from mmtrain.plan.comm import COMM_SHARE_LIMIT
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train import parallel
from mmtrain.train.checkpointer import Checkpointer
from mmtrain.train.comm_timing import CommTimer
from mmtrain.train.data import TrainData
from mmtrain.train.dpo import reference_logps, reference_mode, scores_by_token
from mmtrain.train.ema import Ema
from mmtrain.train.export import copy_processor_files, export_model
from mmtrain.train.export_hub import export_hub_model, write_hub_adapter
from mmtrain.train.export_hub_denoiser import export_hub_denoiser, write_denoiser_adapter
from mmtrain.train.lora import lora_towers
from mmtrain.train.metrics import (
    compile_counts,
    detect_peak_flops,
    memory_gib,
    padding_fraction,
    part_modes,
    planned_memory,
    reset_peak_memory,
    step_model_flops,
    throughput,
)
from mmtrain.train.model_setup import build_model, build_reference, check_hub_settings
from mmtrain.train.objectives import NextTokenObjective, objectives_for
from mmtrain.train.optim import (
    apply_changed_settings,
    group_settings,
    main_lr,
    make_optimizer,
    make_scheduler,
    parameter_counts,
    resolve_optimizer_defaults,
    scale_learning_rates,
)
from mmtrain.train.precision import make_precision
from mmtrain.train.recorder import REFUSED, MetricsRecorder
from mmtrain.train.reference_cache import ReferenceLogps, ReferencePass, identity_of
from mmtrain.train.resolution import check_schedules, spec_at
from mmtrain.train.resume_check import check_resumable
from mmtrain.train.rng import restore_rank_rng_state, seed_everything
from mmtrain.train.sequence_parallel import apply_sequence_parallel, unsplit
from mmtrain.train.signals import StopOnSignal, StopRequested
from mmtrain.train.state import TrainState
from mmtrain.train.step import forward_backward, inject_fault, move_batch, optimizer_step
from mmtrain.train.step_timer import StepTimer
from mmtrain.train.validator import Validator

__all__ = ["TrainResult", "Trainer", "forward_backward", "optimizer_step", "train"]

log = logging.getLogger(__name__)


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
    too_long_samples: int = 0  # skipped: longer than data.sequence_length lets a row hold
    last_loss: float = math.nan
    # The last recorder.HISTORY_ROWS rows written to metrics.jsonl (which keeps them all).
    history: list[dict[str, Any]] = field(default_factory=list)
    eval: dict[str, Any] | None = None  # the final validation report (eval.json)


def train(
    config: RunConfig,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    halt_after_step: int | None = None,
) -> TrainResult:
    """Train (or resume training) the run described by `config`; returns a summary.

    `on_step(row)` sees each step's metrics row when it is written (every `metrics.log_every`
    steps; the CLI draws its progress from it). `halt_after_step` stops dead after that step,
    writing no checkpoint, as a crash would: the fault-injection tests use it to show that
    resuming reproduces an uninterrupted run.
    """
    trainer = Trainer(config, on_step)
    try:
        with trainer.stop, trainer.comm:
            while trainer.state.step < trainer.t.steps:
                trainer.step()
                if halt_after_step is not None and trainer.state.step >= halt_after_step:
                    return trainer.halt()
                if trainer.state.nonfinite_in_a_row >= config.guards.max_nonfinite_in_a_row:
                    trainer.roll_back()
                    continue
                if trainer.checkpoint_when_due():
                    break  # stopped by a signal, checkpoint written
    except StopRequested:
        return trainer.stop_now()
    return trainer.finish()


class Trainer:
    """The components of one run, wired by the set-up, and the parts of the loop."""

    def __init__(self, config: RunConfig, on_step: Callable[[dict[str, Any]], None] | None = None):
        self.spec = spec = load_model_spec(config.model)
        if spec.hub is not None:
            check_hub_settings(config)
        # Before anything touches CUDA: rows and pages of other sizes every step (a decoder,
        # a native-resolution tower) fragment fixed-size allocator segments.
        default_allocator_settings(spec.is_language_model() or spec.vision is not None)
        self.env = env = parallel.init_distributed(
            config.train.device,
            group_of_one=config.train.offload,  # FSDP2 offloads on one GPU too
            sharded=config.train.parallel == "fsdp",
        )
        self.rank, self.world = env.rank, env.world_size
        config.validate(world_size=self.world)
        t = config.train
        # The ranks of a sequence-parallel group read the same samples (data rank); only its
        # first counts what they read (corrupt and too-long samples), once.
        sequence = t.sequence_parallel
        self.data_rank, self.data_world = self.rank // sequence, self.world // sequence
        self.counts_data = self.rank % sequence == 0
        resolve_optimizer_defaults(t, spec)  # AdamW's settings left out: the workload's
        check_schedules(spec, t.resolution_schedule, t.frames_schedule)
        # Fails early where it cannot run; fp32 on CUDA uses TF32 unless train.tf32 is false.
        self.precision = make_precision(t.precision, env.device, tf32=t.tf32)
        self.out = Path(config.out)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        parallel.barrier()
        self.micro_batch = config.micro_batch_for(self.data_world)
        self.accumulation = config.accumulation_steps(self.data_world)

        self.checkpointer = Checkpointer(config, spec, self.out, self.rank, self.world)
        ckpt = self.checkpointer.latest()
        if ckpt is not None:  # settings that change its tensors: exit 2 naming them
            check_resumable(ckpt.meta, config, spec)
        if ckpt is None:
            seed_everything(config.seed)
        on_cuda = env.device.type == "cuda"
        uint8 = config.data.normalise_on_device
        self.data = TrainData(
            config, spec, rank=self.data_rank, world_size=self.data_world,
            micro_batch=self.micro_batch,
            uint8_pixels=on_cuda if uint8 is None else uint8, pin_memory=on_cuda,
        )  # fmt: skip
        # Per-channel values of the pixels normalised on the device, put there once.
        self.pixels = {
            key: tuple(torch.as_tensor(v, device=env.device) for v in values)
            for key, values in self.data.pixel_normalisation().items()
        }
        built = build_model(
            config, spec, self.precision, env, ckpt,
            unused_parameters=bool(self.data.idle_towers()),
        )  # fmt: skip
        self.config = config = built.config  # with `init` recorded
        self.checkpointer.config = config  # checkpoints record init's sha256 (a resume checks them)
        self.model = model = built.model  # the plain module (FSDP shards it in place)
        self.trained = built.trained  # DDP's wrapper, or the model itself
        self.lora_scale, self.recompute = built.lora_scale, built.recompute
        self.sequence_attention = None
        if sequence > 1:
            self.sequence_attention = apply_sequence_parallel(
                model, spec, sequence, t.sequence_parallel_attention
            )
        # FSDP replaced the parameters by their shards: the optimizer comes after.
        self.optimizer = make_optimizer(model, t, env.device)
        self.scheduler = make_scheduler(self.optimizer, t)
        reference, cached = self._dpo_reference(resuming=ckpt is not None)
        self.objectives = objectives_for(
            model, spec, fusion_weight=t.fusion_weight, world_size=self.world,
            diffusion=t.diffusion, seed=config.seed, rank=self.data_rank,
            sequence_parallel=sequence, objective=t.objective, dpo=t.dpo, reference=reference,
            cached=cached,
        )  # fmt: skip
        self.ema = Ema(model, t.ema) if t.ema else None
        self.validator = (
            Validator(config, spec, self.out, self.rank, self.world) if config.data.val else None
        )
        # Model FLOPs as the planner counts them: trained parts 3x, frozen 1x (2x where a
        # gradient passes through), LoRA 2x; recomputation is not model work.
        self.part_modes = part_modes(spec, config) if spec.hub is None else {}
        self.peak_flops = (config.metrics.peak_tflops or 0) * 1e12 or detect_peak_flops(
            env.device, t.precision
        )
        if spec.hub is not None:  # the planner's trace of a hub model does not count steps yet
            self.peak_flops = None
        self.state = TrainState()
        if ckpt is not None:
            self._resume(ckpt)
        self.resumed_from = ckpt.step if ckpt is not None else None
        del ckpt  # the weights now live in the model and optimizer
        # The step of the newest checkpoint: a signal with no step since then stops at once.
        self.saved_step = self.state.step
        # One process stops at once when nothing is left to save (signals.py says why not
        # several ranks).
        self.stop = StopOnSignal(
            nothing_to_save=lambda: self.world == 1 and self.state.step <= self.saved_step
        )
        self.stopped_by_signal = False
        self.injected: set[int] = set()  # fault injection: each step corrupted once
        self.warned_comm_share = False
        self.recorder = self._open_recorder(on_step)
        # Times DDP's/FSDP's collectives and the loss's gathers per step.
        self.comm = CommTimer(env.device, self.world if config.metrics.comm_timing else 1)
        if config.metrics.comm_timing:
            self.comm.attach(self.trained)
        log.info(
            "training %s: %d ranks x %d micro-batch x %d accumulation = %d per step, "
            "%d steps, %s on %s (%s)%s",
            spec.name, self.data_world, self.micro_batch, self.accumulation, t.batch_size,
            t.steps, t.precision, env.device, parameter_counts(model),
            f"; each a group of {sequence} ranks splitting the sequence ({self.sequence_attention})"
            if sequence > 1 else "",
        )  # fmt: skip

    @property
    def t(self) -> Any:
        return self.config.train

    def _open_recorder(self, on_step: Callable[[dict[str, Any]], None] | None) -> MetricsRecorder:
        """The recorder, the resolved config (now that everything accepted it) and the
        planner's prediction for this run, to set beside each step's measured peak."""
        config = self.config
        if self.rank == 0:
            _save_resolved_config(config, self.out)
            # the tokenizer, chat template and processor the run reads text with, so that
            # the run folder exports whole (`convert --to hf`) wherever its sources go
            copy_processor_files(config, self.out)
        recorder = MetricsRecorder(
            self.out,
            rank=self.rank,
            log_every=config.metrics.log_every,
            tensorboard=config.metrics.tensorboard,
            resume_step=self.state.step,
            refused_before=self.state.refused_before,
            skipped_before=self.state.skipped,
            on_step=on_step,
        )
        device = self.env.device  # its model, as the driver names it: the report prices it
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        layout = {"world_size": self.world, "data_ranks": self.data_world,
                  "sequence_parallel": self.t.sequence_parallel, "device": name}  # fmt: skip
        if self.env.ranks_per_node is not None:  # where the node boundaries fall (doctor)
            layout["ranks_per_node"] = self.env.ranks_per_node
        recorder.record("layout", self.state.step, layout)  # what the run folder cannot say
        # The planner knows the training precisions only, and hub models by their trace.
        if self.t.precision != "fp64" and self.spec.hub is None:
            plan = planned_memory(
                self.spec, config, world_size=self.world, recompute=self.recompute,
                device=self.env.device, dpo_reference=self.dpo_reference,
            )  # fmt: skip
            recorder.record("plan", self.state.step, plan)
        return recorder

    # ------------------------------------------------------------------------- one step
    def step(self) -> None:
        """One optimizer step; its row goes to the recorder (written on logging steps)."""
        state, precision, device = self.state, self.precision, self.env.device
        # Progressive resolution: the input size of this step (a pure function of the step).
        step_spec = spec_at(self.spec, state.step, self.t.resolution_schedule,
                            self.t.frames_schedule)  # fmt: skip
        self.data.set_input_spec(step_spec)
        reset_peak_memory(device)

        timer = StepTimer(device)  # CUDA events for forward+backward on a GPU
        timer.start()
        try:
            micro_batches, keys, counts = self._next_micro_batches(step_spec)
        except FieldError as err:  # no batch can be filled: the run folder says why (doctor)
            self.recorder.record("stopped", state.step, {"field": err.path, "message": err.message})
            raise
        timer.data_ready()
        self.comm.start_step()
        self.optimizer.zero_grad(set_to_none=True)
        loss, parts = forward_backward(
            self.trained, self.objectives, micro_batches, precision, self.state.step + 1
        )
        timer.compute_done()
        norm, stepped, loss_finite = optimizer_step(
            self.model, self.optimizer, precision, self.t.grad_clip, loss=loss
        )
        with warnings.catch_warnings():
            # A skipped step still uses up its place in the schedule (by design, not a bug).
            warnings.filterwarnings(
                "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
            )
            self.scheduler.step()
        if self.ema is not None and stepped:
            self.ema.update(self.model)
        if self.comm.world_size > 1 and device.type == "cuda":
            torch.cuda.synchronize(device)  # the timer reads its CUDA events after the step
        times = timer.finish()  # after optimizer_step's read: the events are complete
        comm_times = self.comm.finish_step()

        # fp16 overflows are the loss scaler's business; a non-finite loss, or a non-finite
        # gradient without a scaler, is a step the guard counts towards a rollback.
        bad = not loss_finite or (precision.scaler is None and not stepped)
        state.count_step(self.t.batch_size, stepped, bad)
        if not stepped:
            log.warning("step %d skipped: loss or gradient not finite; samples: %s",
                        state.step, ", ".join(keys[:8]))  # fmt: skip
        self._record(step_spec, loss, parts, norm, times, comm_times, counts, keys)

    def _next_micro_batches(
        self, step_spec: ModelSpec
    ) -> tuple[list[dict[str, torch.Tensor]], list[str], dict[str, Any]]:
        """The step's K micro-batches on the device, their sample keys and what is counted
        from their host copies (no device read): the step's model FLOPs over all ranks
        (`flops`) and, for a language model, the padding share of its rows."""
        micro_batches, keys = [], []
        for _ in range(self.accumulation):
            micro_batches.append(self.data.next_batch())
            keys += self.data.last_keys
        flops = step_model_flops(
            step_spec, micro_batches, self.part_modes, batch_size=self.t.batch_size,
            world=self.data_world, reference_forward=self.reference_forward,
        )  # fmt: skip
        counts: dict[str, Any] = {"flops": flops}
        if step_spec.decoder is not None and self.data_world > 1:
            counts["rank_flops"] = flops / self.data_world  # this rank's rows (the recorder
            # gathers every rank's: load_balance)
        if (padding := padding_fraction(micro_batches)) is not None:
            counts["padding_fraction"] = padding
        dtype = self.precision.param_dtype
        micro_batches = [move_batch(b, self.env.device, dtype, self.pixels) for b in micro_batches]
        step = self.state.step + 1
        guards = self.config.guards
        faults = {"nan": guards.inject_nan_steps, "overflow": guards.inject_overflow_steps}
        for fault, steps in faults.items():
            if step in steps and step not in self.injected:
                self.injected.add(step)
                inject_fault(micro_batches[0], fault)
        return micro_batches, keys, counts

    def _record(self, step_spec, loss, parts, norm, times, comm_times, counts, keys) -> None:
        """Hand the step's row to the recorder: device values stay on the device."""
        state, t = self.state, self.t
        flops = counts["flops"]
        # A part named with its own "/" is a metric of its own (DPO's rewards/chosen, TRL's
        # names), not a part of the loss.
        mean = {"loss": loss, **{k if "/" in k else f"loss/{k}": v for k, v in parts.items()}}
        local = {"grad_norm": norm, **self._model_values()}
        host = {
            "lr": main_lr(self.optimizer.param_groups, self.spec),  # the main tower's
            **{f"lr/{g['name']}": g["lr"] for g in self.optimizer.param_groups},
            "samples_seen": state.samples_seen,
            "skipped_steps": state.skipped,
            "rollbacks": state.rollbacks,
            **self.data.cache_stats(),  # s3:// sources: hit rate, network wait, downloads
            "checkpoint_s_total": self.checkpointer.seconds_total,
            **throughput(
                t.batch_size,
                times,
                flops_per_sample=flops // t.batch_size,
                peak_flops=self.peak_flops,
                world_size=self.world,
                comm=comm_times,
            ),  # fmt: skip
            **memory_gib(self.env.device),
            **compile_counts(),  # still rising after the first steps: recompiles
            **{k: v for k, v in counts.items() if k not in ("flops", "rank_flops")},
        }
        if "mfu" in host and "padding_fraction" in host:  # the part spent on real tokens
            host["mfu_useful"] = host["mfu"] * (1.0 - host["padding_fraction"])
        if step_spec is not self.spec:
            host.update({f"input_size/{k}": v for k, v in _input_sizes(step_spec).items()})
        self._warn_communication_share(host)
        validate = self.validator is not None and self.validator.due(state.step, t.steps)
        if validate:
            # unsplit: the evaluators deal their data by rank, not by sequence-parallel group
            with self.precision.autocast(), unsplit(self.model, self.spec):
                host.update(self.validator.run(self.trained, state.step))
        work = counts.get("rank_flops")
        self.recorder.add(state.step, host, mean, local, self._refused_now(), keys, work)
        if validate or self.recorder.due(state.step) or state.step == t.steps:
            self.recorder.flush()

    def _warn_communication_share(self, host: dict[str, Any]) -> None:
        """Say once when the step waited for communication more than COMM_SHARE_LIMIT of
        its time: past it, another layout (or more intra-node bandwidth) pays."""
        share = host.get("comm_exposed_fraction", 0.0)
        if self.warned_comm_share or share <= COMM_SHARE_LIMIT:
            return
        self.warned_comm_share = True
        if self.rank == 0:
            log.warning(
                "step %d waited for communication %.0f%% of its %.3f s (%.3f s exposed of "
                "%.3f s of collectives); above %.0f%%, change the parallel layout: see "
                "`mmtrain plan --recommend` for this model and GPU count",
                self.state.step, 100 * share, host["step_s"], host["comm_exposed_s"],
                host["comm_s"], 100 * COMM_SHARE_LIMIT,
            )  # fmt: skip

    def _model_values(self) -> dict[str, torch.Tensor]:
        """What only some models have, as device tensors: the contrastive temperature, the
        fp16 loss scale, the step's target tokens of a language model (all ranks)."""
        values: dict[str, torch.Tensor] = {}
        if hasattr(self.model, "logit_scale"):
            values["logit_scale"] = logit_scale_value(self.model.logit_scale.detach())
        if self.precision.scaler is not None:
            values["loss_scale"] = self.precision.scaler._get_scale_async().detach().clone()
        for objective in self.objectives:
            if isinstance(objective, NextTokenObjective):
                values["target_tokens"] = torch.as_tensor(objective.targets)
        return values

    # ------------------------------------------------------------------------- checkpoint
    def checkpoint_when_due(self) -> bool:
        """Write a checkpoint when one is due (every N steps, every M minutes, the last step,
        a signal); returns True when a signal asked the run to stop (the checkpoint is
        written)."""
        step = self.state.step
        save, signalled = self.checkpointer.due(step, self.t.steps, self.stop.requested)
        if save:
            self.recorder.flush()  # the rows up to the checkpoint are written before it
            self.checkpointer.save(
                step, self.model, self.optimizer, self._saved_state(), self.state.samples_seen,
                self.ema,
            )  # fmt: skip
            self.saved_step = step
        if signalled:
            log.warning("stopped by a signal after step %d; checkpoint written, exiting", step)
            self.stopped_by_signal = True
        return signalled

    def _saved_state(self) -> dict[str, Any]:
        """What the checkpoint holds besides weights, optimizer and RNG states."""
        scaler = self.precision.scaler
        state = {
            "scheduler": self.scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else {},
            "loader": self.data.state_dict(),
            "counters": self.state.counters(self._refused_totals()),
        }
        return state

    def _refused_now(self) -> dict[str, int]:
        """Samples this rank skipped, corrupt and too long (a sequence-parallel group's first
        rank only counts them)."""
        if not self.counts_data:
            return dict.fromkeys(REFUSED, 0)
        return {
            "corrupt_samples": self.data.corrupt_samples(),
            "too_long_samples": self.data.too_long_samples(),
        }

    def _refused_totals(self) -> dict[str, int]:
        """Skipped samples of the whole run over all ranks, by counter (a collective)."""
        now = sum_over_ranks([float(self._refused_now()[name]) for name in REFUSED])
        before = self.state.refused_before
        totals = zip(REFUSED, now, strict=True)
        return {name: before.get(name, 0) + int(round(n)) for name, n in totals}

    def _dpo_reference(self, resuming: bool) -> tuple[nn.Module | None, ReferenceLogps | None]:
        """DPO's reference (train/dpo.py `reference_mode`): (a frozen copy, None), (None, the
        cached log-probs: scored now, before the first step, or read back on a resume), or
        (None, None) for the model without its adapters. Sets `dpo_reference` (the mode; None
        without dpo) and `reference_forward`: whether a step runs the reference's forward (the
        step's model FLOPs)."""
        self.dpo_reference, self.reference_forward = None, False
        if self.t.objective != "dpo" or self.t.sequence_parallel > 1:  # (objectives_for refuses)
            return None, None
        self.dpo_reference = mode = reference_mode(
            self.model, self.t.dpo, self.data.pair_inputs_vary()
        )
        log.info("dpo reference: %s", mode)
        self.reference_forward = mode != "cache"
        if mode == "copy":
            return build_reference(self.config, self.spec, self.precision, self.env), None
        if mode == "adapters":
            return None, None
        identity = identity_of(self.config, self.data.source_fingerprints())
        store = ReferencePass(self.out, identity, self.data.samples(), self.rank, parallel.barrier)
        if resuming or store.complete():
            return None, store.load()
        loader = self.data.pairs_once()

        def score(batch: dict[str, Any]) -> torch.Tensor:
            moved = move_batch(batch, self.env.device, self.precision.param_dtype, self.pixels)
            return reference_logps(self.trained, moved, self.precision,
                                   by_token=scores_by_token(self.model))  # fmt: skip

        try:
            return None, store.run(loader, score)
        finally:
            loader.close()

    def _resume(self, ckpt: Checkpoint) -> None:
        """The checkpoint's state (`_restore`), then the settings the config changed since."""
        configured = group_settings(self.optimizer)  # before the checkpoint's load over them
        self._restore(ckpt)
        log.info("resuming from %s (step %d, %d samples seen)",
                 ckpt.path, self.state.step, self.state.samples_seen)  # fmt: skip
        self._apply_changed_settings(ckpt, configured)

    def _apply_changed_settings(self, ckpt: Checkpoint, configured: list[dict[str, Any]]) -> None:
        """The learning rates, AdamW settings and schedule the config changed since the
        checkpoint apply from here on (the checkpoint's optimizer and schedule carry the old
        ones)."""
        old = (ckpt.meta.get("config") or {}).get("train") or {}
        changed = diff_configs(old, self.config.to_dict()["train"], "train.")
        factor = self.config.guards.rollback_lr_factor**self.state.rollbacks
        applied = apply_changed_settings(
            self.optimizer, self.scheduler, configured, changed, factor
        )
        if applied and self.rank == 0:
            log.warning("the config changed %s since the checkpoint: the new values apply from "
                        "step %d on", ", ".join(applied), self.state.step + 1)  # fmt: skip

    def _restore(self, ckpt: Checkpoint) -> None:
        """Everything but a full checkpoint's weights (loaded before wrapping)."""
        self.checkpointer.restore(ckpt, self.model, self.optimizer, self.ema)
        self.scheduler.load_state_dict(ckpt.state["scheduler"])
        if self.precision.scaler is not None and ckpt.state.get("scaler"):
            self.precision.scaler.load_state_dict(ckpt.state["scaler"])
        self.data.load_state_dict(ckpt.state["loader"])
        counters = ckpt.state["counters"]
        restore_rank_rng_state(ckpt.state["rng"], self.rank, self.config.seed, counters["step"])
        self.state.load_counters(counters)

    # ------------------------------------------------------------------------- rollback
    def roll_back(self) -> None:
        """After K non-finite steps in a row, every rank reloads the newest valid checkpoint
        from before them (weights, optimizer, schedule, scaler, data position, RNG) and
        trains on."""
        state = self.state
        self.recorder.flush()
        ckpt = self.checkpointer.rollback_point(
            state.step, state.nonfinite_in_a_row, state.rollbacks
        )
        if ckpt.format == "full":  # a sharded one's weights load with the optimizer state
            parallel.load_full_model_state_dict(self.model, ckpt.model)
        rollbacks, skipped = state.rollbacks, state.skipped  # steps that happened
        self._restore(ckpt)
        state.skipped, state.rollbacks, state.nonfinite_in_a_row = skipped, rollbacks + 1, 0
        # The replay starts from this checkpoint: each replayed step is new progress, and a
        # signal during a replayed step's save (over a checkpoint of the bad streak) must not
        # take it for a stop with nothing to save and break off the save.
        self.saved_step = state.step
        factor = self.config.guards.rollback_lr_factor
        if factor != 1.0:
            scale_learning_rates(self.optimizer, self.scheduler, factor)
        self.recorder.refused_before.update(state.refused_before)
        self.recorder.rewind(state.step)

    # ------------------------------------------------------------------------- finish
    def stop_now(self) -> TrainResult:
        """A signal with no step since the last checkpoint: stop where the run was, with no
        collective (ranks may be anywhere in a step) and nothing written; the newest
        checkpoint stands. The loader's workers are shut down."""
        self.stopped_by_signal = True
        log.warning("stopped by a signal at step %d; the newest checkpoint stands", self.state.step)
        self.recorder.close()
        self.data.close()
        if self.validator is not None:
            self.validator.close()
        return TrainResult(
            out=self.out, step=self.state.step, samples_seen=self.state.samples_seen,
            resumed_from=self.resumed_from, stopped_by_signal=True,
            skipped_steps=self.state.skipped, rollbacks=self.state.rollbacks,
            history=self.recorder.history,
        )  # fmt: skip

    def halt(self) -> TrainResult:
        """Stop dead (`halt_after_step`), as a crash would: no checkpoint, no final weights
        (the rows measured so far are written, as a logging step would)."""
        self.recorder.flush()
        self.recorder.close()
        result = self._result(self._refused_totals())
        self.data.close()
        if self.validator is not None:
            self.validator.close()
        return result

    def finish(self) -> TrainResult:
        """The final weights (OUT/model.safetensors + spec.yaml; LoRA: merged, and the
        adapters alone in OUT/lora.safetensors; EMA in OUT/ema), the validation report, the
        summary."""
        self.recorder.flush()
        done = self.state.step >= self.t.steps
        if done:
            self._export()
        report = None
        if self.validator is not None:
            if done:
                report = self.validator.write_report(self.spec)
            self.validator.close()
        parallel.barrier()
        self.recorder.close()
        result = self._result(self._refused_totals(), report)
        self.data.close()
        # Free the DDP wrapper while the process group is still alive. Its C++ reducer frees
        # without releasing the GIL; were it to hold the group's last reference, the group's
        # destructor would join a gloo thread that waits for the GIL: a deadlock seen under
        # load. (shutdown collects garbage first; the CLI then ends a rank without
        # finalization.)
        self.trained = None  # type: ignore[assignment]
        parallel.shutdown(self.env)
        return result

    def _export(self) -> None:
        """OUT/model.safetensors + spec.yaml (LoRA merged, adapters alone beside), gathered
        and written one tensor at a time (train/export.py); EMA in OUT/ema (a hub model's in its
        library's format, as OUT is: a pipeline or transformers folder; a LoRA run's adapters
        averaged)."""
        self._write_model(self.out)
        if self.ema is None:
            return
        (self.out / "ema").mkdir(exist_ok=True)
        with self.ema.swapped(self.model):
            self._write_model(self.out / "ema")

    def _write_model(self, out: Path) -> None:
        if self.spec.hub is not None and self.spec.hub.is_denoiser():  # a diffusers pipeline
            adapters = export_hub_denoiser(self.model, out, self.rank, self.lora_scale)
            if adapters:
                write_denoiser_adapter(self.model, adapters, lora_towers(self.t), out)
        elif self.spec.hub is not None:  # the run folder becomes a transformers folder
            adapters = export_hub_model(self.model, out, self.rank, self.lora_scale)
            if adapters:
                write_hub_adapter(self.model, adapters, lora_towers(self.t), out)
        else:
            export_model(self.model, out, self.rank, self.lora_scale, lora_towers(self.t),
                         base_name=peft_base_name(self.config.init))  # fmt: skip

    def _result(
        self, refused: dict[str, int], eval_report: dict[str, Any] | None = None
    ) -> TrainResult:
        state, history = self.state, self.recorder.history
        return TrainResult(
            out=self.out,
            step=state.step,
            samples_seen=state.samples_seen,
            resumed_from=self.resumed_from,
            stopped_by_signal=self.stopped_by_signal,
            skipped_steps=state.skipped,
            rollbacks=state.rollbacks,
            corrupt_samples=refused["corrupt_samples"],
            too_long_samples=refused["too_long_samples"],
            last_loss=history[-1]["loss"] if history else math.nan,
            history=history,
            eval=eval_report,
        )


# ----------------------------------------------------------------------------- helpers
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
