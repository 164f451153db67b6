"""The ModelSpec of whatever a run's `model` names: a preset or spec file (mmtrain's own), a
transformers folder or hub name of a native family (its spec read from the config: mmtrain's
modules train it), or of any other class transformers builds (a hub model, models/hub/), or a
diffusers pipeline folder whose transformer trains as diffusers' class (models/hub/denoiser.py)."""

from __future__ import annotations

from mmtrain.model_sources import is_hub_name, is_model_folder
from mmtrain.models.formats import hf
from mmtrain.models.formats.hf_common import read_json
from mmtrain.spec import ModelSpec, load_spec


def load_model_spec(model: str | ModelSpec, key: str = "model") -> ModelSpec:
    """The spec `model` describes (see the module docstring); FieldErrors name `key`."""
    if isinstance(model, ModelSpec):
        return model
    text = str(model)
    from mmtrain.models.hub.pipeline import resolve_pipeline

    pipeline = resolve_pipeline(text, key)
    if pipeline is not None:  # a diffusers pipeline: its transformer as diffusers' class
        from mmtrain.models.hub.denoiser import hub_denoiser_spec_of

        return hub_denoiser_spec_of(pipeline, str(pipeline), key)
    if not (is_model_folder(text) or is_hub_name(text)):
        return load_spec(text)
    from mmtrain.models.hub.model import hub_spec_of
    from mmtrain.models.hub.source import CONFIG_FILE, resolve_folder

    folder = resolve_folder(text, key)
    if hf.native_family(read_json(folder / CONFIG_FILE)) is not None:
        return hf.spec_of_folder(folder)
    return hub_spec_of(folder, text)
