"""`manifest.json`: the description of a shard folder (its shards with sizes and sha256, the
dataset's modalities, counts, filter statistics and the command that built it).

`write_manifest` writes it atomically, last, after every shard is renamed; `read_manifest` and
`parse_manifest` (for a manifest read from object storage) check it and name the field at fault;
`verify_manifest` checks a folder's shards against it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmtrain.atomic import atomic_write_text, sha256_file
from mmtrain.structured import FieldError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "write_manifest",
    "read_manifest",
    "parse_manifest",
    "verify_manifest",
    "ShardProblem",
]


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
