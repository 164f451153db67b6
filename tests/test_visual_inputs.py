"""A native-resolution VLM's splice and 3-D positions, computed from the layout on the device,
equal the row-by-row reference rule (models/mrope.py, itself held to transformers'
get_rope_index in test_mrope.py) on random rows: images and clips of random grids, Qwen2.5-VL
time steps, left padding and packed documents."""

from __future__ import annotations

import random

import pytest
import torch

from mmtrain.models.mrope import rope_index_batch
from mmtrain.models.splice import expand_per_id, make_layout
from mmtrain.models.visual_inputs import multimodal_positions, visual_order

IMAGE, VIDEO, MERGE = 90, 91, 2


def random_rows(rng: random.Random, rows: int, video_step: bool):
    """Rows of text ids with placeholders, the inputs' patch grids (t, h, w) in reading order
    by kind, and each clip's time interval."""
    text, images, videos, seconds = [], [], [], []
    for _ in range(rows):
        row = []
        for _ in range(rng.randint(1, 4)):
            row += [rng.randint(1, 50) for _ in range(rng.randint(1, 3))]
            kind = rng.choice(["image", "video", None])
            if kind == "image":
                images.append((1, 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)))
                row.append(IMAGE)
            elif kind == "video":
                videos.append((rng.randint(1, 6), 2 * rng.randint(1, 2), 2 * rng.randint(1, 2)))
                seconds.append(rng.choice([0.25, 0.7, 1.0, 2.0]))
                row.append(VIDEO)
        text.append(row)
    width = max(map(len, text))
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r, row in enumerate(text):  # left-padded, as generation lays prompts out
        ids[r, width - len(row) :] = torch.tensor(row)
        mask[r, width - len(row) :] = True
    return ids, mask, images, videos, (seconds if video_step else None)


@pytest.mark.parametrize("seed", range(12))
def test_positions_from_the_layout_equal_the_reference_rule(seed):
    rng = random.Random(seed)
    video_step = seed % 2 == 1  # Qwen2.5-VL: clip time in seconds x tokens_per_second
    ids, mask, images, videos, seconds = random_rows(rng, 3, video_step)
    is_visual, order = visual_order(ids, IMAGE, VIDEO, mask, len(images))
    grids = torch.tensor([*images, *videos], dtype=torch.long).reshape(-1, 3)[order]
    merged = grids // torch.tensor([1, MERGE, MERGE])
    tps = 25.0 if video_step else None
    steps = [1.0] * len(images) + (
        [s * tps for s in seconds] if video_step else [1.0] * len(videos)
    )
    intervals = torch.tensor(steps, dtype=torch.float32).reshape(-1)[order]
    layout = make_layout(is_visual, merged.prod(dim=1))
    got = multimodal_positions(layout, is_visual, merged, intervals, mask)

    expanded = expand_per_id(ids, layout, 0)
    want, _ = rope_index_batch(expanded, images, videos, image_token_id=IMAGE,
                               video_token_id=VIDEO, merge_size=MERGE,
                               seconds_per_grid=seconds, tokens_per_second=tps,
                               attention_mask=expand_per_id(mask, layout, False))  # fmt: skip
    real = expand_per_id(mask, layout, False)
    assert torch.equal(got[:, real], want[:, real])


def test_packed_documents_restart_their_positions():
    rng = random.Random(7)
    ids, mask, images, videos, _ = random_rows(rng, 1, False)
    ids, mask = ids[:, mask[0]], mask[:, mask[0]]  # one row, no padding
    half = ids.shape[1] // 2
    documents = torch.tensor([[0] * half + [1] * (ids.shape[1] - half)])
    is_visual, order = visual_order(ids, IMAGE, VIDEO, mask, len(images))
    grids = torch.tensor([*images, *videos], dtype=torch.long).reshape(-1, 3)[order]
    merged = grids // torch.tensor([1, MERGE, MERGE])
    layout = make_layout(is_visual, merged.prod(dim=1))
    got = multimodal_positions(layout, is_visual, merged, torch.ones(len(order)), mask, documents)
    expanded = expand_per_id(ids, layout, 0)
    want, _ = rope_index_batch(expanded, images, videos, image_token_id=IMAGE,
                               video_token_id=VIDEO, merge_size=MERGE,
                               document_ids=expand_per_id(documents, layout, -1))  # fmt: skip
    assert torch.equal(got, want)
    assert got[0, 0, layout.ends[0, half - 1] + 1] == 0  # the second document starts at 0


def test_visual_order_takes_images_then_clips_by_their_own_placeholders():
    ids = torch.tensor([[5, VIDEO, IMAGE, 6], [IMAGE, 7, VIDEO, 0]])
    valid = torch.tensor([[True] * 4, [True, True, True, False]])
    is_visual, order = visual_order(ids, IMAGE, VIDEO, valid, images=2)
    # reading order: clip 0, image 0, image 1, clip 1 -> inputs 2, 0, 1, 3
    assert order.tolist() == [2, 0, 1, 3] and int(is_visual.sum()) == 4


def test_a_batch_without_images_still_reaches_every_vision_parameter():
    # FSDP2 / DDP: a rank whose micro-batch holds no image must run the same modules and give
    # every trained parameter a gradient (zero) as the ranks with images do.
    import mmtrain

    model = mmtrain.create_model("tiny-qwen2-vl", seed=0)
    text = torch.tensor([[1, 2, 3, 4]])
    out = model({"text": text, "labels": text, "image": [], "video": []})
    out["nll_sum"].backward()
    vision = [p for n, p in model.named_parameters() if n.startswith("towers.vision.")]
    assert vision and all(p.grad is not None and not p.grad.any() for p in vision)
    with_image = {"text": torch.tensor([[1, 258, 3]]), "image": [torch.rand(3, 16, 24)]}
    assert model.logits(with_image).shape == (1, 3, 260)
    with pytest.raises(ValueError, match="1 image placeholder.*batch has 0 image"):
        model.logits({"text": with_image["text"]})
