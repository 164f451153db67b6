"""`mmtrain data build SRC --out DIR`: raw files, tables or shards -> filtered WebDataset shards.

The pipeline, in source order:

1. `sources.open_source` lists items (a folder grouped by stem, table rows, or shard samples).
2. Worker processes run `process_item` on each item: read, check the extension against the
   content, decode (bounded pixels), normalise (image re-encoded at a maximum side, video
   optionally cut into clips and re-encoded by `video_clips`, audio resampled to FLAC,
   time-series to npy, text NFC), and measure what the filters need.
   A broken item becomes a reject with its path and reason.
3. The main process takes the outcomes back in source order (whatever the number of workers),
   scores image-text relevance in fixed blocks, applies the `FilterChain` (duplicates need the
   order), appends rejects to `rejects.jsonl` and filtered samples to `filtered.jsonl`, and
   writes kept samples through `ShardWriter`.
4. `manifest.json` is written last: shards with sha256, modalities, counts, filter statistics
   and the command. The build fails (exit 2) when the reject rate passes `--max-reject-rate`.

Resuming: after each finished shard a line goes to `.build-journal.jsonl` with the shard's sha256
and the build state right after its last sample (source position, counts, log offsets). A rerun of
the same command keeps every shard that still matches its sha256 up to the first one missing or
changed, restores the state there (duplicate memory is read back from the kept shards' json) and
goes on. Keys are source positions, and every step is deterministic, so the shards come out byte
for byte the same as an uninterrupted build.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import itertools
import json
import logging
import multiprocessing
import os
import shlex
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mmtrain.atomic import atomic_write_text, sha256_file
from mmtrain.data.filters import (
    Features,
    FilterChain,
    FilterConfig,
    FilterStats,
    center_square,
    clean_caption,
    content_sha256,
    laplacian_variance,
    phash,
    relevance_scorer,
    rms_dbfs,
    sample_reason,
    top_fraction_cutoff,
)
from mmtrain.data.media import (
    DEFAULT_MAX_PIXELS,
    MediaError,
    check_extension,
    decode_audio,
    decode_image,
    decode_text,
    decode_timeseries,
    decode_video,
)
from mmtrain.data.shards import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    ShardWriter,
    read_shard,
    write_manifest,
)
from mmtrain.data.sources import MODALITIES, Item, Source, open_source, parse_columns
from mmtrain.data.video_clips import DEFAULT_KEYFRAME_INTERVAL, ClipOptions, split_video
from mmtrain.structured import FieldError

logger = logging.getLogger(__name__)

JOURNAL_NAME = ".build-journal.jsonl"
REJECTS_NAME = "rejects.jsonl"
FILTERED_NAME = "filtered.jsonl"
SHARD_PREFIX = "shard"
VIDEO_PROBE_FRAMES = 4  # frames decoded to validate a video (spread over it: catches truncation)
SCORE_BLOCK = 64  # relevance is scored in blocks of fixed source positions: same batches on resume
# Re-encoding keeps the source format; quality high enough that training does not see artefacts.
ENCODERS = {"jpg": ("JPEG", {"quality": 95}), "png": ("PNG", {}), "webp": ("WEBP", {"quality": 95})}
# ClipOptions fields -> the flags that set them (for error messages).
VIDEO_FLAGS = {
    "clip_s": "--video-clip-seconds",
    "scene_threshold": "--video-scene-threshold",
    "min_clip_s": "--video-min-clip-seconds",
    "keyframe_interval": "--video-keyframe-interval",
    "max_side": "--video-max-side",
}
# Options that do not change the shards: a rerun that differs only in these resumes.
NOT_IN_FINGERPRINT = {"out", "workers", "max_reject_rate", "relevance_device", "progress"}


# ----------------------------------------------------------------------------- per item
@dataclass(frozen=True)
class ProcessOptions:
    """What a worker needs to turn an item into samples (picklable)."""

    modalities: tuple[str, ...]
    image_max_side: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    audio_rate: int = 16000
    timeseries_window: int | None = None
    video: ClipOptions | None = None  # split and/or re-encode videos (None: stored as they are)
    fix_text: bool = False
    sharpness: bool = False  # measure the Laplacian variance (blur filter on)
    phash: bool = False  # compute the perceptual hash (near-duplicate filter on)
    relevance_size: int | None = None  # return a square thumbnail for the relevance model


@dataclass
class Outcome:
    """The result of one item: samples and features, or a reject (path and reason)."""

    index: int
    origin: str
    samples: list[dict[str, Any]] = field(default_factory=list)
    features: Features | None = None
    reject: tuple[str, str, str] | None = None  # (kind, path, reason)
    thumb: np.ndarray | None = None


@dataclass
class _Piece:
    """One of several samples cut from an item (a time-series window, a video clip): its key
    suffix, its own members and the json fields it adds or overrides."""

    suffix: str
    members: dict[str, bytes]
    meta: dict[str, Any]


@dataclass
class _Work:
    """Per-item scratch: members to store, json metadata, filter features, and the pieces when
    the item is cut into several samples."""

    features: Features
    meta: dict[str, Any]
    members: dict[str, bytes] = field(default_factory=dict)
    windows: list[_Piece] | None = None
    thumb: np.ndarray | None = None


def sample_key(index: int) -> str:
    """Keys are source positions: unique, dot-free, and sorted like the source."""
    return f"{index:09d}"


def process_item(item: Item, opts: ProcessOptions) -> Outcome:
    """Read, validate, normalise and measure one item (runs in a worker process)."""
    reject = partial(Outcome, item.index, item.origin)
    if item.problem:
        return reject(reject=("listing", item.origin, item.problem))
    missing = [m for m in opts.modalities if m not in item.parts]
    if missing:
        return reject(
            reject=(
                "missing_modality",
                item.origin,
                f"no {' or '.join(missing)} file; every sample needs {', '.join(opts.modalities)}",
            )
        )
    raw: dict[str, bytes] = {}
    for m in opts.modalities:
        part = item.parts[m]
        try:
            raw[m] = part.read()
        except OSError as err:
            return reject(reject=("unreadable", part.origin, f"{m}: {err.strerror or err}"))
        if not raw[m]:
            return reject(reject=("empty", part.origin, f"{m}: empty file (0 bytes)"))
    work = _Work(
        Features(sha256=content_sha256(list(raw.items()))),
        {"source": item.origin} | ({"meta": item.meta} if item.meta else {}),
    )
    for m in opts.modalities:
        part = item.parts[m]
        try:
            check_extension(part.ext, raw[m])
        except MediaError as err:
            return reject(reject=("mislabelled", part.origin, f"{m}: {err}"))
        try:
            HANDLERS[m](raw[m], part.ext, opts, work)
        except MediaError as err:
            return reject(reject=("undecodable", part.origin, f"{m}: {err}"))
    return Outcome(item.index, item.origin, _samples(item, work), work.features, thumb=work.thumb)


def _samples(item: Item, work: _Work) -> list[dict[str, Any]]:
    key = sample_key(item.index)
    base = dict(work.members) | dict(item.extra)
    if work.windows is None:
        return [{"__key__": key, **base, "json": _json_bytes(work.meta)}]
    return [
        {
            "__key__": f"{key}_{piece.suffix}",
            **base,
            **piece.members,
            "json": _json_bytes(work.meta | piece.meta),
        }
        for piece in work.windows
    ]


def _json_bytes(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _image(data: bytes, ext: str, opts: ProcessOptions, work: _Work) -> None:
    pixels = decode_image(data, max_pixels=opts.max_pixels)
    height, width = pixels.shape[:2]
    work.features.height, work.features.width = height, width
    if opts.sharpness:
        work.features.sharpness = laplacian_variance(pixels)
    if opts.phash:
        work.features.phash = phash(pixels)
        work.meta["phash"] = f"{work.features.phash:016x}"
    if opts.relevance_size:
        work.thumb = center_square(pixels, opts.relevance_size)
    ext = "jpg" if ext == "jpeg" else ext
    if opts.image_max_side and max(height, width) > opts.image_max_side:
        data, (width, height) = _reencode(pixels, ext, opts.image_max_side)
    work.members[ext] = data
    work.meta.update(width=width, height=height)


def _reencode(pixels: np.ndarray, ext: str, max_side: int) -> tuple[bytes, tuple[int, int]]:
    from PIL import Image

    height, width = pixels.shape[:2]
    scale = max_side / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    # reducing_gap: a cheap integer downscale first, then Lanczos (visually identical, faster).
    image = Image.fromarray(pixels).resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
    fmt, kwargs = ENCODERS.get(ext, ENCODERS["png"])
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue(), size


def _video(data: bytes, ext: str, opts: ProcessOptions, work: _Work) -> None:
    # A few frames spread over the clip: proves it decodes to the end; small frames are cheap.
    clip = decode_video(data, VIDEO_PROBE_FRAMES, short_side=64, max_pixels=opts.max_pixels)
    work.features.video_s = clip.duration_s
    work.meta.update(
        fps=round(clip.fps, 6),
        duration_s=round(clip.duration_s, 6),
        frames=int(round(clip.duration_s * clip.fps)),
    )
    if opts.video is None:
        work.members[ext] = data
        return
    measured, clips = split_video(data, opts.video, opts.max_pixels)
    work.features.video_s = measured.duration_s  # the short-video filter sees decoded frames
    if not opts.video.splits:  # one re-encoded video, same key
        (clip,) = clips
        work.members["mp4"] = clip.data
        work.meta.update(clip.meta)
        return
    # Keys `<item key>_c0003`. No clip at all only when the video is shorter than the minimum
    # clip, which the short-video filter (forced on by config_from_args) then removes.
    work.windows = [
        _Piece(f"c{c:04d}", {"mp4": clip.data}, clip.meta) for c, clip in enumerate(clips)
    ]


def _audio(data: bytes, ext: str, opts: ProcessOptions, work: _Work) -> None:
    import soundfile

    wave = decode_audio(data, opts.audio_rate)
    work.features.audio_dbfs = rms_dbfs(wave)
    buffer = io.BytesIO()
    # 16-bit FLAC is lossless for 16-bit sources; clip first: integer PCM wraps, not saturates.
    soundfile.write(
        buffer, np.clip(wave, -1.0, 1.0), opts.audio_rate, format="FLAC", subtype="PCM_16"
    )
    work.members["flac"] = buffer.getvalue()
    work.meta.update(sample_rate=opts.audio_rate, seconds=round(len(wave) / opts.audio_rate, 6))


def _timeseries(data: bytes, ext: str, opts: ProcessOptions, work: _Work) -> None:
    series = decode_timeseries(data, ext)
    channels, length = series.shape
    work.meta.update(channels=channels, length=length)
    window = opts.timeseries_window
    if window is None:
        work.members["npy"] = _npy_bytes(series)
        return
    if length < window:
        raise MediaError(f"{length} time steps, fewer than one window of {window}")
    starts = range(0, length - window + 1, window)
    work.windows = [
        _Piece(f"{w:05d}", {"npy": _npy_bytes(series[:, s : s + window])}, {"window": w})
        for w, s in enumerate(starts)
    ]
    work.meta["window_length"] = window


def _text(data: bytes, ext: str, opts: ProcessOptions, work: _Work) -> None:
    text = decode_text(data)
    if opts.fix_text:
        import ftfy  # checked at startup: the flag is refused when ftfy is missing

        text = ftfy.fix_text(text)
    text = clean_caption(text)
    work.features.caption = text
    work.members["txt"] = text.encode("utf-8")


HANDLERS: dict[str, Callable[[bytes, str, ProcessOptions, _Work], None]] = {
    "image": _image,
    "video": _video,
    "audio": _audio,
    "timeseries": _timeseries,
    "text": _text,
}


def ordered_map(
    fn: Callable[[Item], Outcome], items: Iterable[Item], workers: int
) -> Iterator[Outcome]:
    """`fn` over `items` in `workers` processes, results in input order, a bounded number in
    flight (so a huge source never sits in memory). One worker runs inline."""
    if workers <= 1:
        yield from map(fn, items)
        return
    context = multiprocessing.get_context("spawn")  # no inherited threads or torch state
    pending: deque[Future] = deque()
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 8 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


# ----------------------------------------------------------------------------- build state
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


def _shard_intact(out_dir: Path, shard: dict[str, Any]) -> bool:
    path = out_dir / shard["name"]
    return (
        path.is_file()
        and path.stat().st_size == shard["bytes"]
        and sha256_file(path) == shard["sha256"]
    )


# ----------------------------------------------------------------------------- the build
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
        _run(source, config, journal, state, chain, scorer, progress)
    return _finish(config, journal, resumed_at, complete)


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
        if shard and not _shard_intact(out, shard):
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
) -> None:
    """The main loop: outcomes in order -> logs and shards, a journal line per finished shard."""
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
                        _checkpoint(journal, writer.shards[-1], after_last_write, logs)
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
            _checkpoint(journal, writer.shards[-1], final, logs, done=True)
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
    sample["json"] = _json_bytes(meta)


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
    done: bool = False,
) -> None:
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


# ----------------------------------------------------------------------------- command line
def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `mmtrain data build` (commands/data.py wires them to `run_build`)."""
    parser.add_argument(
        "src", metavar="SRC", help="folder of files, CSV/TSV/JSONL/parquet table, or shards"
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder (shards, manifest)")
    parser.add_argument(
        "--modalities",
        help=f"required modalities, comma-separated ({','.join(MODALITIES)}); default: all found",
    )
    parser.add_argument(
        "--columns", help="table columns per modality, e.g. image=filepath,text=caption"
    )
    media = parser.add_argument_group("media")
    media.add_argument("--image-max-side", type=int, help="re-encode larger images to this side")
    media.add_argument(
        "--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, help="refuse larger images (bombs)"
    )
    media.add_argument("--audio-rate", type=int, default=16000, help="resample audio to this rate")
    media.add_argument("--timeseries-window", type=int, help="cut time-series into windows of N")
    media.add_argument("--fix-text", action="store_true", help="repair mojibake (needs ftfy)")
    video = parser.add_argument_group(
        "video (each flag but --video-min-clip-seconds re-encodes videos to MP4, H.264 when "
        "available; audio tracks are dropped)"
    )
    video.add_argument(
        "--video-clip-seconds",
        type=float,
        metavar="S",
        help="cut videos (within scenes) into windows of S s",
    )
    video.add_argument(
        "--video-scene-threshold",
        type=float,
        metavar="T",
        help="cut at frames differing from the previous one by more than T levels "
        "(mean absolute RGB difference of 64-px-wide thumbnails, 0-255; about 30 for hard cuts)",
    )
    video.add_argument(
        "--video-min-clip-seconds",
        type=float,
        metavar="S",
        default=1.0,
        help="shortest scene and clip kept when cutting (shorter videos are filtered)",
    )
    video.add_argument(
        "--video-keyframe-interval",
        type=int,
        metavar="N",
        help=f"a keyframe every N frames (default {DEFAULT_KEYFRAME_INTERVAL} when re-encoding)",
    )
    video.add_argument(
        "--video-max-side", type=int, metavar="PIXELS", help="downscale frames to this longer side"
    )
    f = parser.add_argument_group("filters (each off unless given)")
    f.add_argument("--dedup", action="store_true", help="drop exact duplicates (sha256)")
    f.add_argument(
        "--near-dup-bits", type=int, help="drop images within N pHash bits of a kept one"
    )
    f.add_argument("--min-side", type=int, help="drop images whose shorter side is smaller")
    f.add_argument(
        "--max-aspect", type=float, help="drop images with a longer/shorter side ratio above"
    )
    f.add_argument("--min-sharpness", type=float, help="drop blurry images (Laplacian variance)")
    f.add_argument("--min-caption-chars", type=int)
    f.add_argument("--max-caption-chars", type=int)
    f.add_argument("--min-caption-words", type=int)
    f.add_argument("--max-caption-words", type=int)
    f.add_argument("--min-video-seconds", type=float, help="drop shorter videos")
    f.add_argument("--min-audio-dbfs", type=float, help="drop audio quieter than this RMS level")
    f.add_argument("--relevance-model", help="mmtrain model folder scoring image-text relevance")
    f.add_argument("--relevance-threshold", type=float, help="drop CLIP scores below (0..100)")
    f.add_argument("--relevance-top-fraction", type=float, help="keep the best-scored fraction")
    f.add_argument("--relevance-tokenizer", default="byte", help="the model's tokenizer")
    f.add_argument("--relevance-device", default="cpu", help="device for the relevance model")
    run = parser.add_argument_group("shards and run")
    run.add_argument("--max-samples-per-shard", type=int, default=10_000)
    run.add_argument("--max-shard-bytes", type=int, default=1 << 30)
    run.add_argument(
        "--max-reject-rate", type=float, default=0.1, help="fail (exit 2) above this reject rate"
    )
    run.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decoding processes")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def command_line(args: argparse.Namespace) -> tuple[str, str]:
    """The canonical command (options that differ from their defaults) and its fingerprint,
    which leaves out the options that cannot change the shards (workers, reject rate, device)."""
    reference = argparse.ArgumentParser(add_help=False)
    add_build_arguments(reference)
    words, kept = ["mmtrain", "data", "build", str(args.src)], []
    for action in reference._actions:
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        part = [flag] if isinstance(value, bool) else [flag, str(value)]
        words += part
        if action.dest not in NOT_IN_FINGERPRINT:
            kept += part
    fingerprint = hashlib.sha256(json.dumps([str(args.src), *kept]).encode()).hexdigest()[:16]
    return shlex.join(words), fingerprint


def _filter_config(args: argparse.Namespace) -> FilterConfig:
    try:
        return FilterConfig(
            exact_duplicates=args.dedup,
            near_duplicate_bits=args.near_dup_bits,
            min_side=args.min_side,
            max_aspect=args.max_aspect,
            min_sharpness=args.min_sharpness,
            min_caption_chars=args.min_caption_chars,
            max_caption_chars=args.max_caption_chars,
            min_caption_words=args.min_caption_words,
            max_caption_words=args.max_caption_words,
            min_video_s=args.min_video_seconds,
            min_audio_dbfs=args.min_audio_dbfs,
            relevance_threshold=args.relevance_threshold,
            relevance_top_fraction=args.relevance_top_fraction,
        )
    except ValueError as err:
        raise FieldError("filters", str(err)) from None


def _modalities(args: argparse.Namespace, source: Source) -> tuple[str, ...]:
    if args.modalities:
        names = [m.strip() for m in args.modalities.split(",") if m.strip()]
        unknown = [m for m in names if m not in MODALITIES]
        if unknown:
            raise FieldError(
                "--modalities", f"{', '.join(unknown)}: not one of {', '.join(MODALITIES)}"
            )
        return tuple(m for m in MODALITIES if m in names)
    found = source.modalities()
    if not found:
        raise FieldError(
            "SRC", f"{args.src}: no image, video, audio, time-series or text files found"
        )
    return tuple(found)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("max_samples_per_shard", "max_shard_bytes", "workers", "max_pixels", "audio_rate"):
        if getattr(args, name) < 1:
            raise FieldError(f"--{name.replace('_', '-')}", "must be at least 1")
    for name in ("image_max_side", "timeseries_window"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise FieldError(f"--{name.replace('_', '-')}", "must be at least 1")
    splits_video = args.video_clip_seconds is not None or args.video_scene_threshold is not None
    if splits_video and args.timeseries_window is not None:
        raise FieldError(
            "--timeseries-window",
            "cannot be combined with --video-clip-seconds or --video-scene-threshold: each cuts a "
            "sample into several; build the two modalities separately",
        )
    if not 0 <= args.max_reject_rate <= 1:
        raise FieldError("--max-reject-rate", "must be between 0 and 1")
    if args.fix_text:
        try:
            import ftfy  # noqa: F401
        except ImportError:
            raise FieldError(
                "--fix-text", "mojibake repair needs the ftfy package (pip install ftfy)"
            ) from None
    relevance = args.relevance_threshold is not None or args.relevance_top_fraction is not None
    if relevance != (args.relevance_model is not None):
        raise FieldError(
            "--relevance-model",
            "give a model folder together with --relevance-threshold or --relevance-top-fraction",
        )
    if Path(args.src).resolve() == args.out.resolve():
        raise FieldError("--out", f"{args.out} is SRC; write the shards to another folder")


def _clip_options(args: argparse.Namespace) -> ClipOptions | None:
    """The video options, or None when videos are stored as they are."""
    flags = (args.video_clip_seconds, args.video_scene_threshold)
    flags += (args.video_keyframe_interval, args.video_max_side)
    if all(flag is None for flag in flags):
        return None
    try:
        return ClipOptions(
            clip_s=args.video_clip_seconds,
            scene_threshold=args.video_scene_threshold,
            min_clip_s=args.video_min_clip_seconds,
            keyframe_interval=DEFAULT_KEYFRAME_INTERVAL
            if args.video_keyframe_interval is None
            else args.video_keyframe_interval,
            max_side=args.video_max_side,
        )
    except ValueError as err:  # the message starts with the ClipOptions field at fault
        field_name = str(err).split()[0]
        raise FieldError(VIDEO_FLAGS.get(field_name, "--video-clip-seconds"), str(err)) from None


def config_from_args(args: argparse.Namespace) -> tuple[Source, BuildConfig]:
    """Validate the parsed options; the source to read and the build configuration."""
    _check_args(args)
    filters = _filter_config(args)
    video = _clip_options(args)
    if video is not None and video.splits:
        # A video shorter than the minimum clip gives no clip: filter it, counted as short_video.
        shortest = max(filters.min_video_s or 0.0, video.min_clip_s)
        filters = dataclasses.replace(filters, min_video_s=shortest)
    source = open_source(str(args.src), parse_columns(args.columns), args.out)
    relevance_size = None
    if filters.needs_relevance:
        from mmtrain.spec import ModelSpec

        spec = ModelSpec.load(Path(args.relevance_model) / "spec.yaml")
        towers = [t for t in spec.towers.values() if t.modality == "image"]
        if not towers:
            raise FieldError("--relevance-model", f"{args.relevance_model} has no image tower")
        relevance_size = towers[0].stem.image_size
    modalities = _modalities(args, source)
    if filters.needs_relevance and not {"image", "text"} <= set(modalities):
        raise FieldError("--modalities", "the relevance filter needs image and text")
    process = ProcessOptions(
        modalities=modalities,
        image_max_side=args.image_max_side,
        max_pixels=args.max_pixels,
        audio_rate=args.audio_rate,
        timeseries_window=args.timeseries_window,
        video=video,
        fix_text=args.fix_text,
        sharpness=filters.min_sharpness is not None,
        phash=filters.near_duplicate_bits is not None,
        relevance_size=relevance_size,
    )
    command, fingerprint = command_line(args)
    config = BuildConfig(
        out_dir=args.out,
        process=process,
        filters=filters,
        max_samples_per_shard=args.max_samples_per_shard,
        max_shard_bytes=args.max_shard_bytes,
        max_reject_rate=args.max_reject_rate,
        workers=args.workers,
        command=command,
        fingerprint=fingerprint,
        relevance_model=args.relevance_model,
        relevance_device=args.relevance_device,
        relevance_tokenizer=args.relevance_tokenizer,
    )
    return source, config


def run_build(args: argparse.Namespace) -> int:
    """`mmtrain data build`: build, print a summary; exit 2 when the reject rate is too high."""
    source, config = config_from_args(args)
    show = args.progress and sys.stderr.isatty()
    if show:
        from rich.progress import Progress as Bar

        with Bar(transient=True) as bar:
            tasks: dict[str, Any] = {}

            def update(phase: str, done: int, total: int | None) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=total)
                bar.update(tasks[phase], completed=done)

            report = build(source, config, update)
    else:
        report = build(source, config)
    counts = report.manifest["counts"]
    if report.already_complete:
        print(f"already built: {len(report.shards)} shard(s) verified against their sha256")
    elif report.resumed_at_shard is not None:
        print(f"resumed: {report.resumed_at_shard} finished shard(s) verified and kept")
    print(
        f"{counts['samples']} samples in {len(report.shards)} shard(s) from "
        f"{counts['source_items']} source items; {counts['rejected']} rejected, "
        f"{counts['filtered']} filtered"
    )
    removed = report.manifest["filters"]["removed"]
    if removed:
        print("filtered: " + ", ".join(f"{k} {v}" for k, v in removed.items()))
    if not report.ok:
        print(
            f"mmtrain data build: error: reject rate {report.reject_rate:.1%} is above "
            f"--max-reject-rate {config.max_reject_rate:.1%}; see {config.out_dir / REJECTS_NAME} "
            "(no manifest written)",
            file=sys.stderr,
        )
        return 2
    print(f"wrote {config.out_dir / 'manifest.json'}")
    return 0
