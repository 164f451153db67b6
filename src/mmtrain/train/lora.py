"""LoRA (Hu et al. 2021): low-rank adapters on the linear layers of a tower's blocks.

A targeted `nn.Linear` (y = W x + b) becomes a `LoraLinear` computing

    y = W x + b + (alpha / rank) * B (A dropout(x)),   A: [rank, in], B: [out, rank]

with W and b frozen. A starts kaiming-uniform (as `nn.Linear` initialises its weight) from an
explicit generator, B at zero, so at step 0 the model is exactly the base model.

- Targets (`train.towers.NAME.lora.targets`): "attn" = `attn.qkv` and `attn.out`, "mlp" =
  `mlp.fc1` and `mlp.fc2`, in every block of the tower; both by default, which is what the
  planner counts (`plan/model.py`, `Stack.lora_params`). The tower's other weights (stem,
  norms, pooling, projection) are frozen too: only the adapters of a LoRA tower train.
- Names: the wrapper keeps `weight` and `bias` under the linear's own name and adds
  `lora_a` / `lora_b` beside them (`towers.image.blocks.0.attn.qkv.lora_a`), so the base
  weights load by their usual names and a LoRA run's checkpoints resume with their adapters.
- Dropout on the adapter input uses torch's RNG, whose state every checkpoint saves per rank,
  so a resumed CPU run draws the same masks as an uninterrupted one.
- `merge_lora` / `merge_lora_state` fold the adapters into plain weights, W + scale B A
  (computed in float64, then rounded once to the wider of W's and the adapters' dtypes: a
  base held in bf16 or NF4 merges into an fp32 weight, so the update keeps the precision it
  trained in), for a model `mmtrain.load_model` reads.
- QLoRA (`quantize_base: nf4`, train/qlora.py): the base weight is an NF4 tensor, the forward
  dequantises it per call (`nf4_linear`), the merge dequantises it first.
- `save_lora` writes the adapters alone as safetensors, their settings in the metadata;
  `load_lora` reads them back.

Apply LoRA before compile, activation checkpointing and DDP/FSDP (train/parallel.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.atomic import atomic_write_bytes
from mmtrain.config import LoraConfig, TrainConfig
from mmtrain.models.materialize import copy_full_
from mmtrain.structured import FieldError, closest
from mmtrain.train.qlora import dequantised, is_quantised, nf4_linear

ADAPTER_NAMES = ("lora_a", "lora_b")
# Which linears of a block each target adapts (names inside `Block`, models/layers.py).
TARGET_LAYERS = {"attn": ("attn.qkv", "attn.out"), "mlp": ("mlp.fc1", "mlp.fc2")}
LORA_FILE = "lora.safetensors"  # in a run folder, beside the merged model.safetensors
METADATA_KEY = "mmtrain_lora"  # safetensors metadata: JSON {"towers": {name: LoraConfig}}


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module docstring).

    Adopts `base`'s weight and bias (the same Parameter objects, so nothing is copied and the
    names stay `weight` / `bias`); `target` ("attn" or "mlp") is recorded for `lora_configs`.
    """

    ADAPTER_PARAMETERS = ADAPTER_NAMES  # drawn by `reset_adapters`, not the model's init

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, target: str = ""
    ):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.dropout, self.target = rank, alpha, dropout, target
        self.scale = alpha / rank
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        like = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, **like))

    @torch.no_grad()
    def reset_adapters(self, generator: torch.Generator) -> None:
        """A ~ kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), drawn on the CPU in
        float32 from `generator` (the same values on any device); B = 0."""
        a = torch.empty(self.lora_a.shape)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        copy_full_(self.lora_a, a)  # the same values whether lora_a is a shard or not
        self.lora_b.zero_()

    def use_base_linear(self, linear: nn.Module) -> None:
        """Compute the frozen base's matmul through `linear` (e.g. torchao's fp8 training
        linear) on this module's own weight and bias. It is held outside the module tree, so
        parameter names, checkpoints and FSDP's units do not change."""
        object.__setattr__(self, "_base_linear", linear)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.__dict__.get("_base_linear")
        if linear is None:
            if is_quantised(self.weight):  # QLoRA's 4-bit base
                return nf4_linear(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        # This module's parameters as they are now (FSDP swaps in the gathered ones per call).
        linear.weight, linear.bias = self.weight, self.bias
        return linear(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        if self.__dict__.get("_disabled"):  # the base model alone (`adapters_disabled`)
            return y
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return y + self.scale * F.linear(F.linear(h, self.lora_a), self.lora_b)

    def merged_weight(self) -> torch.Tensor:
        return merged(self.weight, self.lora_a, self.lora_b, self.scale)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}"
        )


def merged(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """W + scale B A, summed in float64 and rounded once, to the wider of W's dtype and the
    adapters' (W dequantised first when it is NF4): a base held in the compute dtype (bf16)
    or in 4 bits merges into a weight of the adapters' precision (fp32)."""
    base = dequantised(weight.detach())
    dtype = torch.promote_types(base.dtype, lora_a.dtype)
    update = lora_b.detach().double() @ lora_a.detach().double()
    return (base.double() + scale * update).to(dtype)


def is_adapter(name: str) -> bool:
    """True for the parameter name of an adapter (`...attn.qkv.lora_a`)."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


def adapter_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a state dict (by full name)."""
    return {name: value for name, value in state.items() if is_adapter(name)}


def lora_towers(config: TrainConfig) -> dict[str, LoraConfig]:
    """The towers `train.towers.NAME.lora` adapts, with their settings."""
    return {name: t.lora for name, t in config.towers.items() if t.lora is not None}


# ----------------------------------------------------------------------------- applying
def apply_lora(
    model: nn.Module, loras: Mapping[str, LoraConfig] | TrainConfig, *, seed: int = 0
) -> int:
    """Wrap the targeted linears of each named tower in `LoraLinear` and freeze the rest of
    that tower, in place; returns the number of adapter parameters added.

    Adapters are initialised in tower order, block order, then `TARGET_LAYERS` order, from one
    generator seeded with `seed`: a pure function of the seed, whatever the device.
    """
    if isinstance(loras, TrainConfig):
        loras = lora_towers(loras)
    towers = model.towers
    for name in loras:
        if name not in towers:
            raise FieldError(
                f"train.towers.{name}.lora",
                f"the model has no tower {name!r}{closest(name, towers)}; towers: {', '.join(towers)}",
            )
    generator = torch.Generator().manual_seed(seed)
    added = 0
    for name, tower in towers.items():
        if name in loras:
            tower.requires_grad_(False)
    for block, path, lora, target in _targets(model, loras):
        added += _wrap(block, path, lora, target, generator)
    return added


def reset_lora_adapters(model: nn.Module, loras: Mapping[str, LoraConfig], *, seed: int) -> None:
    """Draw every adapter again exactly as `apply_lora(model, loras, seed=seed)` drew it: for a
    model built on the meta device, once its (sharded) parameters have memory."""
    generator = torch.Generator().manual_seed(seed)
    for block, path, _, _ in _targets(model, loras):
        block.get_submodule(path).reset_adapters(generator)


def _targets(model: nn.Module, loras: Mapping[str, LoraConfig]):
    """(block, linear path, LoRA config, target) of every adapted linear, in the order the
    adapters are drawn: tower order of the model (not the config's), block, TARGET_LAYERS."""
    for name, tower in model.towers.items():
        if name not in loras:
            continue
        # A hub model's tower names its blocks' linears itself (models/hub/towers.py).
        paths = getattr(tower, "lora_paths", lambda block, target: TARGET_LAYERS[target])
        for block in tower.blocks:
            for target in loras[name].targets:
                for path in paths(block, target):
                    yield block, path, loras[name], target


def _alpha(lora: LoraConfig) -> float:
    return float(lora.alpha) if lora.alpha is not None else float(lora.rank)


def _wrap(
    block: nn.Module, path: str, lora: LoraConfig, target: str, generator: torch.Generator
) -> int:
    parent_name, _, leaf = path.rpartition(".")
    parent = block.get_submodule(parent_name)
    base = getattr(parent, leaf)
    if isinstance(base, LoraLinear):
        raise ValueError(f"LoRA is already applied to {path} of this model")
    wrapped = LoraLinear(base, lora.rank, _alpha(lora), lora.dropout, target)
    wrapped.reset_adapters(generator)
    setattr(parent, leaf, wrapped)
    return wrapped.lora_a.numel() + wrapped.lora_b.numel()


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Every LoraLinear of `model` by its qualified name (`towers.image.blocks.0.attn.qkv`)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block every LoRA linear of `model` computes its frozen base alone (DPO's
    reference model, train/dpo.py); the adapters are back after it."""
    modules = list(lora_modules(model).values())
    for module in modules:
        object.__setattr__(module, "_disabled", True)
    try:
        yield
    finally:
        for module in modules:
            object.__setattr__(module, "_disabled", False)


def lora_scales(model: nn.Module) -> dict[str, float]:
    """alpha / rank of every LoraLinear, by its qualified name (for `merge_lora_state`)."""
    return {name: m.scale for name, m in lora_modules(model).items()}


def lora_configs(model: nn.Module) -> dict[str, LoraConfig]:
    """The LoRA settings of each adapted tower, read back from its LoraLinear modules."""
    found: dict[str, LoraConfig] = {}
    for name, module in lora_modules(model).items():
        tower = name.split(".")[1]  # towers.NAME.blocks...
        config = found.setdefault(
            tower, LoraConfig(module.rank, module.alpha, module.dropout, targets=[])
        )
        if module.target not in config.targets:
            config.targets.append(module.target)
    return found


# ----------------------------------------------------------------------------- merging
def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone, by full name, detached on the CPU."""
    return {
        name: value.detach().to("cpu", copy=True)
        for name, value in model.state_dict().items()
        if is_adapter(name)
    }


def merge_lora_state(
    state: Mapping[str, torch.Tensor], scales: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    """A state dict with adapters -> the plain model's state dict (adapters folded into their
    weights, `lora_*` keys gone). `scales` from `lora_scales(model)`; works on gathered
    FSDP/DDP state dicts, whose names are the plain model's."""
    out = {name: value for name, value in state.items() if not is_adapter(name)}
    for prefix, scale in scales.items():
        weight = f"{prefix}.weight"
        out[weight] = merged(
            state[weight], state[f"{prefix}.lora_a"], state[f"{prefix}.lora_b"], scale
        )
    return out


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoraLinear of `model` by a plain `nn.Linear` holding W + scale B A, in
    place (returns `model`): the result has the base model's parameter names and shapes. The
    merged layers' parameters keep the base's `requires_grad` (False)."""
    for name, module in lora_modules(model).items():
        parent_name, _, leaf = name.rpartition(".")
        plain = nn.Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device="meta",
        )
        plain.weight = nn.Parameter(module.merged_weight(), requires_grad=False)
        if module.bias is not None:  # in the merged weight's dtype (a bf16-held base's is not)
            bias = module.bias.detach().to(plain.weight.dtype)
            plain.bias = nn.Parameter(bias, requires_grad=module.bias.requires_grad)
        plain.train(module.training)
        setattr(model.get_submodule(parent_name), leaf, plain)
    return model


# ----------------------------------------------------------------------------- files
def save_lora(model: nn.Module, path: str | Path) -> Path:
    """Write the adapters of `model` (a plain, unsharded module) to `path` as safetensors, with
    their settings in the metadata; atomically."""
    return write_lora_file(lora_state_dict(model), lora_configs(model), path)


def write_lora_file(
    adapters: Mapping[str, torch.Tensor], configs: Mapping[str, LoraConfig], path: str | Path
) -> Path:
    """`save_lora` from tensors already gathered (e.g. rank 0's copy of FSDP weights). The
    metadata records alpha resolved (alpha = rank when the config left it null)."""
    path = Path(path)
    settings = {
        name: {"rank": c.rank, "alpha": _alpha(c), "dropout": c.dropout, "targets": list(c.targets)}
        for name, c in configs.items()
    }
    metadata = {"format": "pt", METADATA_KEY: json.dumps({"towers": settings}, sort_keys=True)}
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in adapters.items()}
    atomic_write_bytes(path, safetensors.torch.save(tensors, metadata=metadata))
    return path


def load_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, LoraConfig]]:
    """(adapters by name, settings by tower) of a file `save_lora` wrote."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
    if METADATA_KEY not in metadata:
        raise FieldError(str(path), "holds no LoRA settings (not written by mmtrain's save_lora)")
    towers = json.loads(metadata[METADATA_KEY])["towers"]
    return tensors, {name: LoraConfig(**values) for name, values in towers.items()}
