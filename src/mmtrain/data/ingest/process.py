"""Per-item processing for `mmtrain data build`: one source item -> samples and features, or a
reject.

`process_item` runs in the build's worker processes: it reads each modality's bytes, checks the
extension against the content, decodes (bounded pixels), normalises (image re-encoded at a maximum
side, video optionally cut into clips and re-encoded by `video_clips`, audio resampled to FLAC,
time-series to npy, optionally cut into windows, text NFC) and measures what the filters need.
A broken item comes back as an `Outcome` with a reject (kind, path, reason) instead of raising, so
one bad file never stops a build. `ordered_map` runs it in worker processes and hands the outcomes
back in source order, whatever the number of workers.

Kept apart from the build loop (`pipeline`) because this is the only part that runs in the
workers (everything it takes and returns, `outcome.ProcessOptions` and `outcome.Outcome`, is
picklable) and the only part that knows about media; the build orders, filters and writes what
comes back. Conversation items go to `conversation_items.process_conversation`.
"""

from __future__ import annotations

import io
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from mmtrain.data.ingest.conversation_items import process_conversation
from mmtrain.data.ingest.filters import (
    Features,
    center_square,
    clean_caption,
    content_sha256,
    laplacian_variance,
    phash,
    rms_dbfs,
)
from mmtrain.data.ingest.outcome import (
    Outcome,
    ProcessOptions,
    json_bytes,
    reencode_image,
    sample_key,
)
from mmtrain.data.ingest.sources import Item
from mmtrain.data.ingest.video_clips import split_video
from mmtrain.data.stream.media import (
    MediaError,
    check_extension,
    decode_audio,
    decode_image,
    decode_text,
    decode_timeseries,
    decode_video,
)

VIDEO_PROBE_FRAMES = 4  # frames decoded to validate a video (spread over it: catches truncation)


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


def process_item(item: Item, opts: ProcessOptions) -> Outcome:
    """Read, validate, normalise and measure one item (runs in a worker process)."""
    reject = partial(Outcome, item.index, item.origin)
    if item.problem:
        return reject(reject=(item.problem_kind, item.origin, item.problem))
    if item.conversation is not None:
        return process_conversation(item, opts)
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
        return [{"__key__": key, **base, "json": json_bytes(work.meta)}]
    return [
        {
            "__key__": f"{key}_{piece.suffix}",
            **base,
            **piece.members,
            "json": json_bytes(work.meta | piece.meta),
        }
        for piece in work.windows
    ]


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
        data, (width, height) = reencode_image(pixels, ext, opts.image_max_side)
    work.members[ext] = data
    work.meta.update(width=width, height=height)


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
    # clip, which the short-video filter (forced on by options.config_from_options) then removes.
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
