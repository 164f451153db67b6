"""Shape buckets: the rule that puts a sample in a bucket, the bucketed order, the loader's
batches of one shape that resume exactly, and a DiT trained on images of several aspects."""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmtrain.cli import main
from mmtrain.config import config_from_dict
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.buckets import NO_BUCKET, Buckets, centre_box, probe_size
from mmtrain.data.stream.denoiser_inputs import DenoiserDecoder
from mmtrain.data.stream.loader import StreamingLoader, merge_rank_states
from mmtrain.data.stream.media import MediaError, encode_video
from mmtrain.data.stream.order import bucketed_order
from mmtrain.data.stream.sample_sizes import bucket_ids, sample_sizes
from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train.loop import train

IMAGE = DenoiserSpec(sample_size=16, channels=3, patch_size=2, width=32, layers=1, heads=2)
VIDEO = DenoiserSpec(sample_size=16, channels=3, patch_size=2, width=32, layers=1, heads=2,
                     frames=4, temporal_patch=2, input="video")  # fmt: skip
LATENT = DenoiserSpec(sample_size=8, channels=4, patch_size=2, width=32, layers=1, heads=2,
                      input="latent")  # fmt: skip


def denoiser_model(denoiser: DenoiserSpec) -> ModelSpec:
    return ModelSpec.from_dict(
        {"name": "bucketed", "objective": "flow_matching", "denoiser": denoiser.to_dict()}
    )


# ----------------------------------------------------------------------------- the rule
def test_an_image_goes_to_the_bucket_of_the_nearest_aspect_ratio():
    buckets = Buckets.for_denoiser([[16, 16], [12, 20], [20, 12]], IMAGE)
    assert buckets.assign((100, 100)) == 0
    assert buckets.assign((90, 160)) == 1  # landscape 16:9 -> the widest bucket
    assert buckets.assign((160, 90)) == 2
    assert buckets.assign((100, 120)) == 0  # 1.2 is nearer 1 than 1.67 in log ratio
    assert Buckets.for_denoiser([[16, 16], [16, 16 + 2]], IMAGE).largest() == (16, 18)


def test_a_clip_goes_to_a_bucket_it_holds_the_frames_of():
    buckets = Buckets.for_denoiser([[4, 16, 16], [8, 16, 16], [8, 12, 20]], VIDEO, video_stride=2)
    # A window of 8 frames every 2nd source frame spans 15 source frames; of 4: 7.
    assert buckets.assign((15, 100, 100)) == 1  # the most frames among equal aspects
    assert buckets.assign((14, 100, 100)) == 0
    assert buckets.assign((30, 90, 160)) == 2
    assert buckets.assign((6, 100, 100)) == NO_BUCKET  # shorter than every window
    spread = Buckets.for_denoiser([[4, 16, 16], [8, 16, 16]], VIDEO)  # no stride: T frames
    assert spread.assign((5, 64, 64)) == 0 and spread.assign((8, 64, 64)) == 1


def test_a_latent_goes_to_the_bucket_equal_to_its_shape():
    buckets = Buckets.for_denoiser([[8, 8], [6, 10]], LATENT)
    assert buckets.assign((6, 10)) == 1 and buckets.assign((10, 6)) == NO_BUCKET


@pytest.mark.parametrize(
    "shapes, spec, match",
    [([], IMAGE, "at least one"), ([[16, 15]], IMAGE, "multiple of the patch"),
     ([[16, 16, 16]], IMAGE, r"\[height, width\]"), ([[3, 16, 16]], VIDEO, "multiple"),
     ([[16, 16], [16, 16]], IMAGE, "twice")],
)  # fmt: skip
def test_bad_buckets_are_refused_by_field(shapes, spec, match):
    with pytest.raises(FieldError, match=match):
        Buckets.for_denoiser(shapes, spec)


def test_the_centre_box_has_the_buckets_aspect_and_crops_the_least():
    assert centre_box(100, 200, (10, 10)) == (50.0, 0.0, 150.0, 100.0)
    left, top, right, bottom = centre_box(100, 200, (12, 20))  # wider than 20:12: the sides
    assert (top, bottom) == (0.0, 100.0) and math.isclose((right - left) / 100, 20 / 12)
    assert math.isclose(left, 200 - right)
    left, top, right, bottom = centre_box(200, 100, (12, 20))  # taller: top and bottom
    assert (left, right) == (0.0, 100.0) and math.isclose(top, 70) and math.isclose(bottom, 130)


# ----------------------------------------------------------------------------- the order
def test_the_bucketed_order_is_chunks_of_one_bucket_each_a_pure_function():
    rng = np.random.default_rng(0)
    bucket_of = rng.integers(-1, 3, 100)
    order = rng.permutation(100)
    out = bucketed_order(order, bucket_of, 8, seed=3, epoch=1)
    assert len(out) % 8 == 0
    chunks = out.reshape(-1, 8)
    assert all(len(set(bucket_of[c].tolist())) == 1 for c in chunks)
    assert (bucket_of[out] >= 0).all()
    placed = set(out.tolist())
    assert placed == set(np.flatnonzero(bucket_of >= 0).tolist())  # all, none in no bucket
    for b in range(3):  # a bucket's last chunk is topped up from its own samples
        assert (bucket_of[out] == b).sum() == -(-(bucket_of == b).sum() // 8) * 8
    assert np.array_equal(out, bucketed_order(order, bucket_of, 8, seed=3, epoch=1))
    assert not np.array_equal(out, bucketed_order(order, bucket_of, 8, seed=3, epoch=2))
    dropped = bucketed_order(order, bucket_of, 8, seed=3, epoch=1, drop_partial=True)
    assert len(dropped) == sum((bucket_of == b).sum() // 8 * 8 for b in range(3))
    assert len(set(dropped.tolist())) == len(dropped)  # nothing repeated when dropping


# ----------------------------------------------------------------------------- data
def _png(height: int, width: int, value: int) -> bytes:
    buffer = io.BytesIO()
    pixels = np.full((height, width, 3), value, np.uint8)
    pixels[:, : width // 2, 0] = 255  # a left half that a flip moves
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


SIZES = [(24, 24), (18, 30), (30, 18)]  # square, landscape, portrait


def aspect_shards(folder: Path, n: int = 40, broken: tuple[int, ...] = (), cut: int = 40) -> str:
    """Images of three aspects (by index), the aspect's number as the class; `broken` ones cut
    after `cut` bytes (negative: that many bytes short)."""
    with ShardWriter(folder, max_samples=16) as writer:
        for i in range(n):
            h, w = SIZES[i % 3]
            png = _png(h, w, 10 * (i % 20))[: cut if i in broken else None]
            writer.write({"__key__": f"s{i:04d}", "png": png, "cls": str(i % 3).encode()})
    return str(folder)


BUCKETS = [[16, 16], [12, 20], [20, 12]]


def _loader(shards, ids, rank=0, world=1, batch=4, seed=0):
    spec = denoiser_model(IMAGE)
    decode = DenoiserDecoder(spec, buckets=Buckets.for_denoiser(BUCKETS, IMAGE))
    return StreamingLoader(shards, decode, batch, seed=seed, rank=rank, world_size=world,
                           buckets=ids, with_keys=True, shuffle_window=8)  # fmt: skip


def test_sizes_are_read_from_headers_once_and_kept_beside_the_shards(tmp_path):
    shards = ShardSet.open(aspect_shards(tmp_path / "d", n=9, broken=(4,)))
    sizes = sample_sizes(shards, "image")
    assert sizes.tolist()[:4] == [[24, 24], [18, 30], [30, 18], [24, 24]]
    assert sizes[4].tolist() == [-1, -1]  # the truncated PNG: in no bucket
    kept = list((tmp_path / "d").glob(".sample-sizes-image-*.npy"))
    assert len(kept) == 1 and np.array_equal(np.load(kept[0]), sizes)
    ids, counts = bucket_ids([shards], Buckets.for_denoiser(BUCKETS, IMAGE))
    assert counts == Counter({0: 3, 1: 2, 2: 3, NO_BUCKET: 1})
    assert probe_size(shards.read(1), "image") == (18, 30)


def test_each_step_is_one_buckets_shape_on_every_rank_and_resumes_exactly(tmp_path):
    shards = ShardSet.open(aspect_shards(tmp_path / "d"))
    ids, _ = bucket_ids([shards], Buckets.for_denoiser(BUCKETS, IMAGE))
    ranks = [_loader(shards, ids, r, 2, batch=2) for r in range(2)]
    steps = list(zip(*(iter(loader) for loader in ranks), strict=True))
    assert len(steps) == len(ranks[0]) > 0
    shapes = Counter()
    for a, b in steps:
        assert a["image"].shape == b["image"].shape  # one bucket a step, on every rank
        shapes[tuple(a["image"].shape[2:])] += 1
        expected = {(16, 16): 0, (12, 20): 1, (20, 12): 2}[tuple(a["image"].shape[2:])]
        assert all(int(k[1:]) % 3 == expected for k in a["__key__"] + b["__key__"])
    assert set(shapes) == {(16, 16), (12, 20), (20, 12)}
    # Stopped after 3 steps, resumed on 1 rank of 4 samples (the same samples a step).
    stopped = [_loader(shards, ids, r, 2, batch=2) for r in range(2)]
    for loader in stopped:
        for _, _ in zip(range(3), loader, strict=False):
            pass
    state = merge_rank_states([loader.rank_state() for loader in stopped])
    one = _loader(shards, ids, 0, 1, batch=4)
    one.load_state_dict(state)
    rest = [batch["__key__"] for _, batch in zip(range(len(steps) - 3), one, strict=False)]
    assert [sorted(k) for k in rest] == [sorted(a["__key__"] + b["__key__"]) for a, b in steps[3:]]
    other = _loader(shards, ids, 0, 1, batch=2)
    with pytest.raises(ValueError, match="same samples a step"):
        other.load_state_dict(state)


class FailsOn:
    """A decoder that fails on one key, as a sample that passes its header and then does not
    decode: the loader skips it inside its bucket's batch."""

    def __init__(self, decode, key):
        self.decode, self.key = decode, key

    def __call__(self, sample, rng):
        if sample["__key__"] == self.key:
            raise MediaError("planted")
        return self.decode(sample, rng)


def test_a_corrupt_sample_makes_its_batch_smaller_not_mixed(tmp_path):
    shards = ShardSet.open(aspect_shards(tmp_path / "d", n=24))
    ids, _ = bucket_ids([shards], Buckets.for_denoiser(BUCKETS, IMAGE))
    loader = _loader(shards, ids, batch=4)
    loader.decode = FailsOn(loader.decode, "s0007")
    sizes = [len(batch["__key__"]) for batch in loader]
    skipped = sum(loader.corrupt_counts.values())
    assert skipped >= 1 and sizes.count(3) == skipped and sizes.count(4) == len(sizes) - skipped


def test_the_decoder_covers_the_bucket_and_flips_in_training(tmp_path):
    spec = denoiser_model(IMAGE)
    buckets = Buckets.for_denoiser(BUCKETS, IMAGE)
    sample = {"__key__": "a", "png": _png(18, 30, 0)}
    plain = DenoiserDecoder(spec, buckets=buckets, train=False)(sample, np.random.default_rng(0))
    assert plain["image"].shape == (3, 12, 20)
    assert plain["image"][0, :, :8].min() > 0.9 and plain["image"][0, :, 12:].max() < -0.9
    flips = [DenoiserDecoder(spec, buckets=buckets)(sample, np.random.default_rng(s))["image"]
             for s in range(8)]  # fmt: skip
    assert any(torch.equal(f, plain["image"].flip(-1)) for f in flips)
    assert any(torch.equal(f, plain["image"]) for f in flips)


def test_a_clip_decodes_at_its_buckets_frames_and_shape():
    spec = denoiser_model(VIDEO)
    frames = np.zeros((12, 36, 60, 3), np.uint8)
    frames[:, :, :, 1] = np.arange(12, dtype=np.uint8)[:, None, None] * 20
    sample = {"__key__": "c", "mp4": encode_video(frames, fps=8)}
    assert probe_size(sample, "video") == (12, 36, 60)
    buckets = Buckets.for_denoiser([[4, 16, 16], [8, 12, 20]], VIDEO, video_stride=1)
    decoder = DenoiserDecoder(spec, buckets=buckets, video_stride=1, train=False)
    clip = decoder(sample, np.random.default_rng(0))["video"]
    assert clip.shape == (3, 8, 12, 20)  # [C, T, H, W]: 8 frames of the landscape bucket
    green = clip[1].mean(dim=(1, 2))
    assert (green[1:] > green[:-1]).all()  # consecutive frames, in order


# ----------------------------------------------------------------------------- training
def test_a_dit_trains_on_aspect_buckets_and_resumes_bitwise(tmp_path):
    shards = aspect_shards(tmp_path / "data", n=36)
    spec = denoiser_model(DenoiserSpec(**{**IMAGE.to_dict(), "num_classes": 3}))
    spec_file = tmp_path / "spec.yaml"
    spec.save(spec_file)

    def config(out):
        return config_from_dict({
            "model": str(spec_file),
            "data": {"train": shards, "shuffle_window": 8, "buckets": BUCKETS},
            "train": {"steps": 6, "batch_size": 4, "lr": 1e-3, "warmup_steps": 1, "ema": 0.9},
            "checkpoint": {"every_steps": 2, "keep": 3},
            "metrics": {"tensorboard": False, "peak_tflops": 1.0},  # an MFU on the CPU
            "out": str(out),
        })  # fmt: skip

    whole = train(config(tmp_path / "whole"))
    assert whole.step == 6 and all(math.isfinite(r["loss"]) for r in whole.history)
    # MFU counts each step's FLOPs at its bucket's shape (3 x forward: all of it trains)
    per_shape = {3 * spec.denoiser.forward_flops(shape) for shape in BUCKETS}
    counted = [r["mfu"] * r["step_s"] * 1e12 / 4 for r in whole.history]
    assert all(min(abs(c / f - 1) for f in per_shape) < 1e-9 for c in counted)
    assert len({round(c) for c in counted}) > 1  # not one shape's count for every step
    # and samples at a bucket's shape
    argv = ["generate", str(tmp_path / "whole"), "--class", "1", "--num", "2", "--steps", "2"]
    assert main([*argv, "--size", "12x20", "--out", str(tmp_path / "wide")]) == 0
    assert Image.open(tmp_path / "wide" / "class1_0.png").size == (20, 12)
    assert main([*argv, "--size", "13x20", "--out", str(tmp_path / "odd")]) == 2
    assert not (tmp_path / "odd").exists()
    stopped = config(tmp_path / "stopped")
    train(stopped, halt_after_step=3)
    resumed = train(stopped)
    assert resumed.resumed_from == 2
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("whole", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_data_order_lists_the_keys_the_bucketed_loader_reads(tmp_path, capsys):
    folder = aspect_shards(tmp_path / "d", n=20)
    shards = ShardSet.open(folder)
    ids, _ = bucket_ids([shards], Buckets.for_denoiser(BUCKETS, IMAGE))
    read = [k for batch in _loader(shards, ids, rank=1, world=2, batch=2) for k in batch["__key__"]]
    args = ["data", "order", folder, "--seed", "0", "--epoch", "0", "--world-size", "2"]
    args += ["--rank", "1", "--batch-size", "2", "--shuffle-window", "8"]
    assert main([*args, "--buckets", "16x16,12x20,20x12"]) == 0
    assert capsys.readouterr().out.split() == read
    assert main([*args, "--buckets", "4x4", "--bucket-input", "latent"]) == 2  # none has one
    assert "no sample falls in any bucket" in capsys.readouterr().err


def test_encode_latents_at_buckets_gives_latents_a_latent_bucket_takes(tmp_path, capsys):
    diffusers = pytest.importorskip("diffusers")
    from test_convert_diffusers import VAE_CONFIG  # a 2x VAE

    torch.manual_seed(0)
    diffusers.AutoencoderKL(**VAE_CONFIG).save_pretrained(tmp_path / "vae")
    images = aspect_shards(tmp_path / "images", n=9, broken=(4,))
    out = tmp_path / "latents"
    argv = ["data", "encode-latents", images, "--vae", str(tmp_path / "vae"), "--out", str(out),
            "--batch-size", "2"]  # fmt: skip
    assert main([*argv, "--buckets", "16x16,12x20,20x12"]) == 0
    assert "data.buckets: [[8, 8], [6, 10], [10, 6]]" in capsys.readouterr().out
    shards = ShardSet.open(str(out))
    shapes = {shards.key(i): probe_size(shards.read(i), "latent") for i in range(len(shards))}
    want = {"s0000": (8, 8), "s0001": (6, 10), "s0002": (10, 6)}  # each image's own aspect
    assert len(shapes) == 8 and all(shapes[k] == v for k, v in want.items())  # s0004 is broken
    latent = Buckets.for_denoiser([[8, 8], [6, 10], [10, 6]], LATENT)
    ids, counts = bucket_ids([shards], latent)
    assert NO_BUCKET not in counts and sorted(counts.values()) == [2, 3, 3]
    manifest = json.loads((out / "manifest.json").read_text())["latent"]["buckets"]
    assert [b["samples"] for b in manifest] == [3, 2, 3]  # s0004 of the wide ones is broken
    assert main([*argv, "--buckets", "16x15"]) == 2  # not a multiple of the VAE's 2x
    assert "--buckets: sides must be positive multiples of the VAE's 2x" in capsys.readouterr().err
