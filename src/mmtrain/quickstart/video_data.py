"""The `--vlm-video` quickstart's data: short clips of a shape that moves, grows or turns,
drawn with Pillow and encoded to MP4 with PyAV, as LLaVA conversations, and the tokenizer
that reads them.

Each clip is FRAMES frames of SIDE x SIDE pixels at FPS frames a second: one shape of SHAPES,
in one colour of COLOURS on a dark grey background, doing one of MOTIONS over the clip. The
motions come in pairs that are each other's reverse in time (PAIRS): a clip of "moves left"
played backwards is a clip of "moves right", "grows" backwards "shrinks", "turns clockwise"
backwards "turns anticlockwise". That is how they are drawn: the first motion of a pair is
drawn forwards (its place, size and angle per frame from a generator seeded by the clip's
split and index), the second is the same kind of path with its frames in reverse order. So the
clips of one motion, reversed, are drawn exactly like the clips of its partner: a model that
ignores the order of the frames cannot tell a pair apart, and one that reads the order answers
a reversed clip with the partner's motion (wrong, scored against the clip's own answer).

    {"id": "train-000041", "video": "train-000041.mp4",
     "conversations": [{"from": "human", "value": "What happens?\\n<video>"},
                       {"from": "gpt", "value": "turns clockwise"}]}

Held-out combinations (HELD_OUT): each shape keeps two motions out of training, each motion is
kept out for one shape, and a shape's held-out motion is never the partner of its other one,
so every training shape is seen doing the partner of each motion it is held out for. Training
clips take the other 24 (shape, motion) pairs in turn, held-out clips only the 8 of HELD_OUT: a
model that learned "the square moves left" from the shape gets the held-out "square moves
right" wrong; one that reads the motion gets it right.

The tokenizer is a byte-level BPE of the training conversations (questions and answers: the
answers are eight phrases, all seen in training), stored with `vlm_data`'s chat template.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmtrain.atomic import atomic_write_text
from mmtrain.quickstart.vlm_data import (
    TokenizerFolder,
    training_texts,
    write_bpe_folder,
    write_llava_split,
)

PROMPTS = ("What happens?", "What does the shape do?", "Describe the motion.")
EVAL_PROMPT = PROMPTS[0]  # what every held-out clip is asked

SIDE = 32  # pixels of a frame's side: 4 x 4 LM tokens of 8 x 8 pixels at the tiny tower
FRAMES = 4  # two temporal patches of the tower
FPS = 4  # frames a second as encoded (and sampled: data.vision.video_fps)
SUPERSAMPLE = 4  # shapes are drawn this many times larger, then scaled down (antialiased)

SHAPES = ("square", "triangle", "cross", "bar")
# (drawn forwards, the same path with its frames reversed)
PAIRS = (
    ("moves right", "moves left"),
    ("moves down", "moves up"),
    ("grows", "shrinks"),
    ("turns clockwise", "turns anticlockwise"),
)
MOTIONS = tuple(motion for pair in PAIRS for motion in pair)
REVERSED = {a: b for pair in PAIRS for a, b in (pair, pair[::-1])}  # motion -> its reverse
# Shape i keeps out the first motion of pair i and the second of pair i + 2.
HELD_OUT = (
    ("square", "moves right"),
    ("square", "shrinks"),
    ("triangle", "moves down"),
    ("triangle", "turns anticlockwise"),
    ("cross", "grows"),
    ("cross", "moves left"),
    ("bar", "turns clockwise"),
    ("bar", "moves up"),
)
TRAINED = tuple((s, m) for s in SHAPES for m in MOTIONS if (s, m) not in HELD_OUT)
COLOURS = {
    "red": (230, 60, 50),
    "green": (70, 200, 80),
    "blue": (70, 110, 240),
    "yellow": (240, 220, 60),
    "magenta": (220, 80, 220),
    "cyan": (70, 220, 230),
}


@dataclass(frozen=True)
class Clip:
    """One clip: what it shows and the shape's place, size and angle in each frame."""

    key: str  # "train-000041": also the MP4's stem
    shape: str  # a name of SHAPES
    motion: str  # a name of MOTIONS, the answer
    colour: str  # a name of COLOURS
    background: int  # grey level
    centres: tuple[tuple[float, float], ...]  # (x, y) in pixels per frame
    radii: tuple[float, ...]  # the shape's circumradius in pixels per frame
    angles: tuple[float, ...]  # degrees, clockwise on screen, per frame
    prompt: str


def _forward_path(kind: int, rng: np.random.Generator, frames: int):
    """(centres, radii, angles) per frame of the first motion of PAIRS[kind], drawn forwards:
    right, down, growing or clockwise, with the whole path inside the frame."""
    t = np.arange(frames) / (frames - 1)  # 0 .. 1 over the clip
    angle = float(rng.uniform(0, 360))
    if kind in (0, 1):  # moves: 8 to 12 pixels over the clip, at a fixed size
        radius = float(rng.uniform(5.5, 7.5))
        travel = float(rng.uniform(8.0, 12.0))
        start = float(rng.uniform(radius + 1, SIDE - 1 - radius - travel))
        across = float(rng.uniform(radius + 1, SIDE - 1 - radius))
        along = start + travel * t
        xs, ys = (along, np.full(frames, across)) if kind == 0 else (np.full(frames, across), along)
        return list(zip(xs, ys, strict=True)), [radius] * frames, [angle] * frames
    centre = (float(rng.uniform(12, SIDE - 12)), float(rng.uniform(12, SIDE - 12)))
    if kind == 2:  # grows: from 4-5.5 to 9-11 pixels, by the same factor each frame
        low, high = float(rng.uniform(4.0, 5.5)), float(rng.uniform(9.0, 11.0))
        radii = low * (high / low) ** t
        return [centre] * frames, radii.tolist(), [angle] * frames
    radius = float(rng.uniform(6.5, 9.0))  # turns: 15-25 degrees a frame
    step = float(rng.uniform(15.0, 25.0)) * (frames - 1)
    return [centre] * frames, [radius] * frames, (angle + step * t).tolist()


def make_clips(
    combinations: tuple[tuple[str, str], ...], split: str, n: int, seed: int
) -> list[Clip]:
    """`n` clips of `split` ("train" or "val"), FRAMES frames each: clip i shows
    combinations[i % len] (shape, motion), its colour, grey, place, size and angles drawn from
    a generator seeded by (seed, split, i). Training clips are asked one of PROMPTS drawn by
    the same generator (never by i: with 24 pairs and 3 prompts in turn each pair would always
    get the same question, and the model would read the answer off the question), held-out
    ones EVAL_PROMPT."""
    tag = {"train": 1, "val": 2}[split]
    clips = []
    for i in range(n):
        rng = np.random.default_rng([seed, tag, i])
        shape, motion = combinations[i % len(combinations)]
        kind = next(k for k, pair in enumerate(PAIRS) if motion in pair)
        centres, radii, angles = _forward_path(kind, rng, FRAMES)
        if motion == PAIRS[kind][1]:  # the partner: the same kind of path, played backwards
            centres, radii, angles = centres[::-1], radii[::-1], angles[::-1]
        names = sorted(COLOURS)
        colour = names[int(rng.integers(len(names)))]
        background = int(rng.integers(0, 70))
        prompt = PROMPTS[int(rng.integers(len(PROMPTS)))] if split == "train" else EVAL_PROMPT
        clips.append(
            Clip(
                key=f"{split}-{i:06d}",
                shape=shape,
                motion=motion,
                colour=colour,
                background=background,
                centres=tuple((float(x), float(y)) for x, y in centres),
                radii=tuple(float(r) for r in radii),
                angles=tuple(float(a) for a in angles),
                prompt=prompt,
            )
        )
    return clips


def outline(shape: str, x: float, y: float, radius: float, angle: float) -> list[tuple]:
    """The shape's polygon in pixels: centred at (x, y), `radius` from the centre to its
    farthest corner, turned `angle` degrees clockwise on screen (y points down)."""
    if shape == "square":
        points = [(math.cos(a), math.sin(a)) for a in np.radians([45, 135, 225, 315])]
    elif shape == "triangle":
        points = [(math.cos(a), math.sin(a)) for a in np.radians([-90, 30, 150])]
    elif shape == "cross":
        w = 0.3  # half the width of an arm, of the radius
        arm = math.sqrt(1 - w * w)
        quarter = [(arm, -w), (arm, w), (w, w)]  # one arm's end and the corner after it
        points = []
        for k in range(4):
            c, s = (round(math.cos(k * math.pi / 2)), round(math.sin(k * math.pi / 2)))
            points += [(c * px - s * py, s * px + c * py) for px, py in quarter]
    elif shape == "bar":
        h = 0.3  # half its thickness, of the radius
        long = math.sqrt(1 - h * h)
        points = [(-long, -h), (long, -h), (long, h), (-long, h)]
    else:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    return [(x + radius * (c * px - s * py), y + radius * (s * px + c * py)) for px, py in points]


def render(clip: Clip) -> np.ndarray:
    """The clip's frames, uint8 [T, SIDE, SIDE, 3]: drawn SUPERSAMPLE times larger, then
    scaled down by averaging (smooth edges, so a sub-pixel step still shows)."""
    from PIL import Image, ImageDraw

    big = SIDE * SUPERSAMPLE
    frames = []
    for (x, y), radius, angle in zip(clip.centres, clip.radii, clip.angles, strict=True):
        image = Image.new("RGB", (big, big), (clip.background,) * 3)
        polygon = outline(clip.shape, x, y, radius, angle)
        ImageDraw.Draw(image).polygon(
            [(px * SUPERSAMPLE, py * SUPERSAMPLE) for px, py in polygon], fill=COLOURS[clip.colour]
        )
        frames.append(np.asarray(image.resize((SIDE, SIDE), Image.Resampling.BOX)))
    return np.stack(frames)


def mp4_bytes(clip: Clip) -> bytes:
    """The clip as an MP4 at FPS frames a second (media.encode_video: H.264 where PyAV has it)."""
    from mmtrain.data.stream.media import encode_video

    return encode_video(render(clip), fps=FPS)


def conversation(clip: Clip) -> dict[str, Any]:
    """One LLaVA record: the question, then the clip, answered with its motion."""
    return {
        "id": clip.key,
        "video": f"{clip.key}.mp4",
        "conversations": [
            {"from": "human", "value": f"{clip.prompt}\n<video>"},
            {"from": "gpt", "value": clip.motion},
        ],
    }


def write_split(folder: Path, clips: list[Clip]) -> tuple[Path, list[dict[str, Any]]]:
    """KEY.mp4 for every clip and `folder/conversations.json` naming them (LLaVA records, in
    key order); returns its path and the records."""
    return write_llava_split(
        folder, ((f"{c.key}.mp4", mp4_bytes(c), conversation(c)) for c in clips)
    )


def write_tokenizer(
    folder: Path, records: list[dict[str, Any]], vocab_size: int
) -> TokenizerFolder:
    """The BPE of the training conversations (`vlm_data.training_texts`, less the video tag),
    with `vlm_data`'s chat template beside it."""
    return write_bpe_folder(folder, training_texts(records, tag="<video>"), vocab_size)


ATTRIBUTION = """\
Quickstart clips: shapes in motion drawn by mmtrain
===================================================

Drawn at run time with Pillow and encoded with PyAV (mmtrain.quickstart.video_data), seed
{seed}: {frames} frames of {side}x{side} pixels at {fps} frames a second, a square, triangle,
cross or bar that moves, grows, shrinks or turns. No third-party images.

Held-out (shape, motion) pairs, on no training clip:
  {held_out}
"""


def write_attribution(out: Path, seed: int) -> Path:
    path = out / "ATTRIBUTION.txt"
    held = "\n  ".join(f"{shape} {motion}" for shape, motion in HELD_OUT)
    text = ATTRIBUTION.format(seed=seed, frames=FRAMES, side=SIDE, fps=FPS, held_out=held)
    atomic_write_text(path, text)
    return path


__all__ = [
    "COLOURS",
    "EVAL_PROMPT",
    "FPS",
    "FRAMES",
    "HELD_OUT",
    "MOTIONS",
    "PAIRS",
    "PROMPTS",
    "REVERSED",
    "SHAPES",
    "SIDE",
    "TRAINED",
    "Clip",
    "conversation",
    "make_clips",
    "mp4_bytes",
    "outline",
    "render",
    "write_attribution",
    "write_split",
    "write_tokenizer",
]
