"""A diffusers denoiser trained as it is: FLUX.1's FluxTransformer2DModel behind the protocol the
loop talks to (the VLMs' HubModel counterpart for a pipeline folder).

`HubDenoiser` holds diffusers' own module (`hf`, built from the pipeline's `transformer/`
config) and gives the loop what a native denoiser gives it: `spec` (its `denoiser` describes
the inputs the data and the flow-matching objective read: 16-channel latents, T5 hidden states,
CLIP's pooled vector), `towers` (`denoiser`: the double-stream blocks and every part outside
the blocks; `denoiser_single`: the single-stream blocks; the planner's names), and
`forward(batch) -> {"prediction"}` in the layout of the latent, [B, C, H, W].

The forward adapter does what FluxPipeline does around the transformer: the latent is packed
2 x 2 into 4C-wide tokens (`_pack_latents`), each token gets its (0, row, column) position and
each text token (0, 0, 0) (`_prepare_latent_image_ids`, `txt_ids`), the timestep goes in as
t (mmtrain's objective feeds 1000 t; the transformer multiplies by 1000 itself), the guidance
scale as it is (FLUX.1-dev's guidance embedding), and the packed prediction is unpacked.

The state dict is the diffusers module's under `hf.` (train/export_hub_denoiser.py strips it):
an export is `save_pretrained` of the same class into the pipeline's `transformer/`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.hub_spec import DENOISER_FAMILIES, DENOISER_TOWERS, HubSpec
from mmtrain.models.dit import PREDICTION, TEXT_HIDDEN, TEXT_POOLED, TIMESTEP
from mmtrain.models.hub.denoiser_trace import build_denoiser, denoiser_config
from mmtrain.models.hub.pipeline import TRANSFORMER_DIR, transformer_class
from mmtrain.models.hub.towers import HubTower
from mmtrain.models.schedules import FLOW_TIMESTEP_SCALE
from mmtrain.spec import ModelSpec

GUIDANCE = "guidance"  # the batch key of the guidance scale per sample (FLUX.1-dev)
LATENT = "latent"
PACK = 2  # FLUX packs 2 x 2 latent positions into one token
# FluxPipeline's defaults: 128 x 128 latents (1024 pixels over the VAE's 8x), T5's 512 tokens.
DEFAULT_LATENT_SIZE = 128
# FLUX's blocks by LoRA target: the attention (both streams' q/k/v/out) and the MLPs (the
# double blocks' `ff` / `ff_context`, the single blocks' `proj_mlp` and the `proj_out` that
# maps attention and MLP together back to the width).
FLUX_LORA_MODULES = {"attn": ("attn",), "mlp": ("ff", "ff_context", "proj_mlp", "proj_out")}


class DenoiserTower(HubTower):
    """A tower of a diffusers denoiser: its blocks' LoRA targets by diffusers' module names."""

    def lora_paths(self, block: nn.Module, target: str) -> list[str]:
        heads = FLUX_LORA_MODULES[target]
        return [
            name
            for name, module in block.named_modules()
            if isinstance(module, nn.Linear) and name.split(".")[0] in heads
        ]


def denoiser_towers(hf: nn.Module, prefix: str = "hf.") -> dict[str, DenoiserTower]:
    """{"denoiser": the double-stream blocks with the embedders, norms and output projection,
    "denoiser_single": the single-stream blocks} of a FluxTransformer2DModel."""
    no_split = set(getattr(hf, "_no_split_modules", None) or ())
    double = {n: m for n, m in hf.named_children() if n != "single_transformer_blocks"}
    single = {"single_transformer_blocks": hf.single_transformer_blocks}
    first, second = DENOISER_TOWERS
    return {
        first: DenoiserTower(first, double, no_split, prefix),
        second: DenoiserTower(second, single, no_split, prefix),
    }


class HubDenoiser(nn.Module):
    def __init__(self, spec: ModelSpec, hf: nn.Module):
        super().__init__()
        assert spec.hub is not None and spec.denoiser is not None
        self.spec = spec
        self.hf = hf
        self._towers = denoiser_towers(hf)

    @property
    def towers(self) -> dict[str, DenoiserTower]:
        return self._towers

    def forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {PREDICTION: self.predict(batch)}

    def predict(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The velocity [B, C, H, W] at the noisy `latent`, `timestep` (1000 t), the text's
        `text_hidden` [B, L, D] and `text_pooled` [B, P], and `guidance` [B] (FLUX.1-dev)."""
        latent = batch[LATENT]
        b, c, h, w = latent.shape
        text = batch[TEXT_HIDDEN]
        guidance = batch.get(GUIDANCE) if self.spec.hub.guidance else None
        packed = self.hf(
            hidden_states=pack_latents(latent),
            encoder_hidden_states=text,
            pooled_projections=batch[TEXT_POOLED],
            timestep=batch[TIMESTEP] / FLOW_TIMESTEP_SCALE,
            img_ids=image_ids(h, w, latent.device, latent.dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=latent.device, dtype=latent.dtype),
            guidance=guidance,
            return_dict=False,
        )[0]
        return unpack_latents(packed, c, h, w)


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


def hub_denoiser_spec_of(folder: Path, source: str, key: str = "init") -> ModelSpec:
    """The spec of the pipeline folder's transformer: the class and its towers' parameters
    (counted on a meta-device build) and, as a DenoiserSpec, what it takes and predicts."""
    transformer_class(folder, key)  # refuses a family not trained from its folder yet
    config = denoiser_config(folder / TRANSFORMER_DIR)
    towers = denoiser_towers(build_denoiser(folder / TRANSFORMER_DIR, "meta"), prefix="")
    family = DENOISER_FAMILIES[config["_class_name"]]
    hub = HubSpec(
        source=source,
        architecture=config["_class_name"],
        model_type=family.pipeline,
        tower_params={n: sum(p.numel() for p in t.parameters()) for n, t in towers.items()},
        guidance=bool(config.get("guidance_embeds", False)),
    )
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    denoiser = DenoiserSpec(
        sample_size=DEFAULT_LATENT_SIZE,
        channels=int(config["in_channels"]) // (PACK * PACK),
        patch_size=PACK,
        width=heads * head_dim,
        layers=int(config["num_layers"]) + int(config["num_single_layers"]),
        heads=heads,
        prediction="velocity",
        input=LATENT,
        architecture="mmdit",
        text_width=int(config["joint_attention_dim"]),
        pooled_width=int(config["pooled_projection_dim"]),
        text_tokens=family.text_tokens,
    )
    return ModelSpec(
        name=Path(source).name or source,
        embed_dim=denoiser.width,
        towers={},
        objective="flow_matching",
        denoiser=denoiser,
        hub=hub,
    )


def create_hub_denoiser(
    spec: ModelSpec, *, device: torch.device, dtype: torch.dtype | None = None, seed: int = 0
) -> HubDenoiser:
    """The HubDenoiser of `spec`: diffusers' class built from the pipeline's transformer config,
    randomly initialised by the class's own init from `seed` (the global RNG forked), on
    `device` ("meta": no memory, no init)."""
    folder = Path(spec.hub.source) / TRANSFORMER_DIR
    if device.type == "meta":
        hf = build_denoiser(folder, "meta")
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf = build_denoiser(folder, "cpu")
    if dtype is not None:
        hf = hf.to(dtype)
    return HubDenoiser(spec, hf.to(device))
