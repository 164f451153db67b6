"""Whether a run's newest checkpoint can be resumed under the config it is run with now.

Running the same command again resumes; running it with changed settings resumes too, and most
changes are what a user means (more steps, another learning rate, other data paths: the run
warns and goes on). Some settings decide which tensors the checkpoint holds or their shapes:
the model spec, the LoRA adapters (their presence, rank and targets), what is frozen (the
optimizer steps other parameters), per-layer learning rates (other parameter groups), an EMA
(its copy of the weights). Loading the checkpoint under other values of those fails deep in
`load_state_dict` with a size mismatch; `check_resumable` refuses them first, naming each
changed key with its old and new value.
"""

from __future__ import annotations

from typing import Any

from mmtrain.config import RunConfig, TowerTrainConfig
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError, to_dict

# Per-tower settings (train.towers.NAME.*) that change the trained parameters' set or shapes:
# compared by value, or (PRESENCE) only by whether they are set.
TOWER_FIXED = ("lora.rank", "lora.targets", "lora.quantize_base", "freeze", "freeze_blocks",
               "unlocked_blocks")  # fmt: skip
TOWER_PRESENCE = ("lora", "lr_layer_decay")
SPEC_IGNORED = ("name",)  # a spec renamed is the same model


def check_resumable(saved: dict[str, Any], config: RunConfig, spec: ModelSpec) -> None:
    """FieldError naming every setting that differs from the checkpoint's and changes its
    tensors. `saved`: the checkpoint's meta ({"config", "spec"}); `spec`: the model spec now."""
    old_config = saved.get("config")
    changes: list[tuple[str, Any, Any]] = []
    try:  # read as this version reads it: keys it adds get their defaults on both sides
        old_spec = ModelSpec.from_dict(saved["spec"]).to_dict()
    except (KeyError, TypeError, ValueError):
        old_spec = None  # an older checkpoint without its spec: the load itself will tell
    if old_spec is not None:
        new_spec = spec.to_dict()
        changes += [(f"model: {key}", a, b) for key, a, b in _spec_changes(old_spec, new_spec)]
    if isinstance(old_config, dict):
        changes += _train_changes(old_config.get("train") or {}, config.to_dict()["train"])
    if not changes:
        return
    listed = "; ".join(f"{key}: {_text(a)} -> {_text(b)}" for key, a, b in changes)
    first = changes[0][0].split(":")[0]
    raise FieldError(
        first,
        f"the checkpoint in {config.out} was trained with other settings that decide its "
        f"tensors ({listed}); a resume continues the same weights and optimizer state: start "
        "a new `out:`, or put the old value back",
    )


def _train_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    changes = []
    if (old.get("ema") is None) != (new.get("ema") is None):
        changes.append(("train.ema", old.get("ema"), new.get("ema")))
    old_towers, new_towers = old.get("towers") or {}, new.get("towers") or {}
    default = to_dict(TowerTrainConfig())  # a tower left out of `towers` has these
    for name in sorted(set(old_towers) | set(new_towers)):
        a = {**default, **(old_towers.get(name) or {})}
        b = {**default, **(new_towers.get(name) or {})}
        for key in TOWER_PRESENCE:
            if (a.get(key) is None) != (b.get(key) is None):
                changes.append((f"train.towers.{name}.{key}", a.get(key), b.get(key)))
        both_lora = a.get("lora") is not None and b.get("lora") is not None
        for key in TOWER_FIXED:
            if key.startswith("lora.") and not both_lora:
                continue  # adapters added or removed: named once, above
            before, after = _dotted(a, key), _dotted(b, key)
            if before != after:
                changes.append((f"train.towers.{name}.{key}", before, after))
    return changes


def _spec_changes(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) of the values that differ between two spec dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            if not prefix and key in SPEC_IGNORED:
                continue
            out += _spec_changes(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def _dotted(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


def _text(value: Any) -> str:
    return "unset" if value is None else str(value)
