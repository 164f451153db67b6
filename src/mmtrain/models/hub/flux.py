"""FLUX.1's FluxTransformer2DModel as a hub denoiser: what FluxPipeline does around it.

The latent is packed 2 x 2 into 4C-wide tokens (`pack_latents`), each token gets its
(0, row, column) position and each text token (0, 0, 0) (the pipeline's latent image ids and
`txt_ids`), the timestep goes in as t (mmtrain's objective feeds 1000 t; the transformer
multiplies by 1000 itself), the guidance scale as it is (FLUX.1-dev's guidance embedding), and
the packed prediction is unpacked to [B, C, H, W].

Towers: `denoiser` (the double-stream blocks and every part outside the blocks) and
`denoiser_single` (the single-stream blocks): the planner's names, each tower's blocks alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from mmtrain.hub_spec import DENOISER_TOWERS
from mmtrain.models.dit import TEXT_HIDDEN, TEXT_POOLED, TIMESTEP
from mmtrain.models.hub.towers import HubTower
from mmtrain.models.schedules import FLOW_TIMESTEP_SCALE

GUIDANCE = "guidance"  # the batch key of the guidance scale per sample (FLUX.1-dev)
LATENT = "latent"
PACK = 2  # FLUX packs 2 x 2 latent positions into one token
# FLUX's blocks by LoRA target: the attention (both streams' q/k/v/out) and the MLPs (the
# double blocks' `ff` / `ff_context`, the single blocks' `proj_mlp` and the `proj_out` that
# maps attention and MLP together back to the width).
FLUX_LORA_MODULES = {"attn": ("attn",), "mlp": ("ff", "ff_context", "proj_mlp", "proj_out")}


class FluxTower(HubTower):
    """A tower of FLUX's transformer: its blocks' LoRA targets by diffusers' module names."""

    def lora_paths(self, block: nn.Module, target: str) -> list[str]:
        heads = FLUX_LORA_MODULES[target]
        return [
            name
            for name, module in block.named_modules()
            if isinstance(module, nn.Linear) and name.split(".")[0] in heads
        ]


def flux_towers(hf: nn.Module, prefix: str = "hf.") -> dict[str, HubTower]:
    """{"denoiser": the double-stream blocks with the embedders, norms and output projection,
    "denoiser_single": the single-stream blocks} of a FluxTransformer2DModel."""
    no_split = set(getattr(hf, "_no_split_modules", None) or ())
    double = {n: m for n, m in hf.named_children() if n != "single_transformer_blocks"}
    single = {"single_transformer_blocks": hf.single_transformer_blocks}
    first, second = DENOISER_TOWERS
    return {
        first: FluxTower(first, double, no_split, prefix),
        second: FluxTower(second, single, no_split, prefix),
    }


def flux_predict(hf: nn.Module, batch: Mapping[str, Tensor], guidance: bool) -> Tensor:
    """The velocity [B, C, H, W] at the noisy `latent`, `timestep` (1000 t), the text's
    `text_hidden` [B, L, D] and `text_pooled` [B, P], and `guidance` [B] (FLUX.1-dev)."""
    latent = batch[LATENT]
    b, c, h, w = latent.shape
    text = batch[TEXT_HIDDEN]
    packed = hf(
        hidden_states=pack_latents(latent),
        encoder_hidden_states=text,
        pooled_projections=batch[TEXT_POOLED],
        timestep=batch[TIMESTEP] / FLOW_TIMESTEP_SCALE,
        img_ids=image_ids(h, w, latent.device, latent.dtype),
        txt_ids=torch.zeros(text.shape[1], 3, device=latent.device, dtype=latent.dtype),
        guidance=batch.get(GUIDANCE) if guidance else None,
        return_dict=False,
    )[0]
    return unpack_latents(packed, c, h, w)


def flux_denoiser_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The DenoiserSpec fields of a FluxTransformer2DModel config: an MMDiT over 2 x 2-packed
    latents, T5's hidden states and CLIP-L's pooled vector."""
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    return dict(
        channels=int(config["in_channels"]) // (PACK * PACK),
        patch_size=PACK,
        width=heads * head_dim,
        layers=int(config["num_layers"]) + int(config["num_single_layers"]),
        heads=heads,
        architecture="mmdit",
        text_width=int(config["joint_attention_dim"]),
        pooled_width=int(config["pooled_projection_dim"]),
    )


def pack_latents(latent: Tensor) -> Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: each 2 x 2 patch one token, channels outermost."""
    b, c, h, w = latent.shape
    x = latent.reshape(b, c, h // PACK, PACK, w // PACK, PACK).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PACK) * (w // PACK), c * PACK * PACK)


def unpack_latents(tokens: Tensor, c: int, h: int, w: int) -> Tensor:
    b = tokens.shape[0]
    x = tokens.reshape(b, h // PACK, w // PACK, c, PACK, PACK).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def image_ids(h: int, w: int, device: Any, dtype: torch.dtype) -> Tensor:
    """Each token's (0, row, column) in the packed grid, row-major, as FluxPipeline gives them."""
    rows = torch.arange(h // PACK, device=device, dtype=dtype)
    cols = torch.arange(w // PACK, device=device, dtype=dtype)
    grid = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).reshape(-1, 2)
    return torch.cat([torch.zeros_like(grid[:, :1]), grid], dim=1)
