"""A hub denoiser's LoRA adapters in diffusers' LoRA format: OUT/adapter/ that a pipeline's
`load_lora_weights(OUT/adapter)` reads (FluxPipeline's loader).

One safetensors file, `pytorch_lora_weights.safetensors`, holds each adapted linear of the
transformer as `transformer.<module>.lora_A.weight` [rank, in] and `.lora_B.weight` [out, rank]
(PEFT's names and shapes, mmtrain's A and B as they are). Its `__metadata__` carries diffusers'
`lora_adapter_metadata`: the PEFT LoraConfig the loader builds, `transformer.`-prefixed — rank
`r`, `lora_alpha` and the exact `target_modules`, with `rank_pattern` / `alpha_pattern` for a
tower whose rank or alpha differs from the first one's. Without it diffusers would take alpha
= rank and apply the adapter at another scale than the one trained.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save

from mmtrain.atomic import atomic_write_bytes
from mmtrain.config import LoraConfig
from mmtrain.models.formats.peft_adapter import ADAPTER_DIR

log = logging.getLogger(__name__)
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what load_lora_weights reads by default
METADATA_KEY = "lora_adapter_metadata"  # diffusers' key in the safetensors metadata
COMPONENT = "transformer"  # the pipeline component the adapters belong to


def write_diffusers_lora(
    adapters: Mapping[str, torch.Tensor],
    loras: Mapping[str, LoraConfig],
    tower_of: Mapping[str, str],
    out: Path,
) -> Path:
    """Write OUT/adapter/pytorch_lora_weights.safetensors from `adapters` (`<module>.lora_a` /
    `.lora_b` by the transformer's module names); `tower_of[module]` is the tower whose
    `train.towers.NAME.lora` adapted it. Returns the file written."""
    modules = sorted(dict.fromkeys(name.rpartition(".")[0] for name in adapters))
    tensors = {}
    for module in modules:
        tensors[f"{COMPONENT}.{module}.lora_A.weight"] = adapters[f"{module}.lora_a"].contiguous()
        tensors[f"{COMPONENT}.{module}.lora_B.weight"] = adapters[f"{module}.lora_b"].contiguous()
    config = _peft_config(modules, {m: loras[tower_of[m]] for m in modules})
    metadata = {f"{COMPONENT}.{key}": value for key, value in config.items()}
    folder = out / ADAPTER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / WEIGHT_NAME
    data = save(tensors, metadata={"format": "pt", METADATA_KEY: json.dumps(metadata)})
    atomic_write_bytes(path, data)
    log.info("wrote %s (%d adapted linears, diffusers' LoRA format)", path, len(modules))
    return path


def _peft_config(modules: list[str], lora_of: Mapping[str, LoraConfig]) -> dict:
    """The LoraConfig kwargs diffusers builds PEFT's adapter from: the first module's rank and
    alpha for all, patterns (exact module names) where another tower's differ."""
    first = lora_of[modules[0]]
    alpha = _alpha(first)
    config: dict = {"r": first.rank, "lora_alpha": alpha, "target_modules": modules}
    ranks = {m: c.rank for m, c in lora_of.items() if c.rank != first.rank}
    alphas = {m: _alpha(c) for m, c in lora_of.items() if _alpha(c) != alpha}
    if ranks:
        config["rank_pattern"] = ranks
    if alphas:
        config["alpha_pattern"] = alphas
    return config


def _alpha(lora: LoraConfig) -> float:
    return float(lora.alpha if lora.alpha is not None else lora.rank)
