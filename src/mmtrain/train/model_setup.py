"""The trained model from its spec, in the order the wrappers need: weights (a baseline's
`init` or a full checkpoint), LoRA adapters, QLoRA's 4-bit base, freezing (frozen matmul
weights then held in the compute dtype), device, fp8, any-resolution position embeddings, then
per block activation checkpointing -> compile (DDP / FSDP2 follow in the loop's set-up,
torchtitan's order). Under FSDP2 with `train.offload` the shards live in host memory."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from mmtrain.checkpoint import Checkpoint
from mmtrain.config import RunConfig
from mmtrain.models import create_model
from mmtrain.models.materialize import copy_full_, materialize_scalars_
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train import parallel
from mmtrain.train.init_sliced import SlicedInit, load_sliced_init, plan_sliced_init
from mmtrain.train.init_start import load_init, record_init_hashes, start_from_init
from mmtrain.train.lora import (
    LoraLinear,
    apply_lora,
    lora_scales,
    lora_towers,
    reset_lora_adapters,
)
from mmtrain.train.optim import freeze_parameters
from mmtrain.train.precision import Precision, convert_to_fp8
from mmtrain.train.qlora import (
    copy_full_nf4_,
    is_quantised,
    nf4_targets,
    own_blocks_in_shards,
    quantised_towers,
    quantize_frozen_linears,
)
from mmtrain.train.resolution import allow_any_resolution

log = logging.getLogger(__name__)

# Layers whose weight and bias autocast casts to its dtype at every call (torch's lists of
# ops that run in the low dtype: linear, convolutions). Frozen, they are held in that dtype.
CAST_BY_AUTOCAST = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Precisions whose autocast dtype frozen weights are held in (fp8's linears are torchao's,
# which cast their weights themselves; fp32 and fp64 have no lower compute dtype).
FROZEN_IN_COMPUTE_DTYPE = ("bf16", "fp16")


@dataclass
class BuiltModel:
    model: nn.Module  # the plain module (FSDP shards it in place)
    trained: nn.Module  # what runs the forward: the DDP wrapper, or `model`
    config: RunConfig  # with `init` recorded (what was loaded, its hash)
    lora_scale: dict[str, float]  # per adapted linear, to merge the final weights
    recompute: list[str]  # towers whose blocks recompute activations in backward


def build_model(
    config: RunConfig,
    spec: ModelSpec,
    precision: Precision,
    env: parallel.DistributedEnv,
    ckpt: Checkpoint | None,
    *,
    unused_parameters: bool = False,
) -> BuiltModel:
    """The model of a run, wrapped for its ranks (a fresh run with `init`: a baseline's
    weights, train/init.py; a resumed one: its checkpoint's weights; a sharded checkpoint's
    load after wrapping, with the optimizer state).

    Under FSDP2 on several ranks the model is built on the meta device, sharded, and only then
    given memory: each rank allocates its shards, draws its rows of the random init and reads
    its rows of the baseline (train/init_sliced.py), so no rank ever holds the whole model.
    A baseline in a format not read in slices is read whole (logged) as on one rank.
    With `train.offload` (any number of ranks) the shards are given host memory; a model that
    must be read whole is then built on the CPU and each rank copies its rows from it.
    """
    t = config.train
    shards = env.world_size if t.parallel == "fsdp" else 1  # what splits QLoRA's NF4 weights
    if t.offload and env.world_size == 1 and quantised_towers(lora_towers(t)):
        # torch's FSDP2 unshards a one-rank group by copying each parameter's first all-gather
        # input only (fsdp_param_group.wait_for_unshard); torchao's NF4 weights have three.
        raise FieldError(
            "train.offload",
            "CPU offload on one rank cannot hold a 4-bit (quantize_base: nf4) base: FSDP2 "
            "cannot unshard NF4 weights in a one-rank group. Without offload the NF4 base "
            "stays on the GPU (0.52 bytes a parameter); or run on 2 ranks or more",
        )
    if t.parallel == "fsdp" and (env.world_size > 1 or t.offload):
        parallel.check_fsdp_can_train(unused_parameters)
        sliced = _sliced_plan(config, spec, precision, ckpt, shards)
        if sliced is not _WHOLE:
            return _build_sharded(config, spec, precision, env, ckpt, sliced)
        if t.offload:  # FSDP2 takes offloaded parameters from the meta device, not whole
            whole = _build_whole(config, spec, precision, torch.device("cpu"), ckpt, shards)
            return _build_sharded(config, spec, precision, env, ckpt, None, whole)
    model, config, lora_scale = _build_whole(config, spec, precision, env.device, ckpt, shards)
    recompute = _apply_wrappers(model, config)
    trained = parallel.wrap_data_parallel(
        model, env, t.parallel, t.precision, unused_parameters=unused_parameters
    )
    return BuiltModel(model, trained, config, lora_scale, recompute)


def check_hub_settings(config: RunConfig) -> None:
    """What a hub model cannot do (yet): exit 2 naming the setting, before anything starts."""
    if config.train.sequence_parallel > 1:
        raise FieldError(
            "train.sequence_parallel",
            "sequence parallelism is native-only: mmtrain's own LLaVA, Qwen2-VL / Qwen2.5-VL and "
            "Llama / Qwen2 modules split a row over ranks, a hub model (transformers' class) "
            "does not; set train.sequence_parallel: 1 (FSDP2 shards the model instead)",
        )


def _build_whole(
    config: RunConfig,
    spec: ModelSpec,
    precision: Precision,
    device: torch.device,
    ckpt: Checkpoint | None,
    shards: int = 1,
) -> tuple[nn.Module, RunConfig, dict[str, float]]:
    """The whole model in this process: random init, `init` or a full checkpoint's weights,
    LoRA, QLoRA's NF4 base (split later over `shards` FSDP ranks), freezing, on `device`."""
    t = config.train
    model = create_model(spec, seed=config.seed, dtype=precision.param_dtype)
    # `init`: a baseline's weights, loaded once before step 0 (a resume restores its checkpoint).
    config = start_from_init(model, config, ckpt.meta if ckpt is not None else None)
    loras = lora_towers(t)
    if ckpt is not None and quantised_towers(loras):
        config = _reload_base(model, config)  # the checkpoint has no 4-bit base
    # LoRA adapters join before a checkpoint loads (it holds them) and before any wrapper.
    apply_lora(model, loras, seed=config.seed)
    quantize_frozen_linears(model, loras, frozen_dtype(precision), device=device, shards=shards)
    if ckpt is not None and ckpt.format == "full":
        model.load_state_dict(ckpt.model)
    freeze_parameters(model, t)
    hold_frozen_in_compute_dtype(model, precision)
    model.to(device)
    return model, config, lora_scales(model)


def _reload_base(model: nn.Module, config: RunConfig) -> RunConfig:
    """A resumed QLoRA run's base, read again from the `init` the run started from (the
    checkpoint leaves the 4-bit weights out): the files must have the sha256 the run recorded
    (InitError naming init_sha256 otherwise). A random base is the seed's, drawn alike."""
    if config.init is None:
        return config
    report = load_init(model, config.init, strict=config.init_strict)
    return record_init_hashes(config, report.sha256)


def frozen_dtype(precision: Precision) -> torch.dtype:
    """The dtype frozen matmul weights are held (and QLoRA's base quantised) in: the autocast
    dtype under bf16 / fp16, the parameters' dtype otherwise."""
    if precision.name in FROZEN_IN_COMPUTE_DTYPE and precision.dtype is not None:
        return precision.dtype
    return precision.param_dtype


def hold_frozen_in_compute_dtype(model: nn.Module, precision: Precision) -> int:
    """Hold the frozen weights and biases of `model`'s linear and convolution layers, LoRA's
    bases included, in the autocast dtype of `precision` (bf16 or fp16); returns how many
    parameters were cast.

    Autocast casts such a weight at every call: held in fp32, a frozen 7B LM costs 4 bytes a
    parameter plus, where a gradient passes through it (LLaVA's stage 1), the 16-bit copy of
    each weight that autograd keeps for the input's gradient, 2 bytes more. Held in the
    compute dtype it costs 2 bytes and the forward computes the very same values (the cast
    rounds once either way). Embeddings, position tables and norms stay fp32: their outputs
    feed the fp32 residual stream. A LoRA base is cast like any frozen linear: its adapters
    (fp32) merge into it at export in float64, into an fp32 weight (train/lora.py `merged`).
    QLoRA's NF4 weights are left as they are (quantised from this dtype already). A parameter
    another kind of layer shares (a tied embedding) is left alone. Trainable parameters are
    never touched: the optimizer and EMA see what they saw before; checkpoints and exports
    hold the frozen weights in this dtype.
    """
    if precision.name not in FROZEN_IN_COMPUTE_DTYPE or precision.dtype is None:
        return 0
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    cast = 0
    for module in model.modules():
        if not _cast_by_autocast(module):
            continue
        for param in module.parameters(recurse=False):
            shared = any(not _cast_by_autocast(m) for m in owners[id(param)])
            if param.requires_grad or shared or param.dtype == precision.dtype:
                continue
            if is_quantised(param):
                continue
            param.data = param.data.to(precision.dtype)
            cast += param.numel()
    if cast:
        log.info("frozen linear and convolution weights held in %s: %d parameters",
                 precision.name, cast)  # fmt: skip
    return cast


def _cast_by_autocast(module: nn.Module) -> bool:
    """A layer whose frozen weight autocast casts at every call: linears and convolutions,
    and LoRA's wrapper of a linear (its base weight and bias; the adapters train)."""
    return isinstance(module, (LoraLinear, *CAST_BY_AUTOCAST))


def _apply_wrappers(model: nn.Module, config: RunConfig) -> list[str]:
    """fp8, any-resolution position embeddings, then per block activation checkpointing ->
    compile; returns the towers that recompute."""
    t = config.train
    if t.precision == "fp8":
        convert_to_fp8(model, t.fp8_keep_bf16, t.fp8_recipe)
    if t.resolution_schedule or t.frames_schedule:
        allow_any_resolution(model)  # position embeddings follow the input's size
    recompute = [n for n, tower in t.towers.items() if tower.activation_checkpointing]
    parallel.apply_activation_checkpointing(model, "full", recompute)
    if t.compile:
        parallel.apply_compile(model)
    return recompute


_WHOLE = object()  # the baseline must be read whole: build the whole model first


def _sliced_plan(
    config: RunConfig,
    spec: ModelSpec,
    precision: Precision,
    ckpt: Checkpoint | None,
    shards: int,
) -> SlicedInit | None | object:
    """None: nothing to read (random init, or a resume); a plan: `init` read in slices;
    `_WHOLE`: a baseline (or a full checkpoint) that this rank must read whole.

    QLoRA's NF4 weights are quantised whole and split afterwards, so a run quantising them
    reads every one of them from a plan (on a resume too: its checkpoint has no 4-bit base,
    which comes from the `init` the run started from), or builds the whole model."""
    loras = lora_towers(config.train)
    quantising = bool(quantised_towers(loras))
    if spec.hub is not None:  # transformers reads its folders whole (train/init_hub.py)
        fresh_or_full = ckpt is None or ckpt.format == "full"
        return _WHOLE if fresh_or_full or quantising else None
    if ckpt is not None:
        if ckpt.format == "full":
            return _WHOLE
        if not quantising:
            return None
        init = ckpt.meta.get("config", {}).get("init")
    else:
        init = config.init
    if init is None:
        return _WHOLE if quantising else None  # a random 4-bit base: quantised whole
    probe = create_model(spec, device="meta", dtype=precision.param_dtype)
    apply_lora(probe, loras, seed=config.seed)
    plan = plan_sliced_init(probe, init)
    if plan is None:
        log.warning(
            "init %s is read whole on every rank (a format or layout not read in slices)", init
        )
        return _WHOLE
    targets, _ = nf4_targets(probe, loras, shards)
    unread = [name for *_, name in targets if name not in plan.parts]
    if unread:
        log.warning("init %s lacks %s (to hold in NF4): the model is built whole", init, unread[0])
        return _WHOLE
    return plan


def _build_sharded(
    config: RunConfig,
    spec: ModelSpec,
    precision: Precision,
    env: parallel.DistributedEnv,
    ckpt: Checkpoint | None,
    plan: SlicedInit | None,
    whole: tuple[nn.Module, RunConfig, dict[str, float]] | None = None,
) -> BuiltModel:
    """Meta device -> LoRA, QLoRA's NF4 placeholders, freezing, wrappers -> FSDP2 shards ->
    memory for this rank's shards (host memory under `train.offload`) -> the random init's
    rows (the same values as a whole model's) -> the baseline's rows, or each rank's rows of
    `whole` (a model `_build_whole` built on the CPU). A sharded checkpoint's weights load
    later, with the optimizer state."""
    t = config.train
    home = torch.device("cpu") if t.offload else env.device  # where the shards live
    model = create_model(spec, device="meta", dtype=precision.param_dtype)
    loras = lora_towers(t)
    apply_lora(model, loras, seed=config.seed)
    lora_scale = lora_scales(model)
    quantize_frozen_linears(
        model, loras, frozen_dtype(precision), device=home, shards=env.world_size
    )
    freeze_parameters(model, t)
    hold_frozen_in_compute_dtype(model, precision)
    recompute = _apply_wrappers(model, config)
    materialize_scalars_(model, home)  # before FSDP hooks their gradients
    parallel.apply_fsdp(model, t.precision, offload=t.offload)
    model.to_empty(device=home)
    own_blocks_in_shards(model)
    if whole is not None:
        source, config, lora_scale = whole
        _copy_rows_from_whole(model, source)
        return BuiltModel(model, model, config, lora_scale, recompute)
    model.init_weights(torch.Generator().manual_seed(config.seed))  # draws full, keeps rows
    reset_lora_adapters(model, loras, seed=config.seed)
    if plan is not None:
        if ckpt is not None:  # QLoRA's resume: the base from the init the run started from
            config = start_from_init(model, config, ckpt.meta)
        config = record_init_hashes(config, load_sliced_init(model, plan))
    else:
        config = start_from_init(model, config, ckpt.meta if ckpt is not None else None)
    return BuiltModel(model, model, config, lora_scale, recompute)


@torch.no_grad()
def _copy_rows_from_whole(sharded: nn.Module, whole: nn.Module) -> None:
    """Every parameter and buffer of `sharded` (this rank's rows) from the same-named one of
    `whole`, one tensor at a time; an NF4 shard takes its rows of the whole NF4 tensor."""
    params = dict(whole.named_parameters())
    for name, param in sharded.named_parameters():
        if is_quantised(param):
            copy_full_nf4_(param, params[name])
        else:
            copy_full_(param, params[name].detach())
    buffers = dict(whole.named_buffers())
    for name, buffer in sharded.named_buffers():
        buffer.copy_(buffers[name])


def build_reference(
    config: RunConfig, spec: ModelSpec, precision: Precision, env: parallel.DistributedEnv
) -> nn.Module:
    """DPO's frozen reference for a full fine-tune (train.dpo.reference copy): the model the
    run starts from (`init`, or the seed's random init: the same on a resume, whose `init`
    hashes the resume check compares), without gradients, held in the compute dtype. Under
    FSDP it is sharded as the policy is (each rank keeps its shards, a block gathered at a
    time in its forward); each rank reads the whole model into host memory first."""
    t = config.train
    model = create_model(spec, seed=config.seed, dtype=frozen_dtype(precision))
    if config.init is not None:
        load_init(model, config.init, strict=config.init_strict)
    model.requires_grad_(False)
    model.eval()
    if t.parallel == "fsdp" and (env.world_size > 1 or t.offload):
        model.to(torch.device("cpu") if t.offload else env.device)
        return parallel.apply_fsdp(model, t.precision, offload=t.offload)
    return model.to(env.device)
