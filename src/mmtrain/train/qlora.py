"""QLoRA (Dettmers et al. 2023): a LoRA tower's frozen base held in 4-bit NF4.

`train.towers.NAME.lora.quantize_base: nf4` replaces, in every block of the tower, the weight
of each frozen linear (the bases LoRA adapts and the block's other linears) by torchao's
NF4Tensor: 4-bit codes of the normal-float grid in blocks of 64 values, one absmax scale per
block, the scales themselves quantised to int8 in blocks of 256 around their mean (torchao's
`to_nf4` defaults; 0.516 bytes a parameter). The tower's stem, head, norms and embeddings stay
unquantised, as QLoRA and bitsandbytes keep the output layer (a frozen head is held in the
compute dtype by `hold_frozen_in_compute_dtype`, embeddings and norms in fp32).

- Quantised from the weight in the compute dtype (bf16 / fp16; fp32 or fp64 without autocast):
  the dequantised weight is then what the matmul takes, without a further cast.
- Forward (`nf4_linear`): the input in the compute dtype, torchao's `linear_nf4`, which
  dequantises the whole weight for the matmul and again in the backward: autograd keeps only
  the 4-bit tensor, never a dequantised copy. Biases stay unquantised.
- FSDP2 shards NF4 weights as they are (torchao's all-gather hooks gather the 4-bit parts).
  The whole tensor is quantised once and each rank keeps its rows (`copy_full_nf4_`), so every
  rank's gathered weight is the one-process weight. A weight is quantised only when torchao
  can split it: its size a multiple of 64 x 256 values, on every rank (`quantizable`); the
  others stay in the compute dtype (logged).
- The quantised weights are derived from `init` (or the seed's random init): they are left out
  of the model's state dict (`state_dict()` hooks), so checkpoints do not store the frozen
  base; a resume reads the base again from `init` (its sha256 checked) and quantises it alike.
- Export dequantises (`dequantised`) and merges the adapters in float64 (train/lora.py).

torchao is imported only when a run asks for NF4.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmtrain.models.materialize import is_sharded
from mmtrain.plan.quantized import NF4_BLOCK, NF4_SCALER_BLOCK
from mmtrain.plan.quantized import quantizable as planned_quantizable
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

# torchao's NF4 module: where torchao 0.18 has it, and where older builds had it.
NF4_MODULES = (
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
    "torchao.dtypes.nf4tensor",
)
# The tensors an NF4Tensor is made of: the first three split by rows (FSDP shards them), the
# scales' mean and the 16-value grid are shared by every row.
NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


# ----------------------------------------------------------------------------- torchao
def nf4_module(field: str = "train.towers.NAME.lora.quantize_base"):
    """torchao's NF4 module, imported now; FieldError naming `field` when torchao lacks it."""
    for name in NF4_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise FieldError(
        field,
        "nf4 comes from torchao, which is not installed (or has no NF4Tensor): "
        "`pip install torchao` (a build matching your torch), or set it to null",
    )


def _loaded_nf4_class() -> type | None:
    """NF4Tensor when torchao's module is loaded (no import: no NF4 tensor can exist else)."""
    for name in NF4_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            return module.NF4Tensor
    return None


def is_quantised(tensor: Tensor) -> bool:
    """True for an NF4 tensor or parameter, or an FSDP2 shard (DTensor) of one."""
    nf4 = _loaded_nf4_class()
    if nf4 is None:
        return False
    local = tensor._local_tensor if is_sharded(tensor) else tensor
    return isinstance(local, nf4)


def dequantised(tensor: Tensor) -> Tensor:
    """The values an NF4 tensor stands for, in its dtype (a plain tensor as it is)."""
    return tensor.get_original_weight() if is_quantised(tensor) else tensor


def quantizable(shape: tuple[int, ...] | torch.Size, shards: int = 1) -> bool:
    """True when torchao can hold a weight of `shape` in NF4 split by rows over `shards`
    ranks: a matrix whose rows divide evenly and whose share of values is a whole number of
    scale blocks (64 x 256 values), the planner's rule (plan/quantized.py)."""
    return len(shape) == 2 and planned_quantizable(shape[0], shape[1], shards)


# ----------------------------------------------------------------------------- forward
def nf4_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b with W in NF4: x is cast to the autocast dtype where autocast is on (to W's
    dtype otherwise), so W is dequantised once, straight into the matmul's dtype. `F.linear`
    on an NF4 weight is torchao's `linear_nf4` (NF4Tensor's __torch_function__), which keeps
    only the 4-bit W for the backward; called so, not through `nf4_module()`, because
    torch.compile cannot trace `importlib.import_module` (a graph break at every linear)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    else:
        x = x.to(weight.dtype)
    y = F.linear(x, weight)
    return y if bias is None else y + bias.to(y.dtype)


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is NF4 (a block's linear LoRA does not adapt). Adopts
    the linear's weight and bias under their names, so state dicts and FSDP's units match
    `nn.Linear`'s."""

    def __init__(self, linear: nn.Linear, weight: nn.Parameter):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = weight
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return nf4_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"


# ----------------------------------------------------------------------------- quantising
def quantised_towers(loras: Mapping[str, object]) -> list[str]:
    """The towers whose LoRA settings (LoraConfig by tower) ask for an NF4 base."""
    return [name for name, lora in loras.items() if getattr(lora, "quantize_base", None)]


@torch.no_grad()
def quantize_frozen_linears(
    model: nn.Module,
    loras: Mapping[str, object],
    dtype: torch.dtype,
    *,
    device: torch.device | str = "cpu",
    shards: int = 1,
) -> list[str]:
    """Hold the frozen linears of the blocks of every tower whose LoRA sets `quantize_base` in
    NF4, quantised from their weights in `dtype`, in place (after `apply_lora`); returns the
    quantised parameters' names. `device`: where the quantisation runs and the NF4 weights
    live (a meta-device model gets meta placeholders, filled by `copy_full_nf4_` once sharded
    and given memory on `device`). `shards`: the ranks FSDP splits each weight over."""
    towers = quantised_towers(loras)
    for tower in towers:
        nf4_module(f"train.towers.{tower}.lora.quantize_base")
    targets, kept = nf4_targets(model, loras, shards)
    device = torch.device(device)
    for block, path, module, _ in targets:
        _hold_in_nf4(block, path, module, _nf4_of(module.weight, dtype, device))
    names = [name for *_, name in targets]
    if kept:
        log.info("QLoRA: %d linears stay in %s (torchao's NF4 needs a multiple of %d values "
                 "per rank), e.g. %s", len(kept), dtype, NF4_BLOCK * NF4_SCALER_BLOCK,
                 kept[0])  # fmt: skip
    if towers:
        log.info("QLoRA: %d frozen linear weights held in NF4 (towers %s)", len(names),
                 ", ".join(towers))  # fmt: skip
    _leave_out_of_state_dict(model, names)
    return names


def nf4_targets(
    model: nn.Module, loras: Mapping[str, object], shards: int = 1
) -> tuple[list[tuple[nn.Module, str, nn.Module, str]], list[str]]:
    """What `quantize_frozen_linears` quantises, changing nothing: (block, path in the block,
    module, weight's full name) of each frozen block linear of a quantised tower, and the
    names of those torchao cannot split over `shards` ranks (kept in the compute dtype)."""
    targets, kept = [], []
    for tower in quantised_towers(loras):
        view = model.towers[tower]
        for index, block in enumerate(view.blocks):
            # A hub model's tower names its blocks by their transformers path (models/hub/).
            prefix = (
                view.block_name(index)
                if hasattr(view, "block_name")
                else (f"towers.{tower}.blocks.{index}.")
            )
            for path, module in list(block.named_modules()):
                weight = getattr(module, "weight", None)
                if not _is_frozen_linear(module, weight):
                    continue
                if quantizable(weight.shape, shards):
                    targets.append((block, path, module, f"{prefix}{path}.weight"))
                else:
                    kept.append(prefix + path)
    return targets, kept


def _is_frozen_linear(module: nn.Module, weight: object) -> bool:
    """A plain linear, or an adapter wrapper's base (a module listing ADAPTER_PARAMETERS, as
    LoraLinear does), whose weight does not train."""
    if not isinstance(weight, nn.Parameter) or weight.requires_grad or is_quantised(weight):
        return False
    return type(module) is nn.Linear or hasattr(module, "ADAPTER_PARAMETERS")


def _hold_in_nf4(block: nn.Module, path: str, module: nn.Module, weight: nn.Parameter) -> None:
    if type(module) is nn.Linear:
        parent_name, _, leaf = path.rpartition(".")
        setattr(block.get_submodule(parent_name), leaf, NF4Linear(module, weight))
    else:
        module.weight = weight


def _nf4_of(weight: Tensor, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """The NF4 parameter of `weight` (real: quantised on `device`; meta: a placeholder of the
    right parts, its shared scale mean and grid already on `device`)."""
    to_nf4 = nf4_module().to_nf4
    if weight.is_meta:
        nf4 = to_nf4(torch.empty(weight.shape, dtype=dtype, device="meta"))
        nf4.scaler_mean = torch.zeros((), dtype=dtype, device=device)
        nf4.nf4 = _nf4_grid(dtype, device)
    else:
        nf4 = to_nf4(weight.detach().to(device=device, dtype=dtype).contiguous())
    return nn.Parameter(nf4, requires_grad=False)


def _nf4_grid(dtype: torch.dtype, device: torch.device) -> Tensor:
    """torchao's 16 normal-float values, as its quantisation makes them (not copied here)."""
    one_block = torch.ones(NF4_BLOCK * NF4_SCALER_BLOCK, dtype=dtype, device=device)
    return nf4_module().to_nf4(one_block).nf4


def own_blocks_in_shards(model: nn.Module) -> None:
    """Make each NF4 shard of `model` (FSDP2, once given memory) count its own blocks: torchao's
    row split keeps the whole tensor's count, so the shard's `copy_` of float rows (a random
    init drawing into every parameter, models/materialize.py) would never match its layout.
    The all-gather does not read the count; `copy_full_nf4_` then sets the true values. (The
    DTensor's own local tensor: `to_local()` may hand out a new wrapper of it each call.)"""
    for param in model.parameters():
        if is_quantised(param) and is_sharded(param):
            local = param._local_tensor
            local.n_blocks = local.quantized_scalers.numel()


@torch.no_grad()
def copy_full_nf4_(param: Tensor, full: Tensor) -> None:
    """Set an NF4 parameter (a shard or not) to the quantisation of the full value `full` (a
    float tensor, or already NF4): the whole tensor is quantised once, then this rank keeps
    its rows, so its scales' mean is the one every rank shares."""
    local = param.to_local() if is_sharded(param) else param
    if not is_quantised(full):
        full = nf4_module().to_nf4(full.to(device=local.device, dtype=local.dtype).contiguous())
    if is_sharded(param):
        mesh = param.device_mesh
        full = torch.chunk(full, mesh.size())[mesh.get_local_rank()]
    for part in NF4_PARTS:
        getattr(local, part).copy_(getattr(full, part))


# ----------------------------------------------------------------------------- state dicts
def _leave_out_of_state_dict(model: nn.Module, names: list[str]) -> None:
    """`model.state_dict()` without the NF4 weights, and `load_state_dict` that does not miss
    them: they come from `init`, not from checkpoints (a QLoRA checkpoint holds the adapters
    and what else the run has, never the 4-bit base)."""
    if not names:
        return
    model.register_state_dict_post_hook(functools.partial(_drop_names, frozenset(names)))
    model.register_load_state_dict_post_hook(functools.partial(_forgive_names, frozenset(names)))


def _drop_names(names: frozenset[str], module, state_dict, prefix, local_metadata) -> None:
    for name in names:
        state_dict.pop(prefix + name, None)


def _forgive_names(names: frozenset[str], module, incompatible_keys) -> None:
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if key not in names]


def full_dequantised_weight(param: Tensor) -> Tensor:
    """The whole dequantised value of an NF4 parameter on the CPU: a shard dequantises its own
    rows and the ranks gather them (a collective every rank must call)."""
    if is_sharded(param):
        from torch.distributed.tensor import DTensor

        rows = param.to_local().get_original_weight()
        whole = DTensor.from_local(
            rows, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
        return whole.full_tensor().cpu()
    return param.detach().get_original_weight().cpu()


__all__ = [
    "NF4Linear",
    "copy_full_nf4_",
    "dequantised",
    "full_dequantised_weight",
    "is_quantised",
    "nf4_linear",
    "nf4_targets",
    "own_blocks_in_shards",
    "quantizable",
    "quantize_frozen_linears",
    "quantised_towers",
]
