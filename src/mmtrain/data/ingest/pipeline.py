"""`mmtrain data build SRC --out DIR`: raw files, tables or shards -> filtered WebDataset shards.

This file holds the build itself (`build`, its `BuildConfig` and `BuildReport`). The per-item work
is in `process` (run in worker processes), the resumable state in `journal`, and the options
that make a `BuildConfig` in `options` (their flags in `commands/_data_args.py`).

The pipeline, in source order:

1. `sources.open_source` lists items (a folder grouped by stem, table rows, or shard samples).
2. Worker processes run `process.process_item` on each item: read, check the extension against
   the content, decode (bounded pixels), normalise (image re-encoded at a maximum side, video
   optionally cut into clips and re-encoded by `video_clips`, audio resampled to FLAC,
   time-series to npy, text NFC), and measure what the filters need.
   A broken item becomes a reject with its path and reason.
3. The main process takes the outcomes back in source order (whatever the number of workers),
   scores image-text relevance in fixed blocks, applies the `FilterChain` (duplicates need the
   order), appends rejects to `rejects.jsonl` and filtered samples to `filtered.jsonl`, and
   writes kept samples through `ShardWriter`.
4. `manifest.json` is written last: shards with sha256, modalities, counts, filter statistics
   and the command. The build fails (exit 2) when the reject rate passes `--max-reject-rate`.

Resuming: after each finished shard a line goes to `.build-journal.jsonl` (`journal.Journal`)
with the shard's sha256 and the build state right after its last sample (source position, counts,
log offsets). A rerun of the same command keeps every shard that still matches its sha256 up to
the first one missing or changed, restores the state there (duplicate memory is read back from the
kept shards' json) and goes on. Keys are source positions, and every step is deterministic, so the
shards come out byte for byte the same as an uninterrupted build.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mmtrain.data.ingest.filters import (
    Features,
    FilterChain,
    FilterConfig,
    relevance_scorer,
    sample_reason,
    top_fraction_cutoff,
)
from mmtrain.data.ingest.journal import JOURNAL_NAME, Journal, State, shard_intact
from mmtrain.data.ingest.outcome import Outcome, ProcessOptions, json_bytes
from mmtrain.data.ingest.process import ordered_map, process_item
from mmtrain.data.ingest.sources import Source
from mmtrain.data.storage.manifest import MANIFEST_NAME, SCHEMA_VERSION, write_manifest
from mmtrain.data.storage.s3 import Uploader
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.tar_index import read_shard
from mmtrain.structured import FieldError

logger = logging.getLogger(__name__)

REJECTS_NAME = "rejects.jsonl"
FILTERED_NAME = "filtered.jsonl"
SHARD_PREFIX = "shard"
SCORE_BLOCK = 64  # relevance is scored in blocks of fixed source positions: same batches on resume


@dataclass
class BuildConfig:
    """Everything `build` needs besides the source."""

    out_dir: Path
    process: ProcessOptions
    filters: FilterConfig
    max_samples_per_shard: int = 10_000
    max_shard_bytes: int = 1 << 30
    max_reject_rate: float = 0.1
    workers: int = 1
    command: str = ""
    fingerprint: str = ""
    relevance_model: str | None = None
    relevance_device: str = "cpu"
    relevance_tokenizer: str = "byte"
    # `--out s3://...`: the build runs in `out_dir` (a local staging folder) and each finished
    # shard is uploaded here, the manifest last (s3.Uploader).
    publish_to: str | None = None


@dataclass
class BuildReport:
    """What a build did: the manifest fields, and whether it passed the reject-rate check."""

    shards: list[dict[str, Any]]
    state: State
    items: int
    resumed_at_shard: int | None  # None: built from scratch
    already_complete: bool  # a rerun of a finished build: nothing was processed
    reject_rate: float
    ok: bool
    manifest: dict[str, Any]


Progress = Callable[[str, int, int | None], None]  # (phase, items done, total)


def build(source: Source, config: BuildConfig, progress: Progress | None = None) -> BuildReport:
    """Run (or resume) a build of `source` into `config.out_dir`; see the module docstring."""
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    uploader = None
    if config.publish_to is not None:
        uploader = Uploader(config.publish_to, out)
        if not (out / JOURNAL_NAME).exists():
            uploader.refuse_foreign()
    journal = _open_journal(config)
    first_bad = _first_bad_shard(out, journal)
    resumed_at = None if not journal.entries else first_bad
    complete = journal.done and first_bad == len(journal.entries)
    if not complete:
        _drop_stale(out, journal, first_bad)
        state = State.from_dict(journal.entries[-1]["state"]) if journal.entries else State()
        _truncate_logs(out, state)
        scorer = _relevance(source, config, journal, progress)
        chain = FilterChain(_chain_config(config.filters, journal))
        chain.stats = state.filters
        _remember_kept(out, journal.shards(), chain)
        for shard in journal.shards() if uploader is not None else []:
            uploader.shard(shard)  # kept shards whose upload an interruption cut off
        publish = uploader.shard if uploader is not None else None
        _run(source, config, journal, state, chain, scorer, progress, publish)
    report = _finish(config, journal, resumed_at, complete)
    if uploader is not None and report.ok:
        uploader.manifest(report.shards)
    return report


def _open_journal(config: BuildConfig) -> Journal:
    path = config.out_dir / JOURNAL_NAME
    journal = Journal.load(path)
    if journal is not None and journal.header["fingerprint"] != config.fingerprint:
        raise FieldError(
            "--out",
            f"{config.out_dir} holds a build made by a different command "
            f"({journal.header.get('command', '?')}); use another --out folder, or delete this one "
            "to rebuild",
        )
    if journal is None:
        foreign = [p.name for p in config.out_dir.iterdir() if p.suffix == ".tar"]
        if foreign or (config.out_dir / "manifest.json").exists():
            raise FieldError(
                "--out",
                f"{config.out_dir} already holds shards that this command did not build; "
                "use an empty or new --out folder",
            )
        journal = Journal(path, {"fingerprint": config.fingerprint, "command": config.command}, [])
        journal.rewrite()
    return journal


def _first_bad_shard(out: Path, journal: Journal) -> int:
    """Number of leading journal entries whose shard is still on disk, unchanged."""
    for n, entry in enumerate(journal.entries):
        shard = entry.get("shard")
        if shard and not shard_intact(out, shard):
            logger.info("%s is missing or changed: rebuilding from there", shard["name"])
            return n
    return len(journal.entries)


def _drop_stale(out: Path, journal: Journal, keep: int) -> None:
    """Forget journal entries from `keep` on; delete leftover temporaries of an interrupted run."""
    if keep < len(journal.entries):
        journal.entries = journal.entries[:keep]
        journal.rewrite()
    for tmp in out.glob(f".{SHARD_PREFIX}-*.tar.tmp"):
        tmp.unlink()


def _truncate_logs(out: Path, state: State) -> None:
    for name, size in ((REJECTS_NAME, state.rejects_bytes), (FILTERED_NAME, state.filtered_bytes)):
        path = out / name
        if path.exists() or size:
            with open(path, "ab") as f:
                f.truncate(size)


def _chain_config(filters: FilterConfig, journal: Journal) -> FilterConfig:
    """The chain's settings: a top-fraction relevance filter becomes its score cutoff."""
    if filters.relevance_top_fraction is None:
        return filters
    return dataclasses.replace(
        filters,
        relevance_top_fraction=None,
        relevance_threshold=journal.header["relevance_cutoff"],
    )


def _remember_kept(out: Path, shards: list[dict[str, Any]], chain: FilterChain) -> None:
    """Refill the duplicate memory from the kept shards (their json holds sha256 and pHash)."""
    config = chain.config
    if not config.exact_duplicates and config.near_duplicate_bits is None:
        return
    for shard in shards:
        for sample in read_shard(out / shard["name"]):
            meta = json.loads(sample["json"])
            if meta.get("window", 0) == 0:
                chain.remember(Features(sha256=meta["sha256"], phash=_hex(meta.get("phash"))))


def _hex(text: str | None) -> int | None:
    return int(text, 16) if text else None


def _relevance(
    source: Source, config: BuildConfig, journal: Journal, progress: Progress | None
) -> Callable[[list[np.ndarray], list[str]], np.ndarray] | None:
    """The relevance scorer, and for a top-fraction filter the score cutoff (computed once over
    the samples that pass the per-sample filters, kept in the journal header)."""
    if not config.filters.needs_relevance:
        return None
    if config.relevance_model is None:
        raise FieldError("--relevance-model", "the relevance filter needs a model folder")
    scorer = relevance_scorer(
        config.relevance_model, device=config.relevance_device, tokenizer=config.relevance_tokenizer
    )
    fraction = config.filters.relevance_top_fraction
    if fraction is not None and "relevance_cutoff" not in journal.header:
        per_sample = dataclasses.replace(config.filters, relevance_top_fraction=None)
        scores: list[float] = []
        for block in _scored_blocks(source, 0, config, scorer, progress, "scoring"):
            for outcome in block:
                if outcome.reject is None and sample_reason(outcome.features, per_sample) is None:
                    if outcome.features.relevance is not None:
                        scores.append(outcome.features.relevance)
        journal.header["relevance_cutoff"] = top_fraction_cutoff(scores, fraction)
        journal.header["relevance_pool"] = len(scores)
        journal.rewrite()
    return scorer


def _scored_blocks(
    source: Source,
    start: int,
    config: BuildConfig,
    scorer: Any,
    progress: Progress | None,
    phase: str,
) -> Iterator[list[Outcome]]:
    """Outcomes from position `start` on, in blocks of `SCORE_BLOCK` fixed source positions,
    with relevance scores filled in (a block is always scored as a whole, so a resumed build
    feeds the model the same batches and gets the same floating-point scores)."""
    begin = start - start % SCORE_BLOCK if scorer is not None else start
    fn = partial(process_item, opts=config.process)
    outcomes = ordered_map(fn, source.items(begin), config.workers)
    done = start
    for _, group in itertools.groupby(outcomes, key=lambda o: o.index // SCORE_BLOCK):
        block = list(group)
        if scorer is not None:
            _score(block, scorer)
        block = [o for o in block if o.index >= start]
        done += len(block)
        if progress is not None:
            progress(phase, done, source.count)
        yield block


def _score(block: list[Outcome], scorer: Any) -> None:
    with_thumbs = [o for o in block if o.thumb is not None and o.features.caption is not None]
    if not with_thumbs:
        return
    scores = scorer([o.thumb for o in with_thumbs], [o.features.caption for o in with_thumbs])
    for outcome, score in zip(with_thumbs, scores, strict=True):
        outcome.features.relevance = round(float(score), 4)


def _run(
    source: Source,
    config: BuildConfig,
    journal: Journal,
    state: State,
    chain: FilterChain,
    scorer: Any,
    progress: Progress | None,
    publish: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """The main loop: outcomes in order -> logs and shards, a journal line per finished shard
    (after `publish(shard)`, when given, has uploaded it)."""
    out = config.out_dir
    start, skip = state.next_index, state.item_samples_done
    shards_before = len(journal.shards())
    with (
        open(out / REJECTS_NAME, "ab") as rejects,
        open(out / FILTERED_NAME, "ab") as filtered,
        ShardWriter(
            out,
            prefix=SHARD_PREFIX,
            max_samples=config.max_samples_per_shard,
            max_bytes=config.max_shard_bytes,
            start_index=shards_before,
        ) as writer,
    ):
        logs = (rejects, filtered)
        after_last_write = state.copy()
        for block in _scored_blocks(source, start, config, scorer, progress, "building"):
            for outcome in block:
                samples = _admit(outcome, state, chain, rejects, filtered, resume_skip=skip)
                skip = 0
                for n, sample in enumerate(samples):
                    finished = len(writer.shards)
                    writer.write(sample)
                    if len(writer.shards) > finished:  # the previous shard was just closed
                        _checkpoint(journal, writer.shards[-1], after_last_write, logs, publish)
                    state.samples += 1
                    last = n == len(samples) - 1
                    state.next_index = outcome.index + 1 if last else outcome.index
                    state.item_samples_done = 0 if last else state.item_samples_done + 1
                    after_last_write = _snapshot(state, logs)
                state.next_index, state.item_samples_done = outcome.index + 1, 0
        finished = len(writer.shards)
        writer.close()
        final = _snapshot(state, logs)
        if len(writer.shards) > finished:
            _checkpoint(journal, writer.shards[-1], final, logs, publish, done=True)
        else:
            _checkpoint(journal, None, final, logs, done=True)


def _admit(
    outcome: Outcome,
    state: State,
    chain: FilterChain,
    rejects: BinaryIO,
    filtered: BinaryIO,
    resume_skip: int,
) -> list[dict[str, Any]]:
    """Log a reject or a filtered sample; return the samples to write."""
    if outcome.reject is not None:
        kind, path, reason = outcome.reject
        _log(rejects, {"index": outcome.index, "path": path, "kind": kind, "reason": reason})
        state.rejected += 1
        state.rejected_by_kind[kind] += 1
        return []
    if not resume_skip:  # else admitted before the interruption, some of its windows written
        verdict = chain.admit(outcome.features)
        if verdict is not None:
            name, detail = verdict
            record = {"index": outcome.index, "path": outcome.origin, "filter": name}
            _log(filtered, record | {"detail": detail})
            return []
    for sample in outcome.samples:
        _add_to_json(sample, outcome.features)
    return outcome.samples[resume_skip:]


def _add_to_json(sample: dict[str, Any], features: Features) -> None:
    """Record the content hash (and relevance score) in the sample's json: the duplicate memory
    of a resumed build is read back from there."""
    meta = json.loads(sample["json"]) | {"sha256": features.sha256}
    if features.relevance is not None:
        meta["relevance"] = features.relevance
    sample["json"] = json_bytes(meta)


def _log(f: BinaryIO, record: dict[str, Any]) -> None:
    f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


def _snapshot(state: State, logs: tuple[BinaryIO, BinaryIO]) -> State:
    snap = state.copy()
    snap.rejects_bytes, snap.filtered_bytes = logs[0].tell(), logs[1].tell()
    return snap


def _checkpoint(
    journal: Journal,
    shard: dict[str, Any] | None,
    state: State,
    logs: tuple[BinaryIO, BinaryIO],
    publish: Callable[[dict[str, Any]], None] | None = None,
    done: bool = False,
) -> None:
    if shard is not None and publish is not None:
        publish(shard)
    for f in logs:  # the journal may only point at log bytes that are on disk
        f.flush()
        os.fsync(f.fileno())
    journal.append({"shard": shard, "state": state.to_dict(), "done": done})


def _finish(
    config: BuildConfig, journal: Journal, resumed_at: int | None, complete: bool
) -> BuildReport:
    """Check the reject rate; write the manifest (last, and only when the build passes)."""
    state = State.from_dict(journal.entries[-1]["state"])
    shards = journal.shards()
    items = state.next_index
    rate = state.rejected / items if items else 0.0
    filters: dict[str, Any] = {"settings": config.filters.enabled(), **state.filters.to_dict()}
    if config.relevance_model is not None:
        filters["relevance_model"] = str(config.relevance_model)
    if "relevance_cutoff" in journal.header:
        filters["relevance_cutoff"] = journal.header["relevance_cutoff"]
    manifest = {
        "modalities": list(config.process.modalities),
        "counts": {
            "samples": state.samples,
            "source_items": items,
            "rejected": state.rejected,
            "rejected_by_kind": dict(sorted(state.rejected_by_kind.items())),
            "filtered": sum(state.filters.removed.values()),
        },
        "filters": filters,
        "command": config.command,
    }
    ok = rate <= config.max_reject_rate
    if ok:
        _write_manifest_if_changed(config.out_dir, shards, manifest)
    return BuildReport(shards, state, items, resumed_at, complete, rate, ok, manifest)


def _write_manifest_if_changed(
    out: Path, shards: list[dict[str, Any]], info: dict[str, Any]
) -> None:
    try:
        current = json.loads((out / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        current = None
    expected = {"schema_version": SCHEMA_VERSION, "shards": shards, **info}
    if current != expected:  # a finished build that is run again touches nothing
        write_manifest(out, shards, **info)
