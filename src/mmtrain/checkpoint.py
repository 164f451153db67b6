"""Atomic, verifiable, resumable checkpoints.

Layout: `ROOT/step_NNNNNNNN/` holding
- `model.safetensors`  model weights (safetensors: no code runs on load),
- `state.pt`           optimizer, scheduler, scaler, loader and RNG state, as tensors, numbers,
                       strings, lists and dicts only, so `torch.load(weights_only=True)` reads it,
- `meta.json`          step, schema version, mmtrain version, format, the resolved config,
- `manifest.json`      size and sha256 of each file above, written last.

That is the "full" format, written by rank 0 alone. The "sharded" format (`save_sharded_checkpoint`,
for FSDP) replaces `model.safetensors` and the optimizer entry of `state.pt` by `dcp/`: every rank
writes its own shards of the weights and the optimizer state there with
`torch.distributed.checkpoint` (DCP), which records how they were split, so the checkpoint loads
on any number of ranks or in one plain process (`read_sharded`, `load_weights`). The manifest
lists every file, `dcp/*` included. DCP's `dcp/.metadata` is a pickle: like any pickle, load
sharded checkpoints only from run folders you trust (the manifest detects damage, not forgery).

A checkpoint is written as `step_NNNNNNNN.tmp/`, every file fsynced, then the folder is renamed
and the parent fsynced. The newest folder whose manifest verifies is the checkpoint to resume
from; there is no "latest" pointer to corrupt. Corrupt or truncated checkpoints are skipped with
a warning, never deleted, so a user can inspect them.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mmtrain import __version__, distributed
from mmtrain.atomic import atomic_open, atomic_write_text, fsync_dir, sha256_file
from mmtrain.distributed import agree_any
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
DCP_DIR = "dcp"  # the sharded format's torch.distributed.checkpoint folder
FORMATS = ("full", "sharded")
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

    @property
    def format(self) -> str:
        """The layout: "full" (weights in `model`, optimizer in `state`) or "sharded" (both in
        `dcp/`, read with `read_sharded`; `model` is empty). Older checkpoints are full."""
        return self.meta.get("format", "full")


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
    """Write checkpoint `step` under `root` atomically; keep only the newest `keep` valid ones.
    The full format: one process (rank 0) writes it all."""
    final, tmp = _folders(Path(root), step)
    _fresh(tmp)
    try:
        _write_files(tmp, step, "full", model, state, meta)
    except (OSError, SafetensorError) as err:
        raise _write_failed(final, tmp, err) from err
    _commit(final, tmp, keep)
    return final


def save_sharded_checkpoint(
    root: str | Path,
    step: int,
    sharded: dict[str, Any],
    state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    keep: int | None = None,
) -> Path:
    """Write checkpoint `step` in the sharded format: a collective, every rank calls it.

    Every rank writes its part of `sharded` (`parallel.sharded_state_dict`: {"model": ...,
    "optimizer": ...}, FSDP's DTensor shards or plain tensors) into `step_N.tmp/dcp/` with
    `torch.distributed.checkpoint.save`, which fsyncs each file. The ranks then share the
    hashing of those files, and rank 0 writes `state.pt`, `meta.json` and the manifest and
    renames the folder, as `save_checkpoint` does. `root` must be one filesystem all ranks see.
    Raises CheckpointError on every rank when any part fails (the folder stays `.tmp`).
    """
    final, tmp = _folders(Path(root), step)
    lead = not _distributed() or dist.get_rank() == 0  # rank 0 makes and finishes the folder
    error: BaseException | None = None
    if lead:
        try:
            _fresh(tmp)
            (tmp / DCP_DIR).mkdir()
        except OSError as err:
            error = err
    _raise_on_every_rank(error, final, tmp, lead)  # a collective: the folder exists after it
    try:
        writer = dcp.FileSystemWriter(tmp / DCP_DIR, sync_files=True)
        with _single_process_is_intended():
            dcp.save(sharded, storage_writer=writer, no_dist=not _distributed())
        hashed = _hash_shared(tmp, DCP_DIR)
    except (OSError, dcp.CheckpointException) as err:  # DCP raises on every rank alike
        raise _write_failed(final, tmp, err, remove=lead) from err
    if lead:
        try:
            fsync_dir(tmp / DCP_DIR)
            _write_files(tmp, step, "sharded", None, state, meta, hashed)
            _commit(final, tmp, keep)
        except OSError as err:
            error = err
    _raise_on_every_rank(error, final, tmp, lead)
    return final


def _distributed() -> bool:
    return distributed.world_size() > 1


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: here that is the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _folders(root: Path, step: int) -> tuple[Path, Path]:
    """Checkpoint `step`'s final folder and the temporary one it is written as."""
    final = root / step_dir_name(step)
    return final, root / (final.name + ".tmp")


def _fresh(tmp: Path) -> None:
    """Make `tmp` (and its parent) empty and ready to write into."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by a run killed mid-write: never valid, safe to drop
        shutil.rmtree(tmp)
    tmp.mkdir()


def _write_failed(
    final: Path, tmp: Path, err: BaseException, remove: bool = True
) -> CheckpointError:
    """The error for a failed write. A full disk or a quota: drop the half-written folder (it
    frees what the write took); the previous checkpoints were never touched."""
    if remove:
        shutil.rmtree(tmp, ignore_errors=True)
    return CheckpointError(
        f"cannot write checkpoint {final}: {err}. The newest valid checkpoint in {final.parent} "
        "is unchanged; free disk space (or lower checkpoint.keep) and run the same command "
        "again to resume from it"
    )


def _raise_on_every_rank(error: BaseException | None, final: Path, tmp: Path, lead: bool) -> None:
    """Raise CheckpointError on every rank when `error` happened on any (a collective), so no
    rank waits forever in the next collective for one that gave up."""
    if not agree_any([error is not None])[0]:
        return
    if error is None:
        error = OSError("rank 0 could not write its part; its log says why")
    raise _write_failed(final, tmp, error, remove=lead)


def _commit(final: Path, tmp: Path, keep: int | None) -> None:
    """Rename the finished `tmp` to `final` (replacing an older copy), then prune to `keep`."""
    root = final.parent
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


def _write_files(
    tmp: Path,
    step: int,
    layout: str,
    model: dict[str, torch.Tensor] | None,
    state: dict[str, Any] | None,
    meta: dict[str, Any] | None,
    hashed: dict[str, dict[str, Any]] | None = None,
) -> None:
    """The checkpoint's files in `tmp`, each fsynced, the manifest last, then the folder.
    `hashed`: manifest entries of files already in `tmp` (the sharded format's `dcp/*`)."""
    names = [STATE_FILE, META_FILE]
    if model is not None:
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.items()}
        save_file(tensors, str(tmp / MODEL_FILE))
        _fsync_file(tmp / MODEL_FILE)
        names.insert(0, MODEL_FILE)
    buffer = io.BytesIO()
    torch.save(state or {}, buffer)
    with atomic_open(tmp / STATE_FILE) as f:
        f.write(buffer.getvalue())
    full_meta = {"step": step, "schema_version": SCHEMA_VERSION, "mmtrain_version": __version__}
    full_meta.update(meta or {})
    full_meta["format"] = layout
    atomic_write_text(tmp / META_FILE, json.dumps(full_meta, indent=2, default=str))
    files = {name: _file_entry(tmp / name) for name in names}
    files.update(hashed or {})
    manifest = {"schema_version": SCHEMA_VERSION, "step": step, "files": files}
    atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2))
    fsync_dir(tmp)


def _file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _hash_shared(tmp: Path, folder: str) -> dict[str, dict[str, Any]]:
    """Manifest entries of the files below `tmp / folder` ("dcp/__0_0.distcp": ...). Rank 0
    lists them; rank r hashes every world_size-th one from the r-th (a collective), so the
    read-back costs each rank its share rather than rank 0 the whole checkpoint."""

    def listing() -> list[str]:
        files = sorted(p for p in (tmp / folder).rglob("*") if p.is_file())
        return [p.relative_to(tmp).as_posix() for p in files]

    if not _distributed():
        return {name: _file_entry(tmp / name) for name in listing()}
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [listing() if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)  # one list for all, whatever each rank sees
    mine = {name: _file_entry(tmp / name) for name in names[0][rank::world]}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {name: entry for part in everyone for name, entry in part.items()}


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


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", verify: bool = True
) -> Checkpoint:
    """Load a checkpoint folder; raises CheckpointError naming what is wrong. `verify=False`
    skips re-hashing a folder `latest_checkpoint` has just verified.
    A sharded checkpoint's weights and optimizer state stay on disk (`model` is empty): every
    rank reads its own part into its model with `read_sharded`."""
    path = Path(path)
    meta = read_meta(path, verify)
    layout = meta.get("format", "full")
    model = load_file(str(path / MODEL_FILE), device=str(map_location)) if layout == "full" else {}
    state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
    return Checkpoint(path=path, step=int(meta["step"]), model=model, state=state, meta=meta)


def read_meta(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """`meta.json` of a usable checkpoint folder (its manifest verified unless `verify=False`,
    its format one this mmtrain reads); raises CheckpointError naming what is wrong."""
    path = Path(path)
    problems = verify_checkpoint(path, hashes=verify)
    version = _newer_schema(path) if problems else None
    if version is not None:
        raise NewerCheckpointError(path, problems[0])
    if problems:
        raise CheckpointError(f"checkpoint {path} is not usable: {'; '.join(problems)}")
    meta = json.loads((path / META_FILE).read_text())
    layout = meta.get("format", "full")
    if layout not in FORMATS:
        raise CheckpointError(
            f"{path / META_FILE}: unknown checkpoint format {layout!r} (this mmtrain reads "
            f"{', '.join(FORMATS)}); upgrade mmtrain to resume from it"
        )
    return meta


def read_sharded(path: str | Path, sharded: dict[str, Any]) -> None:
    """Fill `sharded` ({"model": ..., "optimizer": ...} as `parallel.sharded_state_dict` gives
    for THIS run) in place from checkpoint `path`'s `dcp/`. DCP reads, for each tensor, the
    part of the saved shards it covers: the checkpoint loads on any number of ranks, also in
    one process without a process group (plain tensors get the whole of each)."""
    path = Path(path)
    try:
        reader = dcp.FileSystemReader(path / DCP_DIR)
        with _single_process_is_intended():
            dcp.load(sharded, storage_reader=reader, no_dist=not _distributed())
    except (OSError, RuntimeError, dcp.CheckpointException) as err:
        raise CheckpointError(
            f"cannot read the sharded checkpoint {path / DCP_DIR}: {err}. When its manifest "
            "verifies, the model or optimizer differs from the run that wrote it (model spec, "
            "frozen towers, optimizer settings): resume with the same config"
        ) from err


def load_weights(path: str | Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full model weights of checkpoint folder `path`, in either format, on the CPU of this
    process alone, with or without a process group: for single-process tools (evaluation,
    galleries, conversion) that want one state dict, also from a sharded checkpoint. Reads the
    weights only (never the optimizer state)."""
    path = Path(path)
    if read_meta(path, verify).get("format", "full") == "full":
        return load_file(str(path / MODEL_FILE), device="cpu")
    reader = dcp.FileSystemReader(path / DCP_DIR)
    weights = {
        key.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in reader.read_metadata().state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, dcp.TensorStorageMetadata)
    }
    with _single_process_is_intended():
        dcp.load({"model": weights}, storage_reader=reader, no_dist=True)
    return weights


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
