"""Sequence parallelism (train/sequence_parallel.py) splits a decoder's rows and a denoiser's
tokens over a group of ranks and computes what the unsplit model computes.

Four real gloo ranks hold groups of 2 (two of them) and of 4; every group runs every case with
all-to-all and with ring attention, in float64, with every weight random (adaLN-Zero's zeros
would hide the attention's gradients):
- a decoder's NLL: the parts of a group sum to the unsplit rows' NLL and their gradients to
  its gradient (text-only packed rows; a VLM's packed rows with images, and its right-padded
  rows, whose lengths N does not divide; a native-resolution VLM's packed rows with a page and
  a clip, M-RoPE positions);
- a denoiser's prediction (a video DiT, an MMDiT): every rank of a group gets the unsplit
  prediction, and the group's gradients of one loss per rank sum to N times its gradient (what
  DDP's mean over the ranks turns into the data-parallel gradient).
Float64 with ~1e3 roundings per value gives differences ~1e-13; 1e-9 is "equal up to
rounding", while a wrong mask, chunk or normalisation shows at ~1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mmtrain
from dist_helpers import run_distributed
from mmtrain.models.splice import PAD_DOCUMENT
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError
from mmtrain.train.sequence_comm import SequenceGroup
from mmtrain.train.sequence_parallel import (
    ALL_TO_ALL,
    RING,
    SequenceShard,
    apply_sequence_parallel,
    resolve_attention,
    sequence_group,
    splitting_module,
)

EXACT = {"rtol": 1e-9, "atol": 1e-9}
IMAGE_ID = 258
WORLD = 4


def vlm_spec(images: bool = True) -> ModelSpec:
    """tiny-vlm with 16 tokens per image (or its decoder alone): 4 heads, 2 kv heads."""
    spec = load_spec("tiny-vlm").to_dict()
    spec["towers"]["image"].update(stem={"image_size": 32, "patch_size": 8}, width=32, layers=2)
    spec["decoder"].update(width=32, mlp_hidden=64)
    spec["embed_dim"] = 32
    if not images:
        spec["towers"] = {}
        spec.pop("projector")
    return ModelSpec.from_dict(spec)


def video_dit_spec() -> ModelSpec:
    d = {"sample_size": 8, "channels": 3, "patch_size": 4, "width": 32, "layers": 2,
         "heads": 4, "frames": 4, "temporal_patch": 1, "input": "video", "num_classes": 3}  # fmt: skip
    return ModelSpec.from_dict(
        {"name": "sp-video-dit", "objective": "flow_matching", "denoiser": d}
    )


def mmdit_spec() -> ModelSpec:
    d = {"architecture": "mmdit", "sample_size": 8, "channels": 4, "patch_size": 2, "width": 32,
         "layers": 2, "heads": 4, "text_width": 16, "pooled_width": 8, "text_tokens": 4,
         "pos_embed_max_size": 6, "input": "latent", "qk_norm": "rms_norm"}  # fmt: skip
    return ModelSpec.from_dict({"name": "sp-mmdit", "objective": "flow_matching", "denoiser": d})


def _rows(g: torch.Generator, rows: int, length: int) -> torch.Tensor:
    return torch.randint(1, 200, (rows, length), generator=g)


def decoder_batches() -> dict[str, tuple[ModelSpec, dict[str, torch.Tensor]]]:
    """Packed rows (two documents and trailing padding each; images in the VLM's) and
    right-padded rows, 21-id rows: 21 + 16 per image positions, which 2 and 4 do not divide."""
    g = torch.Generator().manual_seed(0)
    documents = torch.tensor([[0] * 9 + [1] * 9 + [PAD_DOCUMENT] * 3, [0] * 14 + [1] * 7])
    text = _rows(g, 2, 21)
    labels = torch.where(documents == PAD_DOCUMENT, -100, text)
    packed = {"text": text, "labels": labels, "document_ids": documents}
    with_images = dict(packed, text=text.clone())
    with_images["text"][0, [2, 11]] = IMAGE_ID  # one image in each document of row 0
    with_images["text"][1, 15] = IMAGE_ID
    with_images["labels"] = torch.where(with_images["text"] == IMAGE_ID, -100, labels)
    with_images["image"] = torch.randn(3, 3, 32, 32, generator=g, dtype=torch.float64)
    mask = torch.arange(21)[None] < torch.tensor([[21], [13]])
    padded_text = torch.where(mask, text, 0)
    padded_text[:, 1] = IMAGE_ID
    padded = {
        "text": padded_text,
        "labels": torch.where(mask & (padded_text != IMAGE_ID), padded_text, -100),
        "attention_mask": mask,
        "image": torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64),
    }
    return {
        "lm-packed": (vlm_spec(images=False), packed),
        "vlm-packed": (vlm_spec(), with_images),
        "vlm-padded": (vlm_spec(), padded),
        "native-vlm-packed": native_vlm_case(g),
    }


def native_vlm_case(g: torch.Generator) -> tuple[ModelSpec, dict]:
    """tiny-qwen2-vl's packed rows, a 16 x 24 page (6 tokens) and a 2 x 16 x 16 clip (4) in
    each: M-RoPE positions [3, R, L] split with the rows (measure_step's batch, in float64)."""
    from mmtrain.train.measure_step import native_language_batch

    spec = load_spec("tiny-qwen2-vl")
    batch = native_language_batch(spec, 2, 30, ((1, 16, 24), (2, 16, 16)), g, packed=True)
    for key in ("image", "video"):
        batch[key] = [x.double() for x in batch[key]]
    return spec, batch


def denoiser_batches() -> dict[str, tuple[ModelSpec, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    f64 = {"generator": g, "dtype": torch.float64}
    video = {"video": torch.randn(2, 3, 4, 8, 8, **f64), "timestep": torch.tensor([3.0, 700.0]),
             "class": torch.tensor([0, 2])}  # fmt: skip
    latent = {"latent": torch.randn(2, 4, 8, 8, **f64), "timestep": torch.tensor([3.0, 700.0]),
              "text_hidden": torch.randn(2, 4, 16, **f64), "text_pooled": torch.randn(2, 8, **f64)}  # fmt: skip
    return {"video-dit": (video_dit_spec(), video), "mmdit": (mmdit_spec(), latent)}


def random_model(spec: ModelSpec) -> torch.nn.Module:
    model = mmtrain.create_model(spec, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return model


def loss_of(model: torch.nn.Module, spec: ModelSpec, batch: dict) -> torch.Tensor:
    """A decoder's NLL sum; a denoiser's prediction against fixed random weights."""
    if spec.decoder is not None:
        return model.nll_sum(batch)
    prediction = model.predict(batch)
    g = torch.Generator().manual_seed(3)
    return (prediction * torch.randn(prediction.shape, generator=g, dtype=prediction.dtype)).sum()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _split_runs(rank: int, world: int, cases: dict) -> dict:
    groups = {size: sequence_group(size) for size in (2, 4)}  # every rank makes every group
    out = {}
    for name, (spec, batch) in cases.items():
        for size, group in groups.items():
            for attention in (ALL_TO_ALL, RING):
                model = random_model(spec)
                splitting_module(model, spec).sequence_split = SequenceShard(group, attention)
                loss = loss_of(model, spec, batch)
                loss.backward()
                out[name, size, attention] = (loss.detach(), grads(model))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def split_results():
    cases = {**decoder_batches(), **denoiser_batches()}
    return cases, run_distributed(_split_runs, world_size=WORLD, args=(cases,), timeout_s=240)


@pytest.mark.parametrize("attention", [ALL_TO_ALL, RING])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "case", ["lm-packed", "vlm-packed", "vlm-padded", "native-vlm-packed", "video-dit", "mmdit"]
)
def test_a_split_sequence_gives_the_unsplit_loss_and_gradients(
    split_results, case, size, attention
):
    cases, results = split_results
    spec, batch = cases[case]
    model = random_model(spec)
    whole = loss_of(model, spec, batch)
    whole.backward()
    expected = grads(model)
    for first in range(0, WORLD, size):
        parts = [results[r][case, size, attention] for r in range(first, first + size)]
        losses = torch.stack([loss for loss, _ in parts])
        summed = {n: sum(g[n] for _, g in parts) for n in expected}
        if spec.decoder is not None:  # each rank scores the targets at its positions
            torch.testing.assert_close(losses.sum(), whole.detach(), **EXACT)
            scale = 1
        else:  # each rank holds the whole prediction (its tokens gathered)
            torch.testing.assert_close(losses, whole.detach().expand(size), **EXACT)
            scale = size
        assert summed.keys() == expected.keys()
        for n, g in expected.items():
            torch.testing.assert_close(summed[n], scale * g, **EXACT, msg=f"{case}: {n}")


def test_the_attention_resolves_by_heads_and_a_wrong_choice_names_the_field():
    assert resolve_attention("auto", 4, 2) == ALL_TO_ALL
    assert resolve_attention("auto", 6, 4) == RING
    with pytest.raises(FieldError, match="train.sequence_parallel_attention"):
        resolve_attention(ALL_TO_ALL, 6, 4)
    factorised = video_dit_spec().to_dict()
    factorised["denoiser"]["attention"] = "factorised"
    model = mmtrain.create_model(ModelSpec.from_dict(factorised), device="meta")
    with pytest.raises(FieldError, match="train.sequence_parallel: a factorised video DiT"):
        apply_sequence_parallel(model, ModelSpec.from_dict(factorised), 2, "auto")
    clip = load_spec("tiny-clip")
    with pytest.raises(FieldError, match="no decoder or denoiser"):
        apply_sequence_parallel(mmtrain.create_model(clip, device="meta"), clip, 2, "auto")


def test_tokens_the_group_does_not_divide_are_refused_by_name():
    shard = SequenceShard(SequenceGroup(group=object(), size=3, rank=0, ranks=(0, 1, 2)), RING)
    with pytest.raises(ValueError, match="train.sequence_parallel 3 does not divide the 16"):
        shard.split_tokens(torch.zeros(1, 16, 8))
