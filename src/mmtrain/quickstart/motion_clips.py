"""The `--video` quickstart's clips: a coloured square crossing a dark frame in one of four
directions, with its caption, and the frame-difference judge of a clip's direction.

Each clip is FRAMES frames of SIDE x SIDE pixels: a SQUARE x SQUARE square of one of COLOURS
starts at a random place with room to move, and moves one pixel a frame in one of DIRECTIONS
("a red square moves left"). Clips are float32 [3, T, H, W] in [-1, 1], as a VAE takes them,
and MP4s in the shards (`clip_shards`), the format users' data comes in.

`direction_of` judges a clip from how its frames differ, as a person would: where the centre of
its brightness away from the background goes from frame to frame. It reads the VAE's decoding of a generated clip as well as a drawn one;
`judge_accuracy` is its score on drawn clips through the VAE (the ceiling a sample can reach).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

FRAMES = 9  # 1 + 4 x 2: the tiny VAE's 2x temporal rule, 5 latent frames
SIDE = 16
SQUARE = 4
# Colours without blue: in its 300 steps the demo's VAE learns the red and green channels of
# these clips and not yet the blue one (a blue square decoded to the background).
COLOURS = {"red": (0.9, -0.9, -0.9), "green": (-0.9, 0.9, -0.9), "yellow": (0.9, 0.9, -0.9)}
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (row, column)
BACKGROUND = -0.85


def caption(colour: str, direction: str) -> str:
    return f"a {colour} square moves {direction}"


def draw(colour: str, direction: str, rng: np.random.Generator) -> np.ndarray:
    """One clip [3, FRAMES, SIDE, SIDE] in [-1, 1]: the square moves one pixel a frame."""
    dy, dx = DIRECTIONS[direction]
    travel = FRAMES - 1
    room = SIDE - SQUARE - travel  # start positions that keep the square inside every frame
    start = [int(rng.integers(0, SIDE - SQUARE + 1)) for _ in range(2)]
    for axis, step in enumerate((dy, dx)):
        if step:
            lowest = 0 if step > 0 else travel
            start[axis] = lowest + int(rng.integers(0, room + 1))
    clip = np.full((3, FRAMES, SIDE, SIDE), BACKGROUND, np.float32)
    for f in range(FRAMES):
        y, x = start[0] + dy * f, start[1] + dx * f
        clip[:, f, y : y + SQUARE, x : x + SQUARE] = np.asarray(COLOURS[colour])[:, None, None]
    return clip


def clips(n: int, seed: int) -> Iterator[tuple[str, str, np.ndarray]]:
    """`n` clips (colour, direction, pixels), every (colour, direction) in turn."""
    rng = np.random.default_rng(seed)
    pairs = [(c, d) for d in DIRECTIONS for c in COLOURS]
    for i in range(n):
        colour, direction = pairs[i % len(pairs)]
        yield colour, direction, draw(colour, direction, rng)


def clip_shards(out: Path, n: int, seed: int, fps: int = 8) -> Path:
    """Shards of `n` clips as MP4s (KEY.mp4) with their captions (KEY.txt)."""
    from mmtrain.data.storage.shard_writer import ShardWriter
    from mmtrain.data.stream.media import encode_video

    with ShardWriter(out, max_samples=256) as writer:
        for i, (colour, direction, clip) in enumerate(clips(n, seed)):
            frames = ((clip.transpose(1, 2, 3, 0) + 1) * 127.5).round().clip(0, 255)
            writer.write({"__key__": f"clip{i:05d}", "txt": caption(colour, direction).encode(),
                          "mp4": encode_video(frames.astype(np.uint8), fps=fps)})  # fmt: skip
    return out


def direction_of(clip: np.ndarray) -> str:
    """The direction a clip [3, T, H, W] (any range) moves in: the centre of each frame's
    brightness away from its median (the background), fitted by a line over the frames, and
    the axis and sign of the larger slope."""
    centres = np.array([_centre(clip[:, t]) for t in range(clip.shape[1])])  # [T, (row, col)]
    times = np.arange(len(centres)) - (len(centres) - 1) / 2
    dy, dx = (times[:, None] * (centres - centres.mean(0))).sum(0)
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def _centre(frame: np.ndarray) -> tuple[float, float]:
    brightness = np.abs(frame - np.median(frame, axis=(1, 2), keepdims=True)).sum(0)
    total = brightness.sum() + 1e-9
    rows, cols = np.indices(brightness.shape)
    return float((brightness * rows).sum() / total), float((brightness * cols).sum() / total)
