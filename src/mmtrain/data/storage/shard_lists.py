"""Shard lists: the shard files a spec names (a folder, a list, a glob, a brace pattern, a file).

A folder names the shards its `manifest.json` lists (else its `*.tar` files by name);
`expand_braces` is also how `s3.list_shards` expands a pattern of object URLs.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Sequence
from pathlib import Path

from mmtrain.data.storage.manifest import MANIFEST_NAME, read_manifest

__all__ = ["expand_braces", "expand_shards"]


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
