"""The emoji as a class-labelled image set, for `mmtrain quickstart --diffusion`.

A class-conditional generator needs a condition shared by several images, so that a held-out
image's condition was seen in training. The emoji's names give ten such classes, each a look
one can check by eye in a sample grid: flags (striped rectangles), faces (yellow discs),
hearts, clocks, buttons (coloured squares with a sign) and people or hands in each of the five
skin tones (the same figures in five colours). `emoji_class` reads the class from the name
alone; emoji of no class (animals, food, objects: too varied to share a class at 32 pixels)
and those with two skin tones (couples) are left out.

Each kept emoji becomes `KEY.png` + `KEY.cls` (its class name) in `train/` or `val/`, split by
the hash of KEY as the image-text quickstart splits them (emoji_data.is_validation), so the
extractor trained there never saw the held-out images either.
"""

from __future__ import annotations

import re
from pathlib import Path

from mmtrain.quickstart.emoji_data import (
    Emoji,
    RawSplit,
    is_validation,
    on_white,
    write_attribution,
)

TONES = ("light", "medium-light", "medium", "medium-dark", "dark")
CLASSES = ("flag", "face", "heart", "clock", "button", *(f"{tone} skin tone" for tone in TONES))

_TONE = re.compile(r"\b((?:medium-)?(?:light|dark)|medium) skin tone\b")
_CLOCK = re.compile(r"o’clock|-thirty\b")
_BUTTON = re.compile(r"\bbutton\b|^keycap")


def emoji_class(name: str) -> str | None:
    """The class of an emoji by its name (CLASSES), or None when it has none."""
    tones = set(_TONE.findall(name))
    if len(tones) == 1:
        return f"{tones.pop()} skin tone"
    if tones:
        return None  # two people of two tones: neither class
    if name.startswith("flag"):
        return "flag"
    if _CLOCK.search(name):
        return "clock"
    if "heart" in name:
        return "heart"
    if "face" in name:
        return "face"
    if _BUTTON.search(name):
        return "button"
    return None


def write_class_raw(items: list[Emoji], out_dir: Path, val_fraction: float) -> RawSplit:
    """`train/KEY.png + KEY.cls` and `val/...` under `out_dir` for the emoji with a class, plus
    ATTRIBUTION.txt (the images' licence)."""
    split = RawSplit(out_dir / "train", out_dir / "val", 0, 0)
    split.train_dir.mkdir(parents=True, exist_ok=True)
    split.val_dir.mkdir(parents=True, exist_ok=True)
    for item in items:
        label = emoji_class(item.name)
        if label is None:
            continue
        held_out = is_validation(item.key, val_fraction)
        folder = split.val_dir if held_out else split.train_dir
        (folder / f"{item.key}.png").write_bytes(on_white(item.png.read_bytes()))
        (folder / f"{item.key}.cls").write_text(label + "\n", encoding="utf-8")
        split.val += held_out
        split.train += not held_out
    write_attribution(out_dir)
    return split


__all__ = ["CLASSES", "TONES", "emoji_class", "write_class_raw"]
