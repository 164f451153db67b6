"""The trained model from its spec, in the order the wrappers need: weights (a baseline's
`init` or a full checkpoint), LoRA adapters, freezing (frozen matmul weights then held in the
compute dtype), device, fp8, any-resolution position embeddings, then per block activation
checkpointing -> compile (DDP / FSDP2 follow in the loop's set-up, torchtitan's order)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from mmtrain.checkpoint import Checkpoint
from mmtrain.config import RunConfig
from mmtrain.models import create_model
from mmtrain.models.materialize import materialize_scalars_
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.init_sliced import SlicedInit, load_sliced_init, plan_sliced_init
from mmtrain.train.init_start import record_init_hashes, start_from_init
from mmtrain.train.lora import apply_lora, lora_scales, lora_towers, reset_lora_adapters
from mmtrain.train.optim import freeze_parameters
from mmtrain.train.precision import Precision, convert_to_fp8
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
    """
    t = config.train
    if t.parallel == "fsdp" and env.world_size > 1:
        parallel.check_fsdp_can_train(unused_parameters)
        sliced = _sliced_plan(config, spec, precision, ckpt)
        if sliced is not _WHOLE:
            return _build_sharded(config, spec, precision, env, ckpt, sliced)
    model, config, lora_scale = _build_whole(config, spec, precision, env.device, ckpt)
    recompute = _apply_wrappers(model, config)
    trained = parallel.wrap_data_parallel(
        model, env, t.parallel, t.precision, unused_parameters=unused_parameters
    )
    return BuiltModel(model, trained, config, lora_scale, recompute)


def _build_whole(
    config: RunConfig,
    spec: ModelSpec,
    precision: Precision,
    device: torch.device,
    ckpt: Checkpoint | None,
) -> tuple[nn.Module, RunConfig, dict[str, float]]:
    """The whole model in this process: random init, `init` or a full checkpoint's weights,
    LoRA, freezing, on `device`."""
    t = config.train
    model = create_model(spec, seed=config.seed, dtype=precision.param_dtype)
    # `init`: a baseline's weights, loaded once before step 0 (a resume restores its checkpoint).
    config = start_from_init(model, config, ckpt.meta if ckpt is not None else None)
    # LoRA adapters join before a checkpoint loads (it holds them) and before any wrapper.
    apply_lora(model, lora_towers(t), seed=config.seed)
    if ckpt is not None and ckpt.format == "full":
        model.load_state_dict(ckpt.model)
    freeze_parameters(model, t)
    hold_frozen_in_compute_dtype(model, precision)
    model.to(device)
    return model, config, lora_scales(model)


def hold_frozen_in_compute_dtype(model: nn.Module, precision: Precision) -> int:
    """Hold the frozen weights and biases of `model`'s linear and convolution layers in the
    autocast dtype of `precision` (bf16 or fp16); returns how many parameters were cast.

    Autocast casts such a weight at every call: held in fp32, a frozen 7B LM costs 4 bytes a
    parameter plus, where a gradient passes through it (LLaVA's stage 1), the 16-bit copy of
    each weight that autograd keeps for the input's gradient, 2 bytes more. Held in the
    compute dtype it costs 2 bytes and the forward computes the very same values (the cast
    rounds once either way). Embeddings, position tables and norms stay fp32: their outputs
    feed the fp32 residual stream. LoRA bases stay as they are (their adapters merge into
    them at export, in the base's dtype). A parameter another kind of layer shares (a tied
    embedding) is left alone. Trainable parameters are never touched: the optimizer and EMA
    see what they saw before; checkpoints and exports hold the frozen weights in this dtype.
    """
    if precision.name not in FROZEN_IN_COMPUTE_DTYPE or precision.dtype is None:
        return 0
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    cast = 0
    for module in model.modules():
        if not isinstance(module, CAST_BY_AUTOCAST):
            continue
        for param in module.parameters(recurse=False):
            shared = any(not isinstance(m, CAST_BY_AUTOCAST) for m in owners[id(param)])
            if param.requires_grad or shared or param.dtype == precision.dtype:
                continue
            param.data = param.data.to(precision.dtype)
            cast += param.numel()
    if cast:
        log.info("frozen linear and convolution weights held in %s: %d parameters",
                 precision.name, cast)  # fmt: skip
    return cast


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
    config: RunConfig, spec: ModelSpec, precision: Precision, ckpt: Checkpoint | None
) -> SlicedInit | None | object:
    """None: nothing to read (random init, or a resume); a plan: `init` read in slices;
    `_WHOLE`: a baseline (or a full checkpoint) that this rank must read whole."""
    if ckpt is not None:
        return _WHOLE if ckpt.format == "full" else None
    if config.init is None:
        return None
    probe = create_model(spec, device="meta", dtype=precision.param_dtype)
    apply_lora(probe, lora_towers(config.train), seed=config.seed)
    plan = plan_sliced_init(probe, config.init)
    if plan is None:
        log.warning(
            "init %s is read whole on every rank (a format or layout not read in slices)",
            config.init,
        )
        return _WHOLE
    return plan


def _build_sharded(
    config: RunConfig,
    spec: ModelSpec,
    precision: Precision,
    env: parallel.DistributedEnv,
    ckpt: Checkpoint | None,
    plan: SlicedInit | None,
) -> BuiltModel:
    """Meta device -> LoRA, freezing, wrappers -> FSDP2 shards -> memory for this rank's
    shards -> the random init's rows (the same values as a whole model's) -> the baseline's
    rows. A sharded checkpoint's weights load later, with the optimizer state."""
    t = config.train
    model = create_model(spec, device="meta", dtype=precision.param_dtype)
    loras = lora_towers(t)
    apply_lora(model, loras, seed=config.seed)
    lora_scale = lora_scales(model)
    freeze_parameters(model, t)
    hold_frozen_in_compute_dtype(model, precision)
    recompute = _apply_wrappers(model, config)
    materialize_scalars_(model, env.device)  # before FSDP hooks their gradients
    parallel.apply_fsdp(model, t.precision)
    model.to_empty(device=env.device)
    model.init_weights(torch.Generator().manual_seed(config.seed))  # draws full, keeps rows
    reset_lora_adapters(model, loras, seed=config.seed)
    if plan is not None:
        config = record_init_hashes(config, load_sliced_init(model, plan))
    else:
        config = start_from_init(model, config, ckpt.meta if ckpt is not None else None)
    return BuiltModel(model, model, config, lora_scale, recompute)
