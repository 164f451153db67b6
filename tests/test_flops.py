"""One definition of model FLOPs: the planner's MFU and the trainer's agree, case by case.

Expected values are written out from the rule (trained 3x forward, frozen 1x, frozen with a
gradient passing through 2x, LoRA 2x, recomputation not model work), with the forward FLOPs of
tiny-vlm's parts computed by hand from its preset's sizes.
"""

import pytest
import torch

from mmtrain.config import RunConfig, config_from_dict
from mmtrain.plan.compute import flops_per_sample
from mmtrain.plan.model import Rows, from_spec
from mmtrain.spec import PartTraining, load_spec, train_flops
from mmtrain.structured import FieldError
from mmtrain.train.metrics import (
    part_modes,
    step_model_flops,
)


def run_config(model: str, towers: dict) -> RunConfig:
    return config_from_dict(
        {
            "model": model,
            "data": {"train": "unused/"},
            "train": {"steps": 1, "batch_size": 2, "towers": towers},
        }
    )


# tiny-vlm by hand (presets/tiny-vlm.yaml). Vision: 64 px / patch 8 = 64 patches + CLS = 65
# tokens, width 128, MLP 512; the feature layer -2 of 5 blocks runs 4 blocks.
STEM = 2 * 64 * (8 * 8 * 3) * 128
BLOCK = 2 * 65 * (4 * 128 * 128 + 2 * 128 * 512) + 4 * 65 * 65 * 128
VISION = STEM + 4 * BLOCK  # 114,034,688 per image
PROJECTOR = 2 * 64 * (128 * 128 + 128 * 128)  # mlp: 128 -> 128 -> 128 on 64 image tokens


def decoder(positions: int) -> int:
    """Width 128, 2 layers, 4 heads of 32 (2 KV heads), SwiGLU 352, tied head of vocab 259."""
    per_token = 2 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 352)
    attention = 4 * positions * positions * 128
    return 2 * (positions * per_token + attention) + positions * 2 * 128 * 259


def test_hand_counts_are_the_specs():
    parts = load_spec("tiny-vlm").sequence_flops_by_part([73, 10], images=1)
    assert parts == {"image": VISION, "projector": PROJECTOR, "text": decoder(73) + decoder(10)}


def test_clip_with_a_frozen_image_tower():
    spec = load_spec("tiny-clip")
    image, text = spec.tower_flops()["image"], spec.tower_flops()["text"]
    expected = 1 * image + 3 * text  # towers side by side: no gradient into the image tower
    planner, _ = flops_per_sample(from_spec(spec).with_modes({"image": "frozen"}), "none")
    modes = part_modes(spec, run_config("tiny-clip", {"image": {"freeze": True}}))
    trainer = step_model_flops(spec, [], modes, batch_size=2, world=1)
    assert planner == expected
    assert trainer == 2 * expected  # a global batch of 2


def vlm_batch() -> dict[str, torch.Tensor]:
    """Two rows of 10 ids; the first holds the image placeholder (258): 10 + 63 positions."""
    ids = torch.full((2, 10), 65)
    ids[0, 3] = 258
    return {"text": ids, "image": torch.zeros(1, 3, 64, 64)}


@pytest.mark.parametrize(
    ("towers", "plan_modes", "factors"),
    [
        # stage 2 with LoRA: frozen vision, trained projector, LoRA LM (2x: input gradients)
        (
            {"image": {"freeze": True}, "text": {"lora": {"rank": 4}}},
            {"image": "frozen", "text": "lora"},
            (1, 3, 2),
        ),
        # stage 1: only the projector trains; the frozen LM after it still passes the
        # gradient back to it (2x), the frozen vision tower before it runs forward only (1x)
        (
            {"image": {"freeze": True}, "text": {"freeze": True}},
            {"image": "frozen", "text": "frozen"},
            (1, 3, 2),
        ),
    ],
)
def test_vlm_planner_and_trainer_agree(towers, plan_modes, factors):
    spec = load_spec("tiny-vlm")
    f_image, f_projector, f_text = factors
    row = f_image * VISION + f_projector * PROJECTOR + f_text * decoder(73)
    plan = from_spec(spec, Rows(positions=73, images=1)).with_modes(plan_modes)
    assert flops_per_sample(plan, "none")[0] == row
    modes = part_modes(spec, run_config("tiny-vlm", towers))
    batch = vlm_batch()
    expected = row + f_text * decoder(10)  # the second row: text only
    assert step_model_flops(spec, [batch], modes, batch_size=2, world=1) == expected
    assert step_model_flops(spec, [batch, batch], modes, batch_size=4, world=2) == 4 * expected


def test_partial_freezing_behind_a_trained_part():
    # The LM's first block of 2 frozen behind a trained projector: it passes the gradient (2x)
    forward = {"image": 10.0, "projector": 5.0, "text": 100.0}
    modes = {"image": "frozen", "text": PartTraining("train", 0.5)}
    assert train_flops(forward, modes, chained=True) == 10 + 3 * 5 + (3 * 50 + 2 * 50)
    assert train_flops(forward, modes, chained=False) == 10 + 3 * 5 + (3 * 50 + 1 * 50)


def test_recomputation_is_not_model_work():
    spec = load_spec("tiny-vlm")
    modes = part_modes(spec, run_config("tiny-vlm", {"image": {"freeze": True}}))
    batch = [vlm_batch()]
    mfu = step_model_flops(spec, batch, modes, batch_size=2, world=1)
    hfu = step_model_flops(spec, batch, modes, batch_size=2, world=1, recompute=["text", "image"])
    text = decoder(73) + decoder(10)
    assert mfu == VISION + 3 * PROJECTOR + 3 * text
    assert hfu == mfu + text  # one more forward of the trained LM; the frozen tower keeps none
    plan = from_spec(spec, Rows(positions=73, images=1)).with_modes({"image": "frozen"})
    model, hardware = flops_per_sample(plan, "full")
    assert model == VISION + 3 * PROJECTOR + 3 * decoder(73)
    assert hardware == model + PROJECTOR + decoder(73)  # full AC recomputes every trained part


def test_unknown_mode_names_the_field():
    with pytest.raises(FieldError, match="train.towers.image.mode"):
        train_flops({"image": 1.0}, {"image": "half"})


def test_a_packed_rows_attention_is_counted_per_document():
    """A packed row attends within each document (flex attention's block mask skips the
    rest): its FLOPs are its documents' (and its padding's, computed by the matmuls), not one
    row's n^2. One row of 16 ids holding documents of 6 and 8 and 2 ids of padding, each
    image placeholder of the second document taking 64 positions."""
    spec = load_spec("tiny-vlm")
    modes = part_modes(spec, run_config("tiny-vlm", {}))
    ids = torch.zeros(1, 16, dtype=torch.long)
    ids[0, 7] = 258  # tiny-vlm's image placeholder, in the second document
    documents = torch.tensor([[0] * 6 + [1] * 8 + [-1] * 2])
    batch = {"text": ids, "document_ids": documents, "image": torch.zeros(1, 3, 64, 64)}
    got = step_model_flops(spec, [batch], modes, batch_size=1, world=1)
    forward = decoder(6) + decoder(8 + 63) + decoder(2) + VISION + PROJECTOR
    assert got == 3 * forward
    unpacked = decoder(16 + 63) + VISION + PROJECTOR  # the row whole: more attention
    assert got < 3 * unpacked
