"""Exponential moving average of a model's weights, checkpointed with the run."""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.models import create_model


class Ema:
    """Exponential moving average of the trainable weights, kept in fp32 on the model's device."""

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
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            self.shadow[name].copy_(value)

    def model(self, model: nn.Module) -> nn.Module:
        """A copy of `model` (on the CPU) holding the averaged weights."""
        copy = create_model(model.spec, device="meta")
        state = {k: self.shadow.get(k, v).to("cpu", v.dtype) for k, v in model.state_dict().items()}
        copy.load_state_dict(state, assign=True)
        copy.reset_buffers()
        return copy
