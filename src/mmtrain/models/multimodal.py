"""MultimodalModel: the towers of a `ModelSpec` by name, the contrastive temperature
(`logit_scale`, and SigLIP's `logit_bias`), and an optional fusion head over the towers' tokens."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.models.heads import FusionHead
from mmtrain.models.init_rules import apply_init_rules, init_rules
from mmtrain.models.materialize import initialised_parameters
from mmtrain.models.towers import Tower
from mmtrain.spec import ModelSpec


class MultimodalModel(nn.Module):
    """Towers by name (the batch keys), `logit_scale` / `logit_bias` for the contrastive loss,
    and an optional `fusion` head over the towers' token sequences."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.towers = nn.ModuleDict(
            {name: Tower(tower, spec.embed_dim) for name, tower in spec.towers.items()}
        )
        if spec.pairs:
            self.logit_scale = nn.Parameter(torch.tensor(float(spec.logit_scale_init)))
        if spec.logit_bias_init is not None:
            self.logit_bias = nn.Parameter(torch.tensor(float(spec.logit_bias_init)))
        self.fused = spec.fused_towers()
        self.fusion = None
        if spec.fusion is not None:
            widths = {name: spec.towers[name].width for name in self.fused}
            self.fusion = FusionHead(spec.fusion, widths)

    def _present(self, batch: Mapping[str, torch.Tensor]) -> list[str]:
        names = [name for name in self.towers if name in batch]
        if not names:
            raise KeyError(
                f"the batch has none of this model's towers ({', '.join(self.towers)}); "
                f"batch keys: {', '.join(map(str, batch)) or 'none'}"
            )
        return names

    def encode(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """L2-normalised embeddings [B, embed_dim] for every tower whose name is a batch key
        (other keys, such as labels, are ignored)."""
        return {
            name: F.normalize(self.towers[name](batch[name]), dim=-1)
            for name in self._present(batch)
        }

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`encode(batch)`, plus "fusion" -> [B, num_outputs] when the model has a fusion head and
        every fused tower is in the batch (each tower runs once for both)."""
        out: dict[str, torch.Tensor] = {}
        memory: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name in self._present(batch):
            tower, x = self.towers[name], batch[name]
            tokens = tower.forward_tokens(x)
            out[name] = F.normalize(tower.pool_and_project(tokens, x), dim=-1)
            if name in self.fused:
                memory[name] = (tokens, tower.token_mask(x))
        if self.fusion is not None and all(name in memory for name in self.fused):
            out["fusion"] = self.fusion(memory)
        return out

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Width-aware random init (see `init_rules` for the std of every parameter kind and the
        convention it follows); norms 1/0, biases 0, `logit_scale`/`logit_bias` from the spec.

        Values are drawn on the CPU in float32 from `generator`, one parameter after another in
        `named_parameters()` order, and copied, so the same generator state gives the same weights
        on any device.
        """
        apply_init_rules(initialised_parameters(self), init_rules(self), generator)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute derived (non-persistent) buffers such as the audio stem's mel filterbank."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()
