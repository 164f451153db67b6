"""Video clips: scene cuts, fixed windows, re-encoding with a keyframe interval, and the build."""

from __future__ import annotations

import argparse
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mmtrain.commands._data_args import add_build_arguments
from mmtrain.commands.data import run_build
from mmtrain.data.ingest.video_clips import (
    ClipOptions,
    Span,
    measure,
    plan_clips,
    scene_starts,
    split_video,
    video_codec,
)
from mmtrain.data.storage.manifest import read_manifest
from mmtrain.data.storage.tar_index import read_shard
from mmtrain.data.stream.media import decode_video
from mmtrain.structured import FieldError

RED, BLUE = (200, 40, 40), (30, 60, 210)


# ----------------------------------------------------------------------------- helpers
def video(
    shots: list[tuple[tuple[int, int, int], float]],
    fps: int = 10,
    size: tuple[int, int] = (48, 32),
    audio: bool = False,
) -> bytes:
    """An MP4 of solid-colour shots, e.g. [(RED, 3.0), (BLUE, 3.0)], with a little texture
    that moves each frame (so consecutive frames of a shot differ, a bit), optionally with a
    silent AAC track."""
    import av

    width, height = size
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        sound = container.add_stream("aac", rate=16000) if audio else None
        index = 0
        for colour, seconds in shots:
            for _ in range(round(seconds * fps)):
                image = np.empty((height, width, 3), dtype=np.uint8)
                image[:] = colour
                image[:, (index % width) :: 8] //= 2  # moving stripes
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                frame.pts = index
                index += 1
                for packet in stream.encode(frame):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            samples = np.zeros((1, 1024 * 16), dtype=np.float32)
            chunk = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            chunk.sample_rate, chunk.pts = 16000, 0
            for packet in [*sound.encode(chunk), *sound.encode()]:
                container.mux(packet)
    return buffer.getvalue()


def keyframe_positions(data: bytes) -> list[int]:
    """Positions (in decode order) of the keyframe packets of the first video stream."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        packets = [p for p in container.demux(stream) if p.size]
        return [i for i, p in enumerate(packets) if p.is_keyframe]


def stream_counts(data: bytes) -> tuple[int, int]:
    import av

    with av.open(io.BytesIO(data)) as container:
        return len(container.streams.video), len(container.streams.audio)


def build(*argv: str | Path) -> int:
    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    return run_build(parser.parse_args([str(a) for a in argv]))


def samples(out: Path) -> list[dict]:
    return [s for shard in read_manifest(out)["shards"] for s in read_shard(out / shard["name"])]


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))}


# ----------------------------------------------------------------------------- planning
def test_scene_starts_need_a_score_above_threshold_and_a_minimum_scene_length():
    scores = [0, 1, 1, 1, 50, 2, 60, 1, 1, 1, 70, 1]
    assert scene_starts(scores, threshold=30, min_frames=1) == [0, 4, 6, 10]
    # 6 is only 2 frames after the cut at 4: a flash, not a new scene.
    assert scene_starts(scores, threshold=30, min_frames=3) == [0, 4, 10]
    assert scene_starts(scores, threshold=80, min_frames=1) == [0]


def test_windows_are_cut_within_scenes_and_short_pieces_dropped():
    scores = [0.0] * 100
    scores[47] = 90.0  # a cut at frame 47
    options = ClipOptions(clip_s=2.0, scene_threshold=30.0, min_clip_s=1.0)
    assert plan_clips(scores, fps=10, options=options) == [
        Span(0, 20, 0),
        Span(20, 40, 0),  # frames 40..46 (0.7 s) are shorter than min_clip_s: dropped
        Span(47, 67, 1),
        Span(67, 87, 1),
        Span(87, 100, 1),  # a 1.3 s tail is kept
    ]
    # Windows only: the cut is ignored; scenes only: one clip per scene.
    assert plan_clips(scores, 10, ClipOptions(clip_s=5.0))[-1] == Span(50, 100, 0)
    assert plan_clips(scores, 10, ClipOptions(scene_threshold=30.0)) == [
        Span(0, 47, 0),
        Span(47, 100, 1),
    ]
    # Neither: the whole video as one clip, whatever its length.
    assert plan_clips(scores[:3], 10, ClipOptions()) == [Span(0, 3, 0)]


def test_options_refuse_settings_that_could_never_keep_a_clip():
    with pytest.raises(ValueError, match="min_clip_s"):
        ClipOptions(clip_s=0.5, min_clip_s=1.0)
    with pytest.raises(ValueError, match="keyframe_interval"):
        ClipOptions(keyframe_interval=0)


# ----------------------------------------------------------------------------- real video
def test_measure_finds_the_colour_change():
    m = measure(video([(RED, 3.0), (BLUE, 3.0)]))
    assert m.frames == 60 and m.rate == 10 and (m.width, m.height) == (48, 32)
    assert m.duration_s == pytest.approx(6.0)
    assert int(np.argmax(m.scores)) == 30
    assert m.scores[30] > 30 > max(m.scores[:30] + m.scores[31:])  # stripes move, not a cut


def test_split_video_clips_are_seekable_mp4s_with_their_timing():
    source = video([(RED, 3.0), (BLUE, 3.0)])
    options = ClipOptions(clip_s=2.0, scene_threshold=30.0, keyframe_interval=5)
    _, clips = split_video(source, options)
    metas = [c.meta for c in clips]
    assert [(m["start_s"], m["end_s"], m["frames"]) for m in metas] == [
        (0.0, 2.0, 20),
        (2.0, 3.0, 10),
        (3.0, 5.0, 20),
        (5.0, 6.0, 10),
    ]
    assert [(m["clip"], m["scene"]) for m in metas] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    codec = "h264" if video_codec() == "libx264" else "mpeg4"
    for clip in clips:
        meta = clip.meta
        assert meta["fps"] == 10 and meta["duration_s"] == pytest.approx(meta["frames"] / 10)
        assert meta["codec"] == codec and meta["keyframe_interval"] == 5
        assert "audio_dropped" not in meta
        decoded = decode_video(clip.data, meta["frames"], start_s=0.0)
        assert decoded.frames.shape == (meta["frames"], 32, 48, 3)
        assert decoded.fps == pytest.approx(10)
        assert decoded.duration_s == pytest.approx(meta["duration_s"])
        assert keyframe_positions(clip.data) == list(range(0, meta["frames"], 5))
        colour = RED if meta["scene"] == 0 else BLUE
        # Frames are striped: the brightest pixels hold the shot's colour.
        brightest = decoded.frames.reshape(-1, 3).max(axis=0).astype(int)
        assert np.abs(brightest - colour).max() < 30
    assert split_video(source, options)[1] == clips  # deterministic bytes


def test_reencode_without_splitting_downscales_and_drops_audio():
    source = video([(RED, 1.5)], size=(64, 48), audio=True)
    assert stream_counts(source) == (1, 1)
    _, (clip,) = split_video(source, ClipOptions(keyframe_interval=4, max_side=33))
    assert "clip" not in clip.meta and clip.meta["audio_dropped"] is True
    assert (clip.meta["width"], clip.meta["height"]) == (32, 24)  # rounded down to even
    assert stream_counts(clip.data) == (1, 0)
    assert decode_video(clip.data, 1).frames.shape == (1, 24, 32, 3)
    assert keyframe_positions(clip.data) == [0, 4, 8, 12]


# ----------------------------------------------------------------------------- the build
CLIP_FLAGS = ("--workers", 1, "--video-clip-seconds", 2, "--video-scene-threshold", 30)


def video_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "a.mp4").write_bytes(video([(RED, 3.0), (BLUE, 3.0)]))
    (root / "a.txt").write_text("red then blue")
    (root / "b.mp4").write_bytes(video([(BLUE, 2.5)]))
    (root / "b.txt").write_text("blue")
    (root / "c.mp4").write_bytes(video([(RED, 0.5)]))  # shorter than one clip
    (root / "c.txt").write_text("too short")
    return root


def test_build_turns_each_video_into_clip_samples(tmp_path):
    src = video_folder(tmp_path / "src")
    out = tmp_path / "out"
    assert build(src, "--out", out, *CLIP_FLAGS, "--video-keyframe-interval", 5) == 0
    got = samples(out)
    metas = [json.loads(s["json"]) for s in got]
    # b's 0.5 s tail is shorter than --video-min-clip-seconds (1 s): dropped.
    timing = [(m["source"], m["start_s"], m["frames"]) for m in metas]
    assert [(s["__key__"], *t) for s, t in zip(got, timing, strict=True)] == [
        ("000000000_c0000", "a", 0.0, 20),
        ("000000000_c0001", "a", 2.0, 10),
        ("000000000_c0002", "a", 3.0, 20),
        ("000000000_c0003", "a", 5.0, 10),
        ("000000001_c0000", "b", 0.0, 20),
    ]
    assert [s["txt"] for s in got] == [b"red then blue"] * 4 + [b"blue"]
    manifest = read_manifest(out)
    assert manifest["counts"]["samples"] == 5 and manifest["counts"]["source_items"] == 3
    assert manifest["filters"]["removed"] == {"short_video": 1}  # c gives no 1 s clip
    assert manifest["filters"]["settings"]["min_video_s"] == 1.0
    for sample, meta in zip(got, metas, strict=True):
        assert set(sample) == {"__key__", "mp4", "txt", "json"}
        assert meta["fps"] == 10 and meta["duration_s"] == pytest.approx(meta["frames"] / 10)
        assert meta["end_s"] == pytest.approx(meta["start_s"] + meta["duration_s"])
        assert decode_video(sample["mp4"], 2).frames.shape == (2, 32, 48, 3)
        assert keyframe_positions(sample["mp4"]) == list(range(0, meta["frames"], 5))


def test_build_with_clips_resumes_byte_identical(tmp_path):
    src = video_folder(tmp_path / "src")
    flags = (*CLIP_FLAGS, "--max-samples-per-shard", 3)
    clean = tmp_path / "clean"
    assert build(src, "--out", clean, *flags) == 0
    assert sorted(shard_bytes(clean)) == ["shard-000000.tar", "shard-000001.tar"]
    # A second build from scratch, in two worker processes, gives the same bytes ...
    again = tmp_path / "again"
    assert build(src, "--out", again, *flags, "--workers", 2) == 0
    assert shard_bytes(again) == shard_bytes(clean)
    # ... and so does a resume after losing the shard that starts inside a's clips.
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    (out / "shard-000001.tar").unlink()
    (out / "manifest.json").unlink()
    assert build(src, "--out", out, *flags) == 0
    assert shard_bytes(out) == shard_bytes(clean)
    assert read_manifest(out)["shards"] == read_manifest(clean)["shards"]
    assert read_manifest(out)["counts"] == read_manifest(clean)["counts"]


def test_reencoding_alone_keeps_one_sample_per_video(tmp_path):
    src = video_folder(tmp_path / "src")
    out = tmp_path / "out"
    flags = ("--workers", 1, "--video-max-side", 24, "--video-keyframe-interval", 8)
    assert build(src, "--out", out, *flags) == 0
    got = samples(out)
    assert [s["__key__"] for s in got] == ["000000000", "000000001", "000000002"]
    meta = json.loads(got[0]["json"])
    assert (meta["frames"], meta["width"], meta["height"]) == (60, 24, 16)
    assert decode_video(got[0]["mp4"], 3).frames.shape == (3, 16, 24, 3)
    assert keyframe_positions(got[0]["mp4"]) == list(range(0, 60, 8))


def test_cutting_both_videos_and_time_series_is_refused(tmp_path):
    src = video_folder(tmp_path / "src")
    with pytest.raises(FieldError, match="--timeseries-window"):
        build(src, "--out", tmp_path / "out", *CLIP_FLAGS, "--timeseries-window", 10)
    with pytest.raises(FieldError, match="min_clip_s") as caught:
        build(src, "--out", tmp_path / "out", "--video-clip-seconds", 0.5)
    assert "--video-min-clip-seconds" in str(caught.value)
