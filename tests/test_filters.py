"""Filters: each measurement and check on small synthetic data, duplicates in order, relevance."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image, ImageFilter

from mmtrain.data.ingest.filters import (
    Features,
    FilterChain,
    FilterConfig,
    NearDuplicateIndex,
    clean_caption,
    content_sha256,
    hamming,
    laplacian_variance,
    phash,
    rms_dbfs,
    sample_reason,
    top_fraction_cutoff,
)


def textured(seed: int, size: int = 96) -> np.ndarray:
    """A smooth random picture (low-frequency structure, as photographs have)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC))


def test_phash_is_stable_under_rescale_and_recompression_but_separates_pictures():
    a = textured(0)
    a_small = np.asarray(Image.fromarray(a).resize((61, 61), Image.Resampling.BILINEAR))
    a_bright = np.clip(a.astype(int) + 12, 0, 255).astype(np.uint8)
    h = phash(a)
    assert hamming(h, phash(a_small)) <= 6
    assert hamming(h, phash(a_bright)) <= 6
    others = [hamming(h, phash(textured(s))) for s in range(1, 9)]
    assert min(others) > 10
    assert phash(a) == h  # deterministic


def test_laplacian_variance_is_lower_for_blurred_images():
    rng = np.random.default_rng(1)
    sharp = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    blurred = np.asarray(Image.fromarray(sharp).filter(ImageFilter.GaussianBlur(3)))
    assert laplacian_variance(blurred) < laplacian_variance(sharp) / 20
    assert laplacian_variance(np.full((32, 32, 3), 77, np.uint8)) == 0.0


def test_rms_dbfs():
    t = np.arange(16000) / 16000
    sine = 0.5 * np.sin(2 * np.pi * 440 * t)
    assert rms_dbfs(sine) == pytest.approx(20 * math.log10(0.5 / math.sqrt(2)), abs=0.01)
    assert rms_dbfs(np.zeros(100)) == -math.inf
    assert rms_dbfs(np.zeros(0)) == -math.inf


def test_clean_caption_nfc_and_whitespace():
    assert clean_caption("  cafe\u0301\n\t au   lait ") == "caf\u00e9 au lait"


@pytest.mark.parametrize(
    ("features", "config", "name"),
    [
        (Features(height=20, width=100), FilterConfig(min_side=32), "resolution"),
        (Features(height=40, width=200), FilterConfig(max_aspect=3.0), "resolution"),
        (Features(sharpness=3.0), FilterConfig(min_sharpness=10.0), "blur"),
        (Features(caption="a"), FilterConfig(min_caption_chars=2), "caption_length"),
        (Features(caption="abc " * 10), FilterConfig(max_caption_chars=20), "caption_length"),
        (Features(caption="one two"), FilterConfig(min_caption_words=3), "caption_length"),
        (Features(caption="a b c d"), FilterConfig(max_caption_words=3), "caption_length"),
        (Features(video_s=0.5), FilterConfig(min_video_s=1.0), "short_video"),
        (Features(audio_dbfs=-80.0), FilterConfig(min_audio_dbfs=-60.0), "silent_audio"),
        (Features(audio_dbfs=-math.inf), FilterConfig(min_audio_dbfs=-60.0), "silent_audio"),
        (Features(relevance=10.0), FilterConfig(relevance_threshold=20.0), "relevance"),
    ],
)
def test_each_sample_filter_drops_what_it_should(features, config, name):
    verdict = sample_reason(features, config)
    assert verdict is not None and verdict[0] == name
    # The same sample passes when the filter is off.
    assert sample_reason(features, FilterConfig()) is None


def test_sample_filters_keep_samples_inside_the_bounds():
    config = FilterConfig(
        min_side=32,
        max_aspect=2.0,
        min_sharpness=5,
        min_caption_words=2,
        max_caption_chars=50,
        min_video_s=1,
        min_audio_dbfs=-50,
        relevance_threshold=20,
    )
    ok = Features(
        height=64,
        width=100,
        sharpness=50,
        caption="a red cat",
        video_s=2,
        audio_dbfs=-20,
        relevance=25,
    )
    assert sample_reason(ok, config) is None
    # A filter ignores a modality the sample does not have.
    assert sample_reason(Features(), config) is None


def test_chain_keeps_first_exact_duplicate_and_counts():
    chain = FilterChain(FilterConfig(exact_duplicates=True, min_caption_chars=3))
    digests = [content_sha256([("txt", t.encode())]) for t in ("abc", "def", "abc", "abc")]
    verdicts = [chain.admit(Features(sha256=d, caption="long enough")) for d in digests]
    assert [v and v[0] for v in verdicts] == [None, None, "exact_duplicate", "exact_duplicate"]
    chain.admit(Features(sha256="x", caption="ab"))
    assert chain.stats.to_dict() == {
        "seen": 5,
        "kept": 2,
        "removed": {"caption_length": 1, "exact_duplicate": 2},
    }


def test_chain_near_duplicates_first_kept_and_dropped_ones_not_remembered():
    chain = FilterChain(FilterConfig(near_duplicate_bits=6))
    a = textured(3)
    a_resized = np.asarray(Image.fromarray(a).resize((50, 50), Image.Resampling.BILINEAR))
    kinds = [a, textured(4), a_resized, textured(5)]
    verdicts = [chain.admit(Features(phash=phash(x))) for x in kinds]
    assert [v and v[0] for v in verdicts] == [None, None, "near_duplicate", None]
    assert chain.stats.removed == {"near_duplicate": 1}


def test_near_duplicate_index_agrees_with_brute_force():
    rng = np.random.default_rng(0)
    base = [int(x) for x in rng.integers(0, 2**63, 200, dtype=np.int64)]
    for distance in (0, 3, 10):
        index = NearDuplicateIndex(distance)
        stored: list[int] = []
        for h in base:
            # Some queries are a stored hash with a few flipped bits.
            flips = int(rng.integers(0, 2 * distance + 2))
            q = h
            for bit in rng.choice(64, size=flips, replace=False):
                q ^= 1 << int(bit)
            brute = any(hamming(q, s) <= distance for s in stored)
            assert (index.find(q) is not None) == brute
            index.add(h)
            stored.append(h)


def test_content_sha256_depends_on_every_part():
    a = content_sha256([("jpg", b"x"), ("txt", b"cat")])
    assert a == content_sha256([("txt", b"cat"), ("jpg", b"x")])
    assert a != content_sha256([("jpg", b"x"), ("txt", b"dog")])
    assert content_sha256([("txt", b"ab")]) != content_sha256([("txt", b"a"), ("txu", b"b")])


def test_top_fraction_cutoff():
    scores = [5.0, 1.0, 9.0, 3.0, 7.0]
    assert top_fraction_cutoff(scores, 0.4) == 7.0
    assert top_fraction_cutoff(scores, 1.0) == 1.0
    assert top_fraction_cutoff(scores, 0.01) == 9.0  # at least one kept
    assert top_fraction_cutoff([], 0.5) == -math.inf


def test_config_rejects_contradictory_relevance_settings():
    with pytest.raises(ValueError, match="not both"):
        FilterConfig(relevance_threshold=10, relevance_top_fraction=0.5)
    with pytest.raises(ValueError, match="relevance_top_fraction"):
        FilterConfig(relevance_top_fraction=1.5)
    assert FilterConfig(exact_duplicates=True, min_side=8).enabled() == {
        "exact_duplicates": True,
        "min_side": 8,
    }


@pytest.mark.slow  # imports torch and builds a model: seconds on a busy machine
def test_relevance_scorer_is_clip_score_floored_at_zero(tmp_path):
    torch = pytest.importorskip("torch")
    import mmtrain
    from mmtrain.data.ingest.filters import center_square, relevance_scorer
    from mmtrain.data.stream.tokenizer import ByteTokenizer
    from mmtrain.data.stream.transforms import CLIP_MEAN, CLIP_STD

    model = mmtrain.create_model("tiny-clip", seed=0)
    scorer = relevance_scorer(mmtrain.save_model(model, tmp_path / "model"), batch_size=4)
    images = [textured(s, size=80) for s in range(10)]
    texts = [f"picture number {s}" for s in range(10)]
    scores = scorer(images, texts)

    pixels = torch.tensor(np.stack([center_square(im, 64) for im in images])).float() / 255
    pixels = (pixels - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    with torch.no_grad():
        emb = model.encode(
            {"image": pixels.permute(0, 3, 1, 2), "text": ByteTokenizer()(texts, 48)}
        )
    cos = (emb["image"] * emb["text"]).sum(-1).numpy()
    # Scores are 100 x the cosine of two float32 embeddings computed by two code paths (the
    # scorer's batches, this direct call): each cosine carries rounding of order
    # sqrt(depth x width) x eps32 ~ 1e-6, i.e. 1e-4 on this scale; atol leaves 10x margin.
    np.testing.assert_allclose(scores, 100 * np.maximum(cos, 0), atol=1e-3)
    assert scores.shape == (10,) and (scores >= 0).all() and (scores <= 100).all()
    # Batching does not change a sample's score.
    scorer.batch_size = 10
    # Same inputs in other batch sizes: kernels may round by batch size; bound as above / 10.
    np.testing.assert_allclose(scorer(images, texts), scores, atol=1e-4)


def test_relevance_scorer_needs_a_model_folder(tmp_path):
    from mmtrain.data.ingest.filters import relevance_scorer

    with pytest.raises(FileNotFoundError, match="spec.yaml"):
        relevance_scorer(tmp_path)
