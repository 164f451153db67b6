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
- AdamW's weight decay, betas and eps left out of a config take the defaults of the
  workload's anchor (`WORKLOAD_DEFAULTS`), filled in once at the start of a run
  (`resolve_optimizer_defaults`), so the run's config.yaml records what it trained with.
- The run's learning rate (`lr` in metrics.jsonl, the progress line) is its main tower's
  (`main_lr`): a language model's decoder, else the tower with the most trainable parameters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mmtrain.config import TowerTrainConfig, TrainConfig
from mmtrain.spec import DECODER_TOWER, ModelSpec
from mmtrain.structured import FieldError, closest
from mmtrain.train.lora import is_adapter

log = logging.getLogger(__name__)

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


# ----------------------------------------------------------------------------- defaults
@dataclass(frozen=True)
class OptimizerDefaults:
    """AdamW's settings a workload's anchor trains with when its user sets none."""

    weight_decay: float
    betas: tuple[float, float]
    eps: float
    source: str  # whose defaults these are (the start log names them)


WORKLOAD_DEFAULTS: dict[str, OptimizerDefaults] = {
    # transformers' TrainingArguments (weight_decay 0.0, adam_beta1 0.9, adam_beta2 0.999,
    # adam_epsilon 1e-8): what LLaMA-Factory's and LLaVA's fine-tuning scripts train with.
    "language model": OptimizerDefaults(
        0.0, (0.9, 0.999), 1e-8, "transformers' TrainingArguments, as LLaMA-Factory and LLaVA"
    ),
    # OpenCLIP's training defaults (open_clip_train/params.py: --wd 0.2; for ViT models beta1
    # 0.9, beta2 0.98, eps 1e-6, the CLIP paper's): every tower here is a transformer.
    "contrastive model": OptimizerDefaults(0.2, (0.9, 0.98), 1e-6, "OpenCLIP's for ViT models"),
    # diffusers' training scripts (examples/text_to_image and the others: --adam_weight_decay
    # 1e-2, --adam_beta1 0.9, --adam_beta2 0.999, --adam_epsilon 1e-08).
    "denoiser": OptimizerDefaults(1e-2, (0.9, 0.999), 1e-8, "diffusers' training scripts"),
}
OPTIMIZER_FIELDS = ("weight_decay", "betas", "eps")


def workload(spec: ModelSpec) -> str:
    """The key of `WORKLOAD_DEFAULTS` for a model: a decoder LM (with or without vision) is a
    language model, a DiT a denoiser; towers with pairs or a fusion head a contrastive model."""
    if spec.is_language_model():
        return "language model"
    if spec.is_generator():
        return "denoiser"
    return "contrastive model"


def resolve_optimizer_defaults(config: TrainConfig, spec: ModelSpec) -> list[str]:
    """Fill the AdamW settings `config` leaves out (null) with `spec`'s workload defaults, in
    place, and say so in the log; returns the fields filled. Explicit values are kept (a
    tower's `weight_decay` overrides the run's either way)."""
    kind = workload(spec)
    defaults = WORKLOAD_DEFAULTS[kind]
    filled = [name for name in OPTIMIZER_FIELDS if getattr(config, name) is None]
    for name in filled:
        setattr(config, name, getattr(defaults, name))
    if filled:
        log.info("%s left out: the defaults of a %s (%s)",
                 ", ".join(f"train.{name}" for name in filled), kind, defaults.source)  # fmt: skip
    return filled


def _require_resolved(config: TrainConfig, fields: Sequence[str] = OPTIMIZER_FIELDS) -> None:
    missing = [f"train.{name}" for name in fields if getattr(config, name) is None]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not resolved: call resolve_optimizer_defaults(config, spec) "
            "before building the optimizer"
        )


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
    _require_resolved(config, ("weight_decay",))  # what the groups take of the three
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
    """AdamW over `param_groups`; fused kernels on CUDA (the same maths, fewer launches). Its
    effective settings go to the log: what the run trains with, whatever the config left out."""
    _require_resolved(config)
    optimizer = torch.optim.AdamW(
        param_groups(model, config),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        fused=device.type == "cuda",
    )
    log.info("%s", describe_optimizer(optimizer.param_groups, config))
    return optimizer


def describe_optimizer(groups: Sequence[Mapping], config: TrainConfig) -> str:
    """One line: AdamW's peak learning rate and weight decay per tower, betas, eps, schedule."""
    lrs = tower_values(groups, "lr")
    decays = tower_values([g for g in groups if g["name"].endswith("/decay")], "weight_decay")
    betas = ", ".join(f"{b:g}" for b in config.betas)
    schedule = f"{config.schedule} schedule"
    if config.schedule == "cosine":
        schedule += f" down to {config.min_lr:g}"
    warmup = config.warmup_steps
    schedule += f" after {warmup} warm-up steps" if warmup else ", no warm-up"
    return (
        f"optimizer AdamW: lr {per_tower(lrs)}; weight decay "
        f"{per_tower(decays, config.weight_decay)} (none on norms, biases, embeddings); "
        f"betas ({betas}); eps {config.eps:g}; {schedule}"
    )


def per_tower(values: Mapping[str, float], usual: float | None = None, style: str = "g") -> str:
    """`0.001` when every tower has the same value; else the usual one (`usual`, or the
    commonest) and the towers that differ beside it: `0.05 (image 0.3)`."""
    if not values:
        return format(usual, style) if usual is not None else "-"
    counts = list(values.values())
    first = usual if usual in counts else max(counts, key=counts.count)
    others = [f"{name} {value:{style}}" for name, value in values.items() if value != first]
    return format(first, style) + (f" ({', '.join(others)})" if others else "")


# ----------------------------------------------------------------------------- the run's lr
def tower_of(group_name: str) -> str:
    """The tower a parameter group belongs to ("image/block3/decay" -> "image"; "head")."""
    return group_name.split("/", 1)[0]


def tower_values(groups: Sequence[Mapping], key: str) -> dict[str, float]:
    """The largest `key` of each tower's groups, in group order: with layer-wise decay (factors
    at most 1) a tower's lr is its output layers'."""
    values: dict[str, float] = {}
    for group in groups:
        tower = tower_of(group["name"])
        values[tower] = max(values.get(tower, group[key]), group[key])
    return values


def row_tower_lrs(row: Mapping[str, object]) -> dict[str, float]:
    """Each tower's learning rate from a metrics row's `lr/GROUP` keys (as `tower_values`)."""
    groups = [{"name": k[len("lr/") :], "lr": v} for k, v in row.items() if k.startswith("lr/")]
    return tower_values(groups, "lr")


def main_tower(groups: Sequence[Mapping], spec: ModelSpec) -> str:
    """The tower whose learning rate is the run's: a language model's decoder when it trains,
    else the tower (or "head") with the most trainable parameters."""
    sizes: dict[str, int] = {}
    for group in groups:
        tower = tower_of(group["name"])
        sizes[tower] = sizes.get(tower, 0) + sum(p.numel() for p in group["params"])
    if spec.is_language_model() and DECODER_TOWER in sizes:
        return DECODER_TOWER
    return max(sizes, key=sizes.__getitem__)


def main_lr(groups: Sequence[Mapping], spec: ModelSpec) -> float:
    """The run's learning rate now: its main tower's (`main_tower`)."""
    return tower_values(groups, "lr")[main_tower(groups, spec)]


def parameter_counts(model: nn.Module) -> str:
    """The model's size as the start log gives it: `12.3M trainable, 7.0B frozen parameters`
    (a parameter FSDP shards counts whole)."""
    trainable = frozen = 0
    for param in model.parameters():
        if param.requires_grad:
            trainable += param.numel()
        else:
            frozen += param.numel()
    return f"{_count(trainable)} trainable, {_count(frozen)} frozen parameters"


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


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


# What a resume takes from the run's config instead of the checkpoint, when the config changed
# it: AdamW's settings per group, the learning rates (the schedule's base rates), and the
# schedule's shape (its factor at the resumed step).
RESUME_SETTINGS = ("weight_decay", "betas", "eps")
LR_KEYS = ("lr", "lr_layer_decay")
SCHEDULE_KEYS = ("train.steps", "train.warmup_steps", "train.min_lr", "train.schedule")


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's learning rate and AdamW settings as the config made them (before a
    checkpoint's state is loaded over them)."""
    return [{k: g[k] for k in ("lr", *RESUME_SETTINGS)} for g in optimizer.param_groups]


def apply_changed_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    configured: list[dict[str, Any]],
    changed: Sequence[str],
    lr_factor: float = 1.0,
) -> list[str]:
    """After a resume loaded the checkpoint's optimizer and schedule (which carry the rates and
    AdamW settings the run started with), put back what the config now changes (`changed`:
    dotted keys of `train`): a weight decay, betas or eps; the learning rates, rebased on the
    config's times `lr_factor` (the rollbacks' reductions so far); and, for either of those or
    a changed schedule (steps, warm-up, min_lr), each group's rate at the resumed step as the
    config's schedule has it (`scheduler.lr_lambdas`: the config's, a checkpoint keeps none),
    as `scheduler.step()` computes it. The checkpoint's rate is the old schedule's: at the end
    of a cosine, 0. Nothing changed: nothing touched, so a resume stays bitwise exact. Returns
    what was applied."""
    applied = []
    for name in RESUME_SETTINGS:
        if any(key == f"train.{name}" or key.endswith(f".{name}") for key in changed):
            for group, wanted in zip(optimizer.param_groups, configured, strict=True):
                group[name] = wanted[name]
            applied.append(name)
    rates = any(key == "train.lr" or key.rsplit(".", 1)[-1] in LR_KEYS for key in changed)
    if rates:
        scheduler.base_lrs = [wanted["lr"] * lr_factor for wanted in configured]
        for group, lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["initial_lr"] = lr
        applied.append("lr")
    reshaped = any(key in SCHEDULE_KEYS for key in changed)
    if rates or reshaped:
        step = scheduler.last_epoch
        groups = zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        for group, base, factor in groups:
            group["lr"] = base * factor(step)
        if reshaped:
            applied.append("the schedule")
    return applied


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
