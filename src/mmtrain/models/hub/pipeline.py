"""A diffusers pipeline folder as a run's starting point: what it holds, and whether mmtrain
trains its transformer yet.

A pipeline folder has model_index.json (the pipeline class and one entry per component) and a
folder per component; the transformer trained is `transformer/` (its config.json names the
class). FLUX.1 (FluxPipeline with FluxTransformer2DModel) and Wan 2.x text-to-video (WanPipeline
with WanTransformer3DModel) are trained as diffusers' own classes (models/hub/denoiser.py); other pipelines are refused naming their class and what is
supported. SD3's transformer trains as mmtrain's native MMDiT (`convert --from diffusers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mmtrain.model_sources import HubModelError, is_hub_name, snapshot
from mmtrain.model_sources import read_json_object as read_json

PIPELINE_INDEX = "model_index.json"
TRANSFORMER_DIR = "transformer"
# The transformer classes trained from their pipeline folder, with the pipeline that runs them.
SUPPORTED = {
    "FluxTransformer2DModel": "FluxPipeline",
    "WanTransformer3DModel": "WanPipeline",
}


def is_pipeline_folder(value: str | Path) -> bool:
    """A folder holding model_index.json (a diffusers pipeline)."""
    return (Path(value) / PIPELINE_INDEX).is_file()


def resolve_pipeline(value: str | Path, key: str = "init") -> Path | None:
    """The pipeline folder `value` names: a local folder holding model_index.json, or a hub
    name (`org/name`) whose snapshot in the Hugging Face cache is one; None for anything else
    (HubModelError when a hub name cannot be had)."""
    if is_pipeline_folder(value):
        return Path(value)
    text = str(value)
    if Path(text).exists() or not is_hub_name(text):
        return None
    folder = snapshot(text, key)
    return folder if is_pipeline_folder(folder) else None


def transformer_class(folder: Path, key: str = "init") -> str:
    """The class name of the pipeline's transformer, refused unless mmtrain trains it from the
    folder (HubModelError naming the pipeline, the class and what is supported)."""
    index = read_json(folder / PIPELINE_INDEX, key)
    pipeline = str(index.get("_class_name", "a pipeline"))
    config = folder / TRANSFORMER_DIR / "config.json"
    if not config.is_file():
        raise HubModelError(
            key,
            f"{folder}: {pipeline} has no {TRANSFORMER_DIR}/config.json; mmtrain trains a "
            f"pipeline's transformer ({_supported()})",
        )
    name = str(read_json(config, key).get("_class_name", ""))
    if name not in SUPPORTED:
        raise HubModelError(
            key,
            f"{folder}: {pipeline}'s transformer {name or '(no _class_name)'} is not trained "
            f"from its pipeline folder yet; supported: {_supported()}; SD3's transformer "
            "trains as the native MMDiT (mmtrain convert --from diffusers DIR/transformer)",
        )
    return name


def _supported() -> str:
    return ", ".join(f"{cls} ({pipe})" for cls, pipe in SUPPORTED.items())


SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"


@dataclass(frozen=True)
class FlowShift:
    """The timestep shift a pipeline's flow-matching scheduler applies, as training samples it.

    A fixed `shift` (Wan: FlowMatchEulerDiscreteScheduler's `shift`, UniPC's `flow_shift`;
    3 at 480p) or, with `use_dynamic_shifting` (FLUX.1), one that grows with the sample:
    mu = base_shift at base_image_seq_len latent tokens, max_shift at max_image_seq_len,
    linear between (and beyond), and the shift exp(mu) (the scheduler's exponential time shift
    exp(mu) / (exp(mu) + 1 / t - 1) is SD3's shift with shift = exp(mu)).
    """

    shift: float = 1.0
    dynamic: tuple[float, float, float, float] | None = None  # base/max seq len, base/max mu

    def at(self, tokens: int) -> float:
        """The shift for a sample of `tokens` latent tokens (after the transformer's patches)."""
        if self.dynamic is None:
            return self.shift
        base_len, max_len, base_mu, max_mu = self.dynamic
        slope = (max_mu - base_mu) / (max_len - base_len)
        return math.exp(base_mu + slope * (tokens - base_len))


def flow_shift(folder: Path) -> FlowShift:
    """The FlowShift of the pipeline folder's scheduler config (none: no shift)."""
    path = folder / SCHEDULER_CONFIG
    if not path.is_file():
        return FlowShift()
    config = read_json(path, "init")
    if config.get("use_dynamic_shifting"):
        if config.get("time_shift_type", "exponential") != "exponential":
            raise HubModelError(
                "train.diffusion.shift",
                f"{path}: time_shift_type {config['time_shift_type']!r} is not the exponential "
                "shift mmtrain samples; set train.diffusion.shift",
            )
        keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
        return FlowShift(dynamic=tuple(float(config[k]) for k in keys))
    return FlowShift(shift=float(config.get("shift", config.get("flow_shift", 1.0)) or 1.0))
