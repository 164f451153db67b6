"""Decoders: the bytes of one shard member -> a numpy array, or a `MediaError` saying why not.

One function per modality (image, video, audio, time-series, text), used by ingest (to validate
and re-encode), by the loader's workers (before the transforms) and by `data inspect --verify`.
All of them take untrusted bytes: sizes are checked before memory is committed (the pixel count
of an image or a video frame is read from the header and refused above `max_pixels`), and every
failure of the underlying library becomes a `MediaError` with a reason a user can act on.

`sniff` identifies a format from its magic bytes, so ingest can catch files whose extension lies.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import struct
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "MediaError",
    "DEFAULT_MAX_PIXELS",
    "EXTENSION_TYPE",
    "TYPE_MODALITY",
    "sniff",
    "check_extension",
    "decode_image",
    "LazyImage",
    "draft_reduction",
    "JPEG_REDUCTIONS",
    "VideoClip",
    "decode_video",
    "decode_audio",
    "resample_audio",
    "decode_timeseries",
    "decode_text",
]

# 64 megapixels (8000 x 8000): far above any training resolution, and below Pillow's own
# warning threshold (~89 MP), so our check always speaks first.
DEFAULT_MAX_PIXELS = 64_000_000


class MediaError(ValueError):
    """Bytes that cannot be decoded into the expected modality (empty, truncated, corrupt,
    mislabelled or too large); the message says which and why."""


# ----------------------------------------------------------------------------- sniffing
# File extension (lower-case, no dot) -> the content type `sniff` reports for it.
EXTENSION_TYPE = {
    "jpg": "jpg",
    "jpeg": "jpg",
    "png": "png",
    "webp": "webp",
    "gif": "gif",
    "mp4": "mp4",
    "m4v": "mp4",
    "mov": "mp4",
    "webm": "webm",
    "mkv": "mkv",
    "wav": "wav",
    "flac": "flac",
    "ogg": "ogg",
    "oga": "ogg",
    "opus": "ogg",
    "mp3": "mp3",
    "npy": "npy",
}
TYPE_MODALITY = {
    "jpg": "image",
    "png": "image",
    "webp": "image",
    "gif": "image",
    "mp4": "video",
    "webm": "video",
    "mkv": "video",
    "wav": "audio",
    "flac": "audio",
    "ogg": "audio",
    "mp3": "audio",
    "npy": "timeseries",
}


def sniff(data: bytes) -> str:
    """The content type of `data` from its first bytes: one of the values of `EXTENSION_TYPE`
    (jpg, png, webp, gif, mp4, webm, mkv, wav, flac, ogg, mp3, npy), or "unknown"."""
    head = bytes(data[:64])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE":
        return "wav"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):  # EBML: Matroska, or its WebM profile
        return "webm" if b"webm" in bytes(data[:4096]) else "mkv"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"ID3") or _is_mpeg_audio_frame(head):
        return "mp3"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    return "unknown"


def _is_mpeg_audio_frame(head: bytes) -> bool:
    # 11 sync bits, then a layer field that is not 0 (AAC's ADTS header has layer 0).
    return len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and (head[1] >> 1) & 3 != 0


def check_extension(ext: str, data: bytes) -> None:
    """Raise MediaError when `data` is a known media format other than the one `ext` names.

    Extensions without a magic number (txt, json, csv, cls) are not checked. A `.mkv` holding
    WebM is accepted (WebM is a Matroska profile).
    """
    expected = EXTENSION_TYPE.get(ext.lower().lstrip("."))
    if expected is None:
        return
    found = sniff(data)
    if found == expected or (expected == "mkv" and found == "webm"):
        return
    if not data:
        raise MediaError(f"empty .{ext} file (0 bytes)")
    what = "an unrecognised format" if found == "unknown" else f"{found} data"
    raise MediaError(f"extension .{ext} does not match the content: the bytes are {what}")


def _require_bytes(data: bytes, what: str) -> None:
    if not data:
        raise MediaError(f"empty {what} (0 bytes)")


def _refuse_other_modality(data: bytes, modality: str, also: tuple[str, ...] = ()) -> None:
    """FFmpeg happily reads a JPEG as a one-frame video; a sample labelled video should not."""
    kind = sniff(data)
    if kind in TYPE_MODALITY and TYPE_MODALITY[kind] != modality and kind not in also:
        raise MediaError(
            f"expected {modality}, but the bytes are {kind} ({TYPE_MODALITY[kind]}) data"
        )


def _library_error(what: str, err: Exception) -> MediaError:
    # FFmpeg errors carry a clean `strerror`; their str() adds a meaningless '<none>' file name.
    reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return MediaError(f"undecodable {what}: {reason}")


# ----------------------------------------------------------------------------- images
# libjpeg decodes a JPEG at 1/2, 1/4 or 1/8 of each side (DCT scaling) far faster than in full.
JPEG_REDUCTIONS = (8, 4, 2)
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height


def decode_image(
    data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
) -> np.ndarray:
    """Image bytes -> uint8 [H, W, 3] RGB, EXIF orientation applied (first frame of a GIF).

    The pixel count is read from the header and refused above `max_pixels` before any pixel is
    decoded (a 50 kB PNG can claim 100k x 100k pixels). `draft_size` lets JPEG decoding use
    libjpeg's DCT scaling (1/2, 1/4, 1/8) while both sides stay >= draft_size: decoding a
    512 px JPEG for a 224 px crop then costs a fraction of a full decode. To pick the
    reduction from a crop rather than from the whole image, use `LazyImage`.
    """
    image = LazyImage(data, max_pixels)
    reduce = draft_reduction(min(image.height, image.width) / draft_size) if draft_size else 1
    return image.decode(reduce)[0]


class LazyImage:
    """Image bytes whose header is read and checked, but whose pixels are not decoded yet.

    Lets a transform look at the size first (`height`, `width`: after EXIF orientation, as
    `decode` returns them), decide which region it needs, and only then decode, at a reduced
    size when that region allows it. `decode` can be called once.
    """

    def __init__(self, data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS):
        from PIL import ExifTags, Image

        _require_bytes(data, "image")
        self._data = data
        with _image_errors(data):
            self._image = Image.open(io.BytesIO(data))  # reads the header only
            width, height = self._image.size
            if width * height > max_pixels:
                raise MediaError(
                    f"image of {width} x {height} = {width * height:,} pixels exceeds "
                    f"max_pixels {max_pixels:,} (possible decompression bomb)"
                )
            orientation = self._image.getexif().get(ExifTags.Base.Orientation, 1)
        swap = orientation in _TRANSPOSING_ORIENTATIONS
        self.height, self.width = (width, height) if swap else (height, width)
        self.is_jpeg = self._image.format == "JPEG"

    def decode(self, reduce: int = 1) -> tuple[np.ndarray, int]:
        """(uint8 [H, W, 3] RGB, the reduction applied): a JPEG is decoded at 1/`reduce` of
        each side (rounded up; reduced pixel i covers full pixels [i * reduce, (i + 1) *
        reduce)), other formats, and JPEGs libjpeg cannot scale, in full (reduction 1)."""
        image, applied = self.decode_pil(reduce)
        return np.asarray(image), applied

    def decode_pil(self, reduce: int = 1) -> tuple[Any, int]:
        """`decode` as an RGB PIL image, for callers that resize with Pillow next (saves two
        copies of the pixels)."""
        from PIL import ImageOps

        if reduce not in (1, *JPEG_REDUCTIONS):
            raise ValueError(f"reduce must be 1, 2, 4 or 8, got {reduce}")
        img = self._image
        with _image_errors(self._data):
            try:
                applied = 1
                full = img.size
                if reduce > 1 and self.is_jpeg and min(full) >= reduce:
                    # Asking for exactly size // reduce makes Pillow pick `reduce` itself.
                    img.draft("RGB", (full[0] // reduce, full[1] // reduce))
                    if img.size != full:
                        applied = reduce
                img.load()  # decode now, inside the error mapping (Pillow is lazy)
                oriented = ImageOps.exif_transpose(img)
                # Alpha is dropped, not composited, as CLIP's preprocessing does.
                rgb = oriented if oriented.mode == "RGB" else oriented.convert("RGB")
                return rgb, applied
            finally:
                img.close()


def draft_reduction(ratio: float) -> int:
    """The JPEG reduction to decode at when the source has `ratio` times the pixels needed
    along its shorter side: the largest of 8, 4, 2 that is <= ratio (so nothing is upsampled
    afterwards), else 1."""
    return next((r for r in JPEG_REDUCTIONS if ratio >= r), 1)


@contextlib.contextmanager
def _image_errors(data: bytes) -> Iterator[None]:
    """Map Pillow's many failure types onto MediaError with a reason a user can act on."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # Our own max_pixels check decides; Pillow still raises above twice its limit.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except MediaError:
        raise
    except Image.DecompressionBombError as err:
        raise MediaError(f"image refused as a decompression bomb: {err}") from None
    except Image.UnidentifiedImageError:
        kind = sniff(data)
        if kind != "unknown":
            raise MediaError(f"corrupt {kind} data: its header cannot be read") from None
        raise MediaError(
            f"not a recognised image format (starts with {bytes(data[:8])!r})"
        ) from None
    except MemoryError:
        raise
    except Exception as err:  # Pillow raises OSError, SyntaxError, struct.error, ... on bad data
        raise _library_error("image", err) from None


# ----------------------------------------------------------------------------- video
class VideoClip(NamedTuple):
    """Frames of a clip and the timing of its source."""

    frames: np.ndarray  # uint8 [T, H, W, 3]
    fps: float
    duration_s: float


# Jump forward with a seek (to the keyframe before the target) rather than decoding every frame
# in between when the next wanted frame is further ahead than this.
SEEK_GAP_S = 1.0


def decode_video(
    data: bytes,
    frames: int,
    *,
    start_s: float | None = None,
    interval_s: float | None = None,
    short_side: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    window: tuple[float, int] | None = None,
    times_s: Sequence[float] | None = None,
) -> VideoClip:
    """Decode exactly `frames` frames of the first video stream as uint8 [T, H, W, 3].

    Without `start_s` the frames are spread evenly over the whole video (the centre of each of
    T equal segments). With `start_s` they form a window starting there, `interval_s` apart
    (default: consecutive frames); times past the end repeat the last frame. `window` =
    (position in [0, 1], stride) places a window of every stride-th source frame at that
    position among the starts that keep it inside the video (0: the first frame; a video too
    short for the window starts at 0 and repeats its last frame). Only the frames
    needed are converted, and long gaps are crossed by seeking to a keyframe. `short_side`
    downscales (never upscales) frames in the decoder's scaler so their shorter side has that
    length, which is much cheaper than converting 720p frames and resizing them afterwards.
    `times_s` (non-decreasing, `frames` of them) names the times to show instead: the frames
    a sampler chose by index (data/stream/video_frames.py).
    """
    import av

    _require_bytes(data, "video")
    _refuse_other_modality(data, "video", also=("ogg",))  # Ogg can carry Theora video
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    if times_s is not None and len(times_s) != frames:
        raise ValueError(f"times_s holds {len(times_s)} times for {frames} frames")
    timing = (start_s, interval_s, window, times_s)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = first_video_stream(container, max_pixels)
            width, height = stream.codec_context.width, stream.codec_context.height
            fps = _video_fps(stream)
            duration = _video_duration(container, stream)
            size = _scaled_size(width, height, short_side)
            if duration is None:  # no duration in the headers: decode all, then pick
                return _pick_from_all(container, stream, frames, timing, fps, size)
            targets = _targets(frames, duration, fps, timing)
            images = _decode_at(container, stream, targets, fps, size)
            return VideoClip(np.stack(images), fps, duration)
    except MediaError:
        raise
    except MemoryError:
        raise
    except Exception as err:  # av.error.FFmpegError and its subclasses, mostly
        raise _library_error("video", err) from None


def video_header(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, int, float]:
    """(frames, height, width, frames per second) of a clip's first video stream without
    decoding it: the frame count of its headers, or its duration x frame rate, or (neither
    known) the frames counted by demuxing."""
    import av

    _require_bytes(data, "video")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = first_video_stream(container, max_pixels)
            size = (stream.codec_context.height, stream.codec_context.width)
            frames = int(stream.frames or 0)
            if not frames and stream.duration and stream.time_base and stream.average_rate:
                frames = round(float(stream.duration * stream.time_base * stream.average_rate))
            if not frames:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
            return (frames, *size, _video_fps(stream))
    except MediaError:
        raise
    except Exception as err:  # av.error.FFmpegError and its subclasses, mostly
        raise MediaError(f"video does not open: {err}") from None


def first_video_stream(container, max_pixels: int):
    """The first video stream of an open PyAV container, after the frame-size bomb check."""
    if not container.streams.video:
        raise MediaError("no video stream in the container")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height <= 0:
        raise MediaError("video stream has no frame size")
    if width * height > max_pixels:
        raise MediaError(
            f"video frames of {width} x {height} pixels exceed max_pixels {max_pixels:,}"
        )
    return stream


def _video_fps(stream) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    return fps if fps > 0 and math.isfinite(fps) else 25.0  # a sane default for broken headers


def _video_duration(container, stream) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # container durations are in microseconds
    return None


def _scaled_size(width: int, height: int, short_side: int | None) -> tuple[int, int]:
    if not short_side or min(width, height) <= short_side:
        return width, height
    scale = short_side / min(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _window_times(
    frames: int, duration: float, fps: float, position: float, stride: int
) -> tuple[float, float]:
    """(start, interval) in seconds of `frames` frames `stride` source frames apart, the start
    at `position` of the way through the starts that keep the window inside the video."""
    if not 0.0 <= position <= 1.0 or stride < 1:
        raise ValueError(
            f"window position must be in [0, 1] and stride >= 1, got {position}, {stride}"
        )
    interval = stride / fps
    span = (frames - 1) * interval + 1.0 / fps  # from the first frame's start to the last's end
    return position * max(0.0, duration - span), interval


def _targets(frames: int, duration: float, fps: float, timing: tuple) -> list[float]:
    """The times to show: given (`times_s`), or those of a window or of even spreading."""
    start_s, interval_s, window, times_s = timing
    if times_s is not None:
        return list(times_s)
    if window is not None:
        start_s, interval_s = _window_times(frames, duration, fps, *window)
    return _target_times(frames, duration, fps, start_s, interval_s)


def _target_times(
    frames: int, duration: float, fps: float, start_s: float | None, interval_s: float | None
) -> list[float]:
    """Times (seconds from the stream start) of the wanted frames, non-decreasing."""
    if start_s is None:
        return [(i + 0.5) * duration / frames for i in range(frames)]
    step = interval_s if interval_s is not None else 1.0 / fps
    last = max(0.0, duration - 0.5 / fps)  # the centre of the last frame
    return [min(start_s + i * step, last) for i in range(frames)]


def _frame_time(frame, stream, index: int, fps: float) -> float:
    if frame.pts is None or stream.time_base is None:
        return index / fps
    start = stream.start_time or 0
    return float((frame.pts - start) * stream.time_base)


def _to_rgb(frame, size: tuple[int, int]) -> np.ndarray:
    return frame.reformat(width=size[0], height=size[1], format="rgb24").to_ndarray()


def _decode_at(container, stream, targets: list[float], fps: float, size) -> list[np.ndarray]:
    """For each target time, the frame showing at that time (the last one starting before it)."""
    period = 1.0 / fps
    frames_iter = container.decode(stream)
    current = upcoming = None  # (time, frame) of the frame shown now and the one after it
    current_rgb: np.ndarray | None = None
    index = 0
    out: list[np.ndarray] = []
    for target in targets:
        seen = upcoming[0] if upcoming else current[0] if current else 0.0
        if target - seen > SEEK_GAP_S:
            offset = int(target / stream.time_base) + (stream.start_time or 0)
            container.seek(offset, stream=stream, backward=True, any_frame=False)
            frames_iter = container.decode(stream)
            current = upcoming = None
            current_rgb = None
        # Advance while the next frame has started by `target` (a quarter period of slack for
        # timestamps rounded by the container).
        while True:
            if upcoming is None:
                frame = next(frames_iter, None)
                if frame is None:
                    break
                upcoming = (_frame_time(frame, stream, index, fps), frame)
                index += 1
            if current is not None and upcoming[0] > target + 0.25 * period:
                break
            current, upcoming, current_rgb = upcoming, None, None
        if current is None:
            raise MediaError("no decodable video frames")
        if target - current[0] > SEEK_GAP_S + 2 * period:
            raise MediaError(
                f"truncated video: frames stop at {current[0]:.2f} s, the headers promise more "
                f"(wanted a frame at {target:.2f} s)"
            )
        if current_rgb is None:
            current_rgb = _to_rgb(current[1], size)
        out.append(current_rgb)
    return out


def _pick_from_all(container, stream, frames, timing, fps, size) -> VideoClip:
    decoded = [(_frame_time(f, stream, i, fps), f) for i, f in enumerate(container.decode(stream))]
    if not decoded:
        raise MediaError("no decodable video frames")
    duration = decoded[-1][0] + 1.0 / fps
    times = np.array([t for t, _ in decoded])
    targets = _targets(frames, duration, fps, timing)
    picks = [max(0, int(np.searchsorted(times, t + 0.25 / fps, side="right")) - 1) for t in targets]
    cache: dict[int, np.ndarray] = {}
    images = [cache.setdefault(i, _to_rgb(decoded[i][1], size)) for i in picks]
    return VideoClip(np.stack(images), fps, duration)


# ----------------------------------------------------------------------------- audio
def decode_audio(data: bytes, sample_rate: int) -> np.ndarray:
    """Audio bytes -> float32 [S] mono at `sample_rate` (channels averaged).

    WAV and FLAC are read with soundfile (libsndfile); other formats (MP3, Ogg Vorbis/Opus,
    AAC in MP4, ...) with PyAV. Resampling uses FFmpeg's libswresample through PyAV (see
    `resample_audio`).
    """
    _require_bytes(data, "audio")
    _refuse_other_modality(data, "audio", also=("mp4", "webm", "mkv"))  # audio-only containers
    kind = sniff(data)
    if kind in ("wav", "flac"):
        channels, rate = _read_soundfile(data, kind)
    else:
        channels, rate = _read_pyav_audio(data)
    if channels.shape[1] == 0:
        raise MediaError("audio has no samples")
    mono = channels.mean(axis=0, dtype=np.float32)
    if not np.isfinite(mono).all():
        raise MediaError("audio contains NaN or infinite samples")
    return resample_audio(mono, rate, sample_rate)


def _read_soundfile(data: bytes, kind: str) -> tuple[np.ndarray, int]:
    import soundfile

    if kind == "wav":
        _check_riff_size(data)
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except MemoryError:
        raise
    except Exception as err:  # soundfile.LibsndfileError and friends
        raise _library_error(f"{kind} audio", err) from None
    return np.ascontiguousarray(samples.T), int(rate)


def _check_riff_size(data: bytes) -> None:
    """libsndfile quietly returns the samples present in a cut WAV; its RIFF header knows better."""
    if data[:4] != b"RIFF" or len(data) < 8:
        return
    (declared,) = struct.unpack("<I", data[4:8])
    if 0 < declared < 0xFFFFFFFF and declared + 8 > len(data):  # 0/-1: streamed, size unknown
        raise MediaError(
            f"truncated WAV: the header declares {declared + 8:,} bytes, got {len(data):,}"
        )


def _read_pyav_audio(data: bytes) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise MediaError("no audio stream in the container")
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate
            if not rate:
                raise MediaError("audio stream has no sample rate")
            # Planar float at the native rate and layout: the mix-down and resampling below are
            # the same for every format.
            layout = stream.codec_context.layout.name
            converter = av.AudioResampler(format="fltp", layout=layout, rate=rate)
            chunks = []
            for frame in container.decode(stream):
                frame.pts = None  # timestamps are irrelevant here and may jump in broken files
                chunks += [f.to_ndarray() for f in converter.resample(frame)]
            chunks += [f.to_ndarray() for f in converter.resample(None)]
    except MediaError:
        raise
    except MemoryError:
        raise
    except Exception as err:
        raise _library_error("audio", err) from None
    if not chunks:
        raise MediaError("no decodable audio frames")
    samples = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    # Codecs decode whole blocks (Vorbis pads the last one); the container's duration says
    # where the signal really ends.
    if stream.duration and stream.time_base:
        samples = samples[:, : max(1, round(float(stream.duration * stream.time_base) * rate))]
    return samples, int(rate)


def resample_audio(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """float32 [N] at `rate` -> float32 [round(N * target_rate / rate)] at `target_rate`.

    Uses libswresample (through PyAV): a windowed-sinc polyphase filter written in C, with
    proper anti-aliasing when downsampling (a 10 kHz tone does not fold into a 16 kHz
    recording) and no new dependency. The output length is fixed exactly, so clip lengths do
    not depend on the resampler's internal buffering.
    """
    import av

    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if rate == target_rate:
        return samples
    if rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {rate} -> {target_rate}")
    expected = round(len(samples) * target_rate / rate)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target_rate)
    chunks = []
    step = 1 << 20  # bounded frames keep FFmpeg's buffers small for long recordings
    for start in range(0, len(samples), step):
        frame = av.AudioFrame.from_ndarray(
            samples[None, start : start + step], format="flt", layout="mono"
        )
        frame.sample_rate = rate
        chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    out = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if len(out) < expected:
        out = np.pad(out, (0, expected - len(out)))
    return np.ascontiguousarray(out[:expected], dtype=np.float32)


# ----------------------------------------------------------------------------- time-series
def decode_timeseries(data: bytes, ext: str | None = None) -> np.ndarray:
    """A .npy array or a CSV table -> float32 [channels, length].

    npy: a 1-D array is one channel; a 2-D array is already [channels, length]. Loaded with
    `allow_pickle=False`, so a malicious file cannot run code. CSV (comma, tab or semicolon):
    rows are time steps and numeric columns are channels (an optional header row and
    non-numeric columns such as ISO timestamps are skipped). The format is taken from `ext`
    when given, else sniffed. Missing or non-finite values are an error.
    """
    _require_bytes(data, "time-series")
    kind = (ext or "").lower().lstrip(".") or ("npy" if sniff(data) == "npy" else "csv")
    if kind == "npy":
        array = _load_npy(data)
    elif kind in ("csv", "tsv", "txt"):
        array = _load_csv(data)
    else:
        raise MediaError(f"unsupported time-series format .{kind}; use .npy or .csv")
    if array.size == 0:
        raise MediaError(f"empty time-series array of shape {list(array.shape)}")
    bad = int((~np.isfinite(array)).sum())
    if bad:
        raise MediaError(f"time-series contains {bad} missing or non-finite values")
    return np.ascontiguousarray(array, dtype=np.float32)


def encode_video(frames: np.ndarray, fps: int = 8) -> bytes:
    """uint8 frames [T, H, W, 3] -> an MP4 (H.264 where this PyAV has it, else MPEG-4 Part 2),
    sides rounded up to even as yuv420p needs. The same frames give the same bytes, whatever
    the cores or the load: one encoder thread, and x264 without its lookahead (`tune=zerolatency`; with it,
    two encodes of the same small clip differed in 91 of 600 clips of 4 x 32 x 32 pixels)."""
    import av  # PyAV, imported where video is coded (as the decoders do)

    _, h, w, _ = frames.shape
    even = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        options = {"tune": "zerolatency"} if codec == "libx264" else {}
        stream = container.add_stream(codec, rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = even.shape[2], even.shape[1], "yuv420p"
        stream.codec_context.thread_count = 1
        for frame in even:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def decode_latent(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """A .npy latent (a VAE's encoding of one image) -> float32 of exactly `shape` [C, H, W].
    Loaded with `allow_pickle=False`; a wrong shape or a non-finite value is an error."""
    _require_bytes(data, "latent")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except MemoryError:
        raise
    except Exception as err:  # ValueError (pickled objects, bad header), EOFError (truncated)
        raise _library_error("npy", err) from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "f":
        raise MediaError(
            f"a latent must be a float .npy array, got {getattr(array, 'dtype', array)}"
        )
    if tuple(array.shape) != tuple(shape):
        raise MediaError(f"latent of shape {list(array.shape)}, the denoiser takes {list(shape)}")
    if not np.isfinite(array).all():
        raise MediaError("latent holds non-finite values")
    return array.astype(np.float32)


def _load_npy(data: bytes) -> np.ndarray:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except MemoryError:
        raise
    except Exception as err:  # ValueError (pickled objects, bad header), EOFError (truncated)
        raise _library_error("npy", err) from None
    if not isinstance(array, np.ndarray):
        raise MediaError("expected a single .npy array, got an archive")
    if array.dtype.kind not in "biuf":
        raise MediaError(f"time-series must be numeric, got dtype {array.dtype}")
    if array.ndim == 1:
        return array[None, :].astype(np.float32)
    if array.ndim != 2:
        raise MediaError(
            f"time-series must be 1-D or 2-D [channels, length], got shape {list(array.shape)}"
        )
    return array.astype(np.float32)


def _load_csv(data: bytes) -> np.ndarray:
    text = decode_text(data, what="CSV")
    lines = [line for line in text.splitlines() if line.strip()]
    delimiter = max(",\t;", key=lines[0].count)
    rows = list(csv.reader(lines, delimiter=delimiter))
    width = len(rows[0])
    for number, row in enumerate(rows, start=1):
        if len(row) != width:
            raise MediaError(f"CSV row {number} has {len(row)} fields, the first row has {width}")
    if not all(_is_number(cell) for cell in rows[0]):
        rows = rows[1:]  # a header
    if not rows:
        raise MediaError("CSV has a header but no data rows")
    columns = [c for c in range(width) if all(_is_number(r[c]) or not r[c].strip() for r in rows)]
    columns = [c for c in columns if any(r[c].strip() for r in rows)]
    if not columns:
        raise MediaError("CSV has no numeric columns")
    values = [[float(r[c]) if r[c].strip() else math.nan for c in columns] for r in rows]
    return np.asarray(values, dtype=np.float64).T


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------- text
def decode_text(data: bytes, errors: str = "strict", what: str = "text") -> str:
    """UTF-8 bytes (a leading BOM removed) -> str.

    With `errors="strict"` invalid UTF-8 is a MediaError naming the byte offset; pass
    "replace" to keep such captions with U+FFFD in place of the bad bytes.
    """
    _require_bytes(data, what)
    try:
        text = bytes(data).decode("utf-8-sig", errors=errors)
    except UnicodeDecodeError as err:
        raise MediaError(
            f"{what} is not valid UTF-8: byte {err.start} ({err.object[err.start : err.start + 1]!r}) "
            f"{err.reason}; decode with errors='replace' to keep it"
        ) from None
    if not text.strip():
        raise MediaError(f"{what} is blank (only whitespace)")
    return text
