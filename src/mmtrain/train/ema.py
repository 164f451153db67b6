"""Exponential moving average of a model's weights, checkpointed with the run and exported.

The average is kept in fp32 on the model's device, of every floating tensor of the model's
state. Under FSDP2 the state's tensors are DTensors (this rank's rows of dim 0) and so are the
average's: each rank averages its own shards, checkpoints them with the model's in the sharded
format, and the export gathers one tensor at a time, so no rank ever holds the whole average
(what a DiT samples with: Peebles & Xie keep an EMA of decay 0.9999).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from mmtrain.models.build import write_model_folder
from mmtrain.models.materialize import copy_full_, full_on_cpu
from mmtrain.models.safetensors_files import TensorEntry


class Ema:
    """The average of the model's floating state tensors, by name."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.shadow = {
            k: v.detach().clone().float()
            for k, v in model.state_dict().items()
            if v.is_floating_point()
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, value in model.state_dict().items():
            if name in self.shadow:
                self.shadow[name].lerp_(value.float(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average as it is held: DTensor shards under FSDP (for the sharded checkpoint)."""
        return self.shadow

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole average on the CPU (a collective under FSDP: every rank calls it)."""
        return {name: full_on_cpu(value) for name, value in self.shadow.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """From whole tensors (a full checkpoint): each rank keeps its rows of its shards."""
        for name, value in state.items():
            copy_full_(self.shadow[name], value.to(self.shadow[name].device))

    def export(self, model: nn.Module, out: Path, rank: int) -> None:
        """OUT as a model folder of the averaged weights (the model's own where it keeps no
        average), written by rank 0 one gathered tensor at a time; every rank calls it."""
        state = model.state_dict()
        layout = [TensorEntry.of(name, value) for name, value in state.items()]
        tensors = self._tensors(state)
        if rank != 0:
            for _ in tensors:  # take part in every gather
                pass
            return
        write_model_folder(out, model.spec, layout, tensors)

    def _tensors(self, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in state.items():
            average = self.shadow.get(name)
            full = full_on_cpu(value if average is None else average).to(value.dtype)
            yield name, full
            del full
