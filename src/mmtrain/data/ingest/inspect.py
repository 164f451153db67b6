"""What `mmtrain data inspect` reports: shards, samples, modalities, sizes, damage, corrupt samples.

Three pieces, each usable on its own:

- `inspect_shards(spec, check_hash, verify)`: the report (a plain dict, what `--json` prints):
  shards and their sizes, sample counts per extension and modality, the manifest's filter
  statistics and command, shards that do not match the manifest, damaged shards and refused
  (unsafe) members; with `verify=True` also every member decoded, and `corrupt` listing those
  that fail as `{key, shard, member, reason}`.
- `verify_samples(sources)`: that decode pass alone. It uses the decoders the loader uses
  (`data/stream/media.py`), so "verified" means "the loader will not skip it".
- `contact_sheet(sources, path)`: a PNG grid of a few samples spread over the dataset, each
  captioned with its key: the image, the middle frame of a video, a spectrogram of audio, a
  plot of a time-series or the text itself.
- `conversation_counts(sources, tokenizer, template, image_tokens)`: for shards of
  conversations (`{key}.json` with "messages", "images" and "videos"), the tokens each sample
  takes in a language model: its text ids through the chat template and tokenizer, plus
  `image_tokens` positions per image, or, for a native-resolution VLM (a `budget`), each page's
  and clip's own tokens from its header size under the budget the loader applies
  (visual_budget.py). `mmtrain plan --data` plans from them; `inspect_shards` reports their
  distribution (with a tokenizer), else images, videos and text bytes per conversation.
"""

from __future__ import annotations

import json
import logging
import os
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmtrain.atomic import atomic_open
from mmtrain.data.storage.manifest import MANIFEST_NAME, read_manifest, verify_manifest
from mmtrain.data.storage.s3 import is_remote
from mmtrain.data.storage.shard_lists import expand_shards
from mmtrain.data.storage.shards import ShardSet, open_remote_set
from mmtrain.data.storage.tar_index import ShardIndex
from mmtrain.data.stream.chat_templates import (
    ChatTemplate,
    Placeholders,
    RefusedSample,
    TextEncoder,
    encode_conversation,
)
from mmtrain.data.stream.conversations import ConversationError, parse_conversation
from mmtrain.data.stream.media import (
    DEFAULT_MAX_PIXELS,
    MediaError,
    check_extension,
    decode_audio,
    decode_image,
    decode_text,
    decode_timeseries,
    decode_video,
)
from mmtrain.data.stream.native_inputs import NativeInputs
from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS
from mmtrain.lengths import summarize  # the planner reports the same statistics
from mmtrain.visual_budget import BudgetExceeded, VisualBudget

logger = logging.getLogger(__name__)

__all__ = [
    "inspect_shards",
    "open_shards",
    "verify_samples",
    "verify_member",
    "contact_sheet",
    "conversation_counts",
    "conversation_summary",
    "ConversationCounts",
    "EXTENSION_MODALITY",
]

# Extension (last part, lower-case) -> modality, as the loader's decoders read them.
EXTENSION_MODALITY = {ext: m for m, exts in MODALITY_EXTENSIONS.items() for ext in exts}
# Verification decodes this many frames spread over a video: enough to reach its end (a cut
# file fails: its headers promise frames that are not there) without converting every frame.
VERIFY_VIDEO_FRAMES = 8
VERIFY_SAMPLE_RATE = 16_000


# ----------------------------------------------------------------------------- report
def open_shards(spec: str | list[str]) -> tuple[Path | None, dict[str, Any] | None, ShardSet]:
    """(folder, its manifest, the shards that exist): a folder's manifest names its shards
    (those missing are left out here; `inspect_shards` reports them). An s3:// spec has no
    local folder: its shards were checked against the manifest as they were downloaded."""
    if is_remote(spec):
        sources, manifest = open_remote_set(spec)
        return None, manifest, sources
    folder = Path(spec) if isinstance(spec, str) and Path(spec).is_dir() else None
    manifest = None
    if folder is not None and (folder / MANIFEST_NAME).is_file():
        manifest = read_manifest(folder)
    if manifest is not None:  # missing shards are reported by verify_manifest
        paths = [folder / s["name"] for s in manifest["shards"] if (folder / s["name"]).is_file()]
    else:
        paths = expand_shards(spec)
    return folder, manifest, ShardSet.open(paths) if paths else ShardSet([])


def inspect_shards(
    spec: str | list[str],
    check_hash: bool = True,
    verify: bool = False,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    tokenizer: TextEncoder | None = None,
    template: ChatTemplate | None = None,
    image_tokens: int = 1,
    budget: VisualBudget | None = None,
    wrap: bool = False,
) -> dict[str, Any]:
    """The report `data inspect` prints, as a plain dict (also what `--json` writes).

    `problems` lists everything that makes the data unclean (`mismatched`: shards that differ
    from the manifest; damaged shards; corrupt samples); refused members are listed under `unsafe` but are no problem for
    training: they never reach a sample. Shards of conversations also get `conversations`
    (`conversation_summary`: tokens per sample with a `tokenizer` and `template`, else images,
    videos and text bytes). Raises FileNotFoundError when `spec` names no shard.
    """
    folder, manifest, sources = open_shards(spec)
    checked = manifest is not None and folder is not None
    mismatched = [str(p) for p in verify_manifest(folder, check_hash)] if checked else []
    listed = {s["name"]: s for s in (manifest or {}).get("shards", [])}
    shards = []
    extensions: dict[str, int] = {}
    for shard in sources.shards:
        shards.append({"name": shard.name, "samples": len(shard), "bytes": shard.file_bytes})
        expected = listed.get(shard.name)
        if expected is not None and expected["samples"] != len(shard):
            mismatched.append(
                f"{shard.name}: {len(shard)} samples, manifest says {expected['samples']}"
            )
        for ext, n in shard.extension_counts().items():
            extensions[ext] = extensions.get(ext, 0) + n
    modalities: dict[str, int] = {}
    for ext, n in extensions.items():
        modality = EXTENSION_MODALITY.get(ext.rsplit(".", 1)[-1])
        if modality is not None:  # a sample has one member per modality
            modalities[modality] = modalities.get(modality, 0) + n
    problems = list(mismatched)
    damaged = [
        {"shard": Path(d.shard).name, "offset": d.offset, "reason": d.reason}
        for d in sources.damaged()
    ]
    problems += [f"{d['shard']}: damaged at byte {d['offset']}: {d['reason']}" for d in damaged]
    corrupt: list[dict[str, str]] = []
    if verify:
        corrupt = verify_samples(sources, workers=workers, max_pixels=max_pixels)
        problems += [f"{c['shard']}: {c['key']}.{c['member']}: {c['reason']}" for c in corrupt]
    return {
        "path": str(spec),
        "manifest": manifest is not None,
        "shards": shards,
        "samples": len(sources),
        "bytes": sum(s["bytes"] for s in shards),
        "modalities": modalities,
        "extensions": dict(sorted(extensions.items())),
        "counts": (manifest or {}).get("counts", {}),
        "filters": (manifest or {}).get("filters", {}),
        "command": (manifest or {}).get("command", ""),
        "unsafe": [
            {"shard": Path(m.shard).name, "member": m.member, "reason": m.reason}
            for m in sources.skipped()
        ],
        "damaged": damaged,
        "decoded": len(sources) if verify else 0,
        "corrupt": corrupt,
        "corrupt_samples": len({(c["shard"], c["key"]) for c in corrupt}),
        "mismatched": mismatched,
        "problems": problems,
        "verified": "sha256" if manifest and check_hash else "size" if manifest else "none",
        "conversations": conversation_summary(
            sources, tokenizer, template, image_tokens, budget, wrap
        ),
    }


# ----------------------------------------------------------------------------- conversations
@dataclass(frozen=True)
class ConversationCounts:
    """Per usable sample, in shard order: LM positions (text ids + images x image tokens; a
    preference pair's chosen side, its rejected side's under `rejected_positions`),
    text ids (a placeholder counts one), images, text bytes, videos; and the samples left out,
    by reason (`format`, `roles`, ... from parsing; `no_targets`, ... from encoding). Without
    a budget a video's placeholder counts one position (its tokens depend on the frames a
    model samples); with one (a native VLM), `visual_tokens` per sample and `page_tokens` per
    image are what its inputs take."""

    positions: list[int]
    text_ids: list[int]
    images: list[int]
    text_bytes: list[int]
    refused: dict[str, int]
    videos: list[int] = field(default_factory=list)
    visual_tokens: list[int] = field(default_factory=list)
    page_tokens: list[int] = field(default_factory=list)
    # per sample with a budget: its inputs as (frames, height, width) at the tower's size
    visual_shapes: list[tuple[tuple[int, int, int], ...]] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # each usable sample's index in the shards
    # a preference pair's rejected side (`positions` are its chosen side's); 0 for the others
    rejected_positions: list[int] = field(default_factory=list)

    def refuse(self, kind: str) -> None:
        self.refused[kind] = self.refused.get(kind, 0) + 1


def _conversation(sample: dict[str, Any], index: int) -> Any:
    """The sample's parsed conversation, or None when it holds no conversation JSON."""
    data = sample.get("json")
    if data is None:
        return None
    try:
        record = json.loads(decode_text(data, what="JSON"))
    except (ValueError, MediaError) as err:
        raise ConversationError(sample["__key__"], index, None, "json", str(err), "") from None
    if not isinstance(record, dict) or "messages" not in record:
        return None
    return parse_conversation(record, file=sample["__key__"], index=index)


def conversation_counts(
    sources: ShardSet,
    tokenizer: TextEncoder | None = None,
    template: ChatTemplate | None = None,
    image_tokens: int = 1,
    max_samples: int | None = None,
    budget: VisualBudget | None = None,
    wrap: bool = False,
) -> ConversationCounts:
    """Tokens per conversation sample (module docstring), for up to `max_samples` samples
    spread evenly over the shards (all by default). Without a tokenizer or template only
    images and text bytes are counted (positions and text ids stay empty).

    Encoding never truncates here (the planner truncates to its sequence length and reports
    how many samples it cut), and counts an image as one placeholder (id -1, never a text id).
    `image_tokens` 0 (a language model without an image tower) refuses samples with images
    (`images_without_tower`). `budget`: a native VLM's; each input's tokens from its header
    size (a sample that cannot fit it is refused as `visual_budget`, as the loader does);
    `wrap`: the model puts a start and an end id around each input (VisionTokens.start_id).
    """
    total = len(sources)
    picks: Any = range(total)
    if max_samples is not None and max_samples < total:
        picks = sorted(set(np.linspace(0, total - 1, max_samples).round().astype(int).tolist()))
    counts = ConversationCounts([], [], [], [], {})
    # ids no text has; an input counts one here, its start and end ids one each
    marks = Placeholders(-1, video_token_id=-2, wrap=(-3, -4) if wrap else None)
    for index in picks:
        sample = sources.read(index)
        try:
            conv = _conversation(sample, index)
            encoded = visual = None
            if conv is not None and budget is not None:
                visual = _visual_tokens(sample, conv, budget)
            if conv is not None and tokenizer is not None and template is not None:
                sides = [conv]
                if conv.is_preference():  # a pair: the prompt with each answer
                    sides = [conv.answered(conv.chosen), conv.answered(conv.rejected)]
                encoded, *rejected = [
                    encode_conversation(side, template, tokenizer, 2**62, -1, placeholders=marks)
                    for side in sides
                ]
        except (ConversationError, RefusedSample) as err:
            counts.refuse(err.kind)
            continue
        except BudgetExceeded:
            counts.refuse("visual_budget")
            continue
        except MediaError:
            counts.refuse("unreadable_media")
            continue
        if conv is None:
            continue
        if conv.images and image_tokens < 1 and budget is None:  # no image tower
            counts.refuse("images_without_tower")
            continue
        counts.indices.append(int(index))
        counts.images.append(len(conv.images))
        counts.videos.append(len(conv.videos))
        counts.text_bytes.append(sum(len(t.text.encode("utf-8")) for t in conv.turns))
        inputs = len(conv.images) + len(conv.videos)
        extra = len(conv.images) * (image_tokens - 1)
        if visual is not None:
            tokens, shapes = visual
            counts.visual_tokens.append(sum(tokens))
            counts.page_tokens.extend(tokens[: len(conv.images)])
            counts.visual_shapes.append(shapes)
            extra = counts.visual_tokens[-1] - inputs
        if encoded is not None:
            ids = len(encoded.input_ids)
            counts.text_ids.append(ids)
            counts.positions.append(ids + extra)
            counts.rejected_positions.append(len(rejected[0].input_ids) + extra if rejected else 0)
    return counts


def _visual_tokens(
    sample: dict[str, Any], conv: Any, budget: VisualBudget
) -> tuple[list[int], tuple[tuple[int, int, int], ...]]:
    """Tokens of each image, then each clip of a sample, and their (frames, height, width) at
    the tower, from their headers under `budget`."""
    missing = [name for name in (*conv.images, *conv.videos) if name not in sample]
    if missing:
        raise MediaError(f"{sample['__key__']}: no member(s) {missing}")
    images = [sample[name] for name in conv.images]
    videos = [sample[name] for name in conv.videos]
    measured = NativeInputs(budget).measure(sample["__key__"], images, videos)
    tokens = [shape.tokens(budget.spec) for shape in measured.shapes]
    return tokens, tuple((s.frames, s.height, s.width) for s in measured.shapes)


def conversation_summary(
    sources: ShardSet,
    tokenizer: TextEncoder | None = None,
    template: ChatTemplate | None = None,
    image_tokens: int = 1,
    budget: VisualBudget | None = None,
    wrap: bool = False,
) -> dict[str, Any] | None:
    """The distribution of tokens per conversation (count, mean, p50, p90, p99, max) as
    `data inspect` reports it; None when the shards hold no conversation."""
    counts = conversation_counts(
        sources, tokenizer, template, image_tokens, budget=budget, wrap=wrap
    )
    if not counts.images and not counts.refused:
        return None
    out: dict[str, Any] = {
        "samples": len(counts.images),
        "refused": counts.refused,
        "images": summarize(counts.images),
        "videos": summarize(counts.videos),
        "text_bytes": summarize(counts.text_bytes),
    }
    if budget is not None:
        out["visual_tokens"] = summarize(counts.visual_tokens)
        out["page_tokens"] = summarize(counts.page_tokens)
    if counts.positions:
        out["image_tokens"] = "per page (budget)" if budget is not None else image_tokens
        out["text_ids"] = summarize(counts.text_ids)
        out["positions"] = summarize(counts.positions)
    else:
        out["note"] = "tokens need a tokenizer and a chat template (mmtrain plan --data has them)"
    return out


# ----------------------------------------------------------------------------- verify
def verify_member(ext: str, data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """Decode one member as the loader would; raise MediaError saying why it cannot be.

    The content must match the extension (a PNG named .jpg is mislabelled). `json` must parse,
    `cls` must be an integer; extensions no decoder reads are only checked for a lying magic.
    """
    last = ext.rsplit(".", 1)[-1]
    check_extension(last, data)
    modality = EXTENSION_MODALITY.get(last)
    if modality == "image":
        decode_image(data, max_pixels=max_pixels)
    elif modality == "video":
        decode_video(data, VERIFY_VIDEO_FRAMES, short_side=64, max_pixels=max_pixels)
    elif modality == "audio":
        decode_audio(data, VERIFY_SAMPLE_RATE)
    elif modality == "timeseries":
        decode_timeseries(data, last)
    elif modality == "text":
        decode_text(data)
    elif last == "json":
        try:
            json.loads(decode_text(data, what="JSON"))
        except ValueError as err:
            raise MediaError(f"invalid JSON: {err}") from None
    elif last == "cls":
        text = decode_text(data, what="class label").strip()
        if not text.lstrip("-").isdigit():
            raise MediaError(f"class label {text[:40]!r} is not an integer")


def _verify_shard(shard: ShardIndex, max_pixels: int) -> list[dict[str, str]]:
    corrupt = []
    fd = os.open(shard.local_path(), os.O_RDONLY)
    try:
        for i in range(len(shard)):
            sample = shard.read(i, fd)
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                try:
                    verify_member(ext, data, max_pixels)
                except MediaError as err:
                    corrupt.append(
                        {
                            "key": shard.keys[i],
                            "shard": shard.name,
                            "member": ext,
                            "reason": str(err),
                        }
                    )
    finally:
        os.close(fd)
    return corrupt


def verify_samples(
    sources: ShardSet, workers: int | None = None, max_pixels: int = DEFAULT_MAX_PIXELS
) -> list[dict[str, str]]:
    """Decode every member of every sample; `[{key, shard, member, reason}]` of those that fail.

    Shards are verified in parallel threads (Pillow, PyAV and libsndfile release the GIL while
    decoding); the list is in shard order, then sample order.
    """
    workers = max(1, min(workers or os.cpu_count() or 1, len(sources.shards) or 1))
    with ThreadPoolExecutor(workers) as pool:
        results = pool.map(lambda s: _verify_shard(s, max_pixels), sources.shards)
        corrupt = [c for shard in results for c in shard]
    if corrupt:
        logger.warning("%d corrupt member(s), e.g. %s", len(corrupt), corrupt[0])
    return corrupt


# ----------------------------------------------------------------------------- contact sheet
# Anchor colours of the spectrogram colour ramp (dark blue -> purple -> orange -> pale yellow).
_RAMP = np.array(
    [[0, 0, 20], [60, 15, 110], [150, 40, 120], [235, 100, 60], [250, 240, 170]], dtype=np.float32
)
_FONT_HEIGHT = 12
_BACKGROUND = (24, 24, 24)


def _fit(image: Image.Image, size: int) -> Image.Image:
    """`image` scaled to fit a size x size square, centred on the background colour."""
    scale = size / max(image.width, image.height)  # up or down: small images stay visible
    shape = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    image = image.convert("RGB").resize(shape, Image.Resampling.BICUBIC)
    tile = Image.new("RGB", (size, size), _BACKGROUND)
    tile.paste(image, ((size - image.width) // 2, (size - image.height) // 2))
    return tile


def spectrogram_tile(wave: np.ndarray, size: int, window: int = 512) -> Image.Image:
    """A log-power spectrogram of a mono waveform (low frequencies at the bottom), coloured."""
    hop = window // 2
    if len(wave) < window:
        wave = np.pad(wave, (0, window - len(wave)))
    count = 1 + (len(wave) - window) // hop
    frames = np.lib.stride_tricks.sliding_window_view(wave, window)[::hop][:count]
    power = np.abs(np.fft.rfft(frames * np.hanning(window), axis=1)) ** 2
    db = 10 * np.log10(power.T[::-1] + 1e-10)
    level = np.clip((db - (db.max() - 80)) / 80, 0, 1)  # the top 80 dB
    position = level * (len(_RAMP) - 1)
    low = np.floor(position).astype(int).clip(0, len(_RAMP) - 2)
    frac = (position - low)[..., None]
    rgb = _RAMP[low] * (1 - frac) + _RAMP[low + 1] * frac
    image = Image.fromarray(rgb.astype(np.uint8))
    return image.resize((size, size), Image.Resampling.BILINEAR)


def _series_tile(series: np.ndarray, size: int) -> Image.Image:
    """Up to three channels of a time-series as lines, each scaled to the tile's height."""
    tile = Image.new("RGB", (size, size), _BACKGROUND)
    draw = ImageDraw.Draw(tile)
    colours = [(90, 180, 250), (250, 160, 60), (120, 220, 120)]
    for channel, colour in zip(series[:3], colours, strict=False):
        picks = channel[np.linspace(0, len(channel) - 1, min(len(channel), size)).astype(int)]
        span = float(picks.max() - picks.min()) or 1.0
        ys = (size - 4) - (picks - picks.min()) / span * (size - 8)
        xs = np.linspace(2, size - 3, len(picks))
        draw.line(list(zip(xs.tolist(), ys.tolist(), strict=True)), fill=colour, width=1)
    return tile


def _text_tile(text: str, size: int) -> Image.Image:
    tile = Image.new("RGB", (size, size), _BACKGROUND)
    lines = textwrap.wrap(" ".join(text.split()), width=max(8, size // 7))
    ImageDraw.Draw(tile).multiline_text(
        (4, 4), "\n".join(lines[: size // (_FONT_HEIGHT + 2)]), fill=(220, 220, 220)
    )
    return tile


def _error_tile(message: str, size: int) -> Image.Image:
    tile = _text_tile(f"CORRUPT: {message}", size)
    ImageDraw.Draw(tile).rectangle([0, 0, size - 1, size - 1], outline=(220, 40, 40), width=2)
    return tile


def _sample_tile(sample: dict[str, Any], size: int) -> Image.Image:
    """The most visual member of a sample as a tile: image, video, audio, time-series, text."""
    members = {ext.rsplit(".", 1)[-1]: data for ext, data in sample.items() if ext != "__key__"}
    makers: list[tuple[str, Callable[[bytes, str], Image.Image]]] = [
        ("image", lambda d, e: _fit(Image.fromarray(decode_image(d, draft_size=size)), size)),
        (
            "video",  # one frame at the middle of the clip
            lambda d, e: _fit(Image.fromarray(decode_video(d, 1, short_side=size).frames[0]), size),
        ),
        ("audio", lambda d, e: spectrogram_tile(decode_audio(d, VERIFY_SAMPLE_RATE), size)),
        ("timeseries", lambda d, e: _series_tile(decode_timeseries(d, e), size)),
        ("text", lambda d, e: _text_tile(decode_text(d, errors="replace"), size)),
    ]
    for modality, make in makers:
        ext = next((e for e in MODALITY_EXTENSIONS[modality] if e in members), None)
        if ext is not None:
            try:
                return make(members[ext], ext)
            except MediaError as err:
                return _error_tile(str(err), size)
    return _text_tile("(no media member: " + ", ".join(sorted(members)) + ")", size)


def _caption(text: str, width: int, draw: ImageDraw.ImageDraw, font: Any) -> str:
    """`text` cut (with an ellipsis) to fit `width` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def contact_sheet(
    sources: ShardSet,
    path: str | Path,
    count: int = 16,
    tile: int = 160,
    columns: int | None = None,
) -> list[str]:
    """Write a PNG grid of `count` samples spread evenly over `sources`; return their keys.

    Each tile shows the sample's most visual member (image; the middle frame of a video; a
    spectrogram of audio; a plot of a time-series; else its text) with the key below it. An
    undecodable member gets a red-framed tile with the reason. The file is written atomically.
    """
    if count < 1 or tile < 32:
        raise ValueError(f"contact sheet needs count >= 1 and tile >= 32, got {count}, {tile}")
    total = len(sources)
    picks = sorted(set(np.linspace(0, total - 1, min(count, total)).round().astype(int).tolist()))
    if total == 0:
        picks = []
    columns = columns or max(1, min(len(picks), round(len(picks) ** 0.5 + 0.49)))
    rows = max(1, -(-len(picks) // columns))
    pad, label = 6, _FONT_HEIGHT + 6
    sheet = Image.new(
        "RGB", (columns * (tile + pad) + pad, rows * (tile + label + pad) + pad), (0, 0, 0)
    )
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    keys = []
    for n, sample_id in enumerate(picks):
        sample = sources.read(sample_id)
        x = pad + (n % columns) * (tile + pad)
        y = pad + (n // columns) * (tile + label + pad)
        sheet.paste(_sample_tile(sample, tile), (x, y))
        draw.text((x, y + tile + 2), _caption(sample["__key__"], tile, draw, font), fill="white", font=font)  # fmt: skip
        keys.append(sample["__key__"])
    with atomic_open(path) as f:
        sheet.save(f, format="PNG")
    return keys
