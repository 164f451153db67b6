"""Parallelism applied to a built model from outside its code (DESIGN.md section 3), per
block in the order activation checkpointing -> compile -> DDP or FSDP2 (torchtitan's).

- `apply_activation_checkpointing(model, mode, towers)`: per transformer block, per tower,
  non-reentrant `torch.utils.checkpoint`. The trainer and the planner's measurement both use it.
- `apply_compile(model)`: `torch.compile` on each transformer block, in place.
- `wrap_data_parallel(model, env, "ddp" | "fsdp", precision)`: a DDP replica per rank, or
  FSDP2 through `apply_fsdp`.
- `apply_fsdp(model, precision, offload=...)`: FSDP2 (`fully_shard`) on each transformer block,
  then on the whole model, with a mixed-precision policy derived from `train.precision` and,
  with `train.offload`, CPUOffloadPolicy (shards, gradients and optimizer state in host memory).
- `full_model_state_dict`, `load_full_model_state_dict`, `optimizer_state_dict`,
  `load_optimizer_state_dict`: full (unsharded) state on the CPU whatever the strategy, so a
  checkpoint written under FSDP keeps the single-process format (`model.safetensors`) and
  resumes on any number of ranks.
- `sharded_state_dict`, `load_sharded_state_dict`: each rank's shards (no gather) for the sharded
  checkpoint format (`torch.distributed.checkpoint`), which reshards them to any rank count.

The same code runs in one process, under torchrun on CPUs (gloo) and on GPUs (nccl).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmtrain.distributed import backend_for, fix_malloc_mmap_threshold
from mmtrain.models.build import unwrap_model
from mmtrain.structured import FieldError
from mmtrain.train.qlora import is_quantised

AC_MODES = ("none", "selective", "full")
# Parameters gathered/computed in this dtype under FSDP; gradients are reduced in fp32 (a sum
# over ranks in bf16 loses the small contributions). fp8 matmuls run on bf16 parameters.
FSDP_PARAM_DTYPES = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
    "fp64": None,  # parameters are float64 already; FSDP keeps their dtype
}


# ----------------------------------------------------------------------------- checkpointing
def _checkpointed(forward):
    """`forward` run under non-reentrant checkpointing: only its inputs are kept for backward;
    everything inside is recomputed when the gradient reaches it."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _towers(model: nn.Module) -> nn.ModuleDict:
    towers = getattr(model, "towers", None)
    if towers is None:
        raise TypeError(
            f"expected a model with .towers (MultimodalModel), got {type(model).__name__}"
        )
    return towers


def apply_activation_checkpointing(
    model: nn.Module, mode: str, towers: Sequence[str] | None = None
) -> nn.Module:
    """Checkpoint each transformer block of the named towers (all towers when None) in place.

    - "full": the whole block is recomputed in backward; autograd keeps only the block input
      (Korthikanti et al. 2022's "full recompute", about one extra forward pass of compute).
    - "selective": each block's attention sub-module (`block.attn`: q/k/v projection, attention
      core, output projection) is recomputed; the MLP keeps its activations. This is the part
      Korthikanti's selective recompute targets (the attention core, whose s^2 softmax dominates
      without a fused kernel); the projections come along because the core cannot be separated
      from outside the model code.
    - "none": nothing changes.

    The wrapped `forward` is set on the module instance, so parameter names (and checkpoints)
    are unchanged and FSDP applied afterwards still sees the blocks as modules. Applying
    checkpointing twice to a module is an error (checkpoint inside checkpoint).
    """
    if mode not in AC_MODES:
        raise ValueError(
            f"activation checkpointing mode {mode!r} is not one of {', '.join(AC_MODES)}"
        )
    all_towers = _towers(model)
    names = list(all_towers) if towers is None else list(towers)
    for name in names:
        if name not in all_towers:
            raise FieldError(
                f"train.towers.{name}",
                f"the model has no tower {name!r}; towers: {', '.join(all_towers)}",
            )
    if mode == "none":
        return model
    for name in names:
        for block in all_towers[name].blocks:
            attention = _attention_of(block)
            target = block if mode == "full" else attention
            if any(getattr(m, "_mmtrain_checkpointed", False) for m in (block, attention)):
                raise ValueError(
                    f"activation checkpointing is already applied to tower {name!r} of this model"
                )
            target.forward = _checkpointed(target.forward)
            target._mmtrain_checkpointed = True
    return model


def _attention_of(block: nn.Module) -> nn.Module:
    """A block's attention sub-module: mmtrain's `attn`, or a transformers layer's child
    named so (`self_attn`, `attention`, ...)."""
    for name, child in block.named_children():
        if name.lower().endswith(("attn", "attention")):
            return child
    raise ValueError(f"{type(block).__name__} has no attention sub-module to checkpoint")


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile each transformer block of every tower in place (`Module.compile`: parameter
    names, and so checkpoints, are unchanged). Blocks are where the step's FLOPs are, they are
    what the step calls (a stem or a VLM's feature path calls blocks directly, never the
    tower's `__call__`), and blocks of one tower share a shape: dynamo compiles one graph per
    distinct block and reuses it. Apply after activation checkpointing (the checkpointed
    forward is traced whole) and before FSDP (its hooks stay outside the graph)."""
    for tower in _towers(model).values():
        for block in tower.blocks:
            block.compile()
    return model


# ----------------------------------------------------------------------------- process groups
@dataclass(frozen=True)
class DistributedEnv:
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    owns_group: bool  # this module created the process group (and destroys it at the end)
    # The ranks on this rank's node, as torchrun says (LOCAL_WORLD_SIZE); None when nothing
    # said (a process started by hand): where the node boundaries fall is then unknown.
    ranks_per_node: int | None = None


def init_distributed(
    device: str = "auto", *, group_of_one: bool = False, sharded: bool = False
) -> DistributedEnv:
    """Pick the device and, under torchrun (WORLD_SIZE > 1), join the default process group:
    nccl when training on CUDA, gloo on CPU. Reuses a group that already exists.
    `group_of_one`: a single process gets a group of its own too (FSDP2 needs one: CPU offload
    on one GPU). `sharded` (an FSDP2 run): also fixes glibc's mmap threshold for this process
    (`distributed.fix_malloc_mmap_threshold`, unless the environment sets one), so that the
    sharded start's freed all-gather buffers go back to the system; other runs keep glibc's
    own (adaptive) threshold."""
    if sharded:
        fix_malloc_mmap_threshold()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise FieldError(
            "train.device", "cuda was asked for but no CUDA GPU is visible; use cpu or auto"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The device first, then the group bound to it (`device_id`): NCCL then creates its
    # communicator for this GPU eagerly instead of guessing one at the first collective.
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    owns = False
    if (world > 1 or group_of_one) and not dist.is_initialized():
        # One process has no rendezvous to make: an in-memory store stands for torchrun's.
        alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if world == 1 else {}
        if use_cuda:
            dist.init_process_group(backend_for(cuda=True), device_id=dev, **alone)
        else:
            dist.init_process_group(backend_for(cuda=False), **alone)
        owns = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return DistributedEnv(dev, rank, world, local_rank, owns, _ranks_per_node(world))


def _ranks_per_node(world: int) -> int | None:
    if world == 1:
        return 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) >= 1 else None


def shutdown(env: DistributedEnv) -> None:
    """Leave the process group this module created (see `distributed.leave_process_group`)."""
    if env.owns_group:
        from mmtrain.distributed import leave_process_group

        leave_process_group()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ----------------------------------------------------------------------------- data parallel
def wrap_data_parallel(
    model: nn.Module,
    env: DistributedEnv,
    strategy: str = "auto",
    precision: str = "fp32",
    unused_parameters: bool = False,
) -> nn.Module:
    """The module the training loop calls: the model itself on one rank, DDP or FSDP2 across
    ranks. Create the optimizer afterwards: FSDP replaces the parameters by their shards.

    DDP keeps a full replica per rank and averages gradients (bucketed, overlapped with the
    backward). Buffers are derived from the spec (mel filterbanks), identical on every rank, so
    they are not broadcast at each forward. "fsdp" is `apply_fsdp` with `precision`'s policy: it
    shards the model in place (and returns it), so the caller must save through
    `full_model_state_dict` / `optimizer_state_dict` (gathered) or `sharded_state_dict` (the
    sharded checkpoint format), on every rank. `unused_parameters`: some steps leave parameters
    without gradients (towers absent from a step); DDP then looks for them after each backward.
    """
    if env.world_size == 1:
        return model
    if strategy == "fsdp":
        check_fsdp_can_train(unused_parameters)
        return apply_fsdp(model, precision)
    device_ids = [env.local_rank] if env.device.type == "cuda" else None
    # Quantised frozen weights (QLoRA's NF4, train/qlora.py) are not broadcast: every rank
    # quantised the same baseline alike, and DDP's broadcast has no way to send their parts.
    quantised = [name for name, p in model.named_parameters() if is_quantised(p)]
    if unused_parameters:
        # DDP's search for unused parameters walks the forward's graph; the logit scale and
        # bias are used by the loss, outside the forward, and would be counted twice. They are
        # left out of DDP and averaged over ranks by a hook, as under FSDP.
        # (DDP matches ignored names both as "name" and as "module.name", "" for the root.)
        scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
        quantised += scalars + [f".{name}" for name in scalars if "." not in name]
        _average_gradients_by_hook(model.get_parameter(name) for name in scalars)
    if quantised:
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, quantised
        )
    return nn.parallel.DistributedDataParallel(
        model,
        device_ids=device_ids,
        broadcast_buffers=False,
        find_unused_parameters=unused_parameters,
    )


def check_fsdp_can_train(unused_parameters: bool) -> None:
    """FieldError when FSDP2 on several ranks cannot train this run's steps."""
    if unused_parameters:
        raise FieldError(
            "train.parallel",
            "fsdp on several ranks cannot yet train towers that sit out some steps "
            "(data.train sources of different modalities); use ddp",
        )


def fsdp_mixed_precision(precision: str):
    """FSDP2's MixedPrecisionPolicy for `train.precision`: parameters all-gathered and used in
    the low dtype, gradients reduce-scattered in fp32, sharded master weights kept in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in FSDP_PARAM_DTYPES:
        raise FieldError(
            "train.precision", f"{precision!r} is not one of {', '.join(FSDP_PARAM_DTYPES)}"
        )
    dtype = FSDP_PARAM_DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def fsdp_offload_policy(offload: bool):
    """FSDP2's offload policy for `train.offload`: CPUOffloadPolicy (sharded parameters,
    their gradients and so the optimizer's states in host memory, pinned where CUDA can pin
    them: the copies to and from the GPU then run asynchronously), else none."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def apply_fsdp(
    model: nn.Module,
    precision: str = "fp32",
    *,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> nn.Module:
    """Shard `model` in place with FSDP2 over the default process group; returns it.

    Each transformer block is its own unit (its parameters are all-gathered just before it
    runs and freed after, so at most about one block is unsharded at a time), then the root
    takes what is left (stems, norms, projections). Call after compile and activation
    checkpointing: FSDP then sees the blocks as modules and hooks their calls. Parameter names
    do not change, so `full_model_state_dict` matches `create_model(spec)`.

    `fully_shard` cannot shard 0-d parameters (the logit scale and bias): they stay whole on
    every rank, in fp32, and their gradients are averaged over ranks by a hook, as DDP would.
    `offload` (train.offload): the shards live in host memory (`fsdp_offload_policy`); a model
    built on the meta device is then given memory on the CPU (train/model_setup.py).
    QLoRA's NF4 weights shard as they are (torchao's NF4Tensor all-gathers its 4-bit parts).
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if not dist.is_initialized():
        raise RuntimeError("FSDP needs a process group: launch with torchrun (WORLD_SIZE > 1)")
    settings = {
        "mp_policy": fsdp_mixed_precision(precision),
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": fsdp_offload_policy(offload),
    }
    for tower in _towers(model).values():
        for block in tower.blocks:
            fully_shard(block, **settings)
        if getattr(tower, "lm_head", None) is not None:
            # An untied decoder's embedding is its own unit: gathered for the lookup and freed
            # before the blocks run (the root, which keeps the head, stays gathered through
            # the backward). A tied one is the head's weight too, read outside its forward.
            fully_shard(tower.embed, **settings)
    scalars = {p for p in model.parameters() if p.dim() == 0}
    _average_gradients_by_hook(scalars)
    fully_shard(model, **settings, ignored_params=scalars or None)
    # Methods other than forward that run the model (a language model's logits and
    # generate) must gather the root's parameters (embedding, final norm, head) too.
    for method in ("logits", "generate"):
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    return model


def _average_gradients_by_hook(params: Iterable[nn.Parameter]) -> None:
    """Average the gradients of `params` over ranks as each is accumulated: for parameters
    that DDP or FSDP leave out (the 0-d logit scale and bias)."""
    for param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(_average_gradient_over_ranks)


def _average_gradient_over_ranks(param: torch.Tensor) -> None:
    # Runs after each micro-batch's gradient is added to .grad. What is already there is the
    # same on every rank (averaged before), so averaging again leaves it unchanged: the result
    # is the mean over ranks of the summed micro-batch gradients, what FSDP gives the others.
    dist.all_reduce(param.grad)  # SUM: gloo has no AVG
    param.grad.div_(dist.get_world_size())


def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def no_sync(module: nn.Module) -> contextlib.AbstractContextManager:
    """Skip the gradient reduction of a non-final micro-batch under DDP (`no_sync()`: the
    replicas' gradients add up locally and are all-reduced once, with the last backward).

    Under FSDP2 nothing is skipped: each micro-batch's backward reduce-scatters its gradients
    into the shards, where they add up (torchtitan's choice). Skipping it
    (`set_requires_gradient_sync(False)`) would keep an unsharded gradient of every trainable
    parameter until the last micro-batch, in the reduce dtype (fp32: 4 B/param, the whole
    model's gradient on every rank), which is what sharding is for avoiding; the price is one
    reduce-scatter per micro-batch instead of one per step, which the planner counts
    (plan/compute.py, ZeRO-3). A no-op on one rank too."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- state
def _full_options(**extra: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **extra)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict on the CPU, in `create_model(spec)`'s names and dtypes.

    Under FSDP this is a collective (every rank must call it; each shard is all-gathered) and
    only rank 0 receives the tensors: other ranks get an empty dict. Otherwise it is the
    module's own state dict (every rank holds the full model), moved to the CPU.
    """
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=_full_options(cpu_offload=True))
        return _copied(model, state)
    return {k: v.detach().to("cpu", copy=True) for k, v in unwrap_model(model).state_dict().items()}


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict, as `full_model_state_dict` gives, into `model`.

    Under FSDP every rank passes the full state and keeps its own shard of each tensor (a
    sharded model cannot `load_state_dict` full tensors itself); otherwise the tensors are
    copied into the module's parameters and buffers, on whatever device they live.
    """
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state, options=_full_options(broadcast_from_rank0=False))
        return
    unwrap_model(model).load_state_dict(state)


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state, unsharded, to save in a checkpoint.

    Plain and DDP models: `optimizer.state_dict()` (states keyed by parameter index). FSDP:
    a collective returning full tensors keyed by parameter name on rank 0 (empty elsewhere).
    `load_optimizer_state_dict` reads either form into either kind of model.
    """
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
        return _copied(model, state)
    return optimizer.state_dict()


def _copied(model: nn.Module, state: Any) -> Any:
    """`state` with its tensors copied when the model lives on the CPU: there the gathered
    "offloaded" tensors can share memory with what the next step overwrites (FSDP's buffers,
    the unsharded logit scale and its optimizer state)."""
    if next(model.parameters()).device.type != "cpu":
        return state  # cpu_offload already copied them off the accelerator
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _copied(model, v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copied(model, v) for v in state]
    return state


def load_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a state from `optimizer_state_dict` (of any strategy, any number of ranks).

    Every rank passes the full state (each reads the checkpoint); under FSDP each keeps its
    own shard of it. The optimizer may adopt tensors of `state`: do not reuse it afterwards.
    """
    keyed_by_name = any(isinstance(k, str) for k in state.get("state", {}))
    if not is_fsdp(model) and not keyed_by_name:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not keyed_by_name:
        state = _keyed_by_name(unwrap_model(model), optimizer, state)
    set_optimizer_state_dict(unwrap_model(model), optimizer, state, options=_full_options())


def _keyed_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any]:
    """`optimizer.state_dict()`'s index keys -> parameter names (the form FSDP's loader reads).
    Indexes count the parameters of `optimizer.param_groups` in order, as torch numbers them."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = [
        {**saved, "params": [order[i] for i in saved["params"]]} for saved in state["param_groups"]
    ]
    return {"state": {order[i]: s for i, s in state["state"].items()}, "param_groups": groups}


# ----------------------------------------------------------------------------- sharded state
def sharded_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} in the form `torch.distributed.checkpoint` saves and
    loads: under FSDP each rank's DTensor shards, nothing gathered or copied (they alias the
    live parameters and optimizer state); otherwise the full tensors. Keys are parameter
    names, so DCP matches a checkpoint saved on N ranks to a model on M ranks or one process.

    A collective under FSDP. An optimizer that has not stepped yet gets its state created
    first (zeros, through one step with learning rate 0), so there is something to load into.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(unwrap_model(model), optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_sharded_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put `state` (from `sharded_state_dict`, filled by `checkpoint.read_sharded`) into the
    model and the optimizer. A collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        unwrap_model(model),
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def nonfinite_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of `state` holding a NaN or an infinity. Of an FSDP
    shard (DTensor) only this rank's part is looked at: no communication."""
    from torch.distributed.tensor import DTensor

    bad = []
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.is_floating_point() and not torch.isfinite(local).all():
            bad.append(name)
    return bad
