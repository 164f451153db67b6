"""A model folder's own processor: `AutoProcessor` as transformers loads it, images only where
the environment cannot build the video part.

transformers 5 defines its video processors only when torchvision is installed, and a
processor that takes one (Qwen3-VL's, InternVL's) then cannot be loaded at all. Without
torchvision the folder's processor class is built here from its own image processor and
tokenizer with no video processor, with the settings the folder saved: images are processed
exactly as `AutoProcessor` would, and a video sample is refused with the reason.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

from mmtrain.structured import FieldError

log = logging.getLogger(__name__)
PROCESSOR_CONFIG = "processor_config.json"


def load_processor(folder: str | Path) -> Any:
    """The processor of `folder` (a transformers ProcessorMixin)."""
    import transformers

    folder = Path(folder)
    try:
        return transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except (ImportError, AttributeError, OSError, ValueError, TypeError) as err:
        if has_torchvision():
            raise FieldError(
                "init", f"{folder}: transformers cannot load its processor: {err}"
            ) from None
        return _images_only(folder, err)


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def _images_only(folder: Path, why: Exception) -> Any:
    import transformers

    settings = _processor_settings(folder)
    name = settings.get("processor_class")
    cls = getattr(transformers, str(name), None)
    if cls is None:
        raise FieldError(
            "init", f"{folder / PROCESSOR_CONFIG}: no processor class {name!r} ({why})"
        ) from None
    if "video_processor" in inspect.signature(cls.__init__).parameters:
        cls = _without_video(cls)
    parts = {
        "image_processor": transformers.AutoImageProcessor.from_pretrained(str(folder)),
        "tokenizer": transformers.AutoTokenizer.from_pretrained(str(folder)),
    }
    accepted = inspect.signature(cls.__init__).parameters
    extra = {
        k: v
        for k, v in settings.items()
        if k in accepted and k not in parts and not isinstance(v, dict)
    }
    if "chat_template" in accepted:
        extra.setdefault("chat_template", parts["tokenizer"].chat_template)
    log.info("%s: %s without its video processor (torchvision is not installed)", folder, name)
    return cls(**parts, **extra)


def _without_video(cls: type) -> type:
    """`cls` whose video processor is None and left out of its signature (transformers lists
    a processor's parts from its __init__ and checks each against its class)."""

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, video_processor=None, **kwargs)

    signature = inspect.signature(cls.__init__)
    __init__.__signature__ = signature.replace(
        parameters=[p for n, p in signature.parameters.items() if n != "video_processor"]
    )
    return type(cls.__name__, (cls,), {"__init__": __init__})


def _processor_settings(folder: Path) -> dict[str, Any]:
    path = folder / PROCESSOR_CONFIG
    if not path.is_file():
        return json.loads((folder / "preprocessor_config.json").read_text(encoding="utf-8"))
    return json.loads(path.read_text(encoding="utf-8"))
