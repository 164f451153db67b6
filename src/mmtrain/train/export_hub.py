"""A hub model's final weights: the run folder becomes a transformers folder of its class.

`save_pretrained` of the trained transformers module writes config.json, the weights
(model.safetensors, shards and an index past 5 GB) and generation_config.json, from the full
state dict: gathered one tensor at a time under FSDP (every rank calls this; rank 0 keeps
them), LoRA adapters merged into their weights (W + scale B A in float64, rounded once:
train/lora.py `merged`), QLoRA's NF4 bases dequantised, the adapters' wrapper names gone, so
the folder holds the class's own parameter names. Rank 0 holds the whole state dict on the
CPU for `save_pretrained` (native models are written one tensor at a time instead). The
processor files were copied in at the start of the run (`copy_processor_files`), so
`AutoModelForImageTextToText.from_pretrained(OUT)` and `AutoProcessor.from_pretrained(OUT)`
open the run folder as it is; spec.yaml beside them says what mmtrain trained.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from mmtrain.config import LoraConfig
from mmtrain.folders import SPEC_FILE
from mmtrain.models.formats.peft_adapter import (
    ADAPTER_DIR,
    AdaptedLinear,
    peft_base_name,
    write_adapter,
)
from mmtrain.models.materialize import full_on_cpu
from mmtrain.train import parallel
from mmtrain.train.checkpointer import check_finite_weights
from mmtrain.train.export import merged_tensors, plain_sources
from mmtrain.train.lora import is_adapter

log = logging.getLogger(__name__)
PREFIX = "hf."  # a HubModel's transformers module, among its parameter names


def export_hub_model(
    model: nn.Module, out: Path, rank: int, lora_scale: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    """Write `model` (a HubModel) into `out` as its transformers class's folder; returns the
    adapters (`hf.`-less names: `<module>.lora_a` / `.lora_b`) on rank 0, {} elsewhere.
    Every rank takes part in gathering each tensor (FSDP); QLoRA's NF4 bases are written
    dequantised, their adapters merged (train/export.py's tensors)."""
    gathered = gathered_weights(model, rank, lora_scale)
    if gathered is None:
        return {}
    weights, adapters = gathered
    hf = model.hf
    _drop_tied(hf, weights)
    count = len(weights)  # save_pretrained consumes the dict
    hf.save_pretrained(str(out), state_dict=weights)
    model.spec.save(out / SPEC_FILE)
    log.info("wrote %s (%s, %d tensors)", out, type(hf).__name__, count)
    return adapters


def gathered_weights(
    model: nn.Module, rank: int, lora_scale: Mapping[str, float]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """(the plain weights, the adapters) of a hub model's module by its own names (`hf.`
    left out) on rank 0, None elsewhere. Every rank takes part in gathering each tensor
    (FSDP); QLoRA's NF4 bases come dequantised, LoRA adapters merged (train/export.py)."""
    sharded = parallel.is_fsdp(model)
    if not sharded and rank != 0:
        return None
    state = model.state_dict()
    check_finite_weights(state, sharded=sharded)
    adapters = {name: full_on_cpu(v) for name, v in state.items() if is_adapter(name)}
    tensors = merged_tensors(plain_sources(model, state), adapters, lora_scale)
    weights = {name[len(PREFIX) :]: value.contiguous() for name, value in tensors}
    if rank != 0:
        return None
    return weights, {name[len(PREFIX) :]: value for name, value in adapters.items()}


def _drop_tied(hf: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Leave out a head that shares the token embedding's weight: transformers writes (and
    reads) tied weights once, under the embedding's name."""
    head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return
    names = {id(m): n for n, m in hf.named_modules()}
    weights.pop(f"{names[id(head)]}.weight", None)


def write_hub_adapter(
    model: nn.Module,
    adapters: Mapping[str, torch.Tensor],
    loras: Mapping[str, LoraConfig],
    out: Path,
) -> list[str]:
    """OUT/adapter/ in PEFT's layout for a hub model's LoRA run: its adapted linears are the
    transformers model's own modules, so each is one PEFT module of the same name; its tower
    is the tower whose parts hold it (rank and alpha per tower). The base model is the folder
    the run started from when nothing but the adapters trained (`peft_base_name`)."""
    parts = {path: name for name, tower in model.towers.items() for path in tower.parts}
    linears = []
    for linear in dict.fromkeys(name.rpartition(".")[0] for name in adapters):
        tower = next(t for path, t in parts.items() if linear.startswith(path + "."))
        rows = adapters[f"{linear}.lora_b"].shape[0]
        linears.append(AdaptedLinear(linear, tower, ((linear, rows),)))
    trained = [n for n, p in model.named_parameters() if p.requires_grad and not is_adapter(n)]
    base = None if trained else peft_base_name(model.spec.hub.source)
    return write_adapter(model.spec, linears, adapters, loras, out / ADAPTER_DIR, base)
