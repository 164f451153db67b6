"""The `--vlm-docs` quickstart's data: small pages with a number on them, drawn with Pillow in
the DejaVu Sans font that matplotlib ships, as LLaVA conversations, and the tokenizer that
reads them.

Each page is a number of 3 or 4 digits on a page of one of four aspect ratios (SHAPES), at
one of a few font sizes, left-aligned (up to JITTER pixels in) at a random height, dark ink on
a light background; every choice is drawn from a `numpy.random.Generator` seeded by the page's
split and index, so the pages are the same on every run. At the tiny tower's scale (patch 4,
merge 2: one LM token = 8 x 8 pixels) every page's long side is 48 pixels:

    1:1  96 x 96 drawn, 144 tokens; the budget (image_max_tokens 40) resizes it to 48 x 48, 36
    3:1  16 x 48   12 tokens   one line filling the page
    2:1  24 x 48   18 tokens   one line
    1:2  48 x 24   18 tokens   two lines of 2 digits, read top to bottom

One conversation per page, in LLaVA's format, the question before the page (so the answer
follows every page at the same distance in the decoder's positions):

    {"id": "train-000041", "image": "train-000041.png",
     "conversations": [{"from": "human", "value": "What is the number?\n<image>"},
                       {"from": "gpt", "value": "4721"}]}

The held-out pages carry numbers that no training page carries: all numbers of 3 and 4 digits
are shuffled once (seeded) and the first `n_val` of them are the validation split's, the rest
the training pages' pool. Training pages are asked one of PROMPTS in turn (so the model learns
to answer the question, not one string); held-out pages are all asked EVAL_PROMPT.

The tokenizer is a byte-level BPE trained on the training conversations' prompt side only (the
questions and the chat template's role names), stored with `vlm_data`'s chat template: the
prompts merge into a few ids each, while the answers, digits the BPE never saw, are encoded one
digit per id (after the space that follows "ASSISTANT:"). A held-out number is then a new
sequence of ten familiar classes, each trained on about four times per page, where a BPE
trained on the answers too would split it into multi-digit pieces, many of them rare in
training (a thousand three-digit pieces against ten digits), and its answer would have to be
recalled rather than read digit by digit.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmtrain.atomic import atomic_write_text
from mmtrain.quickstart.vlm_data import TokenizerFolder, write_bpe_folder, write_llava_split

PROMPTS = ("What is the number?", "What does the page say?", "Read the number on the page.")
EVAL_PROMPT = PROMPTS[0]  # what every held-out page is asked
ALPHABET = "0123456789"
LENGTHS = (3, 4)  # digits of a number; the first is never 0


@dataclass(frozen=True)
class Shape:
    """A kind of page: its size as drawn, in pixels, and how its number is laid out."""

    name: str  # the aspect ratio, height:width... as people say it: "3:1" is wide
    height: int
    width: int
    per_line: int | None = None  # digits per line (None: one line)
    font_sizes: tuple[int, ...] = (12, 13, 14, 16)  # as the tower sees them (x scale drawn)
    scale: int = 1  # drawn `scale` times larger; the budget brings it back (visual_budget.py)


# Every page's long side is 48 pixels at the tower (6 tokens of 8 x 8 pixels), so the answer
# sits as far after every page in the decoder's M-RoPE positions (text continues one past the
# page's largest position).
SHAPES = (
    Shape("1:1", 96, 96, scale=2),  # 144 tokens as drawn; image_max_tokens 40 -> 48 x 48, 36
    Shape("3:1", 16, 48, font_sizes=(12, 13, 14)),  # 2 x 6 = 12 tokens: the line fills it
    Shape("2:1", 24, 48),  # 3 x 6 = 18 tokens
    Shape("1:2", 48, 24, per_line=2, font_sizes=(12, 13, 14)),  # 6 x 3 = 18 tokens, 2 per line
)
MARGIN = 1  # pixels kept free at each edge (at the tower's scale)
JITTER = 3  # the text starts up to this many pixels right of the margin


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
  digits on pages of 96x96, 16x48, 24x48 and 48x24 pixels (height x width).

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
    shape: str  # a name of SHAPES
    height: int  # as drawn
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


def _digit_box(face: Any) -> tuple[int, int]:
    """(top, height) in pixels of the digits' ink below a line's origin."""
    _, top, _, bottom = face.getbbox(ALPHABET)
    return top, bottom - top


def _block(face: Any, lines: tuple[str, ...]) -> tuple[int, int]:
    """(width, height) in pixels of the ink of `lines` in `face`, one under the other."""
    width = max(int(np.ceil(face.getlength(line))) for line in lines)
    return width, _line_pitch(face) * (len(lines) - 1) + _digit_box(face)[1]


def _layout(text: str, shape: Shape, font: Any, rng) -> tuple[int, tuple[str, ...]]:
    """(font size as drawn, lines) of `text` on a page of `shape`: a font size drawn from
    those of `shape` whose layout fits the page."""
    if shape.per_line:
        lines = tuple(text[i : i + shape.per_line] for i in range(0, len(text), shape.per_line))
    else:
        lines = (text,)
    fitting = []
    room_w = shape.width - 2 * MARGIN * shape.scale
    room_h = shape.height - 2 * MARGIN * shape.scale
    for size in shape.font_sizes:
        block_w, block_h = _block(font(size * shape.scale), lines)
        if block_w <= room_w and block_h <= room_h:
            fitting.append(size * shape.scale)
    if not fitting:
        raise ValueError(f"{text!r} fits no font size on a {shape.name} page")
    return fitting[int(rng.integers(len(fitting)))], lines


def _line_pitch(face: Any) -> int:
    height = _digit_box(face)[1]
    return height + max(2, height // 4)


def make_pages(
    numbers: list[str], split: str, n: int, seed: int, prompts: tuple[str, ...] = PROMPTS
) -> list[Page]:
    """`n` pages of `split` ("train" or "val"): page i carries numbers[i % len(numbers)] (the
    held-out split takes each of its numbers once), on SHAPES[i % 4], with its font size,
    place and greys drawn from a generator seeded by (seed, split, i). Text is left-aligned
    (up to JITTER pixels in), at a random height. Training pages are asked
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
        shape = SHAPES[i % len(SHAPES)]
        size, lines = _layout(text, shape, font, rng)
        block_w, block_h = _block(font(size), lines)
        margin = MARGIN * shape.scale
        jitter = min(JITTER * shape.scale, shape.width - 2 * margin - block_w)
        x = margin + int(rng.integers(0, jitter + 1))
        y = int(rng.integers(margin, shape.height - margin - block_h + 1))
        prompt = prompts[i % len(prompts)] if split == "train" else EVAL_PROMPT
        pages.append(
            Page(
                key=f"{split}-{i:06d}",
                text=text,
                shape=shape.name,
                height=shape.height,
                width=shape.width,
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
    top = page.y - _digit_box(face)[0]  # the digits' ink starts at y
    for n, line in enumerate(page.lines):
        draw.text((page.x, top + n * _line_pitch(face)), line, fill=(page.ink,) * 3, font=face)
    return image


def png_bytes(page: Page) -> bytes:
    buffer = io.BytesIO()
    render(page).save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def conversation(page: Page) -> dict[str, Any]:
    """One LLaVA record: the question, then the page, answered with its number. The question
    comes first so that the answer follows the page at the same distance in every sample."""
    return {
        "id": page.key,
        "image": f"{page.key}.png",
        "conversations": [
            {"from": "human", "value": f"{page.prompt}\n<image>"},
            {"from": "gpt", "value": page.text},
        ],
    }


def write_split(folder: Path, pages: list[Page]) -> tuple[Path, list[dict[str, Any]]]:
    """KEY.png for every page and `folder/conversations.json` naming them (LLaVA records, in
    key order); returns its path and the records."""
    return write_llava_split(
        folder, ((f"{p.key}.png", png_bytes(p), conversation(p)) for p in pages)
    )


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
    return write_bpe_folder(folder, prompt_texts(records), vocab_size)


def write_attribution(out: Path, seed: int, n_val: int) -> Path:
    path = out / "ATTRIBUTION.txt"
    text = ATTRIBUTION.format(seed=seed, font=font_path().name, n_val=n_val)
    atomic_write_text(path, text)
    return path


def _shape(page: Page) -> Shape:
    return next(shape for shape in SHAPES if shape.name == page.shape)


def contact_sheet(
    pages: list[Page],
    columns: int = 4,
    scale: int = 3,
    gap: int = 8,
    captions: list[str] | None = None,
) -> Any:
    """Pages side by side as the tower sees them (the 1:1 pages at the budget's 48 x 48),
    each scaled up `scale` times, with a caption under each: the README's picture."""
    from PIL import Image, ImageDraw, ImageFont

    images = []
    for page in pages:
        image = render(page)
        factor = _shape(page).scale
        if factor > 1:  # what the budget gives the tower (bicubic, as the loader resizes)
            size = (page.width // factor, page.height // factor)
            image = image.resize(size, Image.Resampling.BICUBIC)
        images.append(image.resize((image.width * scale, image.height * scale), Image.NEAREST))
    face = ImageFont.truetype(str(font_path()), 14)
    text_h = 20 if captions else 0
    rows = [images[i : i + columns] for i in range(0, len(images), columns)]
    cell_w = max(max(im.width for im in images), 150 if captions else 0) + gap
    cell_h = max(im.height for im in images) + text_h + gap
    size = (cell_w * min(columns, len(images)) + gap, cell_h * len(rows) + gap)
    sheet = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for r, row in enumerate(rows):
        for c, image in enumerate(row):
            x, y = gap + c * cell_w, gap + r * cell_h
            sheet.paste(image, (x, y))
            draw.rectangle((x - 1, y - 1, x + image.width, y + image.height), outline=(160,) * 3)
            if captions:
                caption = captions[r * columns + c]
                draw.text((x, y + image.height + 3), caption, fill=(0, 0, 0), font=face)
    return sheet


__all__ = [
    "ALPHABET",
    "EVAL_PROMPT",
    "PROMPTS",
    "SHAPES",
    "Page",
    "Shape",
    "conversation",
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
