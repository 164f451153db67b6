"""Optimizer and learning-rate schedule: parameter groups per tower, freezing, warmup + cosine.

- Each tower gets its own groups, so `train.towers.image.lr` can give the vision tower a smaller
  learning rate than the text tower (common when fine-tuning a pretrained encoder).
- No weight decay on 1-D parameters (norm weights, biases), embeddings (token tables, position
  and class embeddings, learned queries) and the logit scale/bias: decaying them pulls
  temperatures and positions towards zero for no regularisation benefit.
- Frozen parameters (`freeze`, `freeze_blocks`, `unlocked_blocks`, the base of a `lora`
  tower) get `requires_grad=False` and stay out of the optimizer entirely (no state, no decay).
  A frozen block is frozen whole: its norms too.
- `lr_layer_decay` (BEiT, Bao et al. 2021; timm's `param_groups_layer_decay`): within a tower
  of L blocks, the stem (and norm_pre) is layer 0, block i is layer i + 1, and norm_final,
  pooling and projection are layer L + 1; layer l gets the tower's lr x decay^(L + 1 - l). So
  the output layers keep the tower's lr, the last block gets lr x decay, the first block
  lr x decay^L and the stem lr x decay^(L + 1). Adapters of a LoRA tower follow their block.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from mmtrain.config import TowerTrainConfig, TrainConfig
from mmtrain.structured import FieldError, closest
from mmtrain.train.lora import is_adapter

# Parameters registered directly on a module (not inside Linear/Conv) that are embeddings.
EMBEDDING_NAMES = frozenset(
    {
        "pos_embed",
        "pos_spatial",
        "pos_temporal",
        "cls_token",
        "probe",
        "queries",
        "logit_scale",
        "logit_bias",
    }
)
GROUP_OTHER = "head"  # logit scale/bias, fusion head: everything outside the towers


def freeze_parameters(model: nn.Module, config: TrainConfig) -> int:
    """Apply `train.towers.NAME.freeze` / `freeze_blocks` / `unlocked_blocks` / `lora` (the
    tower's own weights; apply_lora has added the adapters already); return the number of
    frozen parameters in the model."""
    towers = model.towers
    for name, tower_config in config.towers.items():
        if name not in towers:
            raise FieldError(
                f"train.towers.{name}",
                f"the model has no tower {name!r}{closest(name, towers)}; towers: {', '.join(towers)}",
            )
        for param in _frozen_by(towers[name], tower_config, f"train.towers.{name}"):
            param.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def _frozen_by(tower: nn.Module, tc: TowerTrainConfig, path: str) -> list[nn.Parameter]:
    """The parameters of `tower` that `tc` freezes."""
    if tc.freeze:
        return list(tower.parameters())
    if tc.lora is not None:
        return [p for n, p in tower.named_parameters() if not is_adapter(n)]
    layers = len(tower.blocks)
    if tc.unlocked_blocks is not None:
        _check_blocks(f"{path}.unlocked_blocks", tc.unlocked_blocks, layers)
        count = layers - tc.unlocked_blocks
    elif tc.freeze_blocks:
        _check_blocks(f"{path}.freeze_blocks", tc.freeze_blocks, layers)
        count = tc.freeze_blocks
    else:
        return []
    # The stem feeds the frozen blocks: training it alone would shift their inputs.
    modules = [*_input_modules(tower), *tower.blocks[:count]]
    return [p for module in modules for p in module.parameters()]


DEFAULT_INPUT_MODULES = ("stem", "norm_pre", "embed")


def _input_names(tower: nn.Module) -> tuple[str, ...]:
    """What runs before a tower's first block: an encoder's stem and pre-norm, a decoder LM's
    token embedding, or what the tower names (`INPUT_MODULES`: a DiT's patch embedding,
    timestep MLP and class table)."""
    return getattr(tower, "INPUT_MODULES", DEFAULT_INPUT_MODULES)


def _input_modules(tower: nn.Module) -> list[nn.Module]:
    names = _input_names(tower)
    return [getattr(tower, n) for n in names if getattr(tower, n, None) is not None]


def _check_blocks(path: str, value: int, layers: int) -> None:
    if value > layers:
        raise FieldError(path, f"{value} is more than the tower's {layers} blocks")


def _no_decay(module: nn.Module, leaf: str, param: nn.Parameter) -> bool:
    return param.ndim < 2 or isinstance(module, nn.Embedding) or leaf in EMBEDDING_NAMES


def _layer_of(name: str, layers: int, inputs: tuple[str, ...]) -> tuple[int, str]:
    """(layer, label) of a tower parameter by its name inside the tower: what runs before the
    blocks (`inputs`) is layer 0, block i layer i + 1, everything after the blocks layer L + 1."""
    first, _, rest = name.partition(".")
    if first in inputs:
        return 0, "stem"
    if first == "blocks":
        index = int(rest.partition(".")[0])
        return index + 1, f"block{index}"
    return layers + 1, "out"


def _tower_lrs(model: nn.Module, config: TrainConfig) -> dict[int, tuple[str, str, float]]:
    """For every tower parameter: (tower, group label, learning rate), by id."""
    found = {}
    for tower_name, tower in model.towers.items():
        overrides = config.towers.get(tower_name)
        lr = overrides.lr if overrides is not None and overrides.lr is not None else config.lr
        decay = overrides.lr_layer_decay if overrides is not None else None
        layers = len(tower.blocks)
        for name, param in tower.named_parameters():
            if decay is None:
                found[id(param)] = (tower_name, tower_name, lr)
                continue
            layer, label = _layer_of(name, layers, _input_names(tower))
            found[id(param)] = (
                tower_name,
                f"{tower_name}/{label}",
                lr * decay ** (layers + 1 - layer),
            )
    return found


def param_groups(model: nn.Module, config: TrainConfig) -> list[dict]:
    """AdamW parameter groups: per tower (and "head" for the rest) x decay / no decay, and per
    layer of a tower with `lr_layer_decay` ("image/block3/decay").

    Each group carries `name` (e.g. "image/decay") for logging. Only trainable parameters.
    """
    groups: dict[str, dict] = {}
    tower_lrs = _tower_lrs(model, config)
    seen: set[int] = set()
    for module in model.modules():
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            owner, label, lr = tower_lrs.get(id(param), (GROUP_OTHER, GROUP_OTHER, config.lr))
            overrides = config.towers.get(owner)
            decay = config.weight_decay
            if overrides is not None and overrides.weight_decay is not None:
                decay = overrides.weight_decay
            no_decay = _no_decay(module, leaf, param)
            key = f"{label}/{'no_decay' if no_decay else 'decay'}"
            group = groups.setdefault(
                key,
                {"name": key, "params": [], "lr": lr, "weight_decay": 0.0 if no_decay else decay},
            )
            group["params"].append(param)
    if not groups:
        raise FieldError("train.towers", "every parameter is frozen: nothing to train")
    return list(groups.values())


def make_optimizer(
    model: nn.Module, config: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW over `param_groups`; fused kernels on CUDA (the same maths, fewer launches)."""
    return torch.optim.AdamW(
        param_groups(model, config),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        fused=device.type == "cuda",
    )


def lr_factor(config: TrainConfig) -> Callable[[int], float]:
    """Multiplier of each group's base LR at optimizer step `step` (0-based): linear warmup from
    1/warmup to 1, then cosine down to min_lr/lr at the last step, or constant."""
    warmup, total = config.warmup_steps, config.steps
    floor = config.min_lr / config.lr if config.lr > 0 else 0.0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        decay_steps = max(1, total - warmup)
        progress = min(1.0, (step - warmup) / decay_steps)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def make_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_factor`; its state_dict holds only numbers (weights_only-loadable)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config))


def scale_learning_rates(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, factor: float
) -> None:
    """Multiply every group's learning rate, now and for the rest of the schedule, by `factor`
    (after a rollback). The schedule's base rates live in its state_dict, so checkpoints written
    afterwards, and runs resumed from them, keep the lower rates."""
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
