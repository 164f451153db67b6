"""The resumable state of `mmtrain data build`: where a build is (`State`) and the journal that
records it after each finished shard (`Journal`, `.build-journal.jsonl`).

After each finished shard a line goes to the journal with the shard's sha256 and the build state
right after its last sample (source position, counts, log offsets). A rerun of the same command
keeps every shard that `shard_intact` finds unchanged, up to the first one missing or changed,
and restores the state there (`pipeline.build` does the resuming).

Kept apart from the build loop because it is the on-disk format of a build in progress: what it
records decides what a resumed build can trust.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.atomic import atomic_write_text, sha256_file
from mmtrain.data.ingest.filters import FilterStats

JOURNAL_NAME = ".build-journal.jsonl"


@dataclass
class State:
    """Where a build is: the next source position (and samples of it already written, when a
    windowed item straddles two shards), the counts, and the sizes of the two logs."""

    next_index: int = 0
    item_samples_done: int = 0
    samples: int = 0
    rejected: int = 0
    rejected_by_kind: Counter = field(default_factory=Counter)
    filters: FilterStats = field(default_factory=FilterStats)
    rejects_bytes: int = 0
    filtered_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rejected_by_kind"] = dict(sorted(self.rejected_by_kind.items()))
        data["filters"] = self.filters.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> State:
        data = dict(data)
        data["rejected_by_kind"] = Counter(data["rejected_by_kind"])
        data["filters"] = FilterStats.from_dict(data["filters"])
        return cls(**data)

    def copy(self) -> State:
        return State.from_dict(self.to_dict())


class Journal:
    """`.build-journal.jsonl`: a header (fingerprint, relevance cutoff), then one line per
    finished shard with the state after its last sample; the last line says when the build
    reached the end of the source. Lines are appended and fsynced; a torn last line is ignored."""

    def __init__(self, path: Path, header: dict[str, Any], entries: list[dict[str, Any]]):
        self.path = path
        self.header = header
        self.entries = entries

    @classmethod
    def load(cls, path: Path) -> Journal | None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return None
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                break  # a line cut by a crash: everything after it is unknown
        if not records or "fingerprint" not in records[0]:
            return None
        return cls(path, records[0], records[1:])

    def rewrite(self) -> None:
        lines = [self.header, *self.entries]
        atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines))

    def append(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @property
    def done(self) -> bool:
        return bool(self.entries) and bool(self.entries[-1].get("done"))

    def shards(self) -> list[dict[str, Any]]:
        return [e["shard"] for e in self.entries if e.get("shard")]


def shard_intact(out_dir: Path, shard: dict[str, Any]) -> bool:
    """Whether a journalled shard is still on disk with its recorded size and sha256."""
    path = out_dir / shard["name"]
    return (
        path.is_file()
        and path.stat().st_size == shard["bytes"]
        and sha256_file(path) == shard["sha256"]
    )
