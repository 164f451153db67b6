"""Cut a source video into clips (at scene changes and into fixed windows) and re-encode them.

Used by `mmtrain data build` (`--video-scene-threshold`, `--video-clip-seconds`,
`--video-keyframe-interval`, `--video-max-side`). Three steps, each a small function:

1. `measure`: decode every frame once and score how much each frame differs from the one before:
   the mean absolute difference of the RGB values (0-255) of consecutive frames shrunk to
   `THUMB_WIDTH` pixels wide. A hard cut between two shots scores tens of levels; motion within
   a shot, much less. Shrinking first makes the score blind to noise and compression artefacts;
   colour (not just brightness) catches cuts between shots of equal brightness.
2. `plan_clips` (pure): a frame whose score is above the threshold starts a new scene, unless the
   current scene is shorter than the minimum clip length (so a flash or a fast pan does not
   splinter the video). Each scene is cut into consecutive windows of `clip_s` seconds; a piece
   shorter than the minimum (the tail of a scene, or a scene at the end) is dropped, so every
   clip is at least `min_clip_s` long.
3. `encode_clips`: decode again and encode each planned clip as its own MP4 with H.264 (libx264
   when the installed PyAV has it, MPEG-4 part 2 otherwise), a keyframe every
   `keyframe_interval` frames (so a loader can seek to any window cheaply) and the source's
   average frame rate; frames are re-timed at that constant rate. Audio tracks are dropped: a
   clip holds its first video stream only.

Decoding twice keeps memory at one frame plus the encoded clips, whatever the video's length.
The encoders run single-threaded with fixed settings, so the same source always gives the same
bytes: what the build's resume journal relies on.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from mmtrain.data.stream.media import DEFAULT_MAX_PIXELS, MediaError, first_video_stream

__all__ = [
    "ClipOptions",
    "Span",
    "Clip",
    "Measurement",
    "video_codec",
    "measure",
    "scene_starts",
    "plan_clips",
    "encode_clips",
    "split_video",
]

THUMB_WIDTH = 64  # pixels; the scene score compares frames shrunk to this width
DEFAULT_KEYFRAME_INTERVAL = 16  # frames: about half a second at 30 fps
# libx264: "veryfast" is a fair speed/size trade for ingest; CRF 20 keeps artefacts below what
# training at 224 px notices; sc_threshold 0 turns off extra keyframes at scene cuts, so
# keyframes fall exactly every `keyframe_interval` frames. mbtree=0: x264's macroblock-tree
# rate control gave different bytes for the same input from call to call in one process (seen
# with keyframe interval 16: 2448, 2474, 2484 bytes for one 20-frame clip; frame sizes differ
# from the 4th frame on), which breaks the build's byte-identical resume; without it the output
# repeats exactly (20 of 20 encodes), at ~20% more bytes for the same CRF.
X264_OPTIONS = {"preset": "veryfast", "crf": "20", "sc_threshold": "0", "x264-params": "mbtree=0"}
# MPEG-4 part 2 fallback: constant quantiser 3 (qscale * FF_QP2LAMBDA), no scene-cut keyframes.
MPEG4_OPTIONS = {"flags": "+qscale", "global_quality": str(3 * 118), "sc_threshold": "1000000000"}


@dataclass(frozen=True)
class ClipOptions:
    """How to split and re-encode videos (picklable: sent to the ingest workers).

    `clip_s` cuts fixed windows, `scene_threshold` (RGB levels, 0-255) cuts at scene changes;
    with neither, the whole video is re-encoded as one clip. `min_clip_s` is the shortest clip
    kept and the shortest scene; `max_side` caps the longer side of the frames (pixels).
    """

    clip_s: float | None = None
    scene_threshold: float | None = None
    min_clip_s: float = 1.0
    keyframe_interval: int = DEFAULT_KEYFRAME_INTERVAL
    max_side: int | None = None

    def __post_init__(self) -> None:
        if self.clip_s is not None and self.clip_s <= 0:
            raise ValueError(f"clip_s must be > 0, got {self.clip_s}")
        if self.scene_threshold is not None and not 0 <= self.scene_threshold < 255:
            raise ValueError(f"scene_threshold must be in 0..255, got {self.scene_threshold}")
        if self.min_clip_s <= 0:
            raise ValueError(f"min_clip_s must be > 0, got {self.min_clip_s}")
        if self.clip_s is not None and self.min_clip_s > self.clip_s:
            raise ValueError(
                f"min_clip_s ({self.min_clip_s}) is longer than clip_s ({self.clip_s}): "
                "no window could be kept"
            )
        if self.keyframe_interval < 1:
            raise ValueError(f"keyframe_interval must be >= 1, got {self.keyframe_interval}")
        if self.max_side is not None and self.max_side < 2:
            raise ValueError(f"max_side must be >= 2, got {self.max_side}")

    @property
    def splits(self) -> bool:
        """Whether a video becomes several clips (else one re-encoded video)."""
        return self.clip_s is not None or self.scene_threshold is not None


class Span(NamedTuple):
    """Frames [start, stop) of the source, in scene number `scene`."""

    start: int
    stop: int
    scene: int


@dataclass(frozen=True)
class Clip:
    """One encoded clip: MP4 bytes and what the sample's json records about it."""

    data: bytes
    meta: dict[str, Any]


@dataclass(frozen=True)
class Measurement:
    """What the first decoding pass learns: frame rate, frame size, per-frame start times
    (seconds from the stream start) and scene-change scores (score[0] is 0)."""

    rate: Fraction
    width: int
    height: int
    times: list[float]
    scores: list[float]
    has_audio: bool

    @property
    def frames(self) -> int:
        return len(self.times)

    @property
    def duration_s(self) -> float:
        """Frames over the average rate: the length once re-timed at a constant rate."""
        return self.frames / float(self.rate)


# ----------------------------------------------------------------------------- decoding
def video_codec() -> str:
    """The encoder used for clips: libx264 when this PyAV build has it, else mpeg4."""
    import av

    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except Exception:  # av raises UnknownCodecError (a ValueError) or FFmpegError by version
        return "mpeg4"


def _frames(data: bytes, max_pixels: int) -> Iterator[tuple[Any, Any, Any]]:
    """(container, stream, frame) for each frame of the first video stream, with size checks."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = first_video_stream(container, max_pixels)
            for frame in container.decode(stream):
                yield container, stream, frame
    except MediaError:
        raise
    except MemoryError:
        raise
    except Exception as err:  # av.error.FFmpegError and its subclasses, mostly
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise MediaError(f"undecodable video: {reason}") from None


def _rate(stream) -> Fraction:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if rate is None or rate <= 0:
        return Fraction(25)  # broken headers: the common default
    return Fraction(rate)


def _start_time(frame, stream, index: int, rate: Fraction) -> float:
    if frame.pts is None or stream.time_base is None:
        return index / float(rate)
    return float((frame.pts - (stream.start_time or 0)) * stream.time_base)


def _thumb(frame, width: int, height: int) -> np.ndarray:
    small_w = min(THUMB_WIDTH, width)
    small_h = max(1, round(height * small_w / width))
    rgb = frame.reformat(width=small_w, height=small_h, format="rgb24").to_ndarray()
    return rgb.astype(np.int16)


def measure(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Measurement:
    """Decode every frame once: rate, size, frame times and scene-change scores."""
    times: list[float] = []
    scores: list[float] = []
    previous: np.ndarray | None = None
    rate, width, height, has_audio = Fraction(25), 0, 0, False
    for index, (container, stream, frame) in enumerate(_frames(data, max_pixels)):
        if index == 0:
            rate, has_audio = _rate(stream), bool(container.streams.audio)
            width, height = stream.codec_context.width, stream.codec_context.height
        thumb = _thumb(frame, width, height)
        diff = 0.0 if previous is None else float(np.abs(thumb - previous).mean())
        scores.append(diff)
        times.append(_start_time(frame, stream, index, rate))
        previous = thumb
    if not times:
        raise MediaError("no decodable video frames")
    return Measurement(rate, width, height, times, scores, has_audio)


# ----------------------------------------------------------------------------- planning
def _min_frames(options: ClipOptions, fps: float) -> int:
    # The fewest frames that last min_clip_s (a hair of slack for 29.97 fps float products).
    return max(1, math.ceil(options.min_clip_s * fps - 1e-6))


def scene_starts(scores: Sequence[float], threshold: float, min_frames: int) -> list[int]:
    """Frame numbers that start a scene: 0, then every frame scoring above `threshold` at
    least `min_frames` after the previous start."""
    starts = [0]
    for index in range(1, len(scores)):
        if scores[index] > threshold and index - starts[-1] >= min_frames:
            starts.append(index)
    return starts


def plan_clips(scores: Sequence[float], fps: float, options: ClipOptions) -> list[Span]:
    """The clips to encode, in order (see the module docstring for the rules)."""
    frames = len(scores)
    if not options.splits:
        return [Span(0, frames, 0)] if frames else []
    min_frames = _min_frames(options, fps)
    if options.scene_threshold is None:
        starts = [0]
    else:
        starts = scene_starts(scores, options.scene_threshold, min_frames)
    window = frames if options.clip_s is None else max(1, round(options.clip_s * fps))
    spans = []
    for scene, (begin, end) in enumerate(zip(starts, [*starts[1:], frames], strict=True)):
        for start in range(begin, end, window):
            stop = min(start + window, end)
            if stop - start >= min_frames:
                spans.append(Span(start, stop, scene))
    return spans


# ----------------------------------------------------------------------------- encoding
def _output_size(width: int, height: int, max_side: int | None) -> tuple[int, int]:
    """Scaled so the longer side is at most `max_side`, then rounded down to even numbers
    (4:2:0 chroma needs even sizes)."""
    scale = min(1.0, max_side / max(width, height)) if max_side else 1.0
    w, h = max(2, round(width * scale)), max(2, round(height * scale))
    return w - w % 2, h - h % 2


class _ClipEncoder:
    """One clip being written: an MP4 in memory, frames numbered from 0 at `rate`."""

    def __init__(self, codec: str, rate: Fraction, size: tuple[int, int], keyframe_interval: int):
        import av

        self.buffer = io.BytesIO()
        self.container = av.open(self.buffer, mode="w", format="mp4")
        options = X264_OPTIONS if codec == "libx264" else MPEG4_OPTIONS
        self.stream = self.container.add_stream(codec, rate=rate, options=dict(options))
        self.stream.width, self.stream.height = size
        self.stream.pix_fmt = "yuv420p"
        self.stream.codec_context.gop_size = keyframe_interval
        # One thread: the output does not depend on the machine's core count (ingest already
        # runs one worker process per core).
        self.stream.codec_context.thread_count = 1
        self.size = size
        self.time_base = 1 / rate
        self.any_picture = av.video.frame.PictureType.NONE
        self.frames = 0

    def add(self, frame) -> None:
        out = frame.reformat(width=self.size[0], height=self.size[1], format="yuv420p")
        # Re-time at the constant rate, and forget the source's picture type: the encoder
        # would otherwise copy the source's keyframes on top of its own interval.
        out.pts, out.time_base = self.frames, self.time_base
        out.pict_type = self.any_picture
        self.frames += 1
        for packet in self.stream.encode(out):
            self.container.mux(packet)

    def finish(self) -> bytes:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()
        return self.buffer.getvalue()


def encode_clips(
    data: bytes,
    spans: Sequence[Span],
    measurement: Measurement,
    options: ClipOptions,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> list[Clip]:
    """Decode `data` again and encode each span as its own MP4 (see the module docstring)."""
    codec = video_codec()
    rate = measurement.rate
    size = _output_size(measurement.width, measurement.height, options.max_side)
    clips: list[Clip] = []
    pending = iter(spans)
    span = next(pending, None)
    encoder: _ClipEncoder | None = None
    for index, (_, _, frame) in enumerate(_frames(data, max_pixels)):
        if span is None:
            break
        if index == span.start:
            encoder = _ClipEncoder(codec, rate, size, options.keyframe_interval)
        if encoder is not None:
            encoder.add(frame)
        if index == span.stop - 1 and encoder is not None:
            clips.append(_clip(encoder.finish(), span, len(clips), measurement, options, codec))
            encoder, span = None, next(pending, None)
    if span is not None:  # the second decoding gave fewer frames than the first: corrupt input
        raise MediaError(f"video frames stop before frame {span.stop} on the second decoding")
    return clips


def _clip(
    data: bytes, span: Span, number: int, m: Measurement, options: ClipOptions, codec: str
) -> Clip:
    fps = float(m.rate)
    frames = span.stop - span.start
    width, height = _output_size(m.width, m.height, options.max_side)
    start_s = m.times[span.start]
    meta: dict[str, Any] = {
        "fps": round(fps, 6),
        "frames": frames,
        "duration_s": round(frames / fps, 6),
        "start_s": round(start_s, 6),
        "end_s": round(start_s + frames / fps, 6),
        "width": width,
        "height": height,
        "codec": "h264" if codec == "libx264" else codec,
        "keyframe_interval": options.keyframe_interval,
        "source_duration_s": round(m.duration_s, 6),
    }
    if options.splits:
        meta.update(clip=number, scene=span.scene)
    if m.has_audio:
        meta["audio_dropped"] = True
    return Clip(data, meta)


def split_video(
    data: bytes, options: ClipOptions, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[Measurement, list[Clip]]:
    """Measure, plan and encode: the source's measurement and its clips, in order. Without a
    split option the one clip is the whole video re-encoded. Raises MediaError on bad input."""
    measurement = measure(data, max_pixels)
    spans = plan_clips(measurement.scores, float(measurement.rate), options)
    return measurement, encode_clips(data, spans, measurement, options, max_pixels)
