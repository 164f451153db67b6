"""Exponential moving average of a model's weights, checkpointed with the run and exported.

The average is kept in fp32 on the model's device, of every floating tensor of the model's
state that training changes: frozen parameters (a frozen tower, a LoRA run's base weights)
are left out, their average being themselves, so a LoRA run averages its adapters alone. Under
FSDP2 the state's tensors are DTensors (this rank's rows of dim 0) and so are the average's:
each rank averages its own shards and checkpoints them with the model's in the sharded format
(what a DiT samples with: Peebles & Xie keep an EMA of decay 0.9999).

The export swaps the average into the model and writes it with the run's own export (train/
loop.py), so OUT/ema is the same kind of folder as OUT: an mmtrain model folder, a transformers
or a diffusers pipeline folder, LoRA merged and the averaged adapters beside.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mmtrain.models.materialize import copy_full_, full_on_cpu


class Ema:
    """The average of the model's trained floating state tensors, by name."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        frozen = {id(p) for p in model.parameters() if not p.requires_grad}
        self.shadow = {
            k: v.detach().clone().float()
            for k, v in model.state_dict(keep_vars=True).items()
            if v.is_floating_point() and id(v) not in frozen
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
        """From whole tensors (a full checkpoint): each rank keeps its rows of its shards. A
        tensor this run does not average (a checkpoint that averaged frozen weights too) is
        skipped: a frozen weight's average is the weight."""
        for name, value in state.items():
            if name in self.shadow:
                copy_full_(self.shadow[name], value.to(self.shadow[name].device))

    @contextmanager
    @torch.no_grad()
    def swapped(self, model: nn.Module) -> Iterator[None]:
        """The model holds the average (rounded to its dtypes) inside the block and its own
        weights again after, kept meanwhile in host memory (an export runs when the optimizer
        state still fills the device). Each rank swaps its own shards: no collective."""
        state = {name: value for name, value in model.state_dict().items() if name in self.shadow}
        kept = {name: _local(value).to("cpu", copy=True) for name, value in state.items()}
        try:
            for name, value in state.items():
                _local(value).copy_(_local(self.shadow[name]))
            yield
        finally:
            for name, value in state.items():
                _local(value).copy_(kept[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's shards), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
