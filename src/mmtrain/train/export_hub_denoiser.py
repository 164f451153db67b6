"""A hub denoiser's final weights: the run folder becomes a diffusers pipeline folder.

The trained transformer is written by diffusers' own `save_pretrained` of its class into
`transformer/` (LoRA adapters merged into their weights in float64 and rounded once, the
wrappers' names gone: train/export.py's tensors; gathered one tensor at a time under FSDP);
every other component of the pipeline the run started from (VAE, text encoders, tokenizers,
scheduler) and its model_index.json are copied beside it as they are, so
`FluxPipeline.from_pretrained(RUN)` opens the run folder; spec.yaml says what mmtrain trained.
A LoRA run also writes OUT/adapter/ in diffusers' LoRA format (`write_denoiser_adapter`).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from mmtrain.config import LoraConfig
from mmtrain.folders import SPEC_FILE
from mmtrain.models.hub.denoiser_trace import build_denoiser
from mmtrain.models.hub.pipeline import PIPELINE_INDEX, TRANSFORMER_DIR
from mmtrain.train.diffusers_lora import write_diffusers_lora
from mmtrain.train.export_hub import gathered_weights

log = logging.getLogger(__name__)


def export_hub_denoiser(
    model: nn.Module, out: Path, rank: int, lora_scale: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    """Write `model` (a HubDenoiser) into `out` as a pipeline folder; returns the adapters
    (`hf.`-less names) on rank 0, {} elsewhere. Every rank takes part in gathering (FSDP)."""
    gathered = gathered_weights(model, rank, lora_scale)
    if gathered is None:
        return {}
    weights, adapters = gathered
    source = Path(model.spec.hub.source)
    copy_pipeline_components(source, out)
    transformer = build_denoiser(source / TRANSFORMER_DIR, "meta").to_empty(device="cpu")
    dtype = next(iter(weights.values())).dtype
    transformer.load_state_dict(weights, strict=True, assign=True)
    transformer.to(dtype).save_pretrained(str(out / TRANSFORMER_DIR))
    model.spec.save(out / SPEC_FILE)
    log.info("wrote %s (%s, %d tensors)", out, type(transformer).__name__, len(weights))
    return adapters


def write_denoiser_adapter(
    model: nn.Module,
    adapters: Mapping[str, torch.Tensor],
    loras: Mapping[str, LoraConfig],
    out: Path,
) -> Path:
    """OUT/adapter/ of a hub denoiser's LoRA run in diffusers' LoRA format
    (train/diffusers_lora.py), each adapted linear under the tower whose blocks hold it."""
    paths = {t.block_path: name for name, t in model.towers.items()}
    tower_of = {}
    for module in dict.fromkeys(name.rpartition(".")[0] for name in adapters):
        tower_of[module] = next(n for p, n in paths.items() if module.startswith(p + "."))
    return write_diffusers_lora(adapters, loras, tower_of, out)


def copy_pipeline_components(source: Path, out: Path) -> None:
    """model_index.json and every component folder of `source` but the transformer, as they are
    (a folder already in `out` is replaced: a rerun's export writes the same)."""
    shutil.copy2(source / PIPELINE_INDEX, out / PIPELINE_INDEX)
    for part in sorted(p for p in source.iterdir() if p.is_dir() and p.name != TRANSFORMER_DIR):
        target = out / part.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(part, target)
