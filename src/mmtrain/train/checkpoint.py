"""Atomic, verifiable, resumable checkpoints.

Layout: `ROOT/step_NNNNNNNN/` holding
- `model.safetensors`  model weights (safetensors: no code runs on load),
- `state.pt`           optimizer, scheduler, scaler, loader and RNG state, as tensors, numbers,
                       strings, lists and dicts only, so `torch.load(weights_only=True)` reads it,
- `meta.json`          step, schema version, mmtrain version, the resolved config,
- `manifest.json`      size and sha256 of each file above, written last.

A checkpoint is written as `step_NNNNNNNN.tmp/`, every file fsynced, then the folder is renamed
and the parent fsynced. The newest folder whose manifest verifies is the checkpoint to resume
from; there is no "latest" pointer to corrupt. Corrupt or truncated checkpoints are skipped with
a warning, never deleted, so a user can inspect them.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mmtrain import __version__
from mmtrain.atomic import atomic_open, atomic_write_text, fsync_dir, sha256_file

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder and the reason."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    state: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(
    root: str | Path,
    step: int,
    model: dict[str, torch.Tensor],
    state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Write checkpoint `step` under `root` atomically; keep only the newest `keep` valid ones."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / (final.name + ".tmp")
    if tmp.exists():  # left by a run killed mid-write: never valid, safe to drop
        shutil.rmtree(tmp)
    tmp.mkdir()

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.items()}
    save_file(tensors, str(tmp / MODEL_FILE))
    _fsync_file(tmp / MODEL_FILE)
    buffer = io.BytesIO()
    torch.save(state or {}, buffer)
    with atomic_open(tmp / STATE_FILE) as f:
        f.write(buffer.getvalue())
    full_meta = {"step": step, "schema_version": SCHEMA_VERSION, "mmtrain_version": __version__}
    full_meta.update(meta or {})
    atomic_write_text(tmp / META_FILE, json.dumps(full_meta, indent=2, default=str))
    files = {
        name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        for name in (MODEL_FILE, STATE_FILE, META_FILE)
    }
    manifest = {"schema_version": SCHEMA_VERSION, "step": step, "files": files}
    atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2))
    fsync_dir(tmp)

    if final.exists():  # the same step saved again (e.g. a final save at a save step)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    if keep is not None:
        prune(root, keep)
    return final


def verify_checkpoint(path: str | Path, hashes: bool = True) -> list[str]:
    """Problems with the checkpoint folder at `path` (empty list: it is valid).

    `hashes=False` checks presence and sizes only: cheap enough to run at every save.
    """
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        return [f"{manifest_path}: missing (the write did not finish)"]
    except (OSError, ValueError) as err:
        return [f"{manifest_path}: unreadable ({err})"]
    version = manifest.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        return [
            f"{manifest_path}: schema version {version!r} is newer than this mmtrain "
            f"({__version__}, schema {SCHEMA_VERSION}) reads; upgrade mmtrain to resume from it"
        ]
    problems = []
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != expected["bytes"]:
            problems.append(f"{file}: {file.stat().st_size} bytes, manifest says {expected['bytes']}")
        elif hashes and sha256_file(file) != expected["sha256"]:
            problems.append(f"{file}: sha256 differs from the manifest (corrupt)")
    return problems


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """All finished (renamed) checkpoint folders under `root`, oldest first, valid or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` whose manifest verifies; corrupt ones are skipped."""
    for _, path in reversed(list_checkpoints(root)):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Load a verified checkpoint folder; raises CheckpointError naming what is wrong."""
    path = Path(path)
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is not usable: {'; '.join(problems)}")
    meta = json.loads((path / META_FILE).read_text())
    model = load_file(str(path / MODEL_FILE), device=str(map_location))
    state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
    return Checkpoint(path=path, step=int(meta["step"]), model=model, state=state, meta=meta)


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` valid checkpoints (corrupt ones are left for inspection)."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be at least 1, got {keep}")
    valid = [path for _, path in list_checkpoints(root) if not verify_checkpoint(path, hashes=False)]
    for path in valid[:-keep]:
        shutil.rmtree(path)
    fsync_dir(root)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
