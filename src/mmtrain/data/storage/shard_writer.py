"""Write WebDataset tar shards atomically and reproducibly.

`ShardWriter` writes each shard under a temporary name in the same folder, fsyncs it, then
renames it, so a reader never sees half a shard. Member names are `KEY.EXTENSION`, as
`tar_index` reads them back; keys and extensions that a reader would refuse (absolute names,
`..`, pickle-like members) are refused here first. `manifest.write_manifest` (sizes and sha256
per shard) is written last, also atomically.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmtrain.atomic import fsync_dir
from mmtrain.data.storage.tar_index import BLOCK, PICKLE_EXTENSIONS
from mmtrain.structured import FieldError

_EXTENSION = re.compile(r"[a-z0-9][a-z0-9_.\-]*")

__all__ = ["ShardWriter"]


class _HashingFile:
    """A write-only file that also hashes and counts what goes through it."""

    def __init__(self, f: Any):
        self.f = f
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes) -> int:
        if self.f is None:  # aborted: tarfile's late flush of its buffer goes nowhere
            return len(data)
        self.sha256.update(data)
        self.bytes += len(data)
        return self.f.write(data)


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _member_name(key: str, ext: str) -> str:
    return f"{key}.{ext}"


def _check_sample(sample: Mapping[str, Any]) -> tuple[str, list[tuple[str, bytes]]]:
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise FieldError("__key__", "every sample needs a non-empty string key")
    base = key.rsplit("/", 1)[-1]
    if not base or "." in base or key.startswith("/") or ".." in key.split("/") or "\0" in key:
        raise FieldError(
            "__key__",
            f"{key!r} is not a safe shard key (no dot in its last part, no '..', not absolute)",
        )
    members = []
    for ext, value in sample.items():
        if ext.startswith("__"):
            continue  # __key__, and webdataset metadata such as __url__
        if not _EXTENSION.fullmatch(ext):
            raise FieldError(ext, f"sample {key!r}: extensions are lower-case [a-z0-9_.-]")
        if ext.rsplit(".", 1)[-1] in PICKLE_EXTENSIONS:
            raise FieldError(ext, f"sample {key!r}: pickle-like members are not written")
        if isinstance(value, str):
            value = value.encode("utf-8")
        elif isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        elif not isinstance(value, bytes):
            raise FieldError(
                ext, f"sample {key!r}: expected bytes or str, got {type(value).__name__}"
            )
        members.append((ext, value))
    if not members:
        raise FieldError("__key__", f"sample {key!r} has no members")
    return key, members


class ShardWriter:
    """Write samples into `PREFIX-NNNNNN.tar` shards of at most `max_samples` and `max_bytes`.

    Each shard is written under a temporary name in `out_dir`, fsynced and renamed when full or
    at `close()`; on an exception inside `with`, the unfinished shard is deleted and the finished
    ones stay. A sample is never split: one larger than `max_bytes` gets a shard of its own.
    Member headers carry fixed metadata (mtime 0, uid 0), so the same samples give the same bytes.
    """

    def __init__(
        self,
        out_dir: str | Path,
        prefix: str = "shard",
        max_samples: int = 10_000,
        max_bytes: int = 1 << 30,
        start_index: int = 0,
    ):
        if max_samples < 1 or max_bytes < 1:
            raise FieldError("max_samples", "max_samples and max_bytes must be positive")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self.next_index = start_index
        self.shards: list[dict[str, Any]] = []  # finished shards
        self._file: Any = None
        self._hash: _HashingFile | None = None
        self._tar: Any = None
        self._tmp: Path | None = None
        self._name = ""
        self._samples = 0
        self._bytes = 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample (`__key__` and extension -> bytes or str)."""
        key, members = _check_sample(sample)
        size = sum(BLOCK + _padded(len(data)) for _, data in members)
        if self._tar is not None and (
            self._samples >= self.max_samples or self._bytes + size > self.max_bytes
        ):
            self._finish()
        if self._tar is None:
            self._start()
        for ext, data in members:
            info = tarfile.TarInfo(_member_name(key, ext))
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0
            self._tar.addfile(info, _BytesReader(data))
        self._samples += 1
        self._bytes += size

    def close(self) -> list[dict[str, Any]]:
        """Finish the current shard; the list of `{"name", "samples", "bytes", "sha256"}`."""
        if self._tar is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        """Drop the unfinished shard (its temporary file); finished shards stay."""
        if self._tar is not None:
            self._hash.f = None
            try:
                self._file.close()
            finally:
                self._tmp.unlink(missing_ok=True)
                self._tar = self._file = self._hash = None

    def _start(self) -> None:
        self._name = f"{self.prefix}-{self.next_index:06d}.tar"
        self.next_index += 1
        self._tmp = self.out_dir / f".{self._name}.tmp"
        self._file = open(self._tmp, "wb")
        self._hash = _HashingFile(self._file)
        self._tar = tarfile.open(fileobj=self._hash, mode="w|", format=tarfile.PAX_FORMAT)
        self._samples = self._bytes = 0

    def _finish(self) -> None:
        self._tar.close()  # writes the end-of-archive blocks
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.out_dir / self._name)
        fsync_dir(self.out_dir)
        self.shards.append(
            {
                "name": self._name,
                "samples": self._samples,
                "bytes": self._hash.bytes,
                "sha256": self._hash.sha256.hexdigest(),
            }
        )
        self._tar = self._file = self._hash = None


class _BytesReader:
    """The minimal file object `tarfile.addfile` reads member data from."""

    def __init__(self, data: bytes):
        self.view = memoryview(data)
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n < 0 else self.pos + n
        chunk = self.view[self.pos : end]
        self.pos += len(chunk)
        return bytes(chunk)
