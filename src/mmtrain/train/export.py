"""The run's final weights, written one tensor at a time: OUT/model.safetensors (shards and an
index past 5 GB) + OUT/spec.yaml, LoRA adapters merged, and the adapters alone in
OUT/lora.safetensors.

Under FSDP every rank gathers one parameter at a time (`DTensor.full_tensor()`, a collective)
and rank 0 writes it before the next is gathered, so no rank ever holds the whole model; the
LoRA adapters (small) are gathered first, to merge each weight as it passes. Without FSDP rank
0 copies one tensor at a time to the CPU. Non-finite weights are refused before anything is
written (all ranks agree), so a diverged run never replaces a good export.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from mmtrain.config import LoraConfig
from mmtrain.models import create_model
from mmtrain.models.build import write_model_folder
from mmtrain.models.materialize import full_on_cpu
from mmtrain.models.safetensors_files import TensorEntry
from mmtrain.train import parallel
from mmtrain.train.checkpointer import check_finite_weights
from mmtrain.train.lora import LORA_FILE, is_adapter, merged, write_lora_file


def export_model(
    model: nn.Module,
    out: Path,
    rank: int,
    lora_scale: Mapping[str, float],
    loras: Mapping[str, LoraConfig],
) -> None:
    """Every rank calls it (a collective under FSDP); rank 0 writes."""
    sharded = parallel.is_fsdp(model)
    if not sharded and rank != 0:
        return
    state = model.state_dict()
    check_finite_weights(state, sharded=sharded)
    adapters = {name: full_on_cpu(v) for name, v in state.items() if is_adapter(name)}
    layout = [TensorEntry.of(name, v) for name, v in state.items() if not is_adapter(name)]
    _check_layout(model, layout)
    tensors = _merged_tensors(state, adapters, lora_scale)
    if rank != 0:
        for _ in tensors:  # take part in every gather
            pass
        return
    if adapters:
        write_lora_file(adapters, loras, out / LORA_FILE)
    write_model_folder(out, model.spec, layout, tensors)


def _merged_tensors(
    state: Mapping[str, torch.Tensor],
    adapters: Mapping[str, torch.Tensor],
    lora_scale: Mapping[str, float],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on the CPU) of the plain model, one at a time, adapters merged."""
    for name, value in state.items():
        if is_adapter(name):
            continue
        full = full_on_cpu(value)
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix in lora_scale:
            a, b = adapters[f"{prefix}.lora_a"], adapters[f"{prefix}.lora_b"]
            full = merged(full, a, b, lora_scale[prefix])
        yield name, full
        del full


def _check_layout(model: nn.Module, layout: list[TensorEntry]) -> None:
    """The exported names and shapes are those of the plain model of the spec (wrappers such
    as LoRA, compile and FSDP keep names; a mismatch here is a bug, not bad input)."""
    plain = create_model(model.spec, device="meta").state_dict()
    got = {entry.name: tuple(entry.shape) for entry in layout}
    want = {name: tuple(t.shape) for name, t in plain.items()}
    if got != want:
        differ = sorted(set(got) ^ set(want)) or [n for n in got if got[n] != want[n]]
        raise RuntimeError(f"the exported weights do not match the spec: {differ[:5]}")
