"""A native-resolution VLM's conversations in the loader: each page and clip at its own size
within the pixel budget (visual_budget.py), its tokens in the truncation, the packing and the
splice, so that placeholders, tokens and the tower's features always agree.

"Image features and image tokens do not match" is the most reported failure of VLM trainers;
the property test draws conversations (pages of random sizes, a clip, random budgets and
cut-off lengths) and checks that a sample is either refused with a named reason or laid out so
that the model's splice takes exactly its tower's features.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mmtrain.config import DataConfig, DataSource, VisionDataConfig
from mmtrain.data.stream.conversation_batches import (
    ConversationBatcher,
    SkippedSample,
)
from mmtrain.data.stream.media import encode_video
from mmtrain.models.build import create_model
from mmtrain.spec import load_spec
from mmtrain.structured import FieldError
from mmtrain.visual_budget import (
    BudgetExceeded,
    ClipSize,
    ImageSize,
    VisualBudget,
    budget_of,
)

SPEC = load_spec("tiny-qwen2-vl")  # patch 4, merge 2: sides in multiples of 8 pixels
QWEN = load_spec("Qwen2.5-VL-7B").vision
IMAGE_ID, VIDEO_ID = SPEC.vision_tokens.image_token_id, SPEC.vision_tokens.video_token_id


def _png(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


CLIP = encode_video(np.random.default_rng(0).integers(0, 256, (6, 24, 40, 3), dtype=np.uint8), 4)


def _sample(key: str, images: list[bytes], video: bool, answer: str) -> dict:
    tags = "".join("<image>" for _ in images)
    members = {f"{n}.png": data for n, data in enumerate(images)}
    record = {"id": key, "images": list(members)}
    if video:
        members["v0.mp4"] = CLIP
        record["videos"] = ["v0.mp4"]
        tags = tags[:7] + "<video>" + tags[7:]  # between the first and the second page
    record["messages"] = [
        {"role": "user", "content": tags + "Read it."},
        {"role": "assistant", "content": answer},
    ]
    return {"__key__": key, "json": json.dumps(record).encode(), **members}


def _batcher(sequence_length: int, vision: VisionDataConfig, pack: bool = False):
    data = DataConfig(
        train=[DataSource("unused")],
        chat_template="plain",
        sequence_length=sequence_length,
        pack=pack,
        vision=vision,
    )
    return ConversationBatcher(data, SPEC)


# ----------------------------------------------------------------------------- the budget
def test_pages_keep_their_own_size_within_the_per_image_budget():
    budget = VisualBudget.from_tokens(QWEN)  # the spec's 56 x 56 .. 28 x 28 x 1280 pixels
    letter, strip = budget.shapes([ImageSize(2200, 1700), ImageSize(100, 400)])
    assert (letter.height, letter.width) == QWEN.resized(2200, 1700)
    assert letter.tokens(QWEN) == (1120 // 28) * (868 // 28) <= 1280
    assert (strip.height, strip.width) == (112, 392)  # already small: rounded, not scaled


def test_a_sample_budget_shrinks_every_input_by_the_same_factor():
    inputs = [ImageSize(2200, 1700), ImageSize(100, 400), ClipSize(250, 25.0, 720, 1280)]
    free = VisualBudget.from_tokens(QWEN).tokens(inputs)
    assert free == [1240, 56, 7200]  # 20 frames of 20 x 36 tokens, two per temporal patch
    capped = budget_of(QWEN, VisionDataConfig(sample_max_tokens=2000)).tokens(inputs)
    # each input's per-frame cap is floor(its tokens per frame x 2000 / 8496) tokens, in
    # pixels of 28 x 28; the clip keeps its 20 frames (10 temporal patches)
    factor, unit = 2000 / sum(free), 28 * 28
    caps = [int(1240 * factor) * unit, int(56 * factor) * unit, int(720 * factor) * unit]
    page = QWEN.resized(2200, 1700, QWEN.min_pixels, caps[0])
    strip = QWEN.resized(100, 400, QWEN.min_pixels, caps[1])
    frame = QWEN.resized(720, 1280, 128 * unit, caps[2])
    assert capped == [QWEN.tokens(*page), QWEN.tokens(*strip), QWEN.tokens(*frame, 20)]
    assert sum(capped) <= 2000


def test_a_sample_that_cannot_fit_its_budget_is_refused():
    budget = budget_of(QWEN, VisionDataConfig(sample_max_tokens=8, image_min_tokens=4))
    with pytest.raises(BudgetExceeded, match="do not fit sample_max_tokens 8"):
        budget.shapes([ImageSize(500, 500)] * 3)  # three pages of at least 4 tokens


def test_bad_budget_settings_name_the_field():
    with pytest.raises(FieldError, match="data.vision.image_min_tokens"):
        VisionDataConfig(image_min_tokens=10, image_max_tokens=4).validate()
    with pytest.raises(FieldError, match="data.vision.video_fps"):
        VisionDataConfig(video_fps=0).validate()
    data = DataConfig(train=[DataSource("x")], chat_template="plain", vision=VisionDataConfig())
    with pytest.raises(FieldError, match="data.vision"):
        ConversationBatcher(data, load_spec("tiny-vlm"))


# ----------------------------------------------------------------------------- the loader
def test_pages_and_a_clip_decode_at_their_budgeted_sizes():
    vision = VisionDataConfig(image_max_tokens=20, frame_min_tokens=4, frame_max_tokens=12)
    decoder = _batcher(400, vision).decoder(SPEC)
    out = decoder(_sample("a", [_png(96, 24, 1), _png(30, 50, 2)], True, "ok"), None)
    budget = budget_of(SPEC.vision, vision)
    shapes = budget.shapes([ImageSize(96, 24), ImageSize(30, 50), ClipSize(6, 4.0, 24, 40)])
    assert [tuple(x.shape) for x in out["image"]] == [(3, s.height, s.width) for s in shapes[:2]]
    clip = shapes[2]
    assert tuple(out["video"][0].shape) == (clip.frames, 3, clip.height, clip.width)
    ids = out["input_ids"].tolist()
    # tag order: image, video, image; each placeholder's span is its input's tokens
    assert [t for t in ids if t in (IMAGE_ID, VIDEO_ID)] == [IMAGE_ID, VIDEO_ID, IMAGE_ID]
    spans = dict(map(tuple, out["spans"].tolist()))
    order = [shapes[0], shapes[2], shapes[1]]
    places = [i for i, t in enumerate(ids) if t in (IMAGE_ID, VIDEO_ID)]
    assert [spans[i] for i in places] == [s.tokens(SPEC.vision) for s in order]
    # pixels normalised as the Qwen2-VL processor does: x / 255 minus the CLIP mean over std
    assert out["image"][0].dtype == torch.float32 and out["image"][0].min() < -1.0


def test_a_sample_over_its_budget_is_skipped_by_name():
    vision = VisionDataConfig(sample_max_tokens=3, image_min_tokens=2)
    decoder = _batcher(400, vision).decoder(SPEC)
    with pytest.raises(SkippedSample) as err:
        decoder(_sample("b", [_png(64, 64, 1), _png(64, 64, 2)], False, "ok"), None)
    assert err.value.reason == "visual_budget"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pages=st.lists(
        st.tuples(st.integers(4, 120), st.integers(4, 120)), min_size=0, max_size=3
    ).filter(lambda sizes: all(max(h, w) / min(h, w) <= 30 for h, w in sizes)),
    video=st.booleans(),
    answer=st.text(alphabet="abcdefgh ", min_size=1, max_size=40).filter(str.strip),
    sequence_length=st.integers(4, 400),
    image_max_tokens=st.integers(4, 40),
    sample_max_tokens=st.none() | st.integers(8, 80),
    pack=st.booleans(),
)
def test_tokens_and_features_always_agree(
    pages, video, answer, sequence_length, image_max_tokens, sample_max_tokens, pack
):
    vision = VisionDataConfig(
        image_max_tokens=image_max_tokens,
        sample_max_tokens=sample_max_tokens,
        frame_min_tokens=2,
        frame_max_tokens=8,
    )
    batcher = _batcher(sequence_length, vision, pack)
    decoder = batcher.decoder(SPEC)
    images = [_png(h, w, n) for n, (h, w) in enumerate(pages)]
    outs = []
    for key in ("x", "y"):  # two samples, to pack or pad together
        try:
            outs.append(decoder(_sample(key, images, video and bool(images), answer), None))
        except SkippedSample as err:
            assert err.reason in {"image_cut", "video_cut", "truncated_no_targets",
                                  "visual_budget", "no_targets"}  # fmt: skip
            return
    for out in outs:
        ids = out["input_ids"].tolist()
        spans = out["spans"].tolist()
        inputs = [*out["image"], *out["video"]]
        assert ids.count(IMAGE_ID) == len(out["image"]) and ids.count(VIDEO_ID) == len(out["video"])
        tokens = sum(SPEC.vision.tokens(x.shape[-2], x.shape[-1], 1 if x.dim() == 3 else x.shape[0])
                     for x in inputs)  # fmt: skip
        assert sum(n for _, n in spans) == tokens
        assert len(ids) - len(spans) + tokens <= sequence_length
        if sample_max_tokens is not None:
            assert tokens <= sample_max_tokens
    batch = batcher.collate(SPEC)(outs)
    torch.manual_seed(0)
    logits = create_model(SPEC).logits(batch)  # the splice checks placeholders and features
    assert logits.shape[:2] == batch["text"].shape


def test_each_input_sits_between_the_start_and_end_ids_the_spec_names():
    """Qwen2-VL's chat format: <|vision_start|> placeholder <|vision_end|> per input; the
    wrapping ids are text (never trained), the span stays on the placeholder."""
    data = SPEC.to_dict()
    data["vision_tokens"].update(start_id=256, end_id=257)
    spec = type(SPEC).from_dict(data)
    batcher = ConversationBatcher(
        DataConfig(train=[DataSource("x")], chat_template="plain", sequence_length=400), spec
    )
    out = batcher.decoder(spec)(_sample("w", [_png(16, 40, 3)], True, "ok"), None)
    ids, labels = out["input_ids"].tolist(), out["labels"].tolist()
    assert ids[:6] == [256, IMAGE_ID, 257, 256, VIDEO_ID, 257]
    assert labels[:6] == [-100] * 6
    assert [i for i, _ in out["spans"].tolist()] == [1, 4]
    batch = batcher.collate(spec)([out])
    assert create_model(spec).logits(batch).shape[:2] == batch["text"].shape


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_the_step_counts_each_input_at_its_own_size(pack):
    """MFU's FLOPs of a native batch: the tower over each page and clip at its size, the LM
    over each row at its length once the inputs are spliced in (padding computed too); a
    packed row's attention over each document apart (and its padding), as flex attention
    computes it."""
    from mmtrain.spec import VISION_TOWER
    from mmtrain.train.metrics import language_model_forward_flops

    vision = VisionDataConfig(image_max_tokens=20, frame_min_tokens=4, frame_max_tokens=12)
    batcher = _batcher(400, vision, pack)
    decoder = batcher.decoder(SPEC)
    outs = [
        decoder(_sample("a", [_png(96, 24, 1), _png(30, 50, 2)], True, "ok"), None),
        decoder(_sample("b", [_png(40, 40, 3)], False, "a longer answer"), None),
        decoder(_sample("c", [], False, "text"), None),
    ]
    batch = batcher.collate(SPEC)(outs)
    flops = language_model_forward_flops(SPEC, batch)
    inputs = [*batch["image"], *batch["video"]]
    tower = sum(SPEC.vision.forward_flops(x.shape[-2], x.shape[-1],
                                          1 if x.dim() == 3 else x.shape[0]) for x in inputs)  # fmt: skip
    assert flops[VISION_TOWER] == tower
    length = batch["splice_sizes"][0]  # the expanded rows' length: every row is computed to it
    rows = batch["text"].shape[0]
    extra = sum(out["spans"][:, 1].sum().item() - len(out["spans"]) for out in outs)
    positions = batch["text"].numel() + extra  # ids, each input's tokens instead of its id
    spans = _span_lengths(batch)
    assert flops["text"] == sum(SPEC.decoder.forward_flops(n) for n in spans)
    assert sum(spans) == positions and max(_row_lengths(batch)) == length
    assert len(spans) == 3  # three rows, or one row of three documents (no padding left)
    assert rows == (1 if pack else 3)


def _row_lengths(batch) -> list[int]:
    """Positions of each row once its placeholders hold their inputs' tokens."""
    return [sum(row) for row in _id_positions(batch)]


def _span_lengths(batch) -> list[int]:
    """What attention runs over: each row, or in a packed row each document and its padding."""
    if "document_ids" not in batch:
        return _row_lengths(batch)
    spans = []
    for row, documents in zip(_id_positions(batch), batch["document_ids"].tolist(), strict=True):
        by_document: dict[int, int] = {}
        for n, document in zip(row, documents, strict=True):
            by_document[document] = by_document.get(document, 0) + n
        spans += list(by_document.values())
    return spans


def _id_positions(batch) -> list[list[int]]:
    """Each id's positions, row by row: an input's tokens at its placeholder, 1 elsewhere."""
    text = batch["text"]
    counts = iter(
        [SPEC.vision.tokens(x.shape[-2], x.shape[-1], 1 if x.dim() == 3 else x.shape[0])
         for x in batch["image"]]
    )  # fmt: skip
    videos = iter(
        [SPEC.vision.tokens(x.shape[-2], x.shape[-1], x.shape[0]) for x in batch["video"]]
    )
    lengths = []
    for row in text.tolist():
        lengths.append([next(counts) if token == IMAGE_ID else next(videos)
                        if token == VIDEO_ID else 1 for token in row])  # fmt: skip
    return lengths
