"""Optimizer and learning-rate schedule: parameter groups per tower, freezing, warmup + cosine.

- Each tower gets its own groups, so `train.towers.image.lr` can give the vision tower a smaller
  learning rate than the text tower (common when fine-tuning a pretrained encoder).
- No weight decay on 1-D parameters (norm weights, biases), embeddings (token tables, position
  and class embeddings, learned queries) and the logit scale/bias: decaying them pulls
  temperatures and positions towards zero for no regularisation benefit.
- Frozen parameters (`freeze`, `freeze_blocks`) get `requires_grad=False` and stay out of the
  optimizer entirely (no state, no decay).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from mmtrain.config import TrainConfig
from mmtrain.structured import FieldError, closest

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
    """Apply `train.towers.NAME.freeze` / `freeze_blocks`; return the number of frozen parameters."""
    towers = model.towers
    frozen = 0
    for name, tower_config in config.towers.items():
        if name not in towers:
            raise FieldError(
                f"train.towers.{name}",
                f"the model has no tower {name!r}{closest(name, towers)}; towers: {', '.join(towers)}",
            )
        tower = towers[name]
        if tower_config.freeze:
            modules = [tower]
        elif tower_config.freeze_blocks:
            if tower_config.freeze_blocks > len(tower.blocks):
                raise FieldError(
                    f"train.towers.{name}.freeze_blocks",
                    f"{tower_config.freeze_blocks} is more than the tower's {len(tower.blocks)} blocks",
                )
            # The stem feeds the frozen blocks: training it alone would shift their inputs.
            modules = [tower.stem, *([tower.norm_pre] if tower.norm_pre is not None else [])]
            modules += list(tower.blocks[: tower_config.freeze_blocks])
        else:
            continue
        for module in modules:
            for param in module.parameters():
                if param.requires_grad:
                    param.requires_grad_(False)
                    frozen += param.numel()
    return frozen


def _no_decay(module: nn.Module, leaf: str, param: nn.Parameter) -> bool:
    return param.ndim < 2 or isinstance(module, nn.Embedding) or leaf in EMBEDDING_NAMES


def param_groups(model: nn.Module, config: TrainConfig) -> list[dict]:
    """AdamW parameter groups: per tower (and "head" for the rest) x decay / no decay.

    Each group carries `name` (e.g. "image/decay") for logging. Only trainable parameters.
    """
    groups: dict[str, dict] = {}
    tower_of = {}
    for tower_name, tower in model.towers.items():
        for param in tower.parameters():
            tower_of[id(param)] = tower_name
    seen: set[int] = set()
    for module in model.modules():
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            owner = tower_of.get(id(param), GROUP_OTHER)
            overrides = config.towers.get(owner)
            lr = overrides.lr if overrides is not None and overrides.lr is not None else config.lr
            decay = config.weight_decay
            if overrides is not None and overrides.weight_decay is not None:
                decay = overrides.weight_decay
            no_decay = _no_decay(module, leaf, param)
            key = f"{owner}/{'no_decay' if no_decay else 'decay'}"
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
