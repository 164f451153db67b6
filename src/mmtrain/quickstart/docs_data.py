"""The `--vlm-docs` quickstart's data: small pages with a number on them, drawn with Pillow in
the DejaVu Sans font that matplotlib ships, as LLaVA conversations, and the tokenizer that
reads them.

Each page is a number of 3 or 4 digits laid out on a page of one of four aspect ratios, at one
of a few font sizes, at a random place, dark ink on a light background (every choice drawn from
a `numpy.random.Generator` seeded by the page's split and index, so the pages are the same on
every run):

    1:1  40 x 40 px   25 tokens of the tiny tower (patch 4, merge 2: one token = 8 x 8 px)
    3:1  24 x 72 px   27 tokens            one line
    2:1  32 x 64 px   32 tokens            one line
    1:3  72 x 24 px   27 tokens            the number broken into lines of 2 digits, read
                                           top to bottom

One conversation per page, in LLaVA's format (`vlm_data.conversation`):

    {"id": "train-000041", "image": "train-000041.png",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is the number?"},
                       {"from": "gpt", "value": "4721"}]}

The held-out pages carry numbers that no training page carries: all numbers of 3 and 4 digits
are shuffled once (seeded) and the first `n_val` of them are the validation split's, the rest
the training pages' pool. Training pages are asked one of PROMPTS in turn (so the model learns
to answer the question, not one string); held-out pages are all asked EVAL_PROMPT.

The tokenizer is a byte-level BPE trained on the training conversations' prompt side only (the
questions and the chat template's role names), stored with `vlm_data`'s chat template: the
prompts merge into a few ids each, while the answers, which hold no letter of the prompts and
no digit the BPE ever saw, are encoded one digit per id. A held-out number is then a new
sequence of ten familiar classes, each trained on about four times per page, where a BPE
trained on the answers too would split it into multi-digit pieces, most of them rare or never
seen in training (1,000 three-digit pieces against 10 digits).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmtrain.atomic import atomic_write_bytes, atomic_write_text
from mmtrain.quickstart.vlm_data import (
    BOS,
    CHAT_TEMPLATE,
    CONVERSATIONS_FILE,
    EOS,
    TokenizerFolder,
    conversation,
)

PROMPTS = ("What is the number?", "What does the page say?", "Read the number on the page.")
EVAL_PROMPT = PROMPTS[0]  # what every held-out page is asked
ALPHABET = "0123456789"
LENGTHS = (3, 4)  # digits of a number; the first is never 0
# (name, height, width) in pixels: sides multiples of the tiny tower's 8-pixel unit, so the
# budget keeps each page at its own size (visual_budget.py).
PAGES = (("1:1", 40, 40), ("3:1", 24, 72), ("2:1", 32, 64), ("1:3", 72, 24))
FONT_SIZES = (10, 12, 14, 16)  # points = pixels at Pillow's 72 dpi; a digit is 6 to 10 px wide
TALL_LINE = 2  # digits per line on a tall page
MARGIN = 1  # pixels kept free at each edge


def font_path() -> Path:
    """DejaVu Sans as matplotlib ships it (a core dependency): no font is fetched."""
    import matplotlib

    path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    if not path.is_file():
        from matplotlib import font_manager

        path = Path(font_manager.findfont("DejaVu Sans", fallback_to_default=False))
    return path


ATTRIBUTION = """\
Quickstart document pages: numbers drawn by mmtrain
===================================================

Pages
  Drawn at run time with Pillow (mmtrain.quickstart.docs_data), seed {seed}: numbers of 3 or 4
  digits on pages of 40x40, 24x72, 32x64 and 72x24 pixels, font sizes {font_sizes}.

Font
  DejaVu Sans ({font}), as shipped by matplotlib. DejaVu fonts: Bitstream Vera Fonts
  Copyright (c) 2003 Bitstream, Inc.; DejaVu changes are in the public domain. Licence: the
  Bitstream Vera licence (https://dejavu-fonts.github.io/License.html), which allows the
  fonts to be used and distributed freely.

Split
  Every number of 3 and 4 digits, shuffled once by numpy's default_rng(seed); the first
  n_val (here {n_val}) are the held-out pages' numbers, the others the training pages' pool,
  so no held-out number is ever on a training page.
"""


@dataclass(frozen=True)
class Page:
    """One page: what it says and how it is drawn."""

    key: str  # "train-000041": also the PNG's stem
    text: str  # the number, the answer
    shape: str  # a name of PAGES
    height: int
    width: int
    font_size: int
    lines: tuple[str, ...]  # the text as laid out, top to bottom
    x: int  # the text block's top-left corner, in pixels
    y: int
    ink: int  # grey level of the text, 0 black
    paper: int  # grey level of the background
    prompt: str


def split_numbers(seed: int, n_val: int) -> tuple[list[str], list[str]]:
    """(training pool, held-out numbers): every number of LENGTHS digits, shuffled by `seed`;
    the first `n_val` are held out. Disjoint by construction."""
    numbers = [str(n) for length in LENGTHS for n in range(10 ** (length - 1), 10**length)]
    order = np.random.default_rng(seed).permutation(len(numbers))
    shuffled = [numbers[i] for i in order]
    if not 0 < n_val < len(shuffled):
        raise ValueError(f"n_val must be in (0, {len(shuffled)}), got {n_val}")
    return shuffled[n_val:], shuffled[:n_val]


def _layout(text: str, shape: str, font: Any, font_sizes: tuple[int, ...], rng) -> tuple:
    """(font size, lines, block width, block height) of `text` on a page of `shape`: a font
    size drawn from those whose layout fits the page (the largest that fits when none drawn
    does)."""
    _, height, width = next(p for p in PAGES if p[0] == shape)
    if shape == "1:3":
        lines = tuple(text[i : i + TALL_LINE] for i in range(0, len(text), TALL_LINE))
    else:
        lines = (text,)
    fitting = []
    for size in font_sizes:
        face = font(size)
        block_w = max(int(np.ceil(face.getlength(line))) for line in lines)
        ascent, descent = face.getmetrics()
        line_h = ascent + descent - 2  # digits have no descender: lines sit close
        block_h = line_h * len(lines)
        if block_w <= width - 2 * MARGIN and block_h <= height - 2 * MARGIN:
            fitting.append((size, block_w, block_h))
    if not fitting:
        raise ValueError(f"{text!r} fits no font size on a {shape} page")
    size, block_w, block_h = fitting[int(rng.integers(len(fitting)))]
    return size, lines, block_w, block_h


def make_pages(
    numbers: list[str],
    split: str,
    n: int,
    seed: int,
    prompts: tuple[str, ...] = PROMPTS,
    font_sizes: tuple[int, ...] = FONT_SIZES,
) -> list[Page]:
    """`n` pages of `split` ("train" or "val"): page i carries numbers[i % len(numbers)] (the
    held-out split takes each of its numbers once), on shape PAGES[i % 4], with its font size,
    place and greys drawn from a generator seeded by (seed, split, i). Training pages are asked
    prompts[i % len(prompts)], held-out ones EVAL_PROMPT."""
    from PIL import ImageFont

    path = str(font_path())
    faces: dict[int, Any] = {}

    def font(size: int) -> Any:
        if size not in faces:
            faces[size] = ImageFont.truetype(path, size)
        return faces[size]

    tag = {"train": 1, "val": 2}[split]
    pages = []
    for i in range(n):
        rng = np.random.default_rng([seed, tag, i])
        text = numbers[i % len(numbers)]
        shape, height, width = PAGES[i % len(PAGES)]
        size, lines, block_w, block_h = _layout(text, shape, font, font_sizes, rng)
        x = int(rng.integers(MARGIN, width - MARGIN - block_w + 1))
        y = int(rng.integers(MARGIN, height - MARGIN - block_h + 1))
        prompt = prompts[i % len(prompts)] if split == "train" else EVAL_PROMPT
        pages.append(
            Page(
                key=f"{split}-{i:06d}",
                text=text,
                shape=shape,
                height=height,
                width=width,
                font_size=size,
                lines=lines,
                x=x,
                y=y,
                ink=int(rng.integers(0, 80)),
                paper=int(rng.integers(200, 256)),
                prompt=prompt,
            )
        )
    return pages


def render(page: Page) -> Any:
    """The page as a PIL RGB image (grey text on a grey page, both drawn per page)."""
    from PIL import Image, ImageDraw, ImageFont

    face = ImageFont.truetype(str(font_path()), page.font_size)
    image = Image.new("RGB", (page.width, page.height), (page.paper,) * 3)
    draw = ImageDraw.Draw(image)
    ascent, descent = face.getmetrics()
    line_h = ascent + descent - 2
    top = page.y - face.getbbox("0")[1] + 1  # the digits' top at y (their bbox starts lower)
    for n, line in enumerate(page.lines):
        draw.text((page.x, top + n * line_h), line, fill=(page.ink,) * 3, font=face)
    return image


def png_bytes(page: Page) -> bytes:
    buffer = io.BytesIO()
    render(page).save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def write_split(folder: Path, pages: list[Page]) -> tuple[Path, list[dict[str, Any]]]:
    """KEY.png for every page and `folder/conversations.json` naming them (LLaVA records, in
    key order); returns its path and the records."""
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for page in pages:
        atomic_write_bytes(folder / f"{page.key}.png", png_bytes(page))
        records.append(conversation(page.key, page.text, f"{page.key}.png", page.prompt))
    path = folder / CONVERSATIONS_FILE
    atomic_write_text(path, json.dumps(records, indent=1) + "\n")
    return path, records


def prompt_texts(records: list[dict[str, Any]]) -> list[str]:
    """What the BPE learns from: each training conversation's prompt side as the template
    renders it (role names and question, without the image tag and the answer)."""
    texts = []
    for record in records:
        question = record["conversations"][0]["value"].replace("<image>", "")
        texts.append(f"USER: {question}\nASSISTANT:\n")
    return texts


def write_tokenizer(
    folder: Path, records: list[dict[str, Any]], vocab_size: int
) -> TokenizerFolder:
    """The BPE of the prompts (module docstring), with `vlm_data`'s chat template beside it."""
    from mmtrain.data.stream.tokenizer import train_bpe

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(prompt_texts(records), vocab_size, folder / "tokenizer.json")
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return TokenizerFolder(folder, tokenizer.vocab_size, tokenizer.sot_id, tokenizer.eot_id)


def write_attribution(out: Path, seed: int, n_val: int) -> Path:
    path = out / "ATTRIBUTION.txt"
    text = ATTRIBUTION.format(
        seed=seed, font_sizes=", ".join(map(str, FONT_SIZES)), font=font_path().name, n_val=n_val
    )
    atomic_write_text(path, text)
    return path


def contact_sheet(pages: list[Page], columns: int = 4, scale: int = 3, gap: int = 6) -> Any:
    """A few pages side by side, each scaled up `scale` times (nearest), on white: the
    README's picture."""
    from PIL import Image

    images = [render(p).resize((p.width * scale, p.height * scale), Image.NEAREST) for p in pages]
    rows = [images[i : i + columns] for i in range(0, len(images), columns)]
    cell_w = max(im.width for im in images) + gap
    cell_h = max(im.height for im in images) + gap
    sheet = Image.new("RGB", (cell_w * min(columns, len(images)) + gap, cell_h * len(rows) + gap),
                      (255, 255, 255))  # fmt: skip
    for r, row in enumerate(rows):
        for c, image in enumerate(row):
            sheet.paste(image, (gap + c * cell_w, gap + r * cell_h))
    return sheet


__all__ = [
    "ALPHABET",
    "EVAL_PROMPT",
    "FONT_SIZES",
    "PAGES",
    "PROMPTS",
    "Page",
    "contact_sheet",
    "font_path",
    "make_pages",
    "png_bytes",
    "prompt_texts",
    "render",
    "split_numbers",
    "write_attribution",
    "write_split",
    "write_tokenizer",
]
