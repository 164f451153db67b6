"""What `mmtrain data build` reads: a folder of files, a table of paths and captions, shards, or
chat data (LLaVA / ShareGPT / Hugging Face conversations and the images and videos they name).

Each source lists `Item`s in a fixed order (sorted paths, table rows, shard order): one item per
future sample, holding where each modality's bytes come from. Nothing is decoded here; the ingest
workers do that. The order is the build's order, so it is what makes the output deterministic.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.data.stream.conversations import (
    ConversationError,
    scan_conversations,
    scan_records,
)
from mmtrain.structured import FieldError

# File extensions per modality (lower case, no dot). `json` is metadata, `cls` a class label.
MODALITY_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "image": ("jpg", "jpeg", "png", "webp"),
    "video": ("mp4", "webm", "mkv"),
    "audio": ("wav", "flac", "ogg", "mp3"),
    "timeseries": ("npy", "csv"),
    "text": ("txt",),
}
MODALITIES = tuple(MODALITY_EXTENSIONS)
EXTENSION_MODALITY = {ext: m for m, exts in MODALITY_EXTENSIONS.items() for ext in exts}
TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")
# Table columns that name a modality when --columns does not say otherwise.
DEFAULT_COLUMNS = {m: (m,) for m in MODALITIES} | {"text": ("text", "caption")}


@dataclass(frozen=True)
class Part:
    """One modality of an item: a file to read, or bytes already in hand (shards, captions)."""

    ext: str
    origin: str  # file path or "shard.tar:member", for rejects.jsonl
    path: str | None = None
    data: bytes | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        return Path(self.path).read_bytes()


@dataclass(frozen=True)
class Item:
    """One future sample, `index` its position in the source order."""

    index: int
    origin: str
    parts: dict[str, Part]
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, bytes] = field(default_factory=dict)  # carried through as is (e.g. "cls")
    problem: str | None = None  # a listing problem (two images for one key): rejected
    problem_kind: str = "listing"  # the reject kind of `problem` (rejects.jsonl)
    conversation: ConversationItem | None = None  # chat data: processed as one conversation

    def modalities(self) -> set[str]:
        return set(self.parts)


@dataclass(frozen=True)
class ConversationItem:
    """A parsed conversation (`data.conversations.Conversation`) and its image files, in the
    order of its `<image>` tags, and its video files, in the order of its `<video>` tags."""

    conversation: Any
    images: tuple[Part, ...]
    videos: tuple[Part, ...] = ()


class Source:
    """A listing of items; `count` is known up front (None for shards without a manifest)."""

    kind = ""
    count: int | None = None

    def items(self, start: int = 0) -> Iterator[Item]:
        """Items from position `start` on."""
        raise NotImplementedError

    def modalities(self) -> list[str]:
        """Every modality some item has (what --modalities defaults to)."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- folder
def split_name(name: str) -> tuple[str, str]:
    """WebDataset convention: the key is the name up to the first dot, the extension the rest."""
    stem, _, ext = name.partition(".")
    return stem, ext.lower()


class FolderSource(Source):
    """Files grouped by folder and stem (`a/cat.jpg` + `a/cat.txt` -> one item); nested folders
    are walked in sorted order; hidden files and the build's own output folder are skipped."""

    kind = "folder"

    def __init__(self, root: Path, skip: Path | None = None):
        self.root = root
        self.groups = self._group(root, skip.resolve() if skip else None)
        self.count = len(self.groups)

    @staticmethod
    def _group(root: Path, skip: Path | None) -> list[tuple[str, list[tuple[str, Path]]]]:
        groups: dict[str, list[tuple[str, Path]]] = {}
        for folder, dirs, files in os.walk(root):
            here = Path(folder)
            dirs[:] = sorted(
                d for d in dirs if not d.startswith(".") and (here / d).resolve() != skip
            )
            for name in sorted(files):
                stem, ext = split_name(name)
                if name.startswith(".") or not ext:
                    continue
                key = (here / stem).relative_to(root).as_posix()
                groups.setdefault(key, []).append((ext, here / name))
        return sorted(groups.items())

    def items(self, start: int = 0) -> Iterator[Item]:
        for index in range(start, self.count):
            yield self._item(index, *self.groups[index])

    def _item(self, index: int, key: str, files: list[tuple[str, Path]]) -> Item:
        parts: dict[str, Part] = {}
        meta: dict[str, Any] = {}
        extra: dict[str, bytes] = {}
        problem = None
        for ext, path in files:
            modality = EXTENSION_MODALITY.get(ext.rsplit(".", 1)[-1])
            rel = path.relative_to(self.root).as_posix()
            if modality is None:
                if ext == "json":
                    meta, problem = _read_json_meta(path, rel, problem)
                elif ext == "cls":
                    extra["cls"] = path.read_bytes()
                continue
            if modality in parts:
                problem = f"two {modality} files: {parts[modality].origin} and {rel}"
                continue
            parts[modality] = Part(ext.rsplit(".", 1)[-1], origin=str(path), path=str(path))
        return Item(index, key, parts, meta, extra, problem)

    def modalities(self) -> list[str]:
        found = {
            EXTENSION_MODALITY[ext.rsplit(".", 1)[-1]]
            for _, files in self.groups
            for ext, _ in files
            if ext.rsplit(".", 1)[-1] in EXTENSION_MODALITY
        }
        return [m for m in MODALITIES if m in found]


def _read_json_meta(path: Path, rel: str, problem: str | None) -> tuple[dict, str | None]:
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        return {}, problem or f"{rel}: unreadable JSON metadata ({err})"
    if not isinstance(meta, dict):
        return {}, problem or f"{rel}: JSON metadata is not an object"
    return meta, problem


# ----------------------------------------------------------------------------- table
def parse_columns(text: str | None) -> dict[str, str]:
    """`image=filepath,text=caption` -> {"image": "filepath", "text": "caption"}."""
    mapping: dict[str, str] = {}
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        modality, sep, column = entry.partition("=")
        modality, column = modality.strip(), column.strip()
        if not sep or not column:
            raise FieldError("--columns", f"{entry!r} is not MODALITY=COLUMN")
        if modality not in MODALITIES:
            raise FieldError("--columns", f"{modality!r} is not one of {', '.join(MODALITIES)}")
        mapping[modality] = column
    return mapping


def read_table(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV, TSV, JSONL or (with pyarrow installed) parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as err:
                    raise FieldError(f"{path}:{number}", f"not a JSON object: {err}") from None
                if not isinstance(row, dict):
                    raise FieldError(f"{path}:{number}", "each line must be a JSON object")
                rows.append(row)
        return rows
    if suffix == ".parquet":
        return read_parquet(path)
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))


def _pyarrow_parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise FieldError(
            str(path),
            "reading parquet needs the pyarrow package (pip install 'mmtrain[parquet]', or "
            "pip install pyarrow); or convert the table to CSV or JSONL",
        ) from None
    return pq


def read_parquet(path: Path) -> list[dict[str, Any]]:
    """Rows of a parquet file as Python values (lists and structs as lists and dicts)."""
    pq = _pyarrow_parquet(path)
    try:
        return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise FieldError(str(path), f"not a readable parquet file: {err}") from None


def _parquet_columns(path: Path) -> dict[str, bool]:
    """Each column of a parquet file's schema -> whether it holds lists."""
    pq = _pyarrow_parquet(path)
    import pyarrow as pa

    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError) as err:
        raise FieldError(str(path), f"not a readable parquet file: {err}") from None
    return {
        field.name: pa.types.is_list(field.type) or pa.types.is_large_list(field.type)
        for field in schema
    }


class TableSource(Source):
    """Rows of a table: path columns (relative to the table's folder) and an inline caption
    column. Columns are named by `columns` ({modality: column}); without it, a column named as a
    modality (or `caption` for text) is used. Other columns go into the sample's metadata."""

    kind = "table"

    def __init__(self, path: Path, columns: dict[str, str]):
        self.path = path
        self.rows = read_table(path)
        header = list(self.rows[0]) if self.rows else []
        self.columns = columns or {
            m: name for m, names in DEFAULT_COLUMNS.items() for name in names if name in header
        }
        missing = [c for c in self.columns.values() if self.rows and c not in header]
        if missing or not self.columns:
            raise FieldError(
                "--columns",
                f"{path}: no column {', '.join(missing) or 'named after a modality'}; columns are "
                f"{', '.join(header) or '(none)'}; map them with --columns image=COL,text=COL",
            )
        self.count = len(self.rows)

    def items(self, start: int = 0) -> Iterator[Item]:
        for index in range(start, self.count):
            yield self._item(index, self.rows[index])

    def _item(self, index: int, row: dict[str, Any]) -> Item:
        origin = f"{self.path.name}:{index + 1}"
        parts: dict[str, Part] = {}
        for modality, column in self.columns.items():
            value = row.get(column)
            if value is None or value == "":
                continue
            if modality == "text":
                parts[modality] = Part("txt", origin, data=str(value).encode("utf-8"))
                continue
            file = Path(str(value))
            if not file.is_absolute():
                file = self.path.parent / file
            _, ext = split_name(file.name)
            parts[modality] = Part(ext.rsplit(".", 1)[-1], str(file), path=str(file))
        used = set(self.columns.values())
        meta = {k: v for k, v in row.items() if k not in used and v not in (None, "")}
        return Item(index, origin, parts, meta)

    def modalities(self) -> list[str]:
        return [m for m in MODALITIES if m in self.columns]


# ----------------------------------------------------------------------------- shards
class ShardSource(Source):
    """Samples of existing WebDataset shards (this tool's or others'), to filter and re-shard.

    Members the shard reader refuses (links, `../`, pickles) and the damage of a truncated shard
    become items with a `problem`, so they are listed in rejects.jsonl like any bad sample."""

    kind = "shards"

    def __init__(self, spec: str | Path):
        from mmtrain.data.storage.shard_lists import expand_shards
        from mmtrain.data.storage.tar_index import index_shard

        self.indexes = [index_shard(p) for p in expand_shards(str(spec))]
        self.count = sum(len(self._entries(index)) for index in self.indexes)
        self.manifest = _manifest_near([index.path for index in self.indexes])

    @staticmethod
    def _entries(index: Any) -> list[tuple[str, Any]]:
        """("sample", i) for each sample, then ("problem", text) for what could not be read."""
        entries: list[tuple[str, Any]] = [("sample", i) for i in range(len(index))]
        entries += [("problem", str(member)) for member in index.skipped]
        if index.damage is not None:
            entries.append(("problem", str(index.damage)))
        return entries

    def items(self, start: int = 0) -> Iterator[Item]:
        position = 0
        for index in self.indexes:
            entries = self._entries(index)
            if position + len(entries) <= start:
                position += len(entries)
                continue
            fd = os.open(index.path, os.O_RDONLY)
            try:
                for kind, value in entries:
                    if position >= start:
                        if kind == "sample":
                            yield self._item(position, index.name, index.read(value, fd))
                        else:
                            yield Item(position, index.name, {}, problem=value)
                    position += 1
            finally:
                os.close(fd)

    @staticmethod
    def _item(index: int, shard: str, sample: dict[str, Any]) -> Item:
        key = sample["__key__"]
        origin = f"{shard}:{key}"
        parts: dict[str, Part] = {}
        meta: Any = {}
        extra: dict[str, bytes] = {}
        problem = None
        for ext, data in sample.items():
            if ext.startswith("__"):
                continue
            last = ext.rsplit(".", 1)[-1]
            modality = EXTENSION_MODALITY.get(last)
            if modality is None:
                if ext == "json":
                    try:
                        meta = json.loads(data)
                    except ValueError:
                        problem = f"{origin}.json: unreadable JSON metadata"
                elif ext == "cls":
                    extra["cls"] = data
                continue
            if modality in parts:
                problem = f"{origin}: two {modality} members ({parts[modality].ext} and {last})"
                continue
            parts[modality] = Part(last, f"{origin}.{ext}", data=data)
        return Item(index, origin, parts, meta if isinstance(meta, dict) else {}, extra, problem)

    def modalities(self) -> list[str]:
        listed = (self.manifest or {}).get("modalities")
        if listed:
            return [m for m in MODALITIES if m in listed]
        found = {
            EXTENSION_MODALITY[ext.rsplit(".", 1)[-1]]
            for index in self.indexes
            for ext in index.exts
            if ext.rsplit(".", 1)[-1] in EXTENSION_MODALITY
        }
        return [m for m in MODALITIES if m in found]


def _manifest_near(paths: list[Path]) -> dict[str, Any] | None:
    folders = {Path(p).parent for p in paths}
    if len(folders) != 1:
        return None
    manifest = folders.pop() / "manifest.json"
    try:
        return json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- conversations
class ConversationSource(Source):
    """Chat records of a LLaVA `.json` list, a `.jsonl` file or a parquet table (LLaVA,
    ShareGPT / Hugging Face `messages` or TRL `prompt` + `completion` records,
    `data.conversations`), one item per record. Image and video paths are relative
    to `image_root` (default: the file's folder). A record that breaks a rule (tag count against
    image or video count, roles, empty answer, ...) becomes an item with a `problem` of its kind,
    so it is listed in rejects.jsonl like any bad sample. Records are parsed up front: text is
    small next to the images and videos, which the workers read."""

    kind = "conversations"

    def __init__(self, path: Path, image_root: Path | None = None):
        self.path = path
        self.image_root = image_root if image_root is not None else path.parent
        if not self.image_root.is_dir():
            raise FieldError("--image-root", f"{self.image_root}: no such folder")
        # Each a Conversation or its ConversationError.
        if path.suffix.lower() == ".parquet":
            self.records = list(scan_records(read_parquet(path), path))
        else:
            self.records = list(scan_conversations(path))
        self.count = len(self.records)

    def items(self, start: int = 0) -> Iterator[Item]:
        for index in range(start, self.count):
            yield self._item(index, self.records[index])

    def _item(self, index: int, record: Any) -> Item:
        if isinstance(record, ConversationError):
            return Item(index, record.origin, {}, problem=record.reason, problem_kind=record.kind)
        conversation = ConversationItem(
            record, self._parts(record.images), self._parts(record.videos)
        )
        origin = _record_origin(self.path, index, record.key)
        return Item(index, origin, {}, conversation=conversation)

    def _parts(self, paths: list[str]) -> tuple[Part, ...]:
        """The files of a record's image or video paths, relative ones under `image_root`."""
        parts = []
        for name in paths:
            file = Path(name)
            if not file.is_absolute():
                file = self.image_root / file
            _, ext = split_name(file.name)
            parts.append(Part(ext.rsplit(".", 1)[-1], str(file), path=str(file)))
        return tuple(parts)

    def modalities(self) -> list[str]:
        parsed = [r for r in self.records if not isinstance(r, ConversationError)]
        found = {"text"}
        found |= {"image"} if any(r.images for r in parsed) else set()
        found |= {"video"} if any(r.videos for r in parsed) else set()
        return [m for m in MODALITIES if m in found]


def _record_origin(path: Path, index: int, key: str) -> str:
    by_line = path.suffix.lower() in (".jsonl", ".parquet")  # lines and rows count from 1
    where = f"{path.name}:{index + 1}" if by_line else f"{path.name}[{index}]"
    return where if key == str(index) else f"{where} (id {key})"


def is_conversation_file(path: Path) -> bool:
    """A `.json` file (LLaVA lists are JSON), or a `.jsonl` whose first record (a parquet
    whose columns) hold conversations (`_holds_conversations`); otherwise it is a table."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        return True
    if suffix == ".parquet":
        columns = _parquet_columns(path)
        return _holds_conversations(set(columns), columns.get("prompt", False))
    if suffix != ".jsonl":
        return False
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return False  # the table reader names the bad line
                if not isinstance(record, dict):
                    return False
                return _holds_conversations(set(record), isinstance(record.get("prompt"), list))
    return False


def _holds_conversations(fields: set[str], prompt_is_list: bool) -> bool:
    """`conversations` or `messages`, TRL's conversational `prompt` (a list of messages) and
    `completion`, or TRL's preference `prompt` + `chosen` + `rejected` (a string prompt too); a
    prompt and completion as plain strings are a table's text columns."""
    if {"conversations", "messages"} & fields:
        return True
    if {"prompt", "chosen", "rejected"} <= fields:  # TRL's preference pairs, either form
        return True
    return prompt_is_list and {"prompt", "completion"} <= fields


# ----------------------------------------------------------------------------- choice
def open_source(
    src: str, columns: dict[str, str], out_dir: Path, image_root: Path | None = None
) -> Source:
    """The source SRC names: chat data (a .json, or a .jsonl or parquet of conversation
    records), a table file, shards (a .tar, a glob, a brace pattern, or a folder holding only
    shards), or else a folder of files. `image_root`: where the image and video paths of chat data start."""
    path = Path(src)
    if image_root is not None and not (path.is_file() and is_conversation_file(path)):
        raise FieldError(
            "--image-root",
            "only chat data (a .json, or a .jsonl or .parquet of conversations) names images and "
            "videos by path",
        )
    if path.is_file():
        if is_conversation_file(path):
            return ConversationSource(path, image_root)
        if path.suffix.lower() in TABLE_SUFFIXES:
            return TableSource(path, columns)
        if path.suffix.lower() == ".tar":
            return ShardSource(src)
        raise FieldError(
            "SRC",
            f"{src}: not chat data (.json), a table ({', '.join(TABLE_SUFFIXES)}), a .tar shard "
            "or a folder",
        )
    if path.is_dir():
        # A folder of shards: .tar files and no media files (logs such as rejects.jsonl are fine).
        names = [p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
        media = [n for n in names if split_name(n)[1].rsplit(".", 1)[-1] in EXTENSION_MODALITY]
        if any(n.endswith(".tar") for n in names) and not media:
            return ShardSource(src)
        return FolderSource(path, skip=out_dir)
    if any(ch in src for ch in "*?[{"):
        return ShardSource(src)
    raise FileNotFoundError(f"{src}: no such file or folder")
