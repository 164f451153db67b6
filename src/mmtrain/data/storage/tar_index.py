"""Read WebDataset tar shards as they are: parse the tar headers, index the samples, refuse what hurts.

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

`index_shard` turns one shard into a `ShardIndex` (keys, and per member its extension, offset and
size); `shards.ShardSet` addresses the samples of many. Writing is `shard_writer.ShardWriter`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

logger = logging.getLogger(__name__)

BLOCK = 512
# Loading these runs arbitrary code (pickle, torch.load): never handed to a decoder.
PICKLE_EXTENSIONS = frozenset({"pth", "pt", "pickle", "pkl", "pyd"})
_META_NAME = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, skipped silently
_MAX_META_BYTES = 1 << 20  # a pax or GNU long-name header larger than this is damage, not a name
_MAX_OPEN_SHARDS = 64

__all__ = [
    "BLOCK",
    "PICKLE_EXTENSIONS",
    "ShardError",
    "TruncatedShardError",
    "SkippedMember",
    "ShardIndex",
    "split_member_name",
    "index_shard",
    "read_shard",
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
    # A shard in object storage (`remote_cache.RemoteShardIndex`) is read from a local cache.
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
