"""What a run's `model` / `init` names, told apart and found without torch: a preset or a spec file
(mmtrain's own), a model folder (config.json: transformers' layout), or a Hugging Face hub name
(`org/name`, found through the Hugging Face cache by models/hub/source.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from mmtrain.structured import FieldError

HF_CONFIG_FILE = "config.json"
# A hub name: `org/name` (one slash, no suffix), as the Hugging Face hub spells repositories.
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def is_model_folder(value: str | Path) -> bool:
    """A folder holding config.json (a transformers model folder)."""
    return (Path(value) / HF_CONFIG_FILE).is_file()


def is_hub_name(value: str, base: Path | None = None) -> bool:
    """`org/name` that names no existing path (against `base` when given): a folder or file of
    that name wins, and a spec file's suffix makes it a path."""
    if not HUB_NAME.match(value) or Path(value).suffix in SPEC_SUFFIXES:
        return False
    return not (Path(value).exists() or (base is not None and (base / value).exists()))


class HubModelError(FieldError):
    """A folder or name mmtrain cannot train as a hub model; `path` is the config key
    (`init` or `model`) that named it."""


def resolve_folder(source: str | Path, key: str = "init") -> Path:
    """The local folder of `source`: a folder holding config.json, or a hub name's snapshot in
    the Hugging Face cache (downloaded there when online and HF_HUB_OFFLINE is unset)."""
    text = str(source)
    if is_model_folder(text):
        return Path(text)
    if Path(text).exists():
        raise HubModelError(key, f"{text} holds no {HF_CONFIG_FILE}: not a model folder")
    if not is_hub_name(text):
        raise HubModelError(key, f"{text}: no such folder, and not a hub name (org/name)")
    return snapshot(text, key)


def snapshot(name: str, key: str) -> Path:
    """The folder of hub name `name` in the Hugging Face cache (downloaded there when online
    and HF_HUB_OFFLINE is unset); HubModelError naming `key` when it is not to be had."""
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        raise HubModelError(
            key, f"{name} is a hub name: install huggingface_hub (pip install 'mmtrain[hub]')"
        ) from None
    # Read at call time, not at huggingface_hub's import: a test or a job may set them late.
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        folder = huggingface_hub.snapshot_download(name, cache_dir=cache, local_files_only=offline)
    except Exception as err:  # noqa: BLE001 - huggingface_hub raises many kinds; say which
        how = "HF_HUB_OFFLINE is set: only the cache was read" if offline else "download failed"
        raise HubModelError(
            key,
            f"{name} is not in the Hugging Face cache {cache} ({how}: {type(err).__name__}: "
            f"{err}); download it (huggingface-cli download {name}) or give the folder",
        ) from None
    return Path(folder)


def read_json_object(path: Path, key: str) -> dict[str, Any]:
    """The JSON object in `path` (a config.json, model_index.json); HubModelError naming `key`
    and the file when it cannot be read or is not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise HubModelError(key, f"{path}: cannot read it as JSON ({err})") from None
    if not isinstance(data, dict):
        raise HubModelError(key, f"{path}: expected a JSON object")
    return data
