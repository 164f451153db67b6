"""Pre-decoded image cache: resized uint8 arrays in a memory-mapped file, read with no decoding.

Decoding JPEGs dominates the cost of feeding an image model. When the same images are read for
many epochs (evaluation sets, small fine-tuning sets) it pays to decode them once: `ImageCache`
stores every image of a `ShardSet` as uint8 [size, size, 3] — the shorter side resized to
`size`, then the centred square — in one flat file on local disk, opened with `numpy.memmap`.
Reading a sample is then a page-cache lookup; the OS shares the pages between all DataLoader
workers.

Folder layout (`cache_dir/images-<size>px-<fingerprint>/`):

    images.u8    uint8 [samples, size, size, 3], row = the sample's flat id in the ShardSet
    keys.npy     sample keys, sorted (looked up by binary search), and rows.npy their rows
    index.json   version, size, shape, fingerprint, shard paths, rows that failed to decode

The fingerprint covers the shards' names, sample counts, byte sizes and modification times, and
the cache geometry: rewriting, adding or removing a shard gives a new fingerprint, so a stale
cache is never read; the stale entry of the same shards is deleted when the new one is built.
A cache is built once, under a temporary name renamed into place when complete (two ranks
building at once both succeed; one result is kept). Its size is computed before anything is
written and the build is refused above `max_bytes`.

`CachedDecoder` wraps a `SampleDecoder`: image towers read the cache, the other towers decode
as usual, and the tower's own transform runs on the cached array. For evaluation with
`size == image_size` the tensors equal the uncached ones exactly: the cache stores what the eval
transform computes before normalising (same reduced-size decode, same bicubic resize of the same
centred square), and resizing a size x size array to size x size is the identity. A training
cache should keep some slack (e.g. `size = round(1.15 * image_size)`): random crops are then
drawn from the cached centre square instead of the whole image — the only difference.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmtrain.atomic import atomic_write_text, fsync_dir
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.storage.tar_index import ShardIndex
from mmtrain.data.stream.media import DEFAULT_MAX_PIXELS, MediaError, decode_image
from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS, SampleDecoder, centre_square_box

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_VERSION",
    "DEFAULT_MAX_BYTES",
    "CacheLimitError",
    "ImageCache",
    "CachedDecoder",
    "cache_fingerprint",
    "resize_centre_square",
]

CACHE_VERSION = 1
DEFAULT_MAX_BYTES = 32 << 30  # 32 GiB: ~200k images at 224 px
_IMAGES, _KEYS, _ROWS, _INDEX = "images.u8", "keys.npy", "rows.npy", "index.json"


class CacheLimitError(ValueError):
    """The cache would exceed its size limit or the free disk space (the message says both)."""


def cache_fingerprint(sources: ShardSet, size: int) -> str:
    """Which data and geometry a cache holds: 16 hex digits.

    Covers each shard's name, sample count, byte size and modification time (a shard rewritten
    with the same name changes at least its mtime), the cached size and the cache format.
    """
    digest = hashlib.sha256(f"mmtrain-image-cache v{CACHE_VERSION} size {size}\n".encode())
    for shard in sources.shards:
        stat = shard.path.stat()
        digest.update(f"{shard.name}\0{len(shard)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def resize_centre_square(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [size, size, 3]: the centred square, bicubic-resized.

    The exact operation the eval `ImageTransform` applies before normalising, so a cached eval
    image gives the same tensor as decoding it again.
    """
    box = centre_square_box(image.shape[0], image.shape[1])
    out = Image.fromarray(image).resize((size, size), Image.Resampling.BICUBIC, box=box)
    return np.asarray(out)


def _image_member(sample: dict[str, Any]) -> bytes:
    ext = next((e for e in MODALITY_EXTENSIONS["image"] if e in sample), None)
    if ext is None:
        present = ", ".join(sorted(k for k in sample if k != "__key__"))
        raise MediaError(f"no image member (has {present})")
    return sample[ext]


class ImageCache:
    """Resized uint8 images of one ShardSet in a memory-mapped file, looked up by sample key.

    Use `ImageCache.build(...)` (opens an existing up-to-date cache or builds one) or
    `ImageCache.open(...)` (an existing one, or None). Picklable: DataLoader workers get the
    folder path and map the file themselves, they never receive a copy of the pixels.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = json.loads((self.folder / _INDEX).read_text())
        if index.get("version") != CACHE_VERSION:
            raise ValueError(
                f"{self.folder}: cache format {index.get('version')!r}, this mmtrain reads "
                f"{CACHE_VERSION}; delete the folder to rebuild it"
            )
        self.size = int(index["size"])
        self.count = int(index["count"])
        self.fingerprint = str(index["fingerprint"])
        self.shards = list(index["shards"])
        self.failed = {int(row): reason for row, reason in index["failed"].items()}
        self._keys = np.load(self.folder / _KEYS, allow_pickle=False)
        self._rows = np.load(self.folder / _ROWS, allow_pickle=False)
        self._images: np.ndarray | None = None  # mapped on first use, in each process

    # ------------------------------------------------------------------ building
    @classmethod
    def folder_for(cls, cache_dir: str | Path, sources: ShardSet, size: int) -> Path:
        return Path(cache_dir) / f"images-{size}px-{cache_fingerprint(sources, size)}"

    @classmethod
    def open(cls, cache_dir: str | Path, sources: ShardSet, size: int) -> ImageCache | None:
        """The cache of `sources` at `size` in `cache_dir` if it exists and is current."""
        folder = cls.folder_for(cache_dir, sources, size)
        return cls(folder) if (folder / _INDEX).is_file() else None

    @classmethod
    def build(
        cls,
        sources: ShardSet,
        cache_dir: str | Path,
        size: int,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        workers: int | None = None,
    ) -> ImageCache:
        """The cache of `sources` at `size`: reused when current, else built (atomically).

        Raises CacheLimitError before writing anything when `samples x size x size x 3` bytes
        exceed `max_bytes` or the free space of `cache_dir`, and ValueError when sample keys
        are not unique (the cache is looked up by key). Images that fail to decode are recorded
        and raise their MediaError when read, as they would without the cache.
        """
        if size < 1:
            raise ValueError(f"cache size must be positive, got {size}")
        existing = cls.open(cache_dir, sources, size)
        if existing is not None:
            logger.info("image cache %s is current: reused", existing.folder)
            return existing
        count = len(sources)
        if count == 0:
            raise ValueError("no samples to cache: the shards are empty")
        needed = count * size * size * 3
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        _check_space(cache_dir, needed, max_bytes, count, size)
        keys = np.array([k for shard in sources.shards for k in shard.keys], dtype=str)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        duplicate = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
        if len(duplicate):
            raise ValueError(
                f"sample key {str(sorted_keys[duplicate[0]])!r} occurs more than once in the shards; "
                "the image cache looks samples up by key, so keys must be unique"
            )
        folder = cls.folder_for(cache_dir, sources, size)
        tmp = cache_dir / f".{folder.name}.tmp.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            failed = _fill(tmp / _IMAGES, sources, size, max_pixels, workers)
            np.save(tmp / _KEYS, sorted_keys, allow_pickle=False)
            np.save(tmp / _ROWS, order.astype(np.int64), allow_pickle=False)
            index = {
                "version": CACHE_VERSION,
                "size": size,
                "count": count,
                "shape": [count, size, size, 3],
                "dtype": "uint8",
                "bytes": needed,
                "fingerprint": folder.name.rsplit("-", 1)[-1],
                "shards": [str(s.path.resolve()) for s in sources.shards],
                "failed": {str(row): reason for row, reason in sorted(failed.items())},
            }
            atomic_write_text(tmp / _INDEX, json.dumps(index, indent=1) + "\n")
            fsync_dir(tmp)
            try:
                os.rename(tmp, folder)
            except OSError:  # another process finished the same cache first: keep theirs
                if not (folder / _INDEX).is_file():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            fsync_dir(cache_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _remove_stale(cache_dir, folder, index["shards"], size)
        if failed:
            logger.warning("image cache %s: %d image(s) failed to decode", folder, len(failed))
        return cls(folder)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self.count

    def row(self, key: str) -> int | None:
        """The row of sample `key`, or None when the cache does not hold it."""
        i = int(np.searchsorted(self._keys, key))
        if i < len(self._keys) and self._keys[i] == key:
            return int(self._rows[i])
        return None

    def image(self, row: int) -> np.ndarray:
        """uint8 [size, size, 3] of `row` (a read-only view of the mapped file).

        Raises MediaError with the original reason when that image failed to decode.
        """
        if row in self.failed:
            raise MediaError(self.failed[row])
        if self._images is None:
            self._images = np.memmap(
                self.folder / _IMAGES, dtype=np.uint8, mode="r", shape=(self.count, self.size, self.size, 3)
            )  # fmt: skip
        return self._images[row]

    def get(self, key: str) -> np.ndarray | None:
        """The cached image of sample `key`, or None when the cache does not hold it."""
        row = self.row(key)
        return None if row is None else self.image(row)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_images"] = None  # each process maps the file itself: pickling would copy it
        return state


def _check_space(cache_dir: Path, needed: int, max_bytes: int, count: int, size: int) -> None:
    what = f"{count:,} images at {size} x {size} x 3 need {needed / 2**30:,.2f} GiB"
    if needed > max_bytes:
        raise CacheLimitError(
            f"image cache in {cache_dir}: {what}, over the limit max_bytes = "
            f"{max_bytes / 2**30:,.2f} GiB; raise the limit, lower the size or cache fewer shards"
        )
    free = shutil.disk_usage(cache_dir).free
    if needed > free:
        raise CacheLimitError(
            f"image cache in {cache_dir}: {what}, but the disk has only {free / 2**30:,.2f} GiB free"
        )


def _fill(
    path: Path, sources: ShardSet, size: int, max_pixels: int, workers: int | None
) -> dict[int, str]:
    """Decode every image of `sources` into the new file at `path`; {row: reason} of failures."""
    array = np.memmap(path, dtype=np.uint8, mode="w+", shape=(len(sources), size, size, 3))
    failed: dict[int, str] = {}

    def fill_shard(number: int) -> dict[int, str]:
        shard: ShardIndex = sources.shards[number]
        first = int(sources.starts[number])
        errors = {}
        fd = os.open(shard.path, os.O_RDONLY)  # one descriptor per thread: no shared state
        try:
            for i in range(len(shard)):
                try:
                    data = _image_member(shard.read(i, fd))
                    image = decode_image(data, max_pixels=max_pixels, draft_size=size)
                    array[first + i] = resize_centre_square(image, size)
                except MediaError as err:
                    errors[first + i] = str(err)
        finally:
            os.close(fd)
        return errors

    threads = max(1, min(workers or os.cpu_count() or 1, len(sources.shards) or 1))
    with ThreadPoolExecutor(threads) as pool:  # Pillow releases the GIL while decoding
        for errors in pool.map(fill_shard, range(len(sources.shards))):
            failed.update(errors)
    array.flush()
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return failed


def _remove_stale(cache_dir: Path, current: Path, shards: list[str], size: int) -> None:
    """Delete caches of the same shard files at the same size built from older data."""
    for folder in cache_dir.glob(f"images-{size}px-*"):
        if folder == current or not (folder / _INDEX).is_file():
            continue
        try:
            old = json.loads((folder / _INDEX).read_text())
        except (OSError, ValueError):
            continue
        if old.get("shards") == shards:
            logger.info("removing stale image cache %s (the shards changed)", folder)
            shutil.rmtree(folder, ignore_errors=True)


class CachedDecoder:
    """A `SampleDecoder` whose image towers read pre-decoded images from `ImageCache`s.

    Usable wherever a loader takes `decode(sample, rng)`. A sample the caches do not hold
    (another source, a key added later) is decoded from its bytes as usual. Other towers
    (text, audio, ...) always go through the wrapped decoder. Randomness is drawn in the same
    order as `SampleDecoder`, so an uncached sample gets the same crop either way.
    """

    def __init__(self, decoder: SampleDecoder, caches: ImageCache | Sequence[ImageCache]):
        self.decoder = decoder
        self.caches = [caches] if isinstance(caches, ImageCache) else list(caches)
        self.image_towers = [n for n, t in decoder.spec.towers.items() if t.modality == "image"]
        if not self.image_towers:
            raise ValueError("the model has no image tower: an image cache would not be read")
        for name in self.image_towers:
            if decoder.spec.towers[name].stem.channels != 3:
                raise ValueError(f"tower {name!r}: the image cache holds RGB images only")

    def _cached(self, key: str) -> np.ndarray | None:
        for cache in self.caches:
            row = cache.row(key)
            if row is not None:
                return cache.image(row)
        return None

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        image = self._cached(sample["__key__"])
        out = {}
        for name in self.decoder.spec.towers:
            if image is not None and name in self.image_towers:
                transform = self.decoder.transforms[name]
                if not transform.train and image.shape[0] == transform.size:
                    # Eval at the cached size: the crop-and-resize is the identity, only the
                    # normalisation is left (the same arithmetic, bit for bit).
                    out[name] = transform.normalise(image)
                else:
                    out[name] = transform(np.asarray(image), rng)
            else:
                out[name] = self.decoder.decode_tower(name, sample, rng)
        return out
