"""Packing: no split, every token once, no target across a boundary, positions restarting per
sample (images counted as `image_length`), refusal, determinism, and the decoder's per-token
loss of each packed sample equal to its loss alone (float64)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from mmtrain.data.stream.chat_templates import IGNORE_INDEX, EncodedSample
from mmtrain.data.stream.packing import (
    PAD_DOCUMENT,
    PackedRow,
    SampleTooLong,
    expand_images,
    pack_rows,
    padded_batches,
    sample_positions,
)
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models.decoder import Decoder, document_positions

VOCAB = 64
IMAGE = 3  # placeholder id
IMAGE_LEN = 4
PAD = 0
ROW = 48
FP64_RTOL = 1e-10  # float64: equal up to rounding, the same sums in another order


def random_samples(n: int, seed: int) -> list[EncodedSample]:
    """Samples of 1..20 ids with 0-2 images and about half the labels targets."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 20))]
        for _ in range(rng.choice([0, 0, 1, 2])):
            ids.insert(rng.randrange(len(ids) + 1), IMAGE)
        labels = [t if t != IMAGE and rng.random() < 0.5 else IGNORE_INDEX for t in ids]
        out.append(EncodedSample(ids, labels))
    return out


def pack(samples: list[EncodedSample], row: int = ROW, **kwargs) -> list[PackedRow]:
    return list(
        pack_rows(samples, row, image_token_id=IMAGE, image_length=IMAGE_LEN, pad_id=PAD, **kwargs)
    )


def expanded(row: PackedRow) -> PackedRow:
    return expand_images(row, IMAGE, IMAGE_LEN)


def runs(values: list[int]) -> list[int]:
    """The distinct values in order of their runs (a value twice: it was split)."""
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


# ----------------------------------------------------------------------------- layout
def test_every_token_kept_once_and_no_sample_split():
    samples = random_samples(60, seed=0)
    rows = pack(samples)
    seen: list[int] = []
    for row in rows:
        assert len(expanded(row).input_ids) == ROW  # exactly one row of positions
        docs = [d for d in runs(row.document_ids) if d != PAD_DOCUMENT]
        assert docs == row.samples and len(set(docs)) == len(docs)  # one contiguous run each
        seen += docs
        for d in docs:
            at = [i for i, doc in enumerate(row.document_ids) if doc == d]
            assert [row.input_ids[i] for i in at] == samples[d].input_ids
            assert [row.labels[i] for i in at] == [IGNORE_INDEX, *samples[d].labels[1:]]
        pad = [i for i, doc in enumerate(row.document_ids) if doc == PAD_DOCUMENT]
        assert pad == list(range(len(row.input_ids) - len(pad), len(row.input_ids)))  # trailing
        assert all(row.labels[i] == IGNORE_INDEX and row.input_ids[i] == PAD for i in pad)
    assert sorted(seen) == list(range(len(samples)))  # every sample exactly once
    assert len(rows) < len(samples) / 2  # it does pack


def test_boundaries_carry_no_target():
    samples = random_samples(60, seed=1)
    total = 0
    for row in map(expanded, pack(samples)):
        for i in range(1, len(row.labels)):
            if row.labels[i] != IGNORE_INDEX:  # position i - 1 predicts it
                assert row.document_ids[i - 1] == row.document_ids[i] != PAD_DOCUMENT
        total += row.targets
    # Nothing is lost: a sample's first label is never a target, packed or alone.
    assert total == sum(sum(t != IGNORE_INDEX for t in s.labels[1:]) for s in samples)


def test_positions_restart_per_sample_counting_image_positions():
    a = EncodedSample([5, IMAGE, 6], [IGNORE_INDEX, IGNORE_INDEX, 6])
    b = EncodedSample([7, 8], [7, 8])
    (row,) = pack([a, b], row=12)  # 3 + 3 image positions, 2, then 4 of padding
    assert row.input_ids == [5, IMAGE, 6, 7, 8, PAD, PAD, PAD, PAD]
    assert row.labels == [IGNORE_INDEX, IGNORE_INDEX, 6, IGNORE_INDEX, 8] + [IGNORE_INDEX] * 4
    assert row.document_ids == [0, 0, 0, 1, 1] + [PAD_DOCUMENT] * 4
    assert row.position_ids == [0, 1, 5, 0, 1, 0, 1, 2, 3]
    wide = expanded(row)
    assert wide.position_ids == [0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3]
    assert wide.labels[:8] == [IGNORE_INDEX] * 5 + [6, IGNORE_INDEX, 8]


def test_positions_and_documents_agree_with_the_decoder():
    for row in map(expanded, pack(random_samples(40, seed=2))):
        docs = torch.tensor([row.document_ids])
        assert document_positions(docs).tolist() == [row.position_ids]


def test_too_long_sample_is_refused_counting_its_images():
    fits = EncodedSample([5] * 7, [5] * 7)
    too_long = EncodedSample([5, IMAGE, 6, 7, 8], [IGNORE_INDEX] * 4 + [8])  # 5 ids, 8 positions
    assert sample_positions(too_long, IMAGE, IMAGE_LEN) == 8
    with pytest.raises(SampleTooLong, match=r"sample 1 takes 8 positions .* a row's 7"):
        pack([fits, too_long], row=7)
    with pytest.raises(ValueError, match="labels"):
        pack([EncodedSample([5, 6], [5])])


def test_packing_is_a_pure_function_of_the_input_order():
    samples = random_samples(80, seed=3)
    first = pack(samples)
    assert pack(list(samples)) == first
    assert list(pack_rows(iter(samples), ROW, image_token_id=IMAGE, image_length=IMAGE_LEN)) == (
        first
    )
    assert pack(samples[::-1]) != first  # the order is the input, so it matters


def test_first_fit_fills_the_oldest_open_row_and_emits_full_rows_first():
    sizes = [6, 6, 4, 3, 7]
    samples = [EncodedSample([5] * n, [5] * n) for n in sizes]
    assert [r.samples for r in pack(samples, row=10)] == [[0, 2], [1, 3], [4]]
    # One open row: strictly sequential, a sample that does not fit closes the row.
    assert [r.samples for r in pack(samples, row=10, open_rows=1)] == [[0], [1, 2], [3, 4]]


def test_padded_batches_pad_to_the_longest_in_the_batch():
    samples = random_samples(7, seed=4)
    batches = list(padded_batches(samples, 3, image_token_id=IMAGE, image_length=IMAGE_LEN))
    assert [len(b) for b in batches] == [3, 3, 1]
    for start, batch in zip(range(0, 7, 3), batches, strict=True):
        longest = max(sample_positions(s, IMAGE, IMAGE_LEN) for s in samples[start : start + 3])
        for offset, row in enumerate(batch):
            assert row.samples == [start + offset]
            assert len(expanded(row).input_ids) == longest


# ----------------------------------------------------------------------------- the decoder
def tiny_decoder() -> Decoder:
    spec = DecoderSpec(vocab_size=VOCAB, width=32, layers=2, heads=4, kv_heads=2, mlp_hidden=48)
    model = Decoder(spec)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.double().eval()


def image_features(sample: int, image: int, width: int) -> torch.Tensor:
    """Stand-in for a projected image: fixed by (sample, image number) wherever it lands."""
    g = torch.Generator().manual_seed(1000 * sample + image)
    return torch.randn(IMAGE_LEN, width, generator=g, dtype=torch.float64)


def spliced(model: Decoder, row: PackedRow, sample_of: dict[int, int]) -> torch.Tensor:
    """[positions, width] embeddings with each placeholder replaced by its image's tokens."""
    pieces, images = [], Counter()
    for token, doc in zip(row.input_ids, row.document_ids, strict=True):
        if token == IMAGE and doc != PAD_DOCUMENT:
            pieces.append(image_features(sample_of[doc], images[doc], model.spec.width))
            images[doc] += 1
        else:
            pieces.append(model.embed.weight[token][None])
    return torch.cat(pieces)


def token_losses(
    model: Decoder, row: PackedRow, sample_of: dict[int, int], packed: bool
) -> dict[int, torch.Tensor]:
    """Per-token next-token losses of each sample in the row, by input index."""
    wide = expanded(row)
    embeds = spliced(model, row, sample_of)[None]
    docs = torch.tensor([wide.document_ids])
    kwargs = {"document_ids": docs} if packed else {}  # alone: the plain causal path
    positions = torch.tensor([wide.position_ids])
    with torch.no_grad():
        logits = model(inputs_embeds=embeds, position_ids=positions, **kwargs)[0]
    labels = torch.tensor(wide.labels)
    losses = F.cross_entropy(logits[:-1], labels[1:], reduction="none")
    targets = labels[1:] != IGNORE_INDEX
    return {d: losses[targets & (docs[0, 1:] == d)] for d in row.samples}


def test_each_packed_sample_has_its_loss_alone():
    model = tiny_decoder()
    samples = random_samples(16, seed=5)
    rows = pack(samples)
    assert max(len(r.samples) for r in rows) >= 3
    compared = 0
    for row in rows:
        packed = token_losses(model, row, {d: d for d in row.samples}, packed=True)
        for d, loss in packed.items():
            ((alone_row,),) = padded_batches(
                [samples[d]], 1, image_token_id=IMAGE, image_length=IMAGE_LEN
            )
            alone = token_losses(model, alone_row, {0: d}, packed=False)[0]
            assert loss.numel() == alone.numel()
            torch.testing.assert_close(loss, alone, rtol=FP64_RTOL, atol=0)
            compared += loss.numel()
    assert compared > 50
