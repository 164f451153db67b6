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

from mmtrain.quickstart.emoji_data import Emoji, RawSplit, write_raw

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
    """`train/KEY.png + KEY.cls` (the class name) and `val/...` under `out_dir` for the emoji
    with a class, plus ATTRIBUTION.txt (the images' licence)."""

    def label(item: Emoji) -> tuple[str, str] | None:
        name = emoji_class(item.name)
        return None if name is None else ("cls", name)

    return write_raw(items, out_dir, val_fraction, label)


__all__ = ["CLASSES", "TONES", "emoji_class", "write_class_raw"]
