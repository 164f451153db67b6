"""LoRA adapters in PEFT's layout: a folder `peft.PeftModel.from_pretrained(base, folder)` loads
over the transformers model a run exports to (`formats/hf.py`), giving the merged export's
outputs.

The folder holds `adapter_config.json` (peft_type LORA, r, lora_alpha, the adapted modules by
their full names, rank_pattern / alpha_pattern where towers differ) and
`adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`,
the names PEFT's own `save_pretrained` writes. transformers and peft are never imported here.

Names come from the weight mapping itself, never a second table: an adapted linear's weight is
a key group of its family's map (`hf.export_groups`), whose HF tensors are that weight's rows
in order (q | k | v; gate | up). Each HF tensor's module gets the same A and the matching rows
of B, so B_i A is exactly the rows of B A the merged export adds to that module's weight. The
written key's module is then moved to where transformers 5 builds it (`hf.module_prefixes`).
A group that is not such a row split (a reshape, several tensors of ours) has no adapter
counterpart and is refused (NoHFCounterpart), as is a spec without a HF class.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
from torch import Tensor

from mmtrain.atomic import atomic_write_bytes, atomic_write_text, fsync_dir
from mmtrain.config import LoraConfig
from mmtrain.models.formats.hf import export_groups, module_prefixes
from mmtrain.models.formats.hf_common import NoHFCounterpart, is_hf_folder
from mmtrain.spec import ModelSpec

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # in a run folder, beside model.safetensors and lora.safetensors
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PeftModel's path to the transformers model
WEIGHT = ".weight"


@dataclass(frozen=True)
class AdaptedLinear:
    """One LoRA linear of ours and the transformers modules its rows are, in order."""

    ours: str  # `towers.text.blocks.0.attn.qkv`
    tower: str  # `text`
    modules: tuple[tuple[str, int], ...]  # (module path in transformers 5, rows)


def write_peft_adapter(
    spec: ModelSpec,
    adapters: Mapping[str, Tensor],
    configs: Mapping[str, LoraConfig],
    out_dir: str | Path,
    base_name: str | None,
) -> list[str]:
    """Write `adapters` (`lora_state_dict`'s names: `<linear>.lora_a` / `.lora_b`) with the
    settings of their towers (`configs`, by tower name) as a PEFT adapter folder, atomically:
    the files go into a temporary folder renamed over `out_dir`. Returns the transformers
    modules adapted. Raises NoHFCounterpart when the spec (or one of its adapted linears)
    has no transformers counterpart."""
    return write_adapter(
        spec, adapted_linears(spec, adapters), adapters, configs, out_dir, base_name
    )


def write_adapter(
    spec: ModelSpec,
    linears: list[AdaptedLinear],
    adapters: Mapping[str, Tensor],
    configs: Mapping[str, LoraConfig],
    out_dir: str | Path,
    base_name: str | None,
) -> list[str]:
    """`write_peft_adapter` once each adapted linear knows its transformers modules (a hub
    model's are its own modules: models/hub/)."""
    missing = sorted({a.tower for a in linears} - set(configs))
    if missing:
        raise ValueError(f"no LoRA settings for tower(s) {', '.join(missing)}")
    tensors = peft_tensors(linears, adapters)
    config = peft_config(spec, linears, configs, base_name)
    _write_folder(Path(out_dir), config, tensors)
    modules = [name for a in linears for name, _ in a.modules]
    log.info("wrote PEFT adapter %s (%d modules)", out_dir, len(modules))
    return modules


def peft_base_name(init: str | Mapping[str, str] | None) -> str | None:
    """`base_model_name_or_path` for a run started from `init`: the folder when it is a HF
    model folder (one path for the whole model), else None."""
    if isinstance(init, str) and is_hf_folder(init):
        return str(Path(init).resolve())
    return None


# ----------------------------------------------------------------------------- the mapping
def adapted_linears(spec: ModelSpec, adapters: Mapping[str, Tensor]) -> list[AdaptedLinear]:
    """Each adapted linear of `adapters` with its transformers modules, in `adapters`' order."""
    names = list(dict.fromkeys(name.rpartition(".")[0] for name in adapters))
    groups = {g.ours[0][0]: g for g in export_groups(spec) if len(g.ours) == 1}
    prefixes = module_prefixes(spec)
    linears = []
    for linear in names:
        for part in ("lora_a", "lora_b"):
            if f"{linear}.{part}" not in adapters:
                raise ValueError(f"{linear}.{part} is missing from the adapters")
        group = groups.get(linear + WEIGHT)
        if group is None:
            raise NoHFCounterpart(f"{linear}: no single HF tensor group holds its weight")
        rows = _row_split(linear, group.ours[0][1], group.theirs)
        modules = tuple(
            (_module_path(name.removesuffix(WEIGHT), prefixes), n)
            for (name, _), n in zip(group.theirs, rows, strict=True)
        )
        linears.append(AdaptedLinear(linear, linear.split(".")[1], modules))
    return linears


def _row_split(linear: str, ours: tuple[int, ...], theirs) -> list[int]:
    """The rows of each HF weight when together they are our weight's rows in order (the
    only layout in which B's rows split with A shared); NoHFCounterpart otherwise."""
    shapes = [shape for _, shape in theirs]
    split = (
        len(ours) == 2
        and all(name.endswith(WEIGHT) for name, _ in theirs)
        and all(len(s) == 2 and s[1] == ours[1] for s in shapes)
        and sum(s[0] for s in shapes) == ours[0]
    )
    if not split:
        raise NoHFCounterpart(
            f"{linear}: its HF weights {[n for n, _ in theirs]} are not a split of its rows"
        )
    return [s[0] for s in shapes]


def _module_path(written: str, prefixes: Mapping[str, str]) -> str:
    for prefix, module in prefixes.items():
        if written.startswith(prefix):
            return module + written[len(prefix) :]
    return written


def peft_tensors(linears: list[AdaptedLinear], adapters: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """PEFT's tensors: per HF module, A (shared by every module of one linear of ours) and its
    rows of B, each with its own storage (safetensors refuses shared views)."""
    out = {}
    for linear in linears:
        a, b = adapters[f"{linear.ours}.lora_a"], adapters[f"{linear.ours}.lora_b"]
        rows = [n for _, n in linear.modules]
        for (module, _), part in zip(linear.modules, b.detach().split(rows), strict=True):
            out[f"{KEY_PREFIX}{module}.lora_A.weight"] = a.detach().to("cpu").clone()
            out[f"{KEY_PREFIX}{module}.lora_B.weight"] = part.to("cpu").clone()
    return out


# ----------------------------------------------------------------------------- adapter_config.json
def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def _alpha(config: LoraConfig) -> float:
    return config.alpha if config.alpha is not None else config.rank  # null alpha: the rank


def peft_config(
    spec: ModelSpec,
    linears: list[AdaptedLinear],
    configs: Mapping[str, LoraConfig],
    base_name: str | None,
) -> dict:
    """adapter_config.json: the tower with the most modules sets r / lora_alpha; any other
    tower's rank or alpha, where it differs, goes in rank_pattern / alpha_pattern by exact
    module name (escaped: PEFT reads the keys as regular expressions). target_modules lists
    the full names, which PEFT matches by equality (or as a dotted suffix, which a name from
    the model's root cannot be of another module)."""
    by_tower: dict[str, list[str]] = {}
    for linear in linears:
        by_tower.setdefault(linear.tower, []).extend(name for name, _ in linear.modules)
    main = max(by_tower, key=lambda tower: len(by_tower[tower]))  # first of equals
    rank, alpha = configs[main].rank, _alpha(configs[main])
    rank_pattern, alpha_pattern = {}, {}
    for tower, modules in by_tower.items():
        for module in modules:
            if configs[tower].rank != rank:
                rank_pattern[re.escape(module)] = configs[tower].rank
            if _alpha(configs[tower]) != alpha:
                alpha_pattern[re.escape(module)] = _number(_alpha(configs[tower]))
    dropouts = {configs[tower].dropout for tower in by_tower}
    if len(dropouts) > 1:
        log.info("the adapter records dropout %g (towers differ: %s); it acts in training only",
                 configs[main].dropout, sorted(dropouts))  # fmt: skip
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if spec.is_language_model() else None,
        "base_model_name_or_path": base_name,
        "revision": None,
        "inference_mode": True,
        "r": rank,
        "lora_alpha": _number(alpha),
        "lora_dropout": configs[main].dropout,
        "target_modules": [name for modules in by_tower.values() for name in modules],
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,  # scale = alpha / r, as ours
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
    }


# ----------------------------------------------------------------------------- the folder
def _write_folder(out: Path, config: dict, tensors: Mapping[str, Tensor]) -> None:
    """Both files into `out`.tmp, then renamed over `out`: a reader sees the old folder or
    the new one, never half of one (the checkpointer's pattern)."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():  # left by a killed write: never valid
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    data = safetensors.torch.save(dict(tensors), metadata={"format": "pt"})
    atomic_write_bytes(tmp / WEIGHTS_FILE, data)
    atomic_write_text(tmp / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    fsync_dir(tmp)
    if out.exists():
        aside = out.with_name(f".{out.name}.replaced")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(out, aside)
        os.replace(tmp, out)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)
