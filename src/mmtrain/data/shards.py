"""WebDataset tar shards: read them as they are, index them, write them atomically.

A shard is a plain POSIX tar file. A member's *key* is its path up to the first dot of its file
name and its *extension* the rest, lower-cased (`a/b/0001.seg.JPG` -> key `a/b/0001`, extension
`seg.jpg`), exactly as webdataset, img2dataset and video2dataset name them. Adjacent members with
one key form a sample: `{"__key__": key, extension: bytes, ...}`.

Reading never extracts anything: the tar headers are parsed here (a small ustar/GNU/pax reader,
much faster than `tarfile` for indexing) and member bytes are read into memory with `os.pread`.
Members that could hurt when a careless tool extracts or loads them (absolute names, `../`,
links, devices, fifos) and pickle-like members (`.pth`, `.pickle`, `.pyd`, ...: loading them runs
code) are refused: they never reach a sample and are reported with the shard and member name.
A truncated or damaged shard yields the samples before the damage, then a `TruncatedShardError`
naming the shard and the byte offset.

Writing goes through `ShardWriter`: each shard under a temporary name in the same folder, fsynced,
then renamed, so a reader never sees half a shard; `manifest.json` (sizes and sha256 per shard) is
written last, also atomically, and `verify_manifest` checks a folder against it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mmtrain.atomic import atomic_write_text, fsync_dir, sha256_file
from mmtrain.structured import FieldError

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
BLOCK = 512
# Loading these runs arbitrary code (pickle, torch.load): never handed to a decoder.
PICKLE_EXTENSIONS = frozenset({"pth", "pt", "pickle", "pkl", "pyd"})
_META_NAME = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, skipped silently
_EXTENSION = re.compile(r"[a-z0-9][a-z0-9_.\-]*")
_MAX_META_BYTES = 1 << 20  # a pax or GNU long-name header larger than this is damage, not a name
_MAX_OPEN_SHARDS = 64

__all__ = [
    "ShardError",
    "TruncatedShardError",
    "SkippedMember",
    "ShardIndex",
    "ShardSet",
    "ShardWriter",
    "split_member_name",
    "index_shard",
    "read_shard",
    "expand_shards",
    "expand_braces",
    "write_manifest",
    "read_manifest",
    "parse_manifest",
    "verify_manifest",
    "ShardProblem",
]


class ShardError(ValueError):
    """A shard cannot be read as a tar file (message names the shard)."""


class TruncatedShardError(ShardError):
    """A shard ends or breaks at byte `offset`; the samples before it are usable."""

    def __init__(self, shard: str | Path, offset: int, reason: str):
        self.shard = str(shard)
        self.offset = offset
        self.reason = reason
        super().__init__(
            f"{self.shard}: damaged at byte {offset}: {reason}; samples before it are used, the "
            "rest of the shard is lost (rebuild it or drop it from the manifest)"
        )


@dataclass(frozen=True)
class SkippedMember:
    """A tar member that was refused or ignored, and why."""

    shard: str
    member: str
    reason: str

    def __str__(self) -> str:
        return f"{self.shard}: {self.member}: {self.reason}"


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name as webdataset splits it, or None without an extension."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:  # no dot in the file name, or the file name starts with one
        return None
    return name[:dot], name[dot + 1 :].lower()


# ----------------------------------------------------------------------------- tar headers
@dataclass(frozen=True)
class _Member:
    name: str
    kind: bytes  # typeflag
    header_offset: int
    data_offset: int
    size: int


def _number(field: bytes) -> int:
    """A tar numeric field: octal text, or GNU base-256 when the high bit is set."""
    if field and field[0] & 0x80:
        if field[0] == 0xFF:
            raise ValueError("negative number")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    return int(text, 8) if text else 0


def _checksum_ok(block: bytes) -> bool:
    stored = _number(block[148:156])
    unsigned = sum(block[:148]) + sum(block[156:]) + 8 * 32  # the field itself counts as spaces
    if stored == unsigned:
        return True
    high = sum(1 for b in block[:148] + block[156:] if b > 127)  # old tars summed signed bytes
    return stored == unsigned - 256 * high


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_records(data: bytes) -> dict[str, str]:
    """Parse `LEN key=value\\n` records of a pax extended header."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        if length <= 0:
            raise ValueError("bad pax record length")
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def _members(fd: int, file_bytes: int, shard: str | Path) -> Iterator[_Member]:
    """Every member of a tar file in order, raising TruncatedShardError at damage."""
    offset = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    if file_bytes == 0:
        raise TruncatedShardError(shard, 0, "empty file")
    while True:
        if offset >= file_bytes:  # every tar writer ends with zero blocks: this one was cut
            raise TruncatedShardError(
                shard, file_bytes, "no end-of-archive marker (truncated file)"
            )
        block = os.pread(fd, BLOCK, offset)
        if len(block) < BLOCK:
            raise TruncatedShardError(shard, offset, "truncated tar header")
        if block == bytes(BLOCK):
            return  # end-of-archive marker
        try:
            valid = _checksum_ok(block)
            size = _number(block[124:136])
        except ValueError:
            valid = False
        if not valid:
            raise TruncatedShardError(shard, offset, "invalid tar header (bad checksum)")
        kind = block[156:157]
        data_offset = offset + BLOCK
        if kind in (b"x", b"g", b"L", b"K"):
            if size > _MAX_META_BYTES or data_offset + size > file_bytes:
                raise TruncatedShardError(shard, offset, "truncated or oversized tar metadata")
            data = os.pread(fd, size, data_offset)
            try:
                if kind == b"x":
                    pax = _pax_records(data)
                elif kind == b"L":
                    long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            except ValueError as err:
                raise TruncatedShardError(shard, offset, f"bad pax header ({err})") from None
            offset = data_offset + -(-size // BLOCK) * BLOCK
            continue
        name = _text(block[0:100])
        if block[257:263] == b"ustar\0" and block[345] != 0:  # POSIX ustar splits long names
            name = _text(block[345:500]) + "/" + name
        name = pax.get("path", long_name or name)
        if "size" in pax:
            size = int(pax["size"])
        long_name, pax = None, {}
        if data_offset + size > file_bytes:
            raise TruncatedShardError(shard, offset, f"data of member {name!r} is truncated")
        yield _Member(name, kind, offset, data_offset, size)
        offset = data_offset + -(-size // BLOCK) * BLOCK


def _refusal(member: _Member) -> str | None:
    """Why a member must not become part of a sample; None for a regular, safe file."""
    if member.kind in (b"1", b"2"):
        return "link refused (links can point outside the data)"
    if member.kind in (b"3", b"4"):
        return "device file refused"
    if member.kind == b"6":
        return "fifo refused"
    if member.kind not in (b"0", b"\0", b"7"):
        return f"unsupported tar member type {member.kind!r} refused"
    if member.name.startswith("/"):
        return "absolute name refused"
    if ".." in member.name.split("/"):
        return "path traversal ('..') refused"
    return None


# ----------------------------------------------------------------------------- index
@dataclass
class ShardIndex:
    """Where every sample of one shard lies: keys, and per member its extension, offset and size.

    Stored as flat numpy arrays (members of sample i are `bounds[i]:bounds[i+1]`), so an index of
    millions of samples stays small and a position maps to byte ranges without scanning.
    """

    path: Path
    file_bytes: int
    keys: list[str]
    bounds: np.ndarray  # int64 [samples + 1]
    ext_ids: np.ndarray  # int32 [members], into `exts`
    exts: tuple[str, ...]
    offsets: np.ndarray  # int64 [members], byte offset of the member's data
    sizes: np.ndarray  # int64 [members]
    skipped: tuple[SkippedMember, ...] = ()
    damage: TruncatedShardError | None = None
    # A shard in object storage (`shard_cache.RemoteShardIndex`) is read from a local cache.
    remote: ClassVar[bool] = False
    open_limit: ClassVar[int] = _MAX_OPEN_SHARDS  # open files a ShardSet keeps for such shards

    def __len__(self) -> int:
        return len(self.keys)

    def local_path(self) -> Path:
        """The file to open for reading (a remote shard is fetched into the cache first)."""
        return self.path

    def stale(self, fd: int) -> bool:
        """Whether an open `fd` of this shard should be reopened (a remote one was evicted)."""
        return False

    @property
    def name(self) -> str:
        return self.path.name

    def extensions(self, i: int) -> list[str]:
        lo, hi = self.bounds[i], self.bounds[i + 1]
        return [self.exts[e] for e in self.ext_ids[lo:hi]]

    def extension_counts(self) -> dict[str, int]:
        """Number of samples holding each extension (an extension occurs once per sample)."""
        counts = np.bincount(self.ext_ids, minlength=len(self.exts))
        return {ext: int(n) for ext, n in zip(self.exts, counts, strict=True) if n}

    def read(self, i: int, fd: int) -> dict[str, Any]:
        """Sample i as `{"__key__": key, ext: bytes}`, read from the open file descriptor `fd`."""
        lo, hi = int(self.bounds[i]), int(self.bounds[i + 1])
        offsets, sizes = self.offsets[lo:hi], self.sizes[lo:hi]
        start, end = int(offsets[0]), int(offsets[-1] + sizes[-1])
        sample: dict[str, Any] = {"__key__": self.keys[i]}
        names = [self.exts[e] for e in self.ext_ids[lo:hi]]
        if end - start <= int(sizes.sum()) + 4 * BLOCK * (hi - lo):
            # Members of a sample are adjacent: one read for all of them.
            span = os.pread(fd, end - start, start)
            if len(span) != end - start:
                raise ShardError(
                    f"{self.path}: short read at byte {start}; the shard changed on disk"
                )
            view = memoryview(span)
            for ext, off, size in zip(names, offsets, sizes, strict=True):
                sample[ext] = bytes(view[off - start : off - start + size])
            return sample
        for ext, off, size in zip(
            names, offsets, sizes, strict=True
        ):  # a refused member lies in between
            data = os.pread(fd, int(size), int(off))
            if len(data) != size:
                raise ShardError(
                    f"{self.path}: short read at byte {off}; the shard changed on disk"
                )
            sample[ext] = data
        return sample


def index_shard(path: str | Path) -> ShardIndex:
    """Scan the tar headers of one shard (no member data is read) into a `ShardIndex`.

    Refused members go to `.skipped`; damage stops the scan and goes to `.damage`, keeping the
    complete samples before it (the sample the damage interrupts is dropped: it may miss parts).
    """
    path = Path(path)
    keys: list[str] = []
    bounds: list[int] = [0]
    ext_ids: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    exts: dict[str, int] = {}
    skipped: list[SkippedMember] = []
    damage = None
    current: set[str] = set()  # extensions of the sample being grouped

    def close_sample() -> None:
        if len(ext_ids) > bounds[-1]:
            bounds.append(len(ext_ids))

    fd = os.open(path, os.O_RDONLY)
    try:
        file_bytes = os.fstat(fd).st_size
        for member in _members(fd, file_bytes, path):
            if member.kind == b"5":
                continue  # folders carry no data
            reason = _refusal(member)
            split = split_member_name(member.name)
            if reason is None and split is None:
                if _META_NAME.match(member.name):
                    continue
                reason = "no extension in the file name: not part of a sample"
            if reason is None and split[1].rsplit(".", 1)[-1] in PICKLE_EXTENSIONS:
                reason = "pickle-like member refused (loading it would run code)"
            if reason is None and (not keys or split[0] != keys[-1]):
                close_sample()
                keys.append(split[0])
                current = set()
            if reason is None and split[1] in current:
                reason = f"second {split[1]!r} member for key {split[0]!r} ignored"
            if reason is not None:
                skipped.append(SkippedMember(str(path), member.name, reason))
                continue
            current.add(split[1])
            ext_ids.append(exts.setdefault(split[1], len(exts)))
            offsets.append(member.data_offset)
            sizes.append(member.size)
    except TruncatedShardError as err:
        damage = err
        del ext_ids[bounds[-1] :], offsets[bounds[-1] :], sizes[bounds[-1] :]
    finally:
        os.close(fd)
    close_sample()
    keys = keys[: len(bounds) - 1]  # a key whose members were all cut off by the damage
    if skipped:
        logger.warning(
            "%s: %d member(s) refused or ignored, e.g. %s", path, len(skipped), skipped[0]
        )
    if damage is not None:
        logger.warning("%s", damage)
    return ShardIndex(
        path=path,
        file_bytes=file_bytes,
        keys=keys,
        bounds=np.asarray(bounds, dtype=np.int64),
        ext_ids=np.asarray(ext_ids, dtype=np.int32),
        exts=tuple(exts),
        offsets=np.asarray(offsets, dtype=np.int64),
        sizes=np.asarray(sizes, dtype=np.int64),
        skipped=tuple(skipped),
        damage=damage,
    )


def read_shard(path: str | Path) -> Iterator[dict[str, Any]]:
    """Samples of one shard in file order, member bytes in memory, nothing extracted.

    Refused members are logged and left out (see `index_shard(path).skipped` for the list). A
    damaged shard yields its samples before the damage, then raises `TruncatedShardError`.
    """
    index = index_shard(path)
    fd = os.open(index.path, os.O_RDONLY)
    try:
        for i in range(len(index)):
            yield index.read(i, fd)
    finally:
        os.close(fd)
    if index.damage is not None:
        raise index.damage


class ShardSet:
    """The indexed samples of a list of shards, addressed by one flat sample id.

    Sample ids run shard after shard in list order. File descriptors are opened lazily and per
    process (they are not pickled to DataLoader workers), and reads use `os.pread`, so processes
    and threads never share a file offset.
    """

    def __init__(self, shards: Sequence[ShardIndex]):
        self.shards = list(shards)
        counts = np.asarray([len(s) for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._fds: dict[int, int] = {}

    @classmethod
    def open(
        cls, spec: str | Path | Sequence[str | Path], threads: int = 8, cache: Any = None
    ) -> ShardSet:
        """Expand `spec` (see `expand_shards`) and index every shard, `threads` at a time.

        `s3://` specs are read through `cache` (a `shard_cache.ShardCache`; default: the user's
        cache folder, see `shard_cache.default_cache`).
        """
        if not isinstance(spec, Path) and _names_remote(spec):
            from mmtrain.data.shard_cache import open_remote_indexes

            return cls(open_remote_indexes(spec, cache, threads))
        paths = expand_shards(spec)
        with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
            return cls(list(pool.map(index_shard, paths)))

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def remote(self) -> bool:
        return any(s.remote for s in self.shards)

    def sizes(self) -> list[int]:
        """Samples per shard, in list order."""
        return [len(s) for s in self.shards]

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard number, sample number inside that shard) of flat sample id `sample`."""
        if not 0 <= sample < len(self):
            raise IndexError(f"sample {sample} out of range 0..{len(self) - 1}")
        shard = int(np.searchsorted(self.starts, sample, side="right")) - 1
        return shard, sample - int(self.starts[shard])

    def key(self, sample: int) -> str:
        shard, local = self.locate(sample)
        return self.shards[shard].keys[local]

    def shard_path(self, sample: int) -> Path:
        return self.shards[self.locate(sample)[0]].path

    def read(self, sample: int) -> dict[str, Any]:
        """Sample `sample` as `{"__key__": key, ext: bytes}`."""
        shard, local = self.locate(sample)
        return self.shards[shard].read(local, self._fd(shard))

    def fingerprint(self) -> str:
        """Short hash of shard names and sample counts: which data a saved loader state is for."""
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(f"{shard.name}\0{len(shard)}\n".encode())
        return digest.hexdigest()[:16]

    def skipped(self) -> list[SkippedMember]:
        return [m for s in self.shards for m in s.skipped]

    def damaged(self) -> list[TruncatedShardError]:
        return [s.damage for s in self.shards if s.damage is not None]

    def _fd(self, shard: int) -> int:
        index = self.shards[shard]
        fd = self._fds.get(shard)
        if fd is not None and index.stale(fd):
            os.close(self._fds.pop(shard))
            fd = None
        if fd is None:
            if len(self._fds) >= index.open_limit:
                os.close(self._fds.pop(next(iter(self._fds))))  # the oldest opened
            fd = self._fds[shard] = os.open(index.local_path(), os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"] = {}
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass


# ----------------------------------------------------------------------------- shard lists
def _names_remote(spec: Any) -> bool:
    if isinstance(spec, (list, tuple)):
        return any(_names_remote(item) for item in spec)
    return isinstance(spec, str) and spec.startswith("s3://")


def expand_braces(pattern: str) -> list[str]:
    """Expand `{000..127}` (zero-padded numeric ranges) and `{a,b}` alternatives, left to right."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end() :]
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric:
        lo, hi = numeric.groups()
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        step = 1 if int(hi) >= int(lo) else -1
        options = [str(n).zfill(width) for n in range(int(lo), int(hi) + step, step)]
    else:
        options = body.split(",")
    return [head + option + rest for option in options for rest in expand_braces(tail)]


def expand_shards(spec: str | Path | Sequence[str | Path]) -> list[Path]:
    """The shard files `spec` names, in order.

    `spec` is a folder (the shards its manifest lists, else its `*.tar` files sorted by name), a
    list of any of these, a glob (`data/*.tar`), a brace pattern (`dir/shard-{000000..000127}.tar`)
    or one file. Raises FileNotFoundError naming what is missing.
    """
    if isinstance(spec, (list, tuple)):
        paths = [p for item in spec for p in expand_shards(item)]
        if not paths:
            raise FileNotFoundError("empty list of shards")
        return paths
    text = str(spec)
    path = Path(text)
    if path.is_dir():
        if (path / MANIFEST_NAME).is_file():
            paths = [path / s["name"] for s in read_manifest(path)["shards"]]
        else:
            paths = sorted(p for p in path.glob("*.tar") if p.is_file())
        if not paths:
            raise FileNotFoundError(f"{path}: no shards (*.tar) in this folder")
    elif "{" in text:
        paths = [Path(p) for p in expand_braces(text)]
    elif any(ch in text for ch in "*?["):
        paths = sorted(Path(p) for p in glob.glob(text))
        if not paths:
            raise FileNotFoundError(f"{text}: no file matches this pattern")
    else:
        paths = [path]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FileNotFoundError(f"shard not found: {missing[0]}{more}")
    return paths


# ----------------------------------------------------------------------------- writing
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


# ----------------------------------------------------------------------------- manifest
def write_manifest(
    out_dir: str | Path, shards: Sequence[Mapping[str, Any]], **dataset_info: Any
) -> Path:
    """Write `out_dir/manifest.json` atomically; call it last, after every shard is renamed.

    `dataset_info` adds or overrides the dataset fields: `modalities`, `counts`, `filters`,
    `command` (and any other JSON-serialisable field).
    """
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "shards": [dict(s) for s in shards],
        "modalities": [],
        "counts": {"samples": sum(int(s["samples"]) for s in shards)},
        "filters": {},
        "command": "",
    }
    manifest.update(dataset_info)
    path = Path(out_dir) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Read and check `manifest.json` (path to it or to its folder); FieldError names the field."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no manifest (is this a shard folder?)") from None
    except UnicodeDecodeError as err:
        raise FieldError(str(path), f"not valid JSON ({err})") from None
    return parse_manifest(text, str(path))


def parse_manifest(text: str, path: str) -> dict[str, Any]:
    """Check the text of a manifest; FieldError names `path` (a file or a URL) and the field."""
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise FieldError(str(path), f"not valid JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise FieldError(str(path), "expected a JSON object")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise FieldError(
            f"{path}: schema_version",
            f"{manifest.get('schema_version')!r} is not supported (this mmtrain reads {SCHEMA_VERSION})",
        )
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise FieldError(f"{path}: shards", "expected a list")
    for i, shard in enumerate(shards):
        where = f"{path}: shards[{i}]"
        if not isinstance(shard, dict):
            raise FieldError(where, "expected an object")
        for field, kind in (("name", str), ("samples", int), ("bytes", int), ("sha256", str)):
            if not isinstance(shard.get(field), kind):
                raise FieldError(f"{where}.{field}", f"missing or not a {kind.__name__}")
        if Path(shard["name"]).name != shard["name"] or shard["name"] in ("", ".", ".."):
            raise FieldError(
                f"{where}.name", f"{shard['name']!r} must be a file name in the folder"
            )
    return manifest


@dataclass(frozen=True)
class ShardProblem:
    """A shard that does not match the manifest."""

    name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.name}: {self.problem}"


def verify_manifest(out_dir: str | Path, check_hash: bool = True) -> list[ShardProblem]:
    """Check every shard of `out_dir/manifest.json` exists with its size and sha256.

    Returns the problems (empty when the folder matches its manifest).
    """
    out_dir = Path(out_dir)
    problems = []
    for shard in read_manifest(out_dir)["shards"]:
        path = out_dir / shard["name"]
        if not path.is_file():
            problems.append(ShardProblem(shard["name"], "missing"))
            continue
        size = path.stat().st_size
        if size != shard["bytes"]:
            problems.append(
                ShardProblem(shard["name"], f"{size} bytes, manifest says {shard['bytes']}")
            )
        elif check_hash and sha256_file(path) != shard["sha256"]:
            problems.append(ShardProblem(shard["name"], "sha256 differs from the manifest"))
    return problems
