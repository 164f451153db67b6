"""Safetensors folders written tensor by tensor: big models are exported without ever holding
the whole state dict, and read back lazily.

The format: an 8-byte little-endian header length, a JSON header (`{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`, offsets relative to the byte after the
header, padded with spaces to a multiple of 8), then the raw little-endian tensor bytes.

`ShardedWriter` takes the ordered (name, dtype, shape) of every tensor up front, plans the shards
as Hugging Face does (files of at most `max_shard_bytes`, filled in the given order,
`model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`; one `model.safetensors`
and no index when everything fits one file), then accepts the tensors one at a time in that order.
Inside each file the data and header follow safetensors' own layout (by dtype, widest first, then
by name), so every tensor is aligned to its element size and a single file is byte-identical to
`safetensors.torch.save_file` with the same metadata. Every file is written under a temporary
name in the same folder and fsynced; all are renamed only once the last tensor is in, the index
last: a reader never sees half a folder, and a writer that fails leaves no new file.

`open_weights` reads a file or a folder either way, one tensor at a time (`safe_open` per file);
`read_weights` reads them all (small models).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open
from torch import Tensor

from mmtrain.atomic import atomic_write_text, fsync_dir
from mmtrain.folders import INDEX_FILE, WEIGHTS_FILE
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

# transformers' default max_shard_size "5GB" (decimal, as huggingface_hub parses it)
MAX_SHARD_BYTES = 5 * 10**9
# transformers refuses a safetensors file whose metadata lacks a known "format"
DEFAULT_METADATA = {"format": "pt"}

# safetensors' dtype names, in the order its writer lays tensors out (widest first; measured
# from safetensors 0.8's `save`, held by tests/test_safetensors_files.py).
_LAYOUT = (
    ("U64", torch.uint64),
    ("I64", torch.int64),
    ("F64", torch.float64),
    ("C64", torch.complex64),
    ("F32", torch.float32),
    ("U32", torch.uint32),
    ("I32", torch.int32),
    ("BF16", torch.bfloat16),
    ("F16", torch.float16),
    ("U16", torch.uint16),
    ("I16", torch.int16),
    ("F8_E5M2FNUZ", torch.float8_e5m2fnuz),
    ("F8_E4M3FNUZ", torch.float8_e4m3fnuz),
    ("F8_E4M3", torch.float8_e4m3fn),
    ("F8_E5M2", torch.float8_e5m2),
    ("I8", torch.int8),
    ("U8", torch.uint8),
    ("BOOL", torch.bool),
)
DTYPE_NAMES = {dtype: name for name, dtype in _LAYOUT}
DTYPES = {name: dtype for name, dtype in _LAYOUT}
_RANK = {dtype: rank for rank, (_, dtype) in enumerate(_LAYOUT)}
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-\d{5}-of-\d{5}\.safetensors$")


class WeightsFileError(FieldError):
    """A safetensors file or index that cannot be read; the message names the file."""

    def __init__(self, file: str | Path, message: str):
        super().__init__(str(file), message)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's name, dtype and shape, known before its values are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: Tensor) -> TensorEntry:
        """The entry of `tensor` (a DTensor gives its global shape; a meta tensor works too)."""
        return cls(name, tensor.dtype, tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def entries_of(state: Mapping[str, Tensor]) -> list[TensorEntry]:
    """The entries of a state dict, in its order."""
    return [TensorEntry.of(name, tensor) for name, tensor in state.items()]


# ----------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class ShardPlan:
    """One file: its name, its entries in arrival order, the header and each tensor's
    [begin, end) in the data section."""

    file: str
    entries: tuple[TensorEntry, ...]
    header: bytes  # 8-byte length + padded JSON
    offsets: dict[str, tuple[int, int]]

    @property
    def size(self) -> int:
        data = max((end for _, end in self.offsets.values()), default=0)
        return len(self.header) + data


def _header(entries: Sequence[TensorEntry], metadata: Mapping[str, str] | None) -> tuple:
    """(header bytes, offsets) in safetensors' layout: widest dtype first, then by name, so each
    tensor starts at a multiple of its element size."""
    offsets: dict[str, tuple[int, int]] = {}
    fields: dict[str, Any] = {}
    if metadata:  # sorted: safetensors' own order of several keys is a hash map's
        fields["__metadata__"] = {str(k): str(metadata[k]) for k in sorted(metadata)}
    begin = 0
    for entry in sorted(entries, key=lambda e: (_RANK[e.dtype], e.name)):
        offsets[entry.name] = (begin, begin + entry.nbytes)
        fields[entry.name] = {
            "dtype": DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [begin, begin + entry.nbytes],
        }
        begin += entry.nbytes
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def _check_entries(entries: Sequence[TensorEntry]) -> None:
    seen: set[str] = set()
    for entry in entries:
        if not isinstance(entry.name, str) or not entry.name or entry.name == "__metadata__":
            raise ValueError(f"{entry.name!r} is not a valid safetensors tensor name")
        if entry.name in seen:
            raise ValueError(f"tensor {entry.name!r} is listed twice")
        if entry.dtype not in _RANK:
            raise ValueError(f"tensor {entry.name!r}: safetensors cannot store {entry.dtype}")
        seen.add(entry.name)


def plan_shards(
    entries: Sequence[TensorEntry],
    max_shard_bytes: int = MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = DEFAULT_METADATA,
    prefix: str = "model",
) -> list[ShardPlan]:
    """The files `entries` are written to: filled in order, a new one started where the next
    tensor would pass `max_shard_bytes` of tensor data (a bigger tensor gets a file of its own),
    as huggingface_hub's `split_torch_state_dict_into_shards`."""
    _check_entries(entries)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + entry.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    if len(groups) == 1:
        names = [f"{prefix}.safetensors"]
    else:
        names = [
            f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)
        ]
    plans = []
    for name, group in zip(names, groups, strict=True):
        header, offsets = _header(group, metadata)
        plans.append(ShardPlan(name, tuple(group), header, offsets))
    return plans


# ----------------------------------------------------------------------------- writing
def _tensor_bytes(tensor: Tensor) -> memoryview:
    """The raw bytes of `tensor` on the CPU, row-major (one copy at most: from the device)."""
    if hasattr(tensor, "full_tensor"):  # a DTensor's local shard is not the tensor
        raise TypeError("got a DTensor: write its `full_tensor()` (a collective on every rank)")
    flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


class ShardedWriter:
    """Write `entries` (name, dtype, shape, in order) into `folder` as one safetensors file or
    as shards plus an index, accepting the tensors one at a time in that order.

        with ShardedWriter(folder, entries) as writer:
            for name, tensor in tensors:
                writer.write(name, tensor)

    Leaving the block without an error finishes the folder (`close`); with one, every file
    written so far is removed (`abort`) and whatever the folder held before stays as it was.
    """

    def __init__(
        self,
        folder: str | Path,
        entries: Sequence[TensorEntry],
        *,
        max_shard_bytes: int = MAX_SHARD_BYTES,
        metadata: Mapping[str, str] | None = DEFAULT_METADATA,
        prefix: str = "model",
    ):
        if sys.byteorder != "little":  # tensors are written as they lie in memory
            raise RuntimeError("safetensors files are little-endian; this machine is not")
        self.folder = Path(folder)
        self.prefix = prefix
        self.plans = plan_shards(list(entries), max_shard_bytes, metadata, prefix)
        self._order = [(i, e) for i, plan in enumerate(self.plans) for e in plan.entries]
        self._next = 0
        self._file: BinaryIO | None = None
        self._tmp: list[Path] = []
        self._done = False
        self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def files(self) -> list[str]:
        """The file names this writer writes (the index besides, when there are several)."""
        return [plan.file for plan in self.plans]

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def write(self, name: str, tensor: Tensor) -> None:
        """Write the next tensor; ValueError when it is not the one planned (name, dtype or
        shape), naming what was expected."""
        if self._done or self._next == len(self._order):
            raise ValueError(f"{self.folder}: every planned tensor is written; got {name!r}")
        shard, entry = self._order[self._next]
        got = TensorEntry.of(name, tensor)
        if got != entry:
            raise ValueError(
                f"{self.folder}: expected tensor #{self._next} {entry.name!r} "
                f"{DTYPE_NAMES[entry.dtype]} {list(entry.shape)}, got {name!r} "
                f"{DTYPE_NAMES.get(got.dtype, str(got.dtype))} {list(got.shape)}"
            )
        plan = self.plans[shard]
        if self._file is None:
            self._open(plan)
        begin, end = plan.offsets[name]
        self._file.seek(len(plan.header) + begin)
        written = self._file.write(_tensor_bytes(tensor))
        if written != end - begin:
            raise OSError(f"{self._tmp[-1]}: wrote {written} of {end - begin} bytes of {name}")
        self._next += 1
        if self._next == len(self._order) or self._order[self._next][0] != shard:
            self._finish_file()

    def _open(self, plan: ShardPlan) -> None:
        tmp = self.folder / f".{plan.file}.tmp.{os.getpid()}"
        self._tmp.append(tmp)
        self._file = open(tmp, "wb")  # noqa: SIM115 (closed in _finish_file or abort)
        self._file.write(plan.header)
        self._file.truncate(plan.size)  # tensors land at their offsets, in any order

    def _finish_file(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def close(self) -> list[Path]:
        """Rename the finished files into place, then write the index (several files); returns
        the paths written. ValueError, and nothing renamed, when a planned tensor is missing."""
        if self._done:
            return [self.folder / f for f in self.files]
        if self._next != len(self._order):
            missing = [e.name for _, e in self._order[self._next :]]
            self.abort()
            raise ValueError(
                f"{self.folder}: {len(missing)} planned tensors were never written, "
                f"from {missing[0]!r}"
            )
        if not self._tmp:  # no tensors at all: a valid file with an empty header
            self._open(self.plans[0])
            self._finish_file()
        index = self.folder / INDEX_FILE.replace("model", self.prefix, 1)
        single = self.folder / f"{self.prefix}.safetensors"
        # Old files that would mislead a reader go first: an index names shards about to be
        # replaced; a single file is read before any index.
        index.unlink(missing_ok=True)
        for tmp, plan in zip(self._tmp, self.plans, strict=True):
            os.replace(tmp, self.folder / plan.file)
        self._tmp = []
        if len(self.plans) > 1:
            single.unlink(missing_ok=True)
            fsync_dir(self.folder)
            atomic_write_text(index, json.dumps(self._index(), indent=2, sort_keys=True) + "\n")
        self._remove_stale_shards()
        fsync_dir(self.folder)
        self._done = True
        log.info("wrote %s (%d files, %d tensors)", self.folder, len(self.plans), len(self._order))
        return [self.folder / f for f in self.files]

    def _index(self) -> dict[str, Any]:
        total = sum(e.nbytes for _, e in self._order)
        weight_map = {e.name: self.plans[i].file for i, e in self._order}
        return {"metadata": {"total_size": total}, "weight_map": weight_map}

    def _remove_stale_shards(self) -> None:
        """Shards of an earlier export under this prefix that this one did not write."""
        ours = set(self.files)
        for path in self.folder.glob(f"{self.prefix}-*-of-*.safetensors"):
            match = _SHARD_NAME.match(path.name)
            if match and match["prefix"] == self.prefix and path.name not in ours:
                path.unlink(missing_ok=True)

    def abort(self) -> None:
        """Remove every file written so far; the folder keeps what it held before."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for tmp in self._tmp:
            tmp.unlink(missing_ok=True)
        self._tmp = []
        self._done = True


def write_tensors(
    folder: str | Path,
    entries: Sequence[TensorEntry],
    tensors: Iterable[tuple[str, Tensor]],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = DEFAULT_METADATA,
    prefix: str = "model",
) -> list[Path]:
    """Write `tensors` ((name, tensor) pairs arriving in the order of `entries`) into `folder`
    through a `ShardedWriter` (files `prefix`.safetensors, or shards and their index); each
    tensor is released once written. Returns the files."""
    with ShardedWriter(
        folder, entries, max_shard_bytes=max_shard_bytes, metadata=metadata, prefix=prefix
    ) as writer:
        for name, tensor in tensors:
            writer.write(name, tensor)
            del tensor  # the iterator's gathered copy can go before the next one arrives
    return [Path(folder) / f for f in writer.files]


def write_state_dict(
    folder: str | Path,
    state: Mapping[str, Tensor],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    metadata: Mapping[str, str] | None = DEFAULT_METADATA,
) -> list[Path]:
    """`write_tensors` of a state dict held in memory."""
    return write_tensors(
        folder,
        entries_of(state),
        state.items(),
        max_shard_bytes=max_shard_bytes,
        metadata=metadata,
    )


# ----------------------------------------------------------------------------- reading
class SafetensorsReader(Mapping[str, Tensor]):
    """The tensors of one safetensors file or of the shards an index lists, read one at a time
    on access (`reader[name]`); names, dtypes and shapes come from the headers alone."""

    def __init__(self, source: Path, weight_map: Mapping[str, Path]):
        self.source = source
        self._where = dict(weight_map)
        self._handles: dict[Path, Any] = {}

    @property
    def files(self) -> list[Path]:
        return sorted(set(self._where.values()))

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = _safe_open(path)
        return self._handles[path]

    def __getitem__(self, name: str) -> Tensor:
        path = self._where[name]  # KeyError for an unknown name, as a dict
        try:
            return self._handle(path).get_tensor(name)
        except Exception as err:  # safetensors raises its own types for bad data
            raise WeightsFileError(path, f"cannot read tensor {name!r} ({err})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def entry(self, name: str) -> TensorEntry:
        """Name, dtype and shape of a tensor, from its file's header (no data read)."""
        path = self._where[name]
        view = self._handle(path).get_slice(name)
        dtype = DTYPES.get(view.get_dtype())
        if dtype is None:
            raise WeightsFileError(path, f"tensor {name!r} has dtype {view.get_dtype()}")
        return TensorEntry(name, dtype, tuple(view.get_shape()))

    def entries(self) -> list[TensorEntry]:
        return [self.entry(name) for name in self._where]

    def meta_state(self) -> dict[str, Tensor]:
        """Every tensor as a meta tensor of its dtype and shape: for checking keys and shapes
        against a spec without reading any data."""
        return {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in self.entries()}

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _safe_open(path: Path) -> Any:
    if not path.is_file():
        raise WeightsFileError(path, "is missing")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own types for corrupt headers
        raise WeightsFileError(
            path, f"is not a readable safetensors file ({err}); it may be truncated or corrupt"
        ) from None


def _read_index(index: Path) -> dict[str, Path]:
    """name -> shard path of an index, each shard checked to hold exactly what it lists."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise WeightsFileError(index, f"is not a readable index ({err})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsFileError(index, "weight_map: expected tensor name -> shard file")
    where: dict[str, Path] = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:  # a shard is a file beside the index, never elsewhere
            raise WeightsFileError(index, f"weight_map: shard {shard!r} is not a file name")
        path = index.parent / shard
        held = set(_safe_open(path).keys())
        listed = {k for k, v in weight_map.items() if v == shard}
        if held != listed:
            extra, absent = sorted(held - listed), sorted(listed - held)
            raise WeightsFileError(
                path,
                f"does not hold what {index.name} lists (unlisted: {extra[:5]}, absent: "
                f"{absent[:5]})",
            )
    for name, shard in weight_map.items():
        where[name] = index.parent / shard
    return where


def has_weights(folder: str | Path) -> bool:
    """True when `folder` holds model.safetensors or model.safetensors.index.json."""
    folder = Path(folder)
    return (folder / WEIGHTS_FILE).is_file() or (folder / INDEX_FILE).is_file()


def open_weights(path: str | Path) -> SafetensorsReader:
    """A lazy reader of a safetensors file, an index file, or a folder holding model.safetensors
    (read first, as transformers does) or model.safetensors.index.json. WeightsFileError naming
    the file for anything missing or unreadable."""
    path = Path(path)
    if path.is_dir():
        if (path / WEIGHTS_FILE).is_file():
            path = path / WEIGHTS_FILE
        elif (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        else:
            raise WeightsFileError(path, f"has no {WEIGHTS_FILE} or {INDEX_FILE}")
    if path.name.endswith(".index.json"):
        if not path.is_file():
            raise WeightsFileError(path, "is missing")
        return SafetensorsReader(path, _read_index(path))
    names = _safe_open(path).keys()
    return SafetensorsReader(path, dict.fromkeys(names, path))


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of `open_weights(path)`, in memory (for small models)."""
    with open_weights(path) as reader:
        return {name: reader[name] for name in reader}


def meta_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Meta tensors of the dtypes and shapes of `state` (a dict, or a reader without reading)."""
    lazy = getattr(state, "meta_state", None)  # a SafetensorsReader, or a view of one
    if callable(lazy):
        return lazy()
    return {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in state.items()}
