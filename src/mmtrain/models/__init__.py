"""Plain PyTorch modules built from a `ModelSpec`: stems, shared transformer blocks, towers, heads.

`create_model(spec)` builds and initialises (a `LanguageModel` when the spec has a decoder);
`save_model` / `load_model` read and write a model folder (model.safetensors + spec.yaml).
"""

from mmtrain.models.build import (
    ModelFileError,
    check_state_dict,
    create_model,
    load_model,
    save_model,
)
from mmtrain.models.multimodal import MultimodalModel
from mmtrain.models.towers import Tower
from mmtrain.models.vlm import LanguageModel

__all__ = [
    "LanguageModel",
    "ModelFileError",
    "MultimodalModel",
    "Tower",
    "check_state_dict",
    "create_model",
    "load_model",
    "save_model",
]
