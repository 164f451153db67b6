"""The model a run trained, loaded from its folder for the parts of the report that use it
(the retrieval gallery, doctor's scoring of a loss spike's samples)."""

from __future__ import annotations

from typing import Any

from mmtrain.folders import CHECKPOINT_DIR, WEIGHTS_FILE
from mmtrain.report.rundata import RunData


class ModelUnavailable(Exception):
    """The run's image-text model cannot be had; the message says why."""


def image_text_model(run: RunData) -> tuple[Any, str, str]:
    """The run's model (final weights, else the newest checkpoint's) and its image/text towers."""
    from safetensors import SafetensorError

    import mmtrain
    from mmtrain.checkpoint import latest_checkpoint, load_weights
    from mmtrain.models import create_model
    from mmtrain.models.build import is_model_folder
    from mmtrain.structured import FieldError

    spec = run.spec
    if spec is None:
        raise ModelUnavailable("no model spec in the run folder")
    pair = next(
        (
            (a, b) if spec.towers[a].modality == "image" else (b, a)
            for a, b in spec.pairs
            if {spec.towers[a].modality, spec.towers[b].modality} == {"image", "text"}
        ),
        None,
    )
    if pair is None:
        raise ModelUnavailable(f"{spec.name} has no image-text pair; the gallery is for image-text")
    try:
        if is_model_folder(run.run_dir):  # final weights: one file, or shards + index
            return mmtrain.load_model(run.run_dir), *pair
        checkpoint = latest_checkpoint(run.run_dir / CHECKPOINT_DIR)  # the newest that verifies
        if checkpoint is not None:
            model = create_model(spec)
            # full or sharded (FSDP); latest_checkpoint has just verified it
            model.load_state_dict(load_weights(checkpoint, verify=False))
            return model, *pair
    except (OSError, FieldError, RuntimeError, SafetensorError) as err:
        raise ModelUnavailable(f"the model weights could not be loaded: {err}") from None
    raise ModelUnavailable(f"no {WEIGHTS_FILE} and no valid checkpoint in {run.run_dir}")
