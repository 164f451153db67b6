"""Sample filters for `mmtrain data build`: each one is switched by a setting and counted.

Two kinds:
- per-sample checks (resolution and aspect, blur, caption length, short video, silent audio,
  relevance below a threshold) look at one sample's `Features` only, so ingest workers can run
  the expensive measurements (`phash`, `laplacian_variance`, `rms_dbfs`) in parallel;
- order-dependent checks (exact and near duplicates) remember what was kept before, so they run
  in the main process in source order: the first of a group of duplicates is the one kept,
  whatever the number of workers.

`FilterChain.admit` applies both in a fixed order and counts what each filter removed; those counts
go into the manifest. The image-text relevance score (CLIP score, as DataComp filters with it)
comes from an mmtrain model folder through `RelevanceScorer`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:  # torch is imported only where a relevance model is used
    from mmtrain.data.stream.tokenizer import Tokenizer


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class FilterConfig:
    """Which filters run and their bounds; `None` (or False) switches a filter off."""

    exact_duplicates: bool = False
    near_duplicate_bits: int | None = None  # max Hamming distance between 64-bit pHashes
    min_side: int | None = None  # pixels, shorter image side
    max_aspect: float | None = None  # longer side / shorter side
    min_sharpness: float | None = None  # variance of the Laplacian of the grayscale image
    min_caption_chars: int | None = None
    max_caption_chars: int | None = None
    min_caption_words: int | None = None
    max_caption_words: int | None = None
    min_video_s: float | None = None
    min_audio_dbfs: float | None = None  # RMS level below which audio counts as silent
    relevance_threshold: float | None = None  # CLIP score (100 * cos, floored at 0)
    relevance_top_fraction: float | None = None  # keep this fraction with the best scores

    def __post_init__(self) -> None:
        if self.near_duplicate_bits is not None and not 0 <= self.near_duplicate_bits < 64:
            raise ValueError(
                f"near_duplicate_bits must be in 0..63, got {self.near_duplicate_bits}"
            )
        if self.relevance_top_fraction is not None and not 0 < self.relevance_top_fraction <= 1:
            raise ValueError(
                f"relevance_top_fraction must be in (0, 1], got {self.relevance_top_fraction}"
            )
        if self.relevance_threshold is not None and self.relevance_top_fraction is not None:
            raise ValueError("use relevance_threshold or relevance_top_fraction, not both")

    def enabled(self) -> dict[str, Any]:
        """The settings that are switched on (what the manifest records)."""
        return {
            k: v for k, v in dataclasses.asdict(self).items() if v is not None and v is not False
        }

    @property
    def needs_relevance(self) -> bool:
        return self.relevance_threshold is not None or self.relevance_top_fraction is not None


@dataclass
class Features:
    """What the filters need to know about one sample, measured once by the ingest worker."""

    sha256: str = ""  # of the sample's source content, all modalities
    height: int | None = None
    width: int | None = None
    sharpness: float | None = None
    phash: int | None = None
    caption: str | None = None
    video_s: float | None = None
    audio_dbfs: float | None = None
    relevance: float | None = None


# ----------------------------------------------------------------------------- measurements
def grayscale(image: np.ndarray) -> np.ndarray:
    """float32 [H, W] luma (ITU-R 601 weights) of a uint8 [H, W, 3] or [H, W] image."""
    if image.ndim == 2:
        return image.astype(np.float32)
    rgb = image[..., :3].astype(np.float32)
    return rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)


def laplacian_variance(image: np.ndarray) -> float:
    """Variance of the 4-neighbour Laplacian of the grayscale image: low means blurry."""
    g = grayscale(image)
    if g.shape[0] < 3 or g.shape[1] < 3:
        return 0.0
    lap = g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:] - 4.0 * g[1:-1, 1:-1]
    return float(lap.var(dtype=np.float64))


def _dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II matrix: `m @ x` transforms the columns of x."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    m = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m


_DCT32 = _dct_matrix(32)


def phash(image: np.ndarray) -> int:
    """64-bit perceptual hash: the signs of the 8x8 lowest DCT frequencies of a 32x32 thumbnail
    against their median. Re-encoding, rescaling and mild colour changes move few bits."""
    gray = np.clip(grayscale(image), 0, 255).astype(np.uint8)
    thumb = Image.fromarray(gray).resize((32, 32), Image.Resampling.BOX)
    x = np.asarray(thumb, dtype=np.float64)
    low = (_DCT32 @ x @ _DCT32.T)[:8, :8].ravel()
    # The DC term measures brightness, not structure: leave it out of the median.
    bits = low > np.median(low[1:])
    return int.from_bytes(
        np.packbits(bits, bitorder="little").tobytes(), "little"
    )  # bit i = bits[i]


def hamming(a: int, b: int) -> int:
    """Number of differing bits between two hashes."""
    return (a ^ b).bit_count()


def rms_dbfs(wave: np.ndarray) -> float:
    """RMS level of a float waveform in dB relative to full scale (1.0); -inf for silence."""
    if wave.size == 0:
        return -math.inf
    rms = math.sqrt(float(np.mean(np.square(wave, dtype=np.float64))))
    return 20.0 * math.log10(rms) if rms > 0 else -math.inf


def clean_caption(text: str) -> str:
    """Unicode NFC with runs of whitespace collapsed to one space, ends stripped."""
    return " ".join(unicodedata.normalize("NFC", text).split())


# ----------------------------------------------------------------------------- per-sample checks
def resolution_reason(height: int, width: int, config: FilterConfig) -> str | None:
    short, long = min(height, width), max(height, width)
    if config.min_side is not None and short < config.min_side:
        return f"shorter side {short} px < {config.min_side}"
    if config.max_aspect is not None and long > config.max_aspect * max(short, 1):
        return f"aspect {long / max(short, 1):.2f} > {config.max_aspect}"
    return None


def caption_reason(caption: str, config: FilterConfig) -> str | None:
    chars, words = len(caption), len(caption.split())
    if config.min_caption_chars is not None and chars < config.min_caption_chars:
        return f"{chars} chars < {config.min_caption_chars}"
    if config.max_caption_chars is not None and chars > config.max_caption_chars:
        return f"{chars} chars > {config.max_caption_chars}"
    if config.min_caption_words is not None and words < config.min_caption_words:
        return f"{words} words < {config.min_caption_words}"
    if config.max_caption_words is not None and words > config.max_caption_words:
        return f"{words} words > {config.max_caption_words}"
    return None


def sample_reason(f: Features, config: FilterConfig) -> tuple[str, str] | None:
    """(filter name, detail) of the first per-sample filter that drops `f`, or None to keep it.

    A filter only looks at the modalities the sample has: a caption filter ignores a sample
    without text."""
    if f.height is not None and f.width is not None:
        reason = resolution_reason(f.height, f.width, config)
        if reason:
            return "resolution", reason
    if config.min_sharpness is not None and f.sharpness is not None:
        if f.sharpness < config.min_sharpness:
            return "blur", f"Laplacian variance {f.sharpness:.1f} < {config.min_sharpness}"
    if f.caption is not None:
        reason = caption_reason(f.caption, config)
        if reason:
            return "caption_length", reason
    if config.min_video_s is not None and f.video_s is not None:
        if f.video_s < config.min_video_s:
            return "short_video", f"{f.video_s:.2f} s < {config.min_video_s} s"
    if config.min_audio_dbfs is not None and f.audio_dbfs is not None:
        if f.audio_dbfs < config.min_audio_dbfs:
            return "silent_audio", f"RMS {f.audio_dbfs:.1f} dBFS < {config.min_audio_dbfs}"
    if config.relevance_threshold is not None and f.relevance is not None:
        if f.relevance < config.relevance_threshold:
            return "relevance", f"score {f.relevance:.2f} < {config.relevance_threshold}"
    return None


# ----------------------------------------------------------------------------- duplicates
class NearDuplicateIndex:
    """64-bit hashes searchable within a Hamming distance, without comparing against all.

    Multi-index hashing: the 64 bits are cut into `max_distance + 1` bands; two hashes within
    the distance agree exactly on at least one band (pigeonhole), so only hashes sharing a band
    value are compared."""

    def __init__(self, max_distance: int):
        self.max_distance = max_distance
        edges = np.linspace(0, 64, max_distance + 2).round().astype(int)
        self.bands = [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
        self.tables: list[dict[int, list[int]]] = [{} for _ in self.bands]

    def _keys(self, h: int) -> list[int]:
        return [(h >> lo) & ((1 << (hi - lo)) - 1) for lo, hi in self.bands]

    def find(self, h: int) -> int | None:
        """A stored hash within the distance of `h`, or None."""
        for table, key in zip(self.tables, self._keys(h), strict=True):
            for other in table.get(key, ()):
                if hamming(h, other) <= self.max_distance:
                    return other
        return None

    def add(self, h: int) -> None:
        for table, key in zip(self.tables, self._keys(h), strict=True):
            table.setdefault(key, []).append(h)


@dataclass
class FilterStats:
    """Counts for the manifest: samples seen, kept, and removed per filter."""

    seen: int = 0
    kept: int = 0
    removed: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "kept": self.kept, "removed": dict(sorted(self.removed.items()))}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FilterStats:
        return cls(data["seen"], data["kept"], Counter(data["removed"]))


class FilterChain:
    """All switched-on filters in a fixed order, with the memory duplicate checks need.

    Call `admit` in source order; it returns None for a kept sample, else (filter, detail)."""

    def __init__(self, config: FilterConfig):
        self.config = config
        self.stats = FilterStats()
        self._seen_sha256: set[str] = set()
        self._near = (
            NearDuplicateIndex(config.near_duplicate_bits)
            if config.near_duplicate_bits is not None
            else None
        )

    def admit(self, f: Features) -> tuple[str, str] | None:
        self.stats.seen += 1
        verdict = sample_reason(f, self.config)
        if verdict is None and self.config.exact_duplicates and f.sha256 in self._seen_sha256:
            verdict = ("exact_duplicate", f"sha256 {f.sha256[:16]}… seen before")
        if verdict is None and self._near is not None and f.phash is not None:
            match = self._near.find(f.phash)
            if match is not None:
                verdict = (
                    "near_duplicate",
                    f"pHash {f.phash:016x} within {hamming(f.phash, match)} bits of {match:016x}",
                )
        if verdict is not None:
            self.stats.removed[verdict[0]] += 1
            return verdict
        self.stats.kept += 1
        self.remember(f)
        return None

    def remember(self, f: Features) -> None:
        """Record a kept sample for the duplicate checks (also used to restore a resumed build)."""
        if self.config.exact_duplicates and f.sha256:
            self._seen_sha256.add(f.sha256)
        if self._near is not None and f.phash is not None:
            self._near.add(f.phash)


def top_fraction_cutoff(scores: Iterable[float], fraction: float) -> float:
    """The lowest score kept when keeping the best `fraction` of `scores` (DataComp's CLIP-score
    top-k%); ties at the cutoff are all kept."""
    values = sorted(scores, reverse=True)
    if not values:
        return -math.inf
    keep = max(1, math.ceil(fraction * len(values)))
    return values[keep - 1]


def content_sha256(parts: Sequence[tuple[str, bytes]]) -> str:
    """sha256 over (name, bytes) parts, length-prefixed so different splits cannot collide."""
    h = hashlib.sha256()
    for name, data in sorted(parts):
        h.update(f"{name}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


# ----------------------------------------------------------------------------- relevance
def center_square(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: shorter side resized to `size` (bicubic), then center-cropped."""
    pil = Image.fromarray(np.ascontiguousarray(image[..., :3]))
    w, h = pil.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    pil = pil.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(pil.crop((left, top, left + size, top + size)))


class RelevanceScorer:
    """Image-text CLIP score from an mmtrain model: 100 * cos(image, text), floored at 0.

    `tokenizer` must be the one the model was trained with (`mmtrain.data.stream.tokenizer`); the
    byte-level tokenizer is the default, right for models with its 258-id vocabulary."""

    def __init__(
        self,
        model: Any,
        device: str = "cpu",
        batch_size: int = 64,
        tokenizer: Tokenizer | None = None,
    ):
        self.model = model.eval().to(device)
        self.device = device
        self.batch_size = batch_size
        towers = model.spec.towers
        self.image_tower = _tower_of(towers, "image")
        self.text_tower = _tower_of(towers, "text")
        self.image_size = towers[self.image_tower].stem.image_size
        text_stem = towers[self.text_tower].stem
        self.context_length = text_stem.context_length
        if tokenizer is None:
            from mmtrain.data.stream.tokenizer import ByteTokenizer

            tokenizer = ByteTokenizer()
        self.tokenizer = tokenizer
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab is not None and vocab > text_stem.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} ids but text tower {self.text_tower!r} only "
                f"{text_stem.vocab_size}: pass the tokenizer the model was trained with"
            )

    def __call__(self, images: Sequence[np.ndarray], texts: Sequence[str]) -> np.ndarray:
        """float32 [N] scores of image i against caption i."""
        if len(images) != len(texts):
            raise ValueError(f"{len(images)} images but {len(texts)} captions")
        scores = [
            self._score_batch(images[i : i + self.batch_size], texts[i : i + self.batch_size])
            for i in range(0, len(images), self.batch_size)
        ]
        return np.concatenate(scores) if scores else np.zeros(0, dtype=np.float32)

    def _score_batch(self, images: Sequence[np.ndarray], texts: Sequence[str]) -> np.ndarray:
        import torch

        from mmtrain.data.stream.transforms import CLIP_MEAN, CLIP_STD
        from mmtrain.models.clip_score import clip_score

        pixels = np.stack([center_square(im, self.image_size) for im in images])
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div_(255.0)
        mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
        batch = {
            self.image_tower: ((x - mean) / std).to(self.device),
            self.text_tower: self.tokenizer(list(texts), self.context_length).to(self.device),
        }
        with torch.no_grad():
            emb = self.model.encode(batch)
        return clip_score(emb[self.image_tower], emb[self.text_tower]).float().cpu().numpy()


def _tower_of(towers: dict[str, Any], modality: str) -> str:
    names = [name for name, t in towers.items() if t.modality == modality]
    if not names:
        raise ValueError(
            f"the relevance model has no {modality} tower (towers: {', '.join(towers)})"
        )
    return names[0]


def relevance_scorer(
    model_dir: str | Path, device: str = "cpu", tokenizer: str = "byte", batch_size: int = 64
) -> RelevanceScorer:
    """A `RelevanceScorer` for the mmtrain model saved in `model_dir` (model.safetensors +
    spec.yaml, as `mmtrain.save_model` writes); `tokenizer` as `get_tokenizer` takes it."""
    import mmtrain
    from mmtrain.data.stream.tokenizer import get_tokenizer

    path = Path(model_dir)
    if not (path / "spec.yaml").is_file():
        raise FileNotFoundError(
            f"{path}: no spec.yaml; the relevance model must be a folder written by "
            "mmtrain.save_model or a training run"
        )
    return RelevanceScorer(
        mmtrain.load_model(path),
        device=device,
        batch_size=batch_size,
        tokenizer=get_tokenizer(tokenizer),
    )
