"""Pre-decoded image cache: same eval tensors as decoding, reuse, invalidation, size limit."""

import io
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.decoded_cache import (
    CachedDecoder,
    CacheLimitError,
    ImageCache,
    resize_centre_square,
)
from mmtrain.data.stream.loader import StreamingLoader
from mmtrain.data.stream.media import MediaError, decode_image
from mmtrain.data.stream.transforms import SampleDecoder
from mmtrain.spec import load_spec

SIZES = [(200, 150), (90, 130), (64, 64), (300, 120), (150, 200), (77, 99)]


def jpeg(width, height, seed):
    """A smooth random picture (JPEG-friendly, so reduced-size decoding really kicks in)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def make_images(folder, seed=0, corrupt=(), keys=None):
    keys = keys or [f"img{i:03d}" for i in range(len(SIZES))]
    with ShardWriter(folder, max_samples=4) as writer:
        for i, ((w, h), key) in enumerate(zip(SIZES, keys, strict=True)):
            data = jpeg(w, h, seed * 100 + i)
            if i in corrupt:
                data = data[: len(data) // 3]
            writer.write({"__key__": key, "jpg": data, "txt": f"picture {i}"})
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return ShardSet.open(folder)


def test_cached_eval_decoding_equals_decoding(tmp_path):
    sources = make_images(tmp_path / "data")
    spec = load_spec("tiny-clip")
    cache = ImageCache.build(sources, tmp_path / "cache", spec.towers["image"].stem.image_size)
    plain = SampleDecoder(spec, train=False)
    cached = CachedDecoder(plain, cache)
    rng = np.random.default_rng(0)
    for i in range(len(sources)):
        sample = sources.read(i)
        expected, got = plain(sample, rng), cached(sample, rng)
        assert set(got) == {"image", "text"}
        assert torch.equal(expected["image"], got["image"]), sample["__key__"]
        assert torch.equal(expected["text"], got["text"])
    # Through the loader (workers get a pickled cache that maps the file itself).
    batches = [
        list(StreamingLoader(sources, decode, 3, seed=1, num_workers=workers))
        for decode, workers in ((plain, 0), (cached, 1))
    ]
    for a, b in zip(*batches, strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["text"], b["text"])
    assert len(pickle.dumps(cache)) < 64 * 64 * 3  # the pixels are not copied


def test_training_cache_crops_from_the_cached_square(tmp_path):
    sources = make_images(tmp_path / "data")
    spec = load_spec("tiny-clip")
    cache = ImageCache.build(sources, tmp_path / "cache", 74)  # 15% slack for random crops
    decode = CachedDecoder(SampleDecoder(spec, train=True), cache)
    sample = sources.read(0)
    out = decode(sample, np.random.default_rng(5))["image"]
    assert out.shape == (3, 64, 64) and out.dtype == torch.float32
    assert torch.equal(out, decode(sample, np.random.default_rng(5))["image"])
    assert not torch.equal(out, decode(sample, np.random.default_rng(6))["image"])


def test_cache_is_reused_and_invalidated_when_the_data_changes(tmp_path):
    data, cache_dir = tmp_path / "data", tmp_path / "cache"
    sources = make_images(data, seed=0)
    first = ImageCache.build(sources, cache_dir, 32)
    inode = os.stat(first.folder / "images.u8").st_ino
    again = ImageCache.build(ShardSet.open(data), cache_dir, 32)
    assert again.folder == first.folder
    assert os.stat(again.folder / "images.u8").st_ino == inode  # not rebuilt
    assert ImageCache.open(cache_dir, ShardSet.open(data), 48) is None  # other size: not built

    # Rewrite the shards with other pictures under the same names and keys.
    for shard in data.glob("*.tar"):
        shard.unlink()
    changed = make_images(data, seed=1)
    assert ImageCache.open(cache_dir, changed, 32) is None  # the old cache is not served
    rebuilt = ImageCache.build(changed, cache_dir, 32)
    assert rebuilt.folder != first.folder and not first.folder.exists()  # stale one removed
    sample = changed.read(2)
    expected = resize_centre_square(decode_image(sample["jpg"], draft_size=32), 32)
    assert np.array_equal(rebuilt.get(sample["__key__"]), expected)
    assert rebuilt.get("no-such-key") is None


def test_cache_refuses_to_exceed_its_size_limit(tmp_path):
    sources = make_images(tmp_path / "data")
    needed = len(SIZES) * 64 * 64 * 3
    with pytest.raises(CacheLimitError, match=r"over the limit max_bytes = 0\.00 GiB"):
        ImageCache.build(sources, tmp_path / "cache", 64, max_bytes=needed - 1)
    assert list((tmp_path / "cache").iterdir()) == []  # nothing written
    assert len(ImageCache.build(sources, tmp_path / "cache", 64, max_bytes=needed)) == len(SIZES)


def test_corrupt_images_fail_the_same_way_from_the_cache(tmp_path, caplog):
    sources = make_images(tmp_path / "data", corrupt=(1,))
    spec = load_spec("tiny-clip")
    cache = ImageCache.build(sources, tmp_path / "cache", 64)
    assert list(cache.failed) == [1]
    plain = SampleDecoder(spec, train=False)
    sample = sources.read(1)
    with pytest.raises(MediaError) as uncached:
        plain(sample, np.random.default_rng(0))
    with pytest.raises(MediaError) as from_cache:
        CachedDecoder(plain, cache)(sample, np.random.default_rng(0))
    assert str(from_cache.value) == str(uncached.value)
    keys = [k for b in StreamingLoader(sources, CachedDecoder(plain, cache), 5, with_keys=True) for k in b["__key__"]]  # fmt: skip
    assert "img001" not in keys and len(set(keys)) == len(SIZES) - 1


def test_cache_needs_unique_keys_and_falls_back_to_decoding(tmp_path):
    sources = make_images(tmp_path / "dup", keys=["a", "b", "c", "a", "e", "f"])
    with pytest.raises(ValueError, match="'a' occurs more than once"):
        ImageCache.build(sources, tmp_path / "cache", 32)
    # A sample missing from the cache (another source mixed in) is decoded from its bytes.
    spec = load_spec("tiny-clip")
    cache = ImageCache.build(make_images(tmp_path / "one"), tmp_path / "cache", 64)
    other = {"__key__": "elsewhere", "jpg": jpeg(120, 90, 7), "txt": b"x"}
    plain = SampleDecoder(spec, train=False)
    got = CachedDecoder(plain, cache)(other, np.random.default_rng(0))
    assert torch.equal(got["image"], plain(other, np.random.default_rng(0))["image"])
