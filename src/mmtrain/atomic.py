"""Atomic, verifiable writes: a reader never sees half a file.

Write to a temporary name in the same folder, fsync it, rename it over the target, fsync the
folder (so the rename itself survives a power cut). Used for shards, manifests, model weights and
checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

CHUNK_BYTES = 1 << 20


def fsync_dir(path: str | Path) -> None:
    """Persist a folder's entries (renames, new files). A no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | Path) -> Iterator[BinaryIO]:
    """Open `path` for binary writing; it appears under its name only if the block succeeds."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_save_npy(path: str | Path, array: Any) -> bool:
    """`np.save` of `array` to `path`, atomically; False when the folder takes no file (a
    read-only dataset: a cache beside it is then just not kept)."""
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    try:
        atomic_write_bytes(path, buffer.getvalue())
    except OSError:
        return False
    return True
