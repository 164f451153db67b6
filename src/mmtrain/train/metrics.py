"""Training metrics: one JSON line per step in `OUT/metrics.jsonl`, the same scalars in
TensorBoard, and the throughput figures that say whether the accelerator is busy.

Per step: loss and loss per pair, learning rate per group, logit scale, grad norm, samples/s,
step time split into data wait / forward+backward / optimizer, the data-wait fraction,
communication (on several ranks: `comm_s`, collectives in flight, overlapped or not, and
`comm_exposed_s`, the part the step waited for; see `comm_timing`), MFU (model FLOPs over the
device's peak, when a peak is known), a language model's padding share of its rows, peak memory of the step (CUDA) or the process's RSS
(CPU), skipped steps and corrupt samples.

Besides step rows, records with a `"kind"` (e.g. `{"kind": "plan", "step": 0, ...}`: the
planner's memory prediction for this run, to set beside the measured peak) share the file.

On resume the writer drops the lines after the checkpoint's step (a crashed run may have logged
steps that the resumed run repeats) and TensorBoard purges its events after that step, so the
curves of an interrupted run look like one run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mmtrain.atomic import atomic_write_text
from mmtrain.config import RunConfig
from mmtrain.folders import METRICS_FILE
from mmtrain.spec import DENOISER_PART, ModelSpec, PartTraining
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)


def part_modes(spec: ModelSpec, config: RunConfig) -> dict[str, PartTraining]:
    """How each part of the model trains in this run (`train.towers`: freeze, lora,
    freeze_blocks, unlocked_blocks), read off the planner's model of the run, so that the
    trainer's MFU and `mmtrain plan` count the same FLOPs. Once per run, at set-up."""
    from mmtrain.plan.model import from_spec

    plan_model = _planned_model(from_spec(spec, _planned_rows(spec, config)), spec, config)
    return {s.name: PartTraining(s.mode, s.trained_layer_share()) for s in plan_model.stacks}


def model_train_flops(
    spec: ModelSpec,
    forward_by_part: dict[str, float],
    modes: dict[str, PartTraining],
    recompute: Sequence[str] = (),
) -> int:
    """Model FLOPs of training on inputs whose forward FLOPs by part are `forward_by_part`
    (`spec.train_flops`, the planner's definition). With `recompute` (parts under activation
    checkpointing): hardware FLOPs instead, for HFU."""
    return round(spec.train_flops(forward_by_part, modes, recompute))


def language_model_forward_flops(spec: ModelSpec, batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """Forward FLOPs of one batch of a language model by part: each row at its length once
    its images are spliced in (padding included: it is computed), and the batch's images
    through the vision tower and the projector. Reads the ids on the host (a host copy)."""
    ids = batch["text"].cpu()
    if spec.vision is not None:
        return _native_forward_flops(spec, batch)
    images = int(batch["image"].shape[0]) if "image" in batch else 0
    positions = torch.ones_like(ids)
    if spec.projector is not None and images:
        extra = spec.image_tokens() - 1  # each placeholder becomes image_tokens positions
        positions = positions + (ids == spec.projector.image_token_id).long() * extra
    lengths = attention_spans(positions, batch.get("document_ids"))
    return spec.sequence_flops_by_part(lengths, images)


def attention_spans(positions: torch.Tensor, document_ids: torch.Tensor | None) -> list[int]:
    """The lengths attention runs over, from each id's LM positions [R, T]: each row whole; in
    a packed row each document apart (flex attention computes only the blocks inside one), its
    padding as one more span (the matmuls compute it; MFU counts what is computed)."""
    if document_ids is None:
        return positions.sum(dim=1).tolist()
    spans: list[int] = []
    for row, documents in zip(positions, document_ids.cpu(), strict=True):
        _, which = torch.unique(documents, return_inverse=True)
        sums = torch.zeros(int(which.max()) + 1, dtype=torch.long).index_add_(0, which, row)
        spans += [n for n in sums.tolist() if n]
    return spans


def _native_forward_flops(spec: ModelSpec, batch: dict[str, Any]) -> dict[str, int]:
    """A native-resolution VLM's: each distinct input through the tower at its own size (a
    preference pair's sides share theirs), each row at its length once every placeholder holds
    its input's tokens (its splice's per-id spans)."""
    from mmtrain.models.splice import id_spans, valid_ids
    from mmtrain.models.visual_inputs import IMAGES, VIDEOS, placeholder_inputs, visual_order

    assert spec.vision is not None and spec.vision_tokens is not None

    def shapes_of(inputs: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
        return [(1 if x.dim() == 3 else x.shape[0], x.shape[-2], x.shape[-1]) for x in inputs]

    encoded = shapes_of([*(batch.get(IMAGES) or []), *(batch.get(VIDEOS) or [])])
    images, videos, _, _ = placeholder_inputs(batch)
    shapes = shapes_of([*images, *videos])
    ids = batch["text"].cpu()
    valid = valid_ids(ids, batch.get("attention_mask"), batch.get("document_ids"))
    tokens = spec.vision_tokens
    is_visual, order = visual_order(
        ids, tokens.image_token_id, tokens.video_token_id, valid.cpu(), len(images)
    )
    counts = torch.tensor([spec.vision.tokens(h, w, t) for t, h, w in shapes], dtype=torch.long)
    spans = id_spans(is_visual, counts[order] if shapes else counts)
    lengths = attention_spans(spans, batch.get("document_ids"))
    return spec.sequence_flops_by_part(lengths, 0, encoded)


def padding_fraction(micro_batches: Sequence[dict[str, torch.Tensor]]) -> float | None:
    """The share of a language model's id positions that are padding, over the step's
    micro-batches (host copies: no device read). Every layer computes them and no target
    trains on them, and MFU counts them as model work (they are computed). None for batches
    without padded or packed rows of ids (other models, whose inputs have one size)."""
    from mmtrain.models.splice import valid_ids

    total = padded = 0
    for batch in micro_batches:
        if "attention_mask" not in batch and "document_ids" not in batch:
            continue
        ids = batch["text"] if "text" in batch else batch["input_ids"]  # native / hub model
        valid = valid_ids(ids, batch.get("attention_mask"), batch.get("document_ids"))
        total += valid.numel()
        padded += int(valid.numel() - valid.sum())
    return padded / total if total else None


def step_model_flops(
    step_spec: ModelSpec,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    modes: dict[str, PartTraining],
    *,
    batch_size: int,
    world: int,
    recompute: Sequence[str] = (),
    reference_forward: bool = False,
) -> int:
    """Model FLOPs of one optimizer step over all ranks (what MFU divides by the peak).
    A language model counts the positions and images of this rank's micro-batches and scales
    by the ranks (`reference_forward`: DPO's reference adds one more forward of the same
    rows, as the planner counts it); a denoiser counts `batch_size` (global) samples of the
    step's shape (shape buckets: one per step, the same on every rank); other models
    `batch_size` samples of the spec's inputs."""
    if step_spec.hub is not None:  # counted by the planner's trace, not per step yet
        return 0
    if step_spec.denoiser is not None and micro_batches:
        d = step_spec.denoiser
        size = tuple(micro_batches[0][d.input].shape[2:])
        per_sample = {DENOISER_PART: d.forward_flops(size)}
        return model_train_flops(step_spec, per_sample, modes, recompute) * batch_size
    if step_spec.decoder is None:
        per_sample = step_spec.forward_flops_by_part()
        return model_train_flops(step_spec, per_sample, modes, recompute) * batch_size
    forward: dict[str, float] = {}
    for batch in micro_batches:
        for part, flops in language_model_forward_flops(step_spec, batch).items():
            forward[part] = forward.get(part, 0) + flops
    reference = sum(forward.values()) if reference_forward else 0
    return int(model_train_flops(step_spec, forward, modes, recompute) + reference) * world


def detect_peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of the current GPU from the hardware catalog, or None if unknown.

    The catalog knows the names as the driver prints them (`NVIDIA H100 80GB HBM3`); a MIG
    instance gets its share of the GPU's peak. fp8 runs report MFU against the bf16 peak, the
    convention of torchtitan and of published fp8 runs (not every matmul is fp8)."""
    found = _catalog_gpu(device)
    if found is None:
        if device.type == "cuda":  # said once per run (the trainer asks once), not a silent gap
            log.warning(
                "the GPU catalog does not know CUDA device %r: MFU not reported. Set "
                "metrics.peak_tflops to the card's dense (no sparsity) TFLOPS for this run's "
                "precision",
                torch.cuda.get_device_name(device),
            )
        return None
    gpu, share = found
    try:
        return gpu.peak_flops("bf16" if precision == "fp8" else precision) * share
    except FieldError as err:  # a precision the card has no published rate for (V100: bf16)
        log.warning("%s: MFU not reported (set metrics.peak_tflops to report it)", err)
        return None


def _catalog_gpu(device: torch.device) -> tuple[Any, float] | None:
    """The catalog's GPU for `device` and the share of it this process has (MIG), or None on a
    CPU or a GPU the catalog does not know."""
    if device.type != "cuda":
        return None
    from mmtrain.hardware import default_catalog

    name = torch.cuda.get_device_name(device)
    try:
        return default_catalog().resolve_device(name)
    except FieldError:
        return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (call at the start of each step; CUDA only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def compile_counts() -> dict[str, int]:
    """What torch.compile compiled in this process so far: frames (each recompile is one more)
    and distinct graphs; empty when nothing was compiled. A count still rising after the first
    steps is a recompile per batch (shapes the graph specialised on: dynamic dims to mark)."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled: do not pay for the import
        return {}
    from torch._dynamo.utils import counters

    frames = counters["frames"].get("ok", 0)
    if not frames:
        return {}
    return {"compiled_frames": frames, "compiled_graphs": counters["stats"].get("unique_graphs", 0)}


def memory_gib(device: torch.device) -> dict[str, float]:
    """Memory measured this step, in GiB and bytes.

    CUDA: the peak allocated since `reset_peak_memory` (tensors only: the planner's
    `allocated_bytes` is the figure to compare) and the peak the caching allocator reserved
    from the driver (what an out-of-memory runs out of; the gap is fragmentation). CPU: the process's resident set now and its
    high-water mark (RSS also holds the Python runtime and libraries, hundreds of MiB that no
    plan of the model counts).
    """
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        return {"peak_memory_gib": peak / 2**30, "peak_memory_bytes": peak,
                "peak_reserved_bytes": reserved}  # fmt: skip
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    high *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    row = {"peak_rss_gib": high / 2**30, "peak_memory_bytes": high}
    now = _current_rss_bytes()
    if now is not None:
        row["rss_bytes"] = now
    return row


def _current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux


def _planned_model(plan_model: Any, spec: ModelSpec, config: RunConfig) -> Any:
    """The planner's model with each tower trained as `train.towers` says: frozen, LoRA (its
    rank and targets), or frozen up to a block (`freeze_blocks`, `unlocked_blocks`)."""
    for name, tower in config.train.towers.items():
        if tower.freeze:
            plan_model = plan_model.with_modes({name: "frozen"})
        elif tower.lora is not None:
            lora = tower.lora
            plan_model = plan_model.with_modes({name: "lora"}, lora.rank, tuple(lora.targets))
            if lora.quantize_base is not None:  # QLoRA: its block linears held in NF4
                plan_model = plan_model.with_quantized_base([name], lora.quantize_base)
        elif tower.freeze_blocks or tower.unlocked_blocks is not None:
            layers = spec.towers[name].layers if name in spec.towers else spec.decoder.layers
            blocks = tower.freeze_blocks or layers - (tower.unlocked_blocks or 0)
            plan_model = plan_model.with_frozen_blocks({name: blocks})
    return plan_model


def _planned_rows(spec: ModelSpec, config: RunConfig) -> Any:
    """A language model's rows as the run makes them, at their longest: `data.sequence_length`
    positions (the decoder's max_positions when unset) with one image per row (None for other
    models: their inputs have one size)."""
    if spec.decoder is None:
        return None
    from mmtrain.plan.model import Rows

    positions = config.data.sequence_length or spec.decoder.max_positions
    if spec.vision is not None:
        page = _largest_page(spec, config, positions)
        return Rows(positions=positions, visual_inputs=(page,), packed=config.data.pack)
    images = 1 if spec.projector is not None else 0
    return Rows(positions=positions, images=images, packed=config.data.pack)


def _largest_page(spec: ModelSpec, config: RunConfig, positions: int) -> tuple[int, int, int]:
    """A native VLM's largest page under the run's budget (data.vision) that a row holds
    with a target: a square one, as `mmtrain plan` plans a page by default."""
    from mmtrain.visual_budget import budget_of

    assert spec.vision is not None
    budget = budget_of(spec.vision, config.data.vision)
    unit = spec.vision.merge_unit_pixels() ** 2
    tokens = budget.image_max_pixels // unit
    if budget.sample_max_tokens is not None:
        tokens = min(tokens, budget.sample_max_tokens)
    tokens = max(1, min(tokens, positions - 2))
    side = 1 << 14  # a large square, scaled down to the cap by the processor's rule
    h, w = spec.vision.resized(side, side, min(budget.image_min_pixels, tokens * unit),
                               tokens * unit)  # fmt: skip
    return 1, h, w


def planned_memory(
    spec: ModelSpec,
    config: RunConfig,
    *,
    world_size: int,
    recompute: list[str],
    device: torch.device,
    dpo_reference: str | None = None,
) -> dict[str, Any]:
    """The planner's per-device memory prediction for this run (the `plan` record).

    Same inputs as `mmtrain plan`: the spec with each tower trained as `train.towers` says
    (frozen, LoRA, or frozen up to a block), the precision, micro-batch, ranks and FSDP sharding, with activation checkpointing per tower
    (`train.towers.NAME.activation_checkpointing`, planned as "full" for those towers).
    `allocated_bytes` (model states + activations + communication buffers) is what CUDA's
    `max_memory_allocated` measures; `total_bytes` adds the CUDA context and fragmentation.
    A DPO run (train.objective dpo) is planned as `mmtrain plan --objective dpo --reference
    R` plans it (plan/preference.py): two rows a pair (a native VLM's images once a pair), the
    log-probs as the model gives them (a native model's per-target NLL, a hub model's whole
    logits), and the frozen reference copy where R is copy (a cached reference holds none). R is `dpo_reference`, the reference the run
    resolved (train/dpo.py `reference_mode`), else its train.dpo.reference, whose `auto` the
    planner resolves as the trainer does but for randomly cropped images (a copy there).
    """
    from mmtrain.plan.activations import activation_options, contrastive_bytes, stack_activations
    from mmtrain.plan.config import PlanConfig
    from mmtrain.plan.memory import (
        CUDA_CONTEXT_BYTES,
        FRAGMENTATION,
        comm_buffers,
        dequantized_working_set,
        model_states,
        nf4_shards,
    )
    from mmtrain.plan.model import from_spec
    from mmtrain.plan.preference import reference_bytes, rows_per_sample

    plan_model = _planned_model(from_spec(spec, _planned_rows(spec, config)), spec, config)
    sequence = config.train.sequence_parallel
    micro = config.micro_batch_for(config.data_ranks(world_size))
    precision = config.train.precision
    offload = config.train.offload  # FSDP2 over a group of one too
    sharded = config.train.parallel == "fsdp" and (world_size > 1 or offload)
    cfg = PlanConfig(
        gpus=world_size,
        precision=precision,
        micro_batch=micro,
        global_batch=config.train.batch_size,
        zero=3 if sharded else 0,
        offload=offload,
        sequence_parallel=sequence,
        sequence_parallel_attention=config.train.sequence_parallel_attention,
        objective=config.train.objective or "sft",
        reference=(dpo_reference or config.train.dpo.reference)
        if config.train.objective == "dpo"
        else "auto",
    )
    weights, grads, optimizer, convention = model_states(plan_model, cfg)
    rows = micro * rows_per_sample(cfg.objective)  # a DPO pair is two rows
    # Packed rows attend through flex attention on CUDA, through a dense mask elsewhere
    # (models/attention.py): the planner counts the mask where it exists.
    options = activation_options(
        precision, "flash", "none", 1, False, dense_packed_mask=device.type != "cuda",
        sequence_parallel=sequence, sp_attention=cfg.sp_attention(plan_model.split_heads()),
        objective=cfg.objective,
    )  # fmt: skip
    saved = recompute_bytes = 0.0
    by_tower = {}
    # a language model's stacks feed each other (image -> text): the planner's input gradients
    for stack, input_grad in zip(plan_model.stacks, plan_model.input_grads(), strict=True):
        mode = "full" if stack.name in recompute else "none"
        options_here = dataclasses.replace(options, ac=mode)
        a = stack_activations(stack, rows, options_here, input_grad=input_grad)
        by_tower[stack.name] = int(a.saved)
        saved += a.saved
        recompute_bytes = max(recompute_bytes, a.recompute_bytes)  # one block at a time
    saved += contrastive_bytes(plan_model, micro, world_size)
    buffers = comm_buffers(plan_model, cfg)
    # QLoRA: the NF4 weight dequantised for its matmul (0 without a quantised base)
    buffers += dequantized_working_set(plan_model, precision, 1, nf4_shards(cfg))
    activations = saved + recompute_bytes
    model_state = weights + grads + optimizer + reference_bytes(plan_model, cfg)
    allocated = model_state + activations + buffers
    on_gpu = device.type == "cuda"
    overhead = (CUDA_CONTEXT_BYTES + FRAGMENTATION * (activations + buffers)) if on_gpu else 0.0
    return {
        "predicted_activations_bytes": int(activations),
        "predicted_model_state_bytes": int(model_state),
        "predicted_allocated_bytes": int(allocated),
        "predicted_total_bytes": int(allocated + overhead),
        "activations_by_tower": by_tower,
        "micro_batch": micro,
        "world_size": world_size,
        "sequence_parallel": sequence,
        "precision": precision,
        "zero": cfg.zero,
        "recompute": list(recompute),
        "state_convention": convention,
        "notes": list(plan_model.notes),
        **_planned_mfu(plan_model, cfg, recomputes=bool(recompute), device=device),
        **_device_memory(device),
    }


def _device_memory(device: torch.device) -> dict[str, int]:
    """The device's memory beside the plan (`mmtrain doctor` reads the headroom from it)."""
    if device.type != "cuda":
        return {}
    return {"device_memory_bytes": torch.cuda.get_device_properties(device).total_memory}


def _planned_mfu(plan_model: Any, cfg: Any, *, recomputes: bool, device: torch.device) -> dict:
    """The MFU the planner expects of this run's workload (`mmtrain doctor` sets the measured
    one beside it). On a GPU of the catalog: plan/compute.py's achievable fraction of peak for
    the workload family, times model over hardware FLOPs (MFU does not count what activation
    checkpointing recomputes; any recomputed tower is planned as full recompute, the lower
    figure). Elsewhere (a CPU or a GPU the catalog lacks, where MFU needs
    metrics.peak_tflops): the family's published MFU as it is, a share of its GPU's peak. A
    DPO run's FLOPs are its pairs' (plan/preference.py: the reference's forward, the images)."""
    from mmtrain.plan.compute import efficiency, objective_flops, published_mfu, workload_family

    found = _catalog_gpu(device)
    if found is None:
        figure = published_mfu(plan_model)
        return {
            "achievable_mfu": figure.point,
            "efficiency_family": workload_family(plan_model),
            "efficiency_source": f"{figure.source}; the published figure as it is (a device "
            "the catalog does not know)",
        }
    planned = dataclasses.replace(cfg, ac="full" if recomputes else "none")
    model_flops, hardware_flops = objective_flops(plan_model, planned)
    achievable = efficiency(plan_model, found[0], cfg)
    return {
        "achievable_mfu": achievable.fraction * model_flops / hardware_flops,
        "efficiency_family": achievable.family,
        "efficiency_source": achievable.source,
    }


class MetricsWriter:
    """Appends metric rows to metrics.jsonl and TensorBoard (on rank 0 only; a no-op elsewhere)."""

    def __init__(
        self,
        out: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_step: int = 0,
    ):
        self.enabled = enabled
        self.out = Path(out)
        self.path = self.out / METRICS_FILE
        self.tensorboard = tensorboard
        self._file = None
        self._tb = None
        if enabled:
            self._open(resume_step)

    def _open(self, step: int) -> None:
        self._truncate_after(step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out / "tensorboard"), purge_step=step + 1)

    def rewind(self, step: int) -> None:
        """Forget the rows after `step` (a rollback to the checkpoint of `step`): the steps
        that follow are trained again and logged once more."""
        if not self.enabled:
            return
        self.close()
        self._open(step)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                kept.append(line)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, step: int, row: dict[str, Any]) -> None:
        """One step's row: `{"step": step, **row}`; its numbers also go to TensorBoard."""
        if not self.enabled:
            return
        self._append({"step": step, **row})
        self._scalars(step, row, prefix="")

    def record(self, kind: str, step: int, data: dict[str, Any]) -> None:
        """A record that is not a step row (`{"kind": kind, "step": step, **data}`), e.g. the
        memory plan; its top-level numbers go to TensorBoard as `kind/name`."""
        if not self.enabled:
            return
        self._append({"kind": kind, "step": step, **data})
        self._scalars(step, data, prefix=f"{kind}/")

    def _append(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def _scalars(self, step: int, row: dict[str, Any], prefix: str) -> None:
        if self._tb is None:
            return
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(prefix + key.replace(".", "/"), value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def throughput(
    samples: int,
    times: dict[str, float],
    *,
    flops_per_sample: int,
    peak_flops: float | None,
    world_size: int,
    comm: dict[str, float] | None = None,
) -> dict[str, float]:
    """samples/s, step time and its split, data-wait fraction and MFU for one optimizer step.

    `times` holds seconds for "data", "compute" (forward+backward) and "optimizer"
    (`StepTimer.finish`: on a GPU "compute" is the device's time between CUDA events around the
    forward+backward, and "optimizer" the rest of the host's step); `samples` is the global
    batch. MFU = achieved model FLOP/s per device / the device's peak.

    `comm` (`CommTimer.finish_step()`: `comm_s`, `comm_exposed_s` and its breakdown by
    collective; empty on one rank) adds the communication and its exposed share of the step. Communication is not a fourth slice of
    the split: collectives run inside forward+backward (and overlap it), so `comm_s` and
    `comm_exposed_s` are parts of `compute_s`, and
    `data_wait_s + compute_s + optimizer_s == step_s` still holds.
    """
    step_s = sum(times.values())
    row = {
        "samples_per_s": samples / step_s if step_s > 0 else 0.0,
        "step_s": step_s,
        "data_wait_s": times["data"],
        "compute_s": times["compute"],
        "optimizer_s": times["optimizer"],
        "data_wait_fraction": times["data"] / step_s if step_s > 0 else 0.0,
    }
    if comm:
        row["comm_s"] = comm["comm_s"]
        row["comm_exposed_s"] = comm["comm_exposed_s"]
        row["comm_exposed_fraction"] = comm["comm_exposed_s"] / step_s if step_s > 0 else 0.0
        row.update({k: v for k, v in comm.items() if k.startswith("comm_exposed_s/")})
    if peak_flops and step_s > 0:
        row["mfu"] = samples * flops_per_sample / step_s / world_size / peak_flops
    return row


class LossSpikes:
    """Flags a step whose loss jumps far above its recent level, so dirty data can be traced.

    Keeps an exponential moving mean and variance of the loss; after `warmup` steps, a loss
    above mean + `sigmas` x std is a spike (the caller logs the batch's sample keys). Spikes do
    not update the statistics, so one bad batch does not raise the bar for the next.
    """

    def __init__(self, sigmas: float = 4.0, decay: float = 0.95, warmup: int = 20):
        self.sigmas, self.decay, self.warmup = sigmas, decay, warmup
        self.mean = 0.0
        self.var = 0.0
        self.seen = 0

    def check(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        spike = self.seen >= self.warmup and loss > self.mean + self.sigmas * math.sqrt(self.var)
        if not spike:
            if self.seen == 0:
                self.mean = loss
            delta = loss - self.mean
            self.mean += (1 - self.decay) * delta
            self.var = self.decay * (self.var + (1 - self.decay) * delta * delta)
            self.seen += 1
        return spike
