"""Decoders on real media made in the test: images, an mp4, wav/flac/mp3, npy/csv, text, and
their empty, truncated, bit-flipped and mislabelled variants."""

from __future__ import annotations

import io
import struct
import zlib

import av
import numpy as np
import pytest
import soundfile
from PIL import Image

from mmtrain.data.stream.media import (
    MediaError,
    check_extension,
    decode_audio,
    decode_image,
    decode_text,
    decode_timeseries,
    decode_video,
    resample_audio,
    sniff,
)

VIDEO_FPS = 10
VIDEO_FRAMES = 30  # 3 s
VIDEO_CODEC = "libx264" if "libx264" in av.codecs_available else "mpeg4"


# ----------------------------------------------------------------------------- makers
def image_bytes(fmt="PNG", size=(40, 20), **save) -> bytes:
    x = np.linspace(0, 255, size[0], dtype=np.uint8)
    pixels = np.stack([np.tile(x, (size[1], 1))] * 3, axis=-1)
    pixels[..., 2] = 200
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **save)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height pixels, with a tiny (bogus) image body."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def frame_value(index: int) -> int:
    return 8 * index


def mp4_bytes(frames=VIDEO_FRAMES, width=64, height=48) -> bytes:
    """A video whose frame i is a flat grey of value 8 * i (readable back after compression)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(VIDEO_CODEC, rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"g": "5"}  # a keyframe every 0.5 s, so seeks land near their target
        for i in range(frames):
            pixels = np.full((height, width, 3), frame_value(i), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def frame_indices(clip: np.ndarray) -> list[int]:
    return [round(float(f.mean()) / 8) for f in clip]


def tone(freq: float, rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.5 * np.sin(2 * np.pi * freq * t).astype(np.float32)
    return np.stack([wave] * channels, axis=1)


def sound_bytes(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


def mp3_bytes(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as container:
        stream = container.add_stream(
            "libmp3lame" if "libmp3lame" in av.codecs_available else "mp3", rate=rate
        )
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


def flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :]


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return mp4_bytes()


# ----------------------------------------------------------------------------- sniff
def test_sniff_recognises_formats(mp4):
    samples = tone(440, 8000, 0.1)
    made = {
        "jpg": image_bytes("JPEG"),
        "png": image_bytes("PNG"),
        "webp": image_bytes("WEBP"),
        "gif": image_bytes("GIF"),
        "mp4": mp4,
        "wav": sound_bytes(samples, 8000, "WAV"),
        "flac": sound_bytes(samples, 8000, "FLAC"),
        "ogg": sound_bytes(samples, 8000, "OGG"),
        "mp3": mp3_bytes(samples[:, 0], 8000),
    }
    npy = io.BytesIO()
    np.save(npy, np.zeros(3))
    made["npy"] = npy.getvalue()
    for kind, data in made.items():
        assert sniff(data) == kind
    assert sniff(b"") == "unknown"
    assert sniff(b"hello, world") == "unknown"
    assert sniff(b"\x1a\x45\xdf\xa3" + b"\x00" * 8 + b"webm") == "webm"


def test_check_extension_catches_lying_files():
    png = image_bytes("PNG")
    check_extension("png", png)
    check_extension("txt", b"anything")  # no magic number to check
    with pytest.raises(MediaError, match=r"\.jpg does not match.*png data"):
        check_extension("jpg", png)
    with pytest.raises(MediaError, match="unrecognised format"):
        check_extension("mp4", b"<html>not a video</html>")
    with pytest.raises(MediaError, match="empty"):
        check_extension("wav", b"")


# ----------------------------------------------------------------------------- images
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_decode_image_formats(fmt):
    image = decode_image(image_bytes(fmt, size=(40, 20)))
    assert image.dtype == np.uint8 and image.shape == (20, 40, 3)
    assert abs(int(image[10, 0, 0]) - 0) < 16 and abs(int(image[10, -1, 0]) - 255) < 16


def test_decode_image_applies_exif_orientation_and_rgb():
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    image = decode_image(image_bytes("JPEG", size=(40, 20), exif=exif))
    assert image.shape == (40, 20, 3)
    buf = io.BytesIO()
    Image.new("LA", (8, 6), (128, 50)).save(buf, "PNG")
    gray = decode_image(buf.getvalue())
    assert gray.shape == (6, 8, 3) and (gray == 128).all()


def test_decode_image_refuses_bombs_before_decoding():
    with pytest.raises(MediaError, match="9,000 x 8,000|9000 x 8000"):
        decode_image(png_header_only(9000, 8000))  # 72 MP: above our 64 MP default
    with pytest.raises(MediaError, match="decompression bomb"):
        decode_image(png_header_only(100_000, 100_000))  # Pillow's own error, mapped
    with pytest.raises(MediaError, match="max_pixels 500"):
        decode_image(image_bytes("PNG", size=(40, 20)), max_pixels=500)


def test_decode_image_draft_reduces_jpeg_decode():
    data = image_bytes("JPEG", size=(400, 200))
    assert decode_image(data).shape == (200, 400, 3)
    assert decode_image(data, draft_size=50).shape == (50, 100, 3)  # 1/4 scale: both sides >= 50
    assert decode_image(data, draft_size=20).shape == (25, 50, 3)  # 1/8 scale


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_decode_image_bad_input(fmt):
    data = image_bytes(fmt, size=(64, 64))
    with pytest.raises(MediaError, match="empty"):
        decode_image(b"")
    with pytest.raises(MediaError):
        decode_image(data[: len(data) // 2])
    with pytest.raises(MediaError, match="not a recognised image"):
        decode_image(b"GIF00" + data)
    with pytest.raises(MediaError, match="undecodable image|corrupt"):
        decode_image(data[:16])
    with pytest.raises(MediaError, match="undecodable image|corrupt"):
        decode_image(flip(data, 20))  # inside the header (PNG IHDR / JPEG JFIF segment)


# ----------------------------------------------------------------------------- video
def test_decode_video_spreads_frames_over_the_clip(mp4):
    clip = decode_video(mp4, frames=5)
    assert clip.frames.dtype == np.uint8 and clip.frames.shape == (5, 48, 64, 3)
    assert clip.fps == pytest.approx(VIDEO_FPS)
    assert clip.duration_s == pytest.approx(3.0, abs=0.11)
    assert frame_indices(clip.frames) == [3, 9, 15, 21, 27]


def test_decode_video_windows_and_seeks(mp4):
    assert frame_indices(decode_video(mp4, 4, start_s=1.0).frames) == [10, 11, 12, 13]
    assert frame_indices(decode_video(mp4, 4, start_s=0.5, interval_s=0.7).frames) == [
        5,
        12,
        19,
        26,
    ]
    # Seek far ahead (past SEEK_GAP_S), then run past the end: the last frame repeats.
    assert frame_indices(decode_video(mp4, 4, start_s=2.8).frames) == [28, 29, 29, 29]
    # More frames than the video has: each source frame is used, some twice.
    many = frame_indices(decode_video(mp4, 40).frames)
    assert many == sorted(many) and set(many) == set(range(VIDEO_FRAMES))


def test_decode_video_windows_at_a_stride_stay_inside_the_clip(mp4):
    # 30 frames at 10 fps; 4 frames 3 apart span 1 s: starts from 0 s to 2 s keep them inside.
    def window(position: float, stride: int = 3) -> list[int]:
        return frame_indices(decode_video(mp4, 4, window=(position, stride)).frames)

    assert window(0.0) == [0, 3, 6, 9]
    assert window(0.5) == [10, 13, 16, 19]
    assert window(1.0) == [20, 23, 26, 29]
    assert window(0.0, stride=10) == [0, 10, 20, 29]  # longer than the clip: from 0, last repeats
    with pytest.raises(ValueError, match="window position"):
        decode_video(mp4, 4, window=(1.5, 3))


def test_a_video_denoiser_draws_its_window_from_the_samples_rng(mp4):
    import torch

    from mmtrain.data.stream.denoiser_inputs import DenoiserDecoder
    from mmtrain.spec import ModelSpec

    spec = ModelSpec.from_dict({"name": "v", "objective": "flow_matching", "denoiser": {
        "sample_size": 16, "channels": 3, "patch_size": 4, "width": 64, "layers": 1, "heads": 4,
        "frames": 4, "temporal_patch": 2, "input": "video"}})  # fmt: skip
    train = DenoiserDecoder(spec, video_stride=3)
    sample = {"mp4": mp4}

    def first_frames(decoder, seed: int) -> torch.Tensor:
        return decoder(sample, np.random.default_rng(seed))["video"][0, :, 8, 8]  # [T]

    assert torch.equal(first_frames(train, 1), first_frames(train, 1))  # a pure function
    starts = {round(float(first_frames(train, seed)[0]), 3) for seed in range(6)}
    assert len(starts) > 1  # windows at several places
    middle = DenoiserDecoder(spec, video_stride=3, train=False)
    assert torch.equal(first_frames(middle, 1), first_frames(middle, 2))  # always the middle


def test_decode_video_scales_in_the_decoder(mp4):
    clip = decode_video(mp4, 2, short_side=24)
    assert clip.frames.shape == (2, 24, 32, 3)
    assert decode_video(mp4, 1, short_side=480).frames.shape == (1, 48, 64, 3)  # never upscales
    with pytest.raises(MediaError, match="max_pixels"):
        decode_video(mp4, 1, max_pixels=1000)


def test_decode_video_bad_input(mp4):
    with pytest.raises(MediaError, match="empty"):
        decode_video(b"", 4)
    with pytest.raises(MediaError, match="undecodable video"):
        decode_video(mp4[: len(mp4) // 2], 4)  # moov box (index) cut off
    moov = mp4.find(b"moov")
    with pytest.raises(MediaError):
        decode_video(flip(mp4, moov), 4)
    with pytest.raises(MediaError, match="expected video, but the bytes are wav"):
        decode_video(sound_bytes(tone(440, 8000, 0.2), 8000, "WAV"), 4)
    with pytest.raises(MediaError, match="expected video, but the bytes are jpg"):
        decode_video(image_bytes("JPEG"), 4)  # FFmpeg alone would read it as a 1-frame video
    with pytest.raises(MediaError):
        decode_video(b"\x00" * 1000, 4)


# ----------------------------------------------------------------------------- audio
@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_decode_audio_soundfile_mixes_down_and_resamples(fmt):
    stereo = tone(440, 44100, 1.0, channels=2)
    stereo[:, 1] *= 0.5
    audio = decode_audio(sound_bytes(stereo, 44100, fmt), sample_rate=16000)
    assert audio.dtype == np.float32 and audio.shape == (16000,)
    assert dominant_hz(audio, 16000) == pytest.approx(440, abs=2)
    assert np.abs(audio).max() == pytest.approx(0.375, abs=0.02)  # mean of 0.5 and 0.25


def test_decode_audio_compressed_with_pyav():
    audio = decode_audio(mp3_bytes(tone(440, 22050, 1.0)[:, 0], 22050), sample_rate=16000)
    assert audio.dtype == np.float32
    assert abs(len(audio) - 16000) < 16000 * 0.1  # mp3 pads with encoder delay frames
    assert dominant_hz(audio, 16000) == pytest.approx(440, abs=3)
    same_rate = decode_audio(sound_bytes(tone(440, 16000, 0.5), 16000, "OGG"), 16000)
    assert len(same_rate) == 8000


def test_resample_audio_is_exact_length_and_antialiased():
    rate, target = 44100, 16000
    low = resample_audio(tone(440, rate, 1.0)[:, 0], rate, target)
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(target) / target)
    assert len(low) == target
    assert np.abs(low[100:-100] - expected[100:-100]).max() < 1e-3  # in phase, no delay
    # 10 kHz is above the new Nyquist (8 kHz): it must be filtered, not folded to 6 kHz.
    high = resample_audio(tone(10_000, rate, 1.0)[:, 0], rate, target)
    assert np.sqrt(np.mean(high[200:-200] ** 2)) < 0.01
    assert len(resample_audio(np.zeros(1001, np.float32), 48000, 16000)) == 334


def test_decode_audio_bad_input():
    wav = sound_bytes(tone(440, 16000, 0.5), 16000, "WAV")
    flac = sound_bytes(tone(440, 16000, 0.5), 16000, "FLAC")
    with pytest.raises(MediaError, match="empty"):
        decode_audio(b"", 16000)
    with pytest.raises(MediaError, match="truncated WAV"):
        decode_audio(wav[: len(wav) // 2], 16000)
    with pytest.raises(MediaError, match="undecodable flac"):
        decode_audio(flac[: len(flac) // 2], 16000)
    with pytest.raises(MediaError, match="undecodable"):
        decode_audio(b"\x00" * 2000, 16000)
    with pytest.raises(MediaError, match="no audio stream"):
        decode_audio(mp4_bytes(frames=3), 16000)
    silent = sound_bytes(np.zeros((0, 1), np.float32), 16000, "WAV")
    with pytest.raises(MediaError, match="no samples"):
        decode_audio(silent, 16000)


# ----------------------------------------------------------------------------- time-series
def npy_bytes(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_decode_timeseries_npy():
    series = np.arange(12, dtype=np.int16).reshape(3, 4)
    out = decode_timeseries(npy_bytes(series))
    assert out.dtype == np.float32 and out.shape == (3, 4)
    assert (out == series).all()
    assert decode_timeseries(npy_bytes(np.ones(5))).shape == (1, 5)


def test_decode_timeseries_npy_refuses_pickles_and_bad_arrays():
    with pytest.raises(MediaError, match="undecodable npy"):
        decode_timeseries(npy_bytes(np.array([{"a": 1}], dtype=object)))
    data = npy_bytes(np.ones((3, 100)))
    with pytest.raises(MediaError, match="undecodable npy"):
        decode_timeseries(data[: len(data) // 2])
    with pytest.raises(MediaError, match="1-D or 2-D"):
        decode_timeseries(npy_bytes(np.ones((2, 2, 2))))
    with pytest.raises(MediaError, match="non-finite"):
        decode_timeseries(npy_bytes(np.array([1.0, np.nan])))
    with pytest.raises(MediaError, match="numeric"):
        decode_timeseries(npy_bytes(np.array(["a", "b"])))


def test_decode_timeseries_csv():
    text = "time,x,y,label\n2024-01-01T00:00,1,2.5,ok\n2024-01-01T00:01,3,-4e1,ok\n"
    out = decode_timeseries(text.encode())
    assert out.tolist() == [[1.0, 3.0], [2.5, -40.0]]  # [channels, length]
    assert decode_timeseries(b"1\t2\n3\t4\n5\t6\n").tolist() == [[1, 3, 5], [2, 4, 6]]
    assert decode_timeseries(b"1;2\n3;4\n", ext="csv").shape == (2, 2)


def test_decode_timeseries_csv_errors():
    with pytest.raises(MediaError, match="missing or non-finite"):
        decode_timeseries(b"a,b\n1,2\n3,\n")
    with pytest.raises(MediaError, match="row 3 has 1 fields"):
        decode_timeseries(b"a,b\n1,2\n3\n")
    with pytest.raises(MediaError, match="no numeric columns"):
        decode_timeseries(b"name\ncat\ndog\n")
    with pytest.raises(MediaError, match="empty"):
        decode_timeseries(b"")
    with pytest.raises(MediaError, match="unsupported"):
        decode_timeseries(b"x", ext="parquet")


# ----------------------------------------------------------------------------- text
def test_decode_text():
    assert decode_text("\ufeffcafé".encode()) == "café"
    with pytest.raises(MediaError, match="byte 3"):
        decode_text(b"abc\xff def")
    assert decode_text(b"abc\xff", errors="replace") == "abc\ufffd"
    with pytest.raises(MediaError, match="empty"):
        decode_text(b"")
    with pytest.raises(MediaError, match="blank"):
        decode_text(b" \n\t")
