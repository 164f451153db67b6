"""`mmtrain quickstart --vlm-video`: the drawn clips (deterministic, each motion visible in the
pixels, a reversed clip drawn exactly as a clip of the opposite motion, held-out (shape,
motion) pairs on no training clip), the evaluator's clips reversed in time, the flags, and a
small end-to-end run that writes the video block of eval.json."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmtrain.cli import main
from mmtrain.quickstart.video_data import (
    EVAL_PROMPT,
    FRAMES,
    HELD_OUT,
    MOTIONS,
    PAIRS,
    PROMPTS,
    REVERSED,
    SHAPES,
    SIDE,
    TRAINED,
    make_clips,
    mp4_bytes,
    render,
)
from mmtrain.quickstart.vlm_video import VlmVideoConfig, run_vlm_video


# ----------------------------------------------------------------------------- data
def test_held_out_pairs_are_on_no_training_clip_and_each_motion_is_trained():
    assert len(set(HELD_OUT)) == 8 and not set(HELD_OUT) & set(TRAINED)
    assert set(HELD_OUT) | set(TRAINED) == {(s, m) for s in SHAPES for m in MOTIONS}
    assert sorted(m for _, m in HELD_OUT) == sorted(MOTIONS)  # each motion held out once
    for shape, motion in HELD_OUT:
        # the shape is trained doing the opposite: a shape-to-direction shortcut fails
        assert (shape, REVERSED[motion]) in TRAINED
        assert sum(s == shape for s, _ in TRAINED) == len(MOTIONS) - 2
    train = make_clips(TRAINED, "train", 96, 0)
    val = make_clips(HELD_OUT, "val", 16, 0)
    assert {(c.shape, c.motion) for c in train} == set(TRAINED)
    assert {(c.shape, c.motion) for c in val} == set(HELD_OUT)
    assert {c.prompt for c in val} == {EVAL_PROMPT} and {c.prompt for c in train} == set(PROMPTS)


def test_the_question_says_nothing_about_the_answer():
    """Every trained pair is asked every training question: a question tied to a pair (as
    prompts taken in turn would be, 24 pairs over 3 questions) lets the model read the answer
    off the question, and then it fails the held-out clips, all asked EVAL_PROMPT."""
    clips = make_clips(TRAINED, "train", 20 * len(TRAINED), 0)
    for pair in TRAINED:
        asked = {c.prompt for c in clips if (c.shape, c.motion) == pair}
        assert asked == set(PROMPTS), (pair, asked)


def test_clips_are_the_same_every_time():
    clips = make_clips(TRAINED, "train", 8, 0)
    assert make_clips(TRAINED, "train", 8, 0) == clips
    assert all(np.array_equal(render(a), render(b))
               for a, b in zip(clips, make_clips(TRAINED, "train", 8, 0), strict=True))  # fmt: skip
    assert make_clips(TRAINED, "train", 8, 1) != clips  # the seed matters


def test_clips_encode_to_the_same_bytes_every_time():
    """media.encode_video: x264 with its lookahead gave another encoding of the same frames
    for about one such clip in seven, so the shards (and the run) changed from run to run."""
    clips = make_clips(TRAINED, "train", 48, 0)
    first = [mp4_bytes(c) for c in clips]
    assert [mp4_bytes(c) for c in clips] == first


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pair", PAIRS)
def test_a_reversed_clip_is_drawn_as_a_clip_of_the_opposite_motion(shape, pair):
    forwards = make_clips(((shape, pair[0]),), "train", 3, 0)
    backwards = make_clips(((shape, pair[1]),), "train", 3, 0)
    for a, b in zip(forwards, backwards, strict=True):
        assert np.array_equal(render(a)[::-1], render(b))


def _ink(frames: np.ndarray, background: int) -> np.ndarray:
    """bool [T, H, W]: pixels at least half-way from the background to the shape."""
    distance = np.abs(frames.astype(np.int32) - background).max(axis=-1)
    return distance >= distance.max() / 2


@pytest.mark.parametrize("shape", SHAPES)
def test_each_motion_shows_in_the_pixels(shape):
    """Measured on the frames: the ink's centre moves the right way, its area grows or
    shrinks, and a turning shape keeps its place and size while its pixels change."""
    for motion in MOTIONS:
        for clip in make_clips(((shape, motion),), "train", 4, 0):
            frames = render(clip)
            assert frames.shape == (FRAMES, SIDE, SIDE, 3) and frames.dtype == np.uint8
            ink = _ink(frames, clip.background)
            assert not ink[:, 0].any() and not ink[:, -1].any()  # inside the frame throughout
            assert not ink[:, :, 0].any() and not ink[:, :, -1].any()
            area = ink.sum(axis=(1, 2)).astype(float)
            ys, xs = (np.array([np.nonzero(f)[k].mean() for f in ink]) for k in (0, 1))
            step = {"moves right": np.diff(xs), "moves left": -np.diff(xs),
                    "moves down": np.diff(ys), "moves up": -np.diff(ys),
                    "grows": np.diff(area), "shrinks": -np.diff(area)}  # fmt: skip
            if motion in step:
                assert (step[motion] > 0).all(), (clip.key, motion, step[motion])
            else:  # turns: the same place and (up to edge pixels) size, different pixels
                assert np.ptp(xs) < 1 and np.ptp(ys) < 1, (clip.key, xs, ys)
                assert np.ptp(area) < 0.2 * area.mean(), (clip.key, area)
                assert all((ink[t] != ink[t + 1]).sum() > 4 for t in range(FRAMES - 1))


def test_the_loader_reads_every_frame_at_its_drawn_size():
    """The run's budget keeps the 4 frames of 32 x 32 (the Qwen2-VL default would upscale each
    frame to 128 tokens): 2 temporal patches of 4 x 4 tokens, and the decoded frames show the
    motion the clip was drawn with."""
    from mmtrain.data.stream.native_inputs import NativeInputs
    from mmtrain.spec import load_spec
    from mmtrain.visual_budget import budget_of

    vision = load_spec("tiny-qwen2-vl").vision
    native = NativeInputs(budget_of(vision, VlmVideoConfig().vision()), uint8=True)
    clip = make_clips((("square", "moves right"),), "train", 1, 0)[0]
    data = mp4_bytes(clip)
    measured = native.measure(clip.key, [], [data])
    assert measured.tokens(native.budget) == ([], [(SIDE // 8) ** 2 * FRAMES // 2])
    frames = native.decode(clip.key, [], [data], measured).videos[0]
    assert tuple(frames.shape) == (FRAMES, 3, SIDE, SIDE)
    ink = _ink(frames.permute(0, 2, 3, 1).numpy(), clip.background)
    xs = np.array([np.nonzero(f)[1].mean() for f in ink])
    assert (np.diff(xs) > 0).all()


# ----------------------------------------------------------------------------- the evaluator
def test_the_evaluator_hands_over_each_clip_reversed_in_time():
    """`reverse_frames`: every clip's frames last to first, the same frame rate and size;
    images untouched."""
    import io

    from PIL import Image

    from mmtrain.data.stream.native_inputs import NativeInputs
    from mmtrain.eval.visual_batches import NativeVisuals
    from mmtrain.spec import load_spec
    from mmtrain.visual_budget import budget_of

    vision = load_spec("tiny-qwen2-vl").vision
    visuals = NativeVisuals(NativeInputs(budget_of(vision, VlmVideoConfig().vision())))
    clips = make_clips(TRAINED, "train", 2, 0)
    page = io.BytesIO()
    Image.new("RGB", (32, 16), (200, 10, 10)).save(page, format="PNG")
    members = {"image0.png": page.getvalue(), "v0.mp4": mp4_bytes(clips[0]),
               "v1.mp4": mp4_bytes(clips[1])}  # fmt: skip
    items = [(0, "a", ["image0.png"], ["v0.mp4"], members), (1, "b", [], ["v1.mp4"], members)]
    import torch

    forwards, _ = visuals.inputs(items, torch.float32)
    backwards, broken = visuals.inputs(items, torch.float32, reverse_frames=True)
    assert not broken and len(backwards["video"]) == 2
    for a, b in zip(forwards["video"], backwards["video"], strict=True):
        assert torch.equal(a.flip(0), b) and not torch.equal(a, b)
    assert torch.equal(forwards["image"][0], backwards["image"][0])
    assert forwards["video_fps"] == backwards["video_fps"]


# ----------------------------------------------------------------------------- the figures
def test_the_video_block_scores_each_motion_in_order_and_reversed():
    """`video_block` on answers made up for the 8 held-out clips: the overall figures are the
    validation's, the per-motion ones and "reversed_as_opposite" come from the answers."""
    from mmtrain.quickstart.vlm_video import video_block

    clips = make_clips(HELD_OUT, "val", len(HELD_OUT), 0)  # one clip per held-out pair
    wrong, stuck = clips[0], clips[1]  # answered wrong in order / reversed as its own motion
    answers = [
        {
            "id": c.key,
            "reference": c.motion,
            "generated": REVERSED[c.motion] if c is wrong else c.motion,
            "exact_match": float(c is not wrong),
            "generated_frames_reversed": c.motion if c is stuck else REVERSED[c.motion],
        }
        for c in clips
    ]
    generation = {"exact_match": 7 / 8, "exact_match_frames_reversed": 1 / 8, "n": 8,
                  "n_frames_reversed": 8, "exact_match_shuffled_images": 0.25}  # fmt: skip
    block = video_block({"generation": generation}, answers, clips, 32)
    assert block["accuracy"] == 7 / 8 and block["accuracy_frames_reversed"] == 1 / 8
    assert block["accuracy_shuffled_clips"] == 0.25 and block["chance"] == 1 / len(MOTIONS)
    assert block["reversed_as_opposite"] == 7 / 8
    assert block["wrong"] == [{"id": wrong.key, "motion": wrong.motion,
                               "generated": REVERSED[wrong.motion]}]  # fmt: skip
    for clip in clips:
        row = block["by_motion"][clip.motion]
        assert row["n"] == 1
        assert row["accuracy"] == float(clip is not wrong)
        assert row["accuracy_frames_reversed"] == float(clip is stuck)
        assert row["reversed_as_opposite"] == float(clip is not stuck)


# ----------------------------------------------------------------------------- the flags
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--vlm-docs"], "demos"),
        (["--vlm", "--diffusion", "--vlm-docs"], "four demos"),
        (["--modalities", "image,audio"], "--modalities"),
        (["--clip", "somewhere"], "--clip"),
        (["--clip-steps", "10"], "--clip-steps"),
        (["--minutes", "0"], "--minutes"),
        (["--limit", "3"], "--limit"),
    ],
)
def test_flags_are_checked_before_anything_runs(tmp_path, capsys, extra, message):
    out = tmp_path / "qs"
    assert main(["quickstart", "--vlm-video", "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- end to end
def test_a_small_run_writes_the_video_block(tmp_path):
    """A reduced config (48 clips, 16 held out, 20 steps of 8): what the command writes and
    prints, and the shards' held-out pairs on no training clip. No learning is asserted: 20
    steps learn nothing, on any machine."""
    from mmtrain.commands.quickstart import vlm_video_summary
    from mmtrain.data.ingest.inspect import open_shards

    config = VlmVideoConfig(out=tmp_path / "qs", steps=20, batch_size=8, train_clips=48,
                            val_clips=16, fit_budget=False, build_workers=1)  # fmt: skip
    result = run_vlm_video(config)
    report = json.loads(result.eval_json.read_text())
    video = report["video"]
    assert 0.0 <= video["accuracy"] <= 1.0 and 0.0 <= video["accuracy_frames_reversed"] <= 1.0
    assert video["n"] == 16 == video["n_frames_reversed"]
    generation = report["generation"]
    assert video["accuracy"] == generation["exact_match"]
    assert video["accuracy_frames_reversed"] == generation["exact_match_frames_reversed"]
    assert generation["n_frames_reversed"] == 16
    assert set(video["by_motion"]) == set(MOTIONS)
    assert sum(row["n"] for row in video["by_motion"].values()) == 16
    assert video["clip_tokens"] == 32
    assert all("generated_frames_reversed" in e for e in report["examples"])
    printed = vlm_video_summary(result)
    assert "in order" in printed and "reversed" in printed and "held out" in printed
    assert (result.paths.run / "model.safetensors").is_file()

    # every training shard's clip is a trained pair, every held-out one a held-out pair
    drawn = make_clips(TRAINED, "train", 48, 0) + make_clips(HELD_OUT, "val", 16, 0)
    by_key = {clip.key: clip for clip in drawn}
    paths = result.paths
    for shards, allowed in ((paths.train_shards, TRAINED), (paths.val_shards, HELD_OUT)):
        sources = open_shards(str(shards))[2]
        for i in range(len(sources)):
            sample = sources.read(i)
            meta = json.loads(sample["json"])
            clip = by_key[meta["id"]]
            answer = meta["messages"][-1]["content"]
            assert answer == clip.motion and (clip.shape, answer) in allowed
            assert sample[meta["videos"][0]] == mp4_bytes(clip)
        assert len(sources) == (48 if allowed is TRAINED else 16)
    # a finished run is not overwritten
    with pytest.raises(Exception, match="already holds a finished quickstart"):
        run_vlm_video(config)
