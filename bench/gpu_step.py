"""The training step under FSDP2 on one GPU, through the trainer's own parts: a Llama-shaped LM
(~0.6B parameters: width 2048, 8 blocks, GQA 16/8 heads, 32k ids, untied head, rows of 2048
random ids) built on the meta device and materialised shard by shard (`model_setup`'s sharded
build), FSDP2 over a one-rank NCCL group, bf16, 4 micro-batches of 2 rows per step.

One line of figures:
- peak allocated memory of a step (optimizer state already made) beside the plan the trainer
  records for this run (`planned_memory`: model states + activations + buffers);
- the gradient clip on FSDP2's DTensor gradients: `step.clip_gradients` (foreach kernels)
  against `clip_grad_norm_(foreach=False)` (one norm and one multiply per parameter), median ms;
- a sharded (DCP) checkpoint written and read back into a freshly built model: seconds each,
  and whether every weight and moment came back equal;
- the step-time split: compute's share of the step by CUDA events (`StepTimer`, what the
  trainer logs) and by host clocks around the same steps (what it logged before), and the
  device->host synchronisations of a step with and without the events
  (`torch.cuda.set_sync_debug_mode("warn")`): the timer must add none.

On a CPU (`dry_run`) the same code on a tiny LM over a one-rank gloo group: it proves the note
runs; its figures mean nothing (no allocator, host clocks only).

    from gpu_step import step_note; print(step_note(torch.device("cuda"), dry_run=False))
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import count_syncs, median_seconds, sync

from mmtrain.checkpoint import read_sharded, save_sharded_checkpoint
from mmtrain.config import config_from_dict
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.distributed import leave_process_group
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.metrics import planned_memory
from mmtrain.train.model_setup import _build_sharded
from mmtrain.train.objectives import LABELS_KEY, NextTokenObjective
from mmtrain.train.precision import make_precision
from mmtrain.train.step import clip_gradients, forward_backward, move_batch, optimizer_step
from mmtrain.train.step_timer import StepTimer

MICRO_BATCHES = 4


def _spec(dry_run: bool, positions: int) -> ModelSpec:
    if dry_run:
        decoder = DecoderSpec(vocab_size=512, width=64, layers=2, heads=4, kv_heads=2,
                              mlp_hidden=160, max_positions=positions, tie_embeddings=False)  # fmt: skip
    else:
        decoder = DecoderSpec(vocab_size=32_000, width=2048, layers=8, heads=16, kv_heads=8,
                              mlp_hidden=8192, max_positions=positions, tie_embeddings=False)  # fmt: skip
    return ModelSpec(name="lm-step", embed_dim=decoder.width, towers={}, objective="next_token",
                     decoder=decoder)  # fmt: skip


def _config(micro: int, positions: int):
    config = config_from_dict({
        "model": "lm-step", "data": {"train": "unused/", "sequence_length": positions},
        "train": {"steps": 1, "batch_size": micro * MICRO_BATCHES, "micro_batch": micro,
                  "precision": "bf16", "parallel": "fsdp"},
    })  # fmt: skip
    config.validate(world_size=1)
    return config


def _one_rank_group(device: torch.device, folder: Path) -> None:
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{folder / 'group'}", rank=0, world_size=1,
                            **kwargs)  # fmt: skip


def _median_ms(fn, device: torch.device, repeats: int = 10) -> float:
    return 1000 * median_seconds(fn, device, repeats)


class _Run:
    """The model, optimizer and data of the note, with one step as the trainer takes it."""

    def __init__(self, device: torch.device, dry_run: bool, seed: int = 0):
        self.dry_run = dry_run
        self.micro, positions = (2, 32) if dry_run else (2, 2048)
        self.spec = _spec(dry_run, positions)
        self.config = _config(self.micro, positions)
        self.config.seed = seed
        self.device = device
        self.precision = make_precision("bf16", device)
        env = parallel.DistributedEnv(device, 0, 1, 0, False, 1)
        built = _build_sharded(self.config, self.spec, self.precision, env, None, None)
        self.model = built.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.spec.decoder.vocab_size, (MICRO_BATCHES, self.micro, positions),
                            generator=g)  # fmt: skip
        if device.type == "cuda":  # as the loader hands them over: copied without blocking
            ids = ids.pin_memory()
        self.host = [{"text": x, LABELS_KEY: x} for x in ids]
        self.objectives = [NextTokenObjective()]

    def step(self, timers: list[StepTimer]) -> None:
        for timer in timers:
            timer.start()
        batches = [move_batch(b, self.device) for b in self.host]
        for timer in timers:
            timer.data_ready()
        self.optimizer.zero_grad(set_to_none=True)
        loss, _ = forward_backward(self.model, self.objectives, batches, self.precision)
        for timer in timers:
            timer.compute_done()
        optimizer_step(self.model, self.optimizer, self.precision, 1.0, loss=loss)


def _peak_vs_plan(run: _Run) -> str:
    run.step([])  # the optimizer's state exists from here on, as in every later step
    if run.device.type != "cuda":
        return "peak n/a on cpu"
    sync(run.device)
    torch.cuda.reset_peak_memory_stats(run.device)
    run.step([])
    peak = torch.cuda.max_memory_allocated(run.device)
    plan = planned_memory(run.spec, run.config, world_size=1, recompute=[], device=run.device)
    predicted = plan["predicted_allocated_bytes"]
    return (f"peak {peak / 2**30:.2f} GiB vs plan {predicted / 2**30:.2f} GiB "
            f"({100 * (peak / predicted - 1):+.1f}%)")  # fmt: skip


def _clip_times(run: _Run) -> str:
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    foreach = _median_ms(lambda: clip_gradients(params, 1.0), run.device)
    loop = _median_ms(
        lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False), run.device
    )
    return f"clip foreach {foreach:.2f} ms vs per-parameter {loop:.2f} ms ({len(params)} params)"


def _split(run: _Run, steps: int) -> str:
    """Compute's share of the step, by events and by host clocks, over the same steps."""
    events = {"compute": 0.0, "step": 0.0}
    host = {"compute": 0.0, "step": 0.0}
    for _ in range(steps):
        device_timer, host_timer = StepTimer(run.device), StepTimer(torch.device("cpu"))
        run.step([device_timer, host_timer])
        for split, timer in ((events, device_timer), (host, host_timer)):
            times = timer.finish()
            split["compute"] += times["compute"]
            split["step"] += sum(times.values())
    share = {name: s["compute"] / s["step"] for name, s in (("events", events), ("host", host))}
    return (f"compute share of the step: events {100 * share['events']:.0f}%, host clocks "
            f"{100 * share['host']:.0f}% ({events['step'] / steps * 1000:.0f} ms/step)")  # fmt: skip


def _syncs(run: _Run) -> str:
    """Device->host synchronisations of one step, without and with the event timer."""
    if run.device.type != "cuda":
        return "syncs n/a on cpu"

    def step(timers: list[StepTimer]) -> None:
        run.step(timers)
        for timer in timers:
            timer.finish()

    plain = count_syncs(lambda: step([]), run.device)
    timed = count_syncs(lambda: step([StepTimer(run.device)]), run.device)
    return f"syncs per step {plain} plain, {timed} with event timing"


def _checkpoint_round_trip(run: _Run, folder: Path) -> str:
    start = time.perf_counter()
    path = save_sharded_checkpoint(folder / "ckpt", 1, parallel.sharded_state_dict(
        run.model, run.optimizer))  # fmt: skip
    saved_s = time.perf_counter() - start
    fresh = _Run(run.device, run.dry_run, seed=1)  # other weights
    fresh.step([])  # so its optimizer has state to load into
    start = time.perf_counter()
    state = parallel.sharded_state_dict(fresh.model, fresh.optimizer)
    read_sharded(path, state)
    parallel.load_sharded_state_dict(fresh.model, fresh.optimizer, state)
    loaded_s = time.perf_counter() - start
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(run.model.parameters(), fresh.model.parameters(), strict=True)
    ) and all(
        torch.equal(sa[k].full_tensor(), sb[k].full_tensor())
        for sa, sb in zip(run.optimizer.state.values(), fresh.optimizer.state.values(), strict=True)
        for k in ("exp_avg", "exp_avg_sq")
    )
    return f"DCP save {saved_s:.2f} s, load {loaded_s:.2f} s, equal after load: {same}"


def step_note(device: torch.device, dry_run: bool) -> str:
    """One line: FSDP2 on one rank with 4 micro-batches (module docstring)."""
    if device.type == "cuda" and device.index is None:  # NCCL binds the group to one GPU
        device = torch.device("cuda", torch.cuda.current_device())
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        owns = not dist.is_initialized()
        if owns:
            _one_rank_group(device, folder)
        try:
            run = _Run(device, dry_run)
            parts = [
                f"FSDP2 1 rank, {run.spec.params() / 1e9:.2f}B LM, {MICRO_BATCHES} x "
                f"{run.micro} x {run.spec.decoder.max_positions}",
                _peak_vs_plan(run),
                _clip_times(run),
                _split(run, 3 if dry_run else 5),
                _syncs(run),
                _checkpoint_round_trip(run, folder),
            ]
        finally:
            if owns:
                leave_process_group()
    return f"{device.type} step: " + "; ".join(parts)


if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    print(step_note(torch.device("cuda" if cuda else "cpu"), dry_run=not cuda))
