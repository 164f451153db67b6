"""Plain PyTorch modules built from a `ModelSpec`: stems, shared transformer blocks, towers, heads.

`create_model(spec)` builds and initialises (a `LanguageModel` when the spec has a decoder);
`save_model` / `load_model` read and write a model folder (model.safetensors + spec.yaml).
Checkpoints in other layouts (OpenCLIP, Hugging Face) are mapped onto these names by `formats/`.
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
