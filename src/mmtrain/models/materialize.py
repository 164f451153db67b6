"""Filling parameters that may be shards: a model built on the meta device and sharded by FSDP2
holds DTensor parameters, each rank the rows of dim 0 it owns. Initialisation and loading draw
or read the full value of ONE parameter at a time and keep only this rank's rows, so the same
seed gives the same weights sharded or not, and no rank ever holds the whole model."""

from __future__ import annotations

import torch
from torch import Tensor


def is_sharded(param: Tensor) -> bool:
    return hasattr(param, "to_local") and hasattr(param, "placements")


def local_rows(param: Tensor) -> tuple[int, int]:
    """The rows [start, end) of dim 0 of the full parameter that this rank holds: all of them
    for a plain tensor; for FSDP2's Shard(0) the `torch.chunk` split (ceil(rows / ranks) per
    rank, the last ones shorter or empty)."""
    rows = param.shape[0] if param.dim() else 1
    if not is_sharded(param):
        return 0, rows
    (placement,) = param.placements
    if not placement.is_shard(0):
        raise ValueError(f"expected a parameter sharded on dim 0, got {param.placements}")
    mesh = param.device_mesh
    rank, ranks = mesh.get_local_rank(), mesh.size()
    per_rank = -(-rows // ranks)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


@torch.no_grad()
def copy_full_(param: Tensor, full: Tensor) -> None:
    """`param.copy_(full)`, also when `param` is a shard: this rank's rows of `full` go into its
    local tensor (`full` is the whole value, e.g. drawn on the CPU from a generator)."""
    if not is_sharded(param):
        param.copy_(full)
        return
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"full value of shape {list(full.shape)} for {list(param.shape)}")
    start, end = local_rows(param)
    copy_rows_(param, full[start:end])


@torch.no_grad()
def copy_rows_(param: Tensor, rows: Tensor) -> None:
    """Copy `rows` (exactly this rank's rows, `local_rows`) into `param` (a shard or not)."""
    local = param.to_local() if is_sharded(param) else param
    if tuple(local.shape) != tuple(rows.shape):
        raise ValueError(f"rows of shape {list(rows.shape)} for a shard of {list(local.shape)}")
    local.copy_(rows)


def materialize_scalars_(model: torch.nn.Module, device: torch.device) -> None:
    """Give the 0-d parameters of a meta-device model (a logit scale and bias) memory on
    `device` now, as new Parameters in place of the meta ones. FSDP2 leaves them out and
    hooks them to average their gradients over ranks; a later `to_empty` then keeps these
    Parameter objects (and their hooks), which it would replace were they still on meta."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0 and param.device.type == "meta":
                fresh = torch.nn.Parameter(
                    torch.empty((), dtype=param.dtype, device=device), param.requires_grad
                )
                setattr(module, name, fresh)


def initialised_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """`named_parameters()` less the adapters that wrappers add (the names a submodule lists in
    `ADAPTER_PARAMETERS`, e.g. LoRA's): the random init draws the model's own parameters in
    the same order whether it runs before adapters are added (a whole model) or after (a model
    built on the meta device); the adapters are drawn by their wrapper."""
    skip = {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in getattr(sub, "ADAPTER_PARAMETERS", ())
    }
    return [(name, p) for name, p in module.named_parameters() if name not in skip]


def full_on_cpu(value: Tensor) -> Tensor:
    """The whole tensor on the CPU: a shard (DTensor) is all-gathered first, a collective every
    rank must call."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().to("cpu")
