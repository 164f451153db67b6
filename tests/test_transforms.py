"""Transforms: shapes and dtypes per modality for tiny-multimodal, seeded determinism, eval
variants, and collate."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from mmtrain.data.stream.media import MediaError
from mmtrain.data.stream.tokenizer import ByteTokenizer
from mmtrain.data.stream.transforms import (
    CLIP_MEAN,
    CLIP_STD,
    AudioTransform,
    AugmentConfig,
    ImageTransform,
    SampleDecoder,
    TimeSeriesTransform,
    VideoTransform,
    collate,
    make_transform,
    make_transforms,
    random_resized_box,
)
from mmtrain.spec import load_spec
from mmtrain.structured import FieldError


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def gradient_image(height=60, width=80) -> np.ndarray:
    """Red ramps left to right, green top to bottom: any crop or flip changes the pixels."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack(
        [x * 255 // (width - 1), y * 255 // (height - 1), np.full_like(x, 90)], axis=-1
    ).astype(np.uint8)


def raw_inputs() -> dict[str, object]:
    generator = rng(0)
    return {
        "image": gradient_image(),
        "video": np.stack([gradient_image(36, 48)] * 6),
        "audio": generator.standard_normal(24_000).astype(np.float32),
        "timeseries": generator.standard_normal((3, 300)).astype(np.float32) * 5 + 2,
        "text": "a photo of a cat",
    }


EXPECTED = {
    "image": ((3, 32, 32), torch.float32),
    "video": ((4, 3, 32, 32), torch.float32),
    "audio": ((16_000,), torch.float32),
    "timeseries": ((3, 128), torch.float32),
    "text": ((32,), torch.int64),
}


@pytest.mark.parametrize("train", [True, False])
def test_tiny_multimodal_shapes_and_batch(train):
    transforms = make_transforms(load_spec("tiny-multimodal"), train=train)
    inputs = raw_inputs()
    samples = []
    for i in range(2):
        sample = {name: t(inputs[name], rng(i)) for name, t in transforms.items()}
        samples.append({**sample, "__key__": f"s{i}"})
    for name, (shape, dtype) in EXPECTED.items():
        assert samples[0][name].shape == shape and samples[0][name].dtype == dtype, name
    batch = collate(samples)
    assert batch["__key__"] == ["s0", "s1"]
    for name, (shape, dtype) in EXPECTED.items():
        assert batch[name].shape == (2, *shape) and batch[name].dtype == dtype
    text = batch["text"][0]
    assert text[0] == 256 and text[17] == 257 and (text[18:] == 0).all()


def test_same_seed_same_output_and_different_seeds_differ():
    transforms = make_transforms(
        load_spec("tiny-multimodal"), train=True, augment=AugmentConfig(scale=(0.5, 1.0), flip=True)
    )
    inputs = raw_inputs()
    for name in ("image", "video", "audio", "timeseries"):
        t = transforms[name]
        first, again = t(inputs[name], rng(7)), t(inputs[name], rng(7))
        assert torch.equal(first, again), name
        others = [t(inputs[name], rng(seed)) for seed in range(8, 12)]
        assert any(not torch.equal(first, other) for other in others), name


def test_training_transform_leaves_global_random_state_alone():
    np.random.seed(0)
    torch.manual_seed(0)
    before = (np.random.random(), torch.rand(1))
    np.random.seed(0)
    torch.manual_seed(0)
    ImageTransform(32, train=True, augment=AugmentConfig(flip=True))(gradient_image(), rng(3))
    assert (np.random.random(), torch.rand(1)) == before


def test_training_needs_a_generator_and_eval_does_not():
    with pytest.raises(ValueError, match="numpy Generator"):
        ImageTransform(32, train=True)(gradient_image())
    t = ImageTransform(32, train=False)
    assert torch.equal(t(gradient_image()), t(gradient_image(), rng(5)))


def test_image_eval_is_resize_shorter_side_and_centre_crop():
    image = gradient_image(60, 80)  # centred square: columns 10..70
    out = ImageTransform(30, train=False)(image)
    pixels = out.numpy().transpose(1, 2, 0) * np.array(CLIP_STD) + np.array(CLIP_MEAN)
    red = pixels[..., 0] * 255
    # Output column 0 samples source column ~10.5 of 80, not column 0: the sides were cropped.
    assert red[15, 0] == pytest.approx(10.5 * 255 / 79, abs=6)
    assert red[15, -1] == pytest.approx(68.5 * 255 / 79, abs=6)
    assert pixels[0, :, 1].mean() < 0.05 and pixels[-1, :, 1].mean() > 0.95  # full height kept
    assert pixels[..., 2] * 255 == pytest.approx(90, abs=1)


def test_image_flip_mirrors_and_normalises():
    image = gradient_image(40, 40)
    plain = ImageTransform(40, train=False)(image)
    flipping = ImageTransform(
        40, train=True, augment=AugmentConfig(scale=(1.0, 1.0), ratio=(1, 1), flip=True)
    )
    outputs = [flipping(image, rng(seed)) for seed in range(10)]
    assert any(torch.allclose(o, plain, atol=1e-5) for o in outputs)
    assert any(torch.allclose(o, plain.flip(-1), atol=1e-5) for o in outputs)
    grey = np.full((10, 10, 3), 128, np.uint8)
    value = ImageTransform(10, train=False)(grey)[:, 0, 0]
    assert value.tolist() == pytest.approx(
        [(128 / 255 - m) / s for m, s in zip(CLIP_MEAN, CLIP_STD, strict=True)], abs=1e-5
    )


def test_random_resized_box_stays_inside_and_respects_scale():
    generator = rng(0)
    for _ in range(200):
        left, top, right, bottom = random_resized_box(60, 80, generator, (0.5, 1.0), (3 / 4, 4 / 3))
        assert 0 <= left < right <= 80 and 0 <= top < bottom <= 60
        assert (right - left) * (bottom - top) >= 0.45 * 60 * 80
    # An extreme strip: no random shape fits, the fallback is the clamped centre crop.
    box = random_resized_box(10, 1000, rng(0), (0.9, 1.0), (3 / 4, 4 / 3))
    assert box == pytest.approx((500 - 20 / 3, 0, 500 + 20 / 3, 10))


def test_min_decode_size_covers_the_smallest_crop():
    assert ImageTransform(224, train=False).min_decode_size() == 224
    t = ImageTransform(224, train=True, augment=AugmentConfig(scale=(0.9, 1.0)))
    assert t.min_decode_size() == 273  # 224 / sqrt(0.9 * 3/4)


def test_video_uses_one_crop_for_all_frames_and_fixes_frame_count():
    frame = gradient_image(36, 48)
    clip = np.stack([frame] * 3)
    t = VideoTransform(16, frames=4, train=True, augment=AugmentConfig(scale=(0.3, 0.6), flip=True))
    out = t(clip, rng(1))
    assert out.shape == (4, 3, 16, 16)
    assert all(torch.equal(out[0], out[i]) for i in range(4))
    marked = np.stack([np.full((8, 8, 3), 10 * i, np.uint8) for i in range(8)])
    picked = VideoTransform(8, frames=4, train=False)(marked)
    means = (picked[:, 0].mean(dim=(1, 2)) * CLIP_STD[0] + CLIP_MEAN[0]) * 255
    assert means.round().tolist() == [10, 30, 50, 70]  # frames 1, 3, 5, 7: evenly spread


def test_audio_crop_and_pad():
    t_eval = AudioTransform(4, train=False)
    wave = np.arange(10, dtype=np.float32)
    assert t_eval(wave).tolist() == [3, 4, 5, 6]  # centred
    assert t_eval(np.array([1, 2], np.float32)).tolist() == [0, 1, 2, 0]
    t_train = AudioTransform(4, train=True)
    starts = {int(t_train(wave, rng(s))[0]) for s in range(40)}
    assert starts == set(range(7))  # every offset 0..6 is reachable
    padded = t_train(np.array([5.0], np.float32), rng(2))
    assert padded.sum() == 5 and (padded != 0).sum() == 1
    with pytest.raises(MediaError, match="mono"):
        t_eval(np.zeros((2, 10), np.float32))


def test_timeseries_window_and_standardisation():
    series = np.stack([np.arange(200.0), np.full(200, 7.0), np.sin(np.arange(200.0))]).astype(
        np.float32
    )
    out = TimeSeriesTransform(3, 64, train=False)(series)
    assert out.shape == (3, 64)
    assert out.mean(dim=1).abs().max() < 1e-5
    assert out[0].std(unbiased=False) == pytest.approx(1.0, abs=1e-4)
    assert (out[1] == 0).all()  # a constant channel standardises to zeros
    short = TimeSeriesTransform(3, 64, train=False)(series[:, :32])
    assert (short[:, :16] == 0).all() and (short[:, 48:] == 0).all()
    with pytest.raises(MediaError, match="4 channels; the stem expects 3"):
        TimeSeriesTransform(3, 64, train=False)(np.zeros((4, 64), np.float32))


def test_text_transform_checks_the_vocabulary():
    tower = load_spec("tiny-multimodal").towers["text"]
    text = make_transform(tower, train=True, tokenizer=ByteTokenizer())
    assert text("hi").tolist()[:4] == [256, ord("h"), ord("i"), 257]
    clip_sized = replace(tower, stem=replace(tower.stem, vocab_size=49408))
    with pytest.raises(FieldError, match="give a tokenizer"):
        make_transform(clip_sized, train=False)
    too_small = replace(tower, stem=replace(tower.stem, vocab_size=100))
    with pytest.raises(FieldError, match="vocab_size"):
        make_transform(too_small, train=False, tokenizer=ByteTokenizer())


def test_collate_errors_name_the_key():
    a = {"image": torch.zeros(3, 4, 4)}
    b = {"image": torch.zeros(3, 5, 5)}
    with pytest.raises(ValueError, match="'image'"):
        collate([a, b])
    with pytest.raises(ValueError, match="keys"):
        collate([a, {"text": torch.zeros(2)}])
    with pytest.raises(ValueError, match="empty"):
        collate([])


def encoded_sample() -> dict[str, object]:
    """One shard sample with a member per modality, encoded by the real libraries."""
    import io

    import av
    import soundfile
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(gradient_image(48, 64)).save(png, "PNG")
    mp4 = io.BytesIO()
    with av.open(mp4, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(6):
            pixels = np.full((48, 64, 3), 20 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    wav = io.BytesIO()
    soundfile.write(wav, rng(0).standard_normal(4000).astype(np.float32) * 0.1, 8000, format="WAV")
    npy = io.BytesIO()
    np.save(npy, rng(1).standard_normal((3, 200)))
    return {
        "__key__": "sample-0",
        "png": png.getvalue(),
        "mp4": mp4.getvalue(),
        "wav": wav.getvalue(),
        "npy": npy.getvalue(),
        "txt": b"a photo of a cat",
    }


def test_sample_decoder_feeds_every_tower():
    spec = load_spec("tiny-multimodal")
    sample = encoded_sample()
    decode = SampleDecoder(spec, train=True)
    out = decode(sample, rng(0))
    for name, (shape, dtype) in EXPECTED.items():
        assert out[name].shape == shape and out[name].dtype == dtype, name
    assert all(torch.equal(out[k], decode(sample, rng(0))[k]) for k in out)
    eval_out = SampleDecoder(spec, train=False)(sample, rng(0))
    assert (eval_out["audio"][:4000] == 0).all() and (eval_out["audio"][12000:] == 0).all()
    missing = {k: v for k, v in sample.items() if k != "wav"}
    with pytest.raises(MediaError, match="no audio member for tower 'audio'"):
        decode(missing, rng(0))
    with pytest.raises(MediaError, match="truncated WAV"):
        decode({**sample, "wav": sample["wav"][:100]}, rng(0))


# ----------------------------------------------------------------------------- reduced decoding
# Drafted (reduced-size) JPEG decoding against the full decode, on normalised pixels (CLIP
# mean/std, so 1.0 is ~70 grey levels): measured ~0.03 mean absolute error for 512 -> 224 crops
# of photo-like JPEGs, 0.008-0.014 here; a wrong crop (another seed's) gives ~0.3.
DRAFT_MEAN_ABS_ERROR = 0.06


def photo(width: int, height: int, fmt: str = "JPEG", seed: int = 0, exif=None) -> bytes:
    """Smooth colour fields plus fine texture, encoded: like a photo, not a flat test card."""
    import io

    from PIL import Image

    generator = rng(seed)
    coarse = Image.fromarray(generator.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    base = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), np.float32)
    pixels = np.clip(base + generator.normal(0, 8, (height, width, 1)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, quality=90, **({"exif": exif} if exif else {}))
    return out.getvalue()


def full_decode(transform: ImageTransform, data: bytes, seed: int) -> torch.Tensor:
    from mmtrain.data.stream.media import decode_image

    return transform(decode_image(data), rng(seed))


def test_draft_reduction_never_upsamples():
    from mmtrain.data.stream.media import draft_reduction

    ratios = (0.5, 1.99, 2.0, 3.9, 4.0, 7.99, 8.0, 50)
    assert [draft_reduction(r) for r in ratios] == [1, 1, 2, 2, 4, 4, 8, 8]


def test_decode_drafts_jpegs_when_the_crop_allows_and_stays_close():
    data = photo(256, 256)
    t = ImageTransform(64, train=True, augment=AugmentConfig(flip=True))
    for seed in range(6):
        box, _ = t.sample_params(256, 256, rng(seed))
        assert min(box[2] - box[0], box[3] - box[1]) >= 2 * 64  # every crop is drafted
        drafted, full = t.decode(data, rng(seed)), full_decode(t, data, seed)
        assert drafted.shape == (3, 64, 64)
        assert torch.equal(drafted, t.decode(data, rng(seed)))  # same rng, same tensor
        assert not torch.equal(drafted, full)  # really decoded at a reduced size ...
        assert (drafted - full).abs().mean() < DRAFT_MEAN_ABS_ERROR  # ... and the same crop
    outputs = [t.decode(data, rng(seed)) for seed in range(4)]
    assert any(not torch.equal(outputs[0], other) for other in outputs[1:])


def test_decode_follows_exif_orientation_when_drafting():
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: stored 320 x 160, shown 160 x 320
    data = photo(320, 160, exif=exif.tobytes())
    t = ImageTransform(48, train=True)
    for seed in range(3):
        drafted, full = t.decode(data, rng(seed)), full_decode(t, data, seed)
        assert not torch.equal(drafted, full)  # crops of >= 131 px for 48: decoded at 1/2
        assert (drafted - full).abs().mean() < DRAFT_MEAN_ABS_ERROR


def test_decode_without_reduction_is_the_full_decode_bit_for_bit():
    small = photo(120, 120)  # every crop is < 2 x 64 px: drafting would need upsampling
    png = photo(256, 256, fmt="PNG")  # not a JPEG: no reduced decoding
    for data in (small, png):
        for train in (True, False):
            t = ImageTransform(64, train=train, augment=AugmentConfig(flip=True))
            for seed in range(3):
                assert torch.equal(t.decode(data, rng(seed)), full_decode(t, data, seed))


def test_eval_decode_is_the_centre_square_of_the_draft_decode():
    from mmtrain.data.stream.media import decode_image

    data = photo(300, 260)  # 260 / 64 > 4: decoded at 1/4 (75 x 65), as the image cache does
    t = ImageTransform(64, train=False)
    assert torch.equal(t.decode(data), t(decode_image(data, draft_size=64)))
    assert (t.decode(data) - t(decode_image(data))).abs().mean() < DRAFT_MEAN_ABS_ERROR


def test_apply_normalises_exactly_like_the_float32_formula():
    image = gradient_image(50, 70)
    t = ImageTransform(32, train=False)
    box = (3.0, 2.0, 60.0, 48.0)
    from PIL import Image

    resized = np.asarray(
        Image.fromarray(image).resize((32, 32), Image.Resampling.BICUBIC, box=box), np.float32
    )
    mean = np.asarray(CLIP_MEAN, np.float32) * 255.0
    inv_std = 1.0 / (np.asarray(CLIP_STD, np.float32) * 255.0)
    expected = ((resized - mean) * inv_std).transpose(2, 0, 1)
    assert torch.equal(t.apply(image, box, False), torch.from_numpy(np.ascontiguousarray(expected)))
    flipped = torch.from_numpy(np.ascontiguousarray(expected[:, :, ::-1]))
    assert torch.equal(t.apply(image, box, True), flipped)
