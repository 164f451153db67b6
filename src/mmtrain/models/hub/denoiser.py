"""A diffusers denoiser trained as it is: the transformer of a pipeline folder (FLUX.1's
FluxTransformer2DModel, Wan 2.x's WanTransformer3DModel) behind the protocol the loop talks to
(the VLMs' HubModel counterpart for a pipeline folder).

`HubDenoiser` holds diffusers' own module (`hf`, built from the pipeline's `transformer/`
config) and gives the loop what a native denoiser gives it: `spec` (its `denoiser` describes
the inputs the data and the flow-matching objective read), `towers` (the planner's names) and
`forward(batch) -> {"prediction"}` in the layout of the latent. What the family's pipeline does
around its transformer (packing, positions, the timestep's scale) is the family's adapter:
models/hub/flux.py, models/hub/wan.py.

The state dict is the diffusers module's under `hf.` (train/export_hub_denoiser.py strips it):
an export is `save_pretrained` of the same class into the pipeline's `transformer/`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.hub_spec import DENOISER_FAMILIES, HubSpec
from mmtrain.model_sources import HubModelError
from mmtrain.models.dit import PREDICTION
from mmtrain.models.hub.denoiser_trace import build_denoiser, denoiser_config
from mmtrain.models.hub.flux import flux_denoiser_fields, flux_predict, flux_towers
from mmtrain.models.hub.pipeline import TRANSFORMER_DIR, transformer_class
from mmtrain.models.hub.towers import HubTower
from mmtrain.models.hub.wan import wan_denoiser_fields, wan_predict, wan_towers
from mmtrain.spec import ModelSpec

LATENT = "latent"


@dataclass(frozen=True)
class DenoiserAdapter:
    """What a family's pipeline does around its transformer, as mmtrain needs it."""

    towers: Callable[..., dict[str, HubTower]]  # (hf, prefix) -> the planner's towers
    predict: Callable[[nn.Module, Mapping[str, Tensor], bool], Tensor]  # (hf, batch, guidance)
    fields: Callable[[Mapping[str, Any]], dict[str, Any]]  # config -> DenoiserSpec fields


ADAPTERS = {
    "FluxTransformer2DModel": DenoiserAdapter(flux_towers, flux_predict, flux_denoiser_fields),
    "WanTransformer3DModel": DenoiserAdapter(wan_towers, wan_predict, wan_denoiser_fields),
}


class HubDenoiser(nn.Module):
    def __init__(self, spec: ModelSpec, hf: nn.Module):
        super().__init__()
        assert spec.hub is not None and spec.denoiser is not None
        self.spec = spec
        self.hf = hf
        self.adapter = ADAPTERS[spec.hub.architecture]
        self._towers = self.adapter.towers(hf)

    @property
    def towers(self) -> dict[str, HubTower]:
        return self._towers

    def forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {PREDICTION: self.predict(batch)}

    def predict(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The velocity at the noisy `latent` ([B, C, H, W], or [B, C, T, H, W] for video)."""
        return self.adapter.predict(self.hf, batch, self.spec.hub.guidance)


def hub_denoiser_spec_of(folder: Path, source: str, key: str = "init") -> ModelSpec:
    """The spec of the pipeline folder's transformer: the class and its towers' parameters
    (counted on a meta-device build) and, as a DenoiserSpec, what it takes and predicts at the
    pipeline's default sample (hub_spec.DENOISER_FAMILIES)."""
    transformer_class(folder, key)  # refuses a family not trained from its folder yet
    config = denoiser_config(folder / TRANSFORMER_DIR)
    adapter = ADAPTERS[config["_class_name"]]
    try:
        fields = adapter.fields(config)
    except ValueError as err:
        raise HubModelError(key, f"{folder / TRANSFORMER_DIR}: {err}") from None
    towers = adapter.towers(build_denoiser(folder / TRANSFORMER_DIR, "meta"), prefix="")
    family = DENOISER_FAMILIES[config["_class_name"]]
    hub = HubSpec(
        source=source,
        architecture=config["_class_name"],
        model_type=family.pipeline,
        tower_params={n: sum(p.numel() for p in t.parameters()) for n, t in towers.items()},
        guidance=bool(config.get("guidance_embeds", False)),
    )
    latent = family.latent(family.frames, family.height, family.height)
    denoiser = DenoiserSpec(
        sample_size=latent[-1],
        frames=latent[1] if family.temporal else 1,
        prediction="velocity",
        input=LATENT,
        text_tokens=family.text_tokens,
        **fields,
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
