"""Plain PyTorch modules built from a `ModelSpec`: stems, shared transformer blocks, towers, heads.

`create_model(spec)` builds and initialises; `save_model` / `load_model` read and write a model
folder (model.safetensors + spec.yaml).
"""

from mmtrain.models.build import (
    ModelFileError,
    MultimodalModel,
    check_state_dict,
    create_model,
    load_model,
    save_model,
)
from mmtrain.models.towers import Tower

__all__ = [
    "ModelFileError",
    "MultimodalModel",
    "Tower",
    "check_state_dict",
    "create_model",
    "load_model",
    "save_model",
]
