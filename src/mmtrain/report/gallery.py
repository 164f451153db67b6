"""Galleries: what the trained model does with a few validation samples.

Vision-language models (a decoder with a projector): the answers `mmtrain eval` or the
training loop's validation wrote into eval.json (`examples`), each beside its images, the
question, the reference and the answer given with another sample's images. The gallery draws
what the numbers were computed from, so it needs no model and no generation of its own.

Image-text retrieval (CLIP-style models): a few validation queries and what the model retrieves.

For a run with an image-text pair, the model in the run folder embeds the first
`max_candidates` decodable samples of the validation shards named in config.yaml (`data.val`);
for a few queries spread over them it shows the top 5 in each direction, image -> captions and
caption -> images, with the true match marked in green (and its rank when it missed the top 5).
Seeing *what* is retrieved tells a user more than R@5 alone: near misses are usually close in
meaning.

Everything here is optional: without validation shards, an image-text pair, or weights, the
gallery is skipped with a note saying why, never an error.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.transforms import IdentityTransform

from mmtrain.report.plots import DPI, Plot, to_png
from mmtrain.report.run_model import ModelUnavailable, image_text_model
from mmtrain.report.rundata import RunData

log = logging.getLogger(__name__)

TITLE_IMAGE_TEXT = "Retrieval gallery: image \u2192 captions"
TITLE_TEXT_IMAGE = "Retrieval gallery: caption \u2192 images"
TITLE_GENERATION = "Generation gallery: image, question, generated answer, reference"
GALLERY_NAMES = ("gallery_image_text", "gallery_text_image", "gallery_generation")
MATCH = "#2f9e44"
THUMB_PIXELS = 112  # thumbnail side: plenty for a gallery, keeps the embedded PNG small
BATCH = 64


class GallerySkipped(ModelUnavailable):
    """The gallery cannot be drawn for this run; the message says why (shown in the report)."""


@dataclass
class Candidates:
    """Decoded validation samples: what the model embeds and what the gallery shows."""

    keys: list[str]
    images: list[np.ndarray]  # uint8 [H, W, 3] thumbnails
    captions: list[str]
    inputs: dict[str, torch.Tensor]  # tower -> model input, row i = sample i


def retrieval_gallery(
    run: RunData,
    *,
    queries: int = 4,
    top_k: int = 5,
    max_candidates: int = 200,
    device: str | torch.device = "cpu",
) -> list[Plot]:
    """The two gallery charts (image -> text, text -> image), or one Plot with a note if skipped.
    For a language model: the generation gallery (`generation_gallery`) instead."""
    if run.spec is not None and run.spec.decoder is not None:
        return generation_gallery(run)
    try:
        model, image_tower, text_tower = image_text_model(run)
        samples = _candidates(run, model.spec, image_tower, text_tower, max_candidates)
    except ModelUnavailable as why:  # GallerySkipped among them
        return [Plot("gallery", "Retrieval gallery", None, str(why))]
    model = model.to(device).eval()
    with torch.no_grad():
        features = _embed(model, samples.inputs, device)
    scores = features[image_tower] @ features[text_tower].T  # [N, N]: image i vs caption j
    n = len(samples.keys)
    picked = _spread(n, queries)
    k = min(top_k, n)
    forward = top_matches(scores, picked, k)  # image i -> captions
    backward = top_matches(scores.T, picked, k)  # caption i -> images
    note = (
        f"{len(picked)} queries among {n} validation samples (the first decodable ones); "
        f"chance of the true match in the top {k}: {100 * k / n:.1f}%"
    )
    return [
        Plot(
            GALLERY_NAMES[0],
            TITLE_IMAGE_TEXT,
            _image_to_text(samples, forward),
            note,
        ),
        Plot(
            GALLERY_NAMES[1],
            TITLE_TEXT_IMAGE,
            _text_to_image(samples, backward),
            note,
        ),
    ]


# ----------------------------------------------------------------------------- inputs
def _val_paths(config: Mapping[str, Any]) -> list[str]:
    data = config.get("data") if isinstance(config.get("data"), Mapping) else {}
    sources = data.get("val") or []
    if isinstance(sources, (str, Mapping)):
        sources = [sources]
    paths: list[str] = []
    for source in sources:
        path = source.get("path") if isinstance(source, Mapping) else source
        paths += [str(p) for p in path] if isinstance(path, list) else [str(path)] if path else []
    return paths


def _candidates(
    run: RunData, spec: Any, image_tower: str, text_tower: str, limit: int
) -> Candidates:
    """The first `limit` validation samples that decode, with thumbnails and caption text."""
    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.data.stream.media import MediaError, decode_image, decode_text
    from mmtrain.data.stream.tokenizer import get_tokenizer
    from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS
    from mmtrain.eval.run import EvalDecoder
    from mmtrain.structured import FieldError

    paths = _val_paths(run.config)
    if not paths:
        raise GallerySkipped("config.yaml names no validation shards (data.val)")
    data = run.config.get("data") or {}
    try:
        shards = ShardSet.open(paths)
        tokenizer = get_tokenizer(data.get("tokenizer", "byte"))
    except (OSError, ValueError, FieldError) as err:
        raise GallerySkipped(f"the validation data could not be opened: {err}") from None
    decoder = EvalDecoder(spec, [image_tower, text_tower], tokenizer)
    out = Candidates([], [], [], {})
    rows: dict[str, list[torch.Tensor]] = {image_tower: [], text_tower: []}
    try:
        for i in range(len(shards)):
            if len(out.keys) >= limit:
                break
            sample = shards.read(i)
            try:
                tensors = decoder(sample)
                image_ext = next(e for e in MODALITY_EXTENSIONS["image"] if e in sample)
                text_ext = next(e for e in MODALITY_EXTENSIONS["text"] if e in sample)
                thumb = _thumbnail(decode_image(sample[image_ext]))
                caption = decode_text(sample[text_ext])
            except (MediaError, StopIteration):
                continue  # a corrupt sample: the gallery shows the ones that decode
            out.keys.append(sample["__key__"])
            out.images.append(thumb)
            out.captions.append(caption.strip())
            for name in rows:
                rows[name].append(tensors[name])
    finally:
        shards.close()
    if len(out.keys) < 2:
        raise GallerySkipped(f"fewer than 2 decodable validation samples in {', '.join(paths)}")
    out.inputs = {name: torch.stack(values) for name, values in rows.items()}
    return out


def _thumbnail(pixels: np.ndarray) -> np.ndarray:
    from PIL import Image

    image = Image.fromarray(pixels)
    scale = THUMB_PIXELS / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    # Small images (icons, test squares) are enlarged with visible pixels, large ones smoothly.
    method = Image.Resampling.NEAREST if scale >= 2 else Image.Resampling.LANCZOS
    return np.asarray(image.resize(size, method))


def _embed(model: Any, inputs: Mapping[str, torch.Tensor], device: Any) -> dict[str, torch.Tensor]:
    n = len(next(iter(inputs.values())))
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in inputs}
    for start in range(0, n, BATCH):
        batch = {name: x[start : start + BATCH].to(device) for name, x in inputs.items()}
        for name, value in model.encode(batch).items():
            parts[name].append(value.float().cpu())
    return {name: torch.cat(values) for name, values in parts.items()}


def _spread(n: int, count: int) -> list[int]:
    """`count` query indices spread evenly over n samples (deterministic: no sampling)."""
    count = min(count, n)
    return sorted({int(i) for i in np.linspace(0, n - 1, count).round()})


# ----------------------------------------------------------------------------- ranking
@dataclass
class Retrieved:
    """One query's top candidates: indices, their scores, and the true match's 0-based rank."""

    query: int
    top: list[int]
    scores: list[float]
    rank: int  # of the true match (candidate index == query index) among all candidates


def top_matches(scores: torch.Tensor, queries: Sequence[int], k: int) -> list[Retrieved]:
    """Top-k candidates of each query row of `scores` [Q, C]; the true match of query i is
    candidate i. Ties keep candidate order (a stable sort), as the eval metrics break them."""
    out = []
    for query in queries:
        order = torch.sort(-scores[query], stable=True).indices.tolist()
        top = order[:k]
        out.append(
            Retrieved(query, top, [float(scores[query, c]) for c in top], order.index(query))
        )
    return out


# ----------------------------------------------------------------------------- drawing
# The gallery is laid out in pixels and drawn with `figimage` and figure text: no Axes, so a
# gallery of 30 thumbnails renders in a fraction of the time a grid of subplots takes.
WIDTH = 1160  # about the width the page shows it at: no rescaling blur
PAD = 12
TEXT_COLOR = "#1b1f24"


def _canvas(rows: int, row_height: int) -> tuple[Figure, int]:
    height = rows * row_height + PAD
    fig = Figure(figsize=(WIDTH / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig, height


def _text(fig: Figure, x: float, y: float, text: str, **style: Any) -> None:
    """Text at pixel (x, y) from the top left (figure coordinates are from the bottom left)."""
    width, height = fig.bbox.width, fig.bbox.height
    style.setdefault("color", TEXT_COLOR)
    style.setdefault("fontsize", 9)
    fig.text(x / width, 1 - y / height, text, va="top", **style)


def _thumb(fig: Figure, pixels: np.ndarray, x: int, y: int, hit: bool) -> None:
    """A thumbnail in the THUMB_PIXELS box whose top left is pixel (x, y); a green frame if hit."""
    height = fig.bbox.height
    h, w = pixels.shape[:2]
    left, top = x + (THUMB_PIXELS - w) // 2, y + (THUMB_PIXELS - h) // 2
    fig.figimage(pixels, xo=left, yo=height - top - h, origin="upper")
    if hit:
        frame = Rectangle(
            (x - 4, height - y - THUMB_PIXELS - 4),
            THUMB_PIXELS + 8,
            THUMB_PIXELS + 8,
            transform=IdentityTransform(),
            fill=False,
            edgecolor=MATCH,
            linewidth=3,
        )
        fig.add_artist(frame)


def _image_to_text(samples: Candidates, results: Sequence[Retrieved]) -> bytes:
    row_height = THUMB_PIXELS + 2 * PAD + 14
    fig, _ = _canvas(len(results), row_height)
    for row, r in enumerate(results):
        y = PAD + row * row_height
        _thumb(fig, samples.images[r.query], PAD, y, hit=False)
        _text(fig, PAD, y + THUMB_PIXELS + 3, samples.keys[r.query], fontsize=8, color="#57606a")
        x = PAD + THUMB_PIXELS + 24
        for position, (candidate, score) in enumerate(zip(r.top, r.scores, strict=True)):
            hit = candidate == r.query
            label = f"{position + 1}.  {_short(samples.captions[candidate])}   {score:.3f}"
            _text(
                fig,
                x,
                y + position * 21,
                label + ("  \u2713 true caption" if hit else ""),
                color=MATCH if hit else TEXT_COLOR,
                fontweight="bold" if hit else "normal",
            )
        if r.rank >= len(r.top):
            missed = f"true caption at rank {r.rank + 1}: {_short(samples.captions[r.query])}"
            _text(fig, x, y + len(r.top) * 21, missed, color=MATCH, style="italic")
    return to_png(fig)


def _text_to_image(samples: Candidates, results: Sequence[Retrieved]) -> bytes:
    row_height = THUMB_PIXELS + 2 * PAD + 18
    caption_width = 300
    step = (WIDTH - PAD - caption_width) // max(1, max(len(r.top) for r in results))
    fig, _ = _canvas(len(results), row_height)
    for row, r in enumerate(results):
        y = PAD + row * row_height
        caption = textwrap.fill(_short(samples.captions[r.query], 110), 34)
        if r.rank >= len(r.top):
            caption += f"\n\ntrue image at rank {r.rank + 1}"
        _text(fig, PAD, y + 18, caption)
        for position, (candidate, score) in enumerate(zip(r.top, r.scores, strict=True)):
            hit = candidate == r.query
            x = PAD + caption_width + position * step
            title = f"{position + 1} \u00b7 {score:.3f}" + ("  \u2713" if hit else "")
            _text(fig, x, y, title, fontsize=8, color=MATCH if hit else TEXT_COLOR)
            _thumb(fig, samples.images[candidate], x, y + 18, hit)
    return to_png(fig)


def _short(text: str, width: int = 80) -> str:
    # A barely trained model's answer may hold control characters no font draws.
    text = "".join(c if c.isprintable() else "\ufffd" for c in " ".join(text.split()))
    return textwrap.shorten(text, width, placeholder="\u2026") or "(empty)"


# ----------------------------------------------------------------------------- generation
MAX_IMAGES_SHOWN = 3  # per example; a note says when there are more
FRAMES_SHOWN = 3  # of a clip, spread over it
LINE = 17  # pixels per line of text


def generation_gallery(run: RunData, *, limit: int = 6) -> list[Plot]:
    """The first `limit` examples of eval.json with their images, or a Plot with a note."""
    try:
        examples = _eval_examples(run.eval_report)[:limit]
        images = _example_images(run, examples)
    except GallerySkipped as why:
        return [Plot(GALLERY_NAMES[2], "Generation gallery", None, str(why))]
    generation = run.eval_report.get("generation") or {}
    note = (
        f"{len(examples)} of the {generation.get('n', '?')} validation answers in eval.json "
        f"(greedy, up to {generation.get('max_new_tokens', '?')} new tokens); green: exact "
        "match; grey: the answer given with another sample's images"
    )
    return [Plot(GALLERY_NAMES[2], TITLE_GENERATION, _draw_examples(examples, images), note)]


def _eval_examples(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    examples = report.get("examples")
    needed = ("key", "images", "question", "generated", "reference")
    if not isinstance(examples, list) or not examples:
        raise GallerySkipped(
            "eval.json holds no generated answers (examples): run `mmtrain eval RUN_DIR --data "
            "VAL_SHARDS`, or train with data.val"
        )
    usable = [e for e in examples if isinstance(e, Mapping) and all(k in e for k in needed)]
    if not usable:
        raise GallerySkipped("the examples in eval.json lack key, images, question or answers")
    return usable


def _example_images(run: RunData, examples: Sequence[Mapping[str, Any]]) -> list[list[np.ndarray]]:
    """Thumbnails of each example's images (pages at their own aspect) and of a few frames of
    each of its clips, read by key from the data eval.json names (else
    the run's validation shards); an image that cannot be read is left out."""
    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.data.stream.media import MediaError, decode_image, decode_video

    data = run.eval_report.get("data")
    paths = ([str(p) for p in data] if isinstance(data, list) else [str(data)]) if data else []
    paths = paths or _val_paths(run.config)
    if not paths:
        raise GallerySkipped("neither eval.json nor config.yaml names the validation shards")
    try:
        shards = ShardSet.open(paths)
    except (OSError, ValueError) as err:
        raise GallerySkipped(f"the validation data could not be opened: {err}") from None
    try:
        index = {shards.key(i): i for i in range(len(shards))}
        out = []
        for example in examples:
            thumbs = []
            videos = list(example.get("videos") or [])
            if example["key"] in index and (example["images"] or videos):
                sample = shards.read(index[example["key"]])
                for name in list(example["images"])[:MAX_IMAGES_SHOWN]:
                    try:
                        thumbs.append(_thumbnail(decode_image(sample[name])))
                    except (MediaError, KeyError):
                        continue
                for name in videos:  # a clip shows as a few of its frames, in order
                    try:
                        frames = decode_video(sample[name], FRAMES_SHOWN).frames
                    except (MediaError, KeyError):
                        continue
                    thumbs += [_thumbnail(frame) for frame in frames]
            out.append(thumbs[:MAX_IMAGES_SHOWN])
    finally:
        shards.close()
    return out


def _draw_examples(
    examples: Sequence[Mapping[str, Any]], images: Sequence[Sequence[np.ndarray]]
) -> bytes:
    row_height = THUMB_PIXELS + 2 * PAD + 22
    fig, _ = _canvas(len(examples), row_height)
    shown = max([len(t) for t in images] + [1])
    x_text = PAD + shown * (THUMB_PIXELS + 8) + 16
    width = max(40, (WIDTH - x_text - PAD) // 7)  # characters per line at fontsize 9
    for row, (example, thumbs) in enumerate(zip(examples, images, strict=True)):
        y = PAD + row * row_height
        for k, thumb in enumerate(thumbs):
            _thumb(fig, thumb, PAD + k * (THUMB_PIXELS + 8), y, hit=False)
        clips = len(example.get("videos") or [])
        more = len(example["images"]) + clips * FRAMES_SHOWN - len(thumbs)
        caption = str(example["key"]) + (f"  (+{more} more)" if more > 0 else "")
        _text(fig, PAD, y + THUMB_PIXELS + 3, caption, fontsize=8, color="#57606a")
        question = str(example["question"]).replace("<image>", " ").replace("<video>", " ")
        question = " ".join(question.split())
        hit = bool(example.get("exact_match"))
        f1 = example.get("token_f1")
        score = f"   token F1 {f1:.2f}" if isinstance(f1, (int, float)) else ""
        lines = [
            (f"Q: {_short(question, width)}", {}),
            (
                f"generated: {_short(str(example['generated']), width)}{score}",
                {"color": MATCH if hit else TEXT_COLOR, "fontweight": "bold"},
            ),
            (f"reference: {_short(str(example['reference']), width)}", {}),
        ]
        if "generated_shuffled_images" in example:
            moved = _short(str(example["generated_shuffled_images"]), width)
            source = example.get("shuffled_images_from", "another sample")
            lines.append((f"with the images of {source}: {moved}", {"color": "#8c959f"}))
        for i, (text, style) in enumerate(lines):
            _text(fig, x_text, y + i * (LINE + 6), text, **style)
    return to_png(fig)
