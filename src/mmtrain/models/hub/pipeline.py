"""A diffusers pipeline folder as a run's starting point: what it holds, and whether mmtrain
trains its transformer yet.

A pipeline folder has model_index.json (the pipeline class and one entry per component) and a
folder per component; the transformer trained is `transformer/` (its config.json names the
class). FLUX.1 (FluxPipeline with FluxTransformer2DModel) is trained as diffusers' own class
(models/hub/denoiser.py); other pipelines are refused naming their class and what is
supported. SD3's transformer trains as mmtrain's native MMDiT (`convert --from diffusers`).
"""

from __future__ import annotations

from pathlib import Path

from mmtrain.model_sources import HubModelError
from mmtrain.model_sources import read_json_object as read_json

PIPELINE_INDEX = "model_index.json"
TRANSFORMER_DIR = "transformer"
# The transformer classes trained from their pipeline folder, with the pipeline that runs them.
SUPPORTED = {"FluxTransformer2DModel": "FluxPipeline"}


def is_pipeline_folder(value: str | Path) -> bool:
    """A folder holding model_index.json (a diffusers pipeline)."""
    return (Path(value) / PIPELINE_INDEX).is_file()


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
