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
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mmtrain import __version__
from mmtrain.atomic import atomic_open, atomic_write_text, fsync_dir, sha256_file
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder and the reason."""


class NewerCheckpointError(CheckpointError, FieldError):
    """A checkpoint written by a newer mmtrain (a higher schema version). Refused rather than
    skipped: resuming from an older checkpoint would silently throw the newer work away. A
    FieldError too (`path` is the folder), so the CLI reports it with exit code 2."""

    def __init__(self, path: str | Path, message: str):
        FieldError.__init__(self, str(path), message)


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
    try:
        _write_files(tmp, step, model, state, meta)
    except (OSError, SafetensorError) as err:
        # A full disk or a quota: drop the half-written folder (it frees what the write took);
        # the previous checkpoints were never touched.
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"cannot write checkpoint {final}: {err}. The newest valid checkpoint in {root} is "
            "unchanged; free disk space (or lower checkpoint.keep) and run the same command "
            "again to resume from it"
        ) from err

    if final.exists():  # the same step saved again (e.g. replayed after a rollback)
        # Renamed aside, not deleted first: the window without a `step_N` folder is one rename.
        aside = root / f".{final.name}.replaced"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    if keep is not None:
        prune(root, keep)
    return final


def _write_files(
    tmp: Path,
    step: int,
    model: dict[str, torch.Tensor],
    state: dict[str, Any] | None,
    meta: dict[str, Any] | None,
) -> None:
    """The checkpoint's files in `tmp`, each fsynced, the manifest last, then the folder."""
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
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int):
        return [f"{manifest_path}: no integer schema_version (not an mmtrain manifest)"]
    if version > SCHEMA_VERSION:
        return [_newer_message(manifest_path, version)]
    problems = []
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != expected["bytes"]:
            problems.append(
                f"{file}: {file.stat().st_size} bytes, manifest says {expected['bytes']}"
            )
        elif hashes and sha256_file(file) != expected["sha256"]:
            problems.append(f"{file}: sha256 differs from the manifest (corrupt)")
    return problems


def _newer_message(manifest_path: Path, version: int) -> str:
    return (
        f"{manifest_path}: schema version {version} is newer than this mmtrain "
        f"({__version__}, schema {SCHEMA_VERSION}) reads; upgrade mmtrain to resume from it"
    )


def _newer_schema(path: Path) -> int | None:
    """The schema version of checkpoint `path` when it is newer than ours, else None."""
    try:
        version = json.loads((path / MANIFEST_FILE).read_text()).get("schema_version")
    except (OSError, ValueError, AttributeError):
        return None
    return version if isinstance(version, int) and version > SCHEMA_VERSION else None


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


def latest_checkpoint(root: str | Path, at_most_step: int | None = None) -> Path | None:
    """The newest checkpoint under `root` whose manifest verifies; corrupt ones are skipped.
    `at_most_step` ignores checkpoints of later steps (a rollback must land before the first
    bad step, not on a checkpoint written after it).

    Raises NewerCheckpointError when a newer mmtrain wrote one of the checkpoints it looks at.
    """
    for step, path in reversed(list_checkpoints(root)):
        if at_most_step is not None and step > at_most_step:
            continue
        problems = verify_checkpoint(path)
        if not problems:
            return path
        version = _newer_schema(path)
        if version is not None:
            raise NewerCheckpointError(
                path,
                f"written by a newer mmtrain (checkpoint schema {version}, this mmtrain "
                f"{__version__} reads schema {SCHEMA_VERSION}); upgrade mmtrain to resume from "
                "it, or move it out of the run folder to resume from an older checkpoint",
            )
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Load a verified checkpoint folder; raises CheckpointError naming what is wrong."""
    path = Path(path)
    problems = verify_checkpoint(path)
    version = _newer_schema(path) if problems else None
    if version is not None:
        raise NewerCheckpointError(path, problems[0])
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
    valid = [
        path for _, path in list_checkpoints(root) if not verify_checkpoint(path, hashes=False)
    ]
    for path in valid[:-keep]:
        shutil.rmtree(path)
    fsync_dir(root)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
