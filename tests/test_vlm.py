"""The language model and vision-language model (models/vlm.py): the module counts what the spec
counts, the vectorised splice computes what a plain per-token loop computes with the decoder on
the expanded sequence, packing, padding and the KV cache change nothing, and weights round-trip.

Tolerance: "equal up to rounding" compares float64 models. The splice only moves embeddings, so
the two sides run the same decoder on the same inputs; they differ only where batching changes
the order of sums (padding keys masked to exact zeros, rows of other lengths in the same matmul),
each rounding ~1e-16 relative, over sums of at most a few hundred O(1) terms: RTOL 1e-9 leaves
five orders of magnitude on any CPU.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import mmtrain
from mmtrain.data.stream.chat_templates import EncodedSample
from mmtrain.data.stream.packing import PAD_DOCUMENT, pack_rows
from mmtrain.models import LanguageModel, load_model, save_model
from mmtrain.models.decoder import Decoder
from mmtrain.models.init_rules import init_rules
from mmtrain.models.splice import PAD_DOCUMENT as MODEL_PAD_DOCUMENT
from mmtrain.spec import ModelSpec, load_spec

RTOL, ATOL = 1e-9, 1e-12
IMG = 258  # tiny-vlm's image_token_id
SOT = 256
P = 64  # tiny-vlm's image tokens per image (8 x 8 patches, no class token)


def vlm_spec(*, tied: bool = True, **projector) -> ModelSpec:
    spec = load_spec("tiny-vlm")
    return dataclasses.replace(
        spec,
        decoder=spec.decoder.replace(tie_embeddings=tied),
        projector=dataclasses.replace(spec.projector, **projector),
    )


def lm_spec(*, tied: bool = True) -> ModelSpec:
    spec = load_spec("tiny-vlm")
    return dataclasses.replace(
        spec, towers={}, projector=None, decoder=spec.decoder.replace(tie_embeddings=tied)
    )


@pytest.fixture(scope="module")
def model() -> LanguageModel:
    """Untied head: greedy tokens vary (a tied random model mostly repeats its input)."""
    return mmtrain.create_model(vlm_spec(tied=False), dtype=torch.float64, seed=1).eval()


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 64, 64, generator=torch.Generator().manual_seed(seed)).double()


def ids(*values: int) -> list[int]:
    return list(values)


# ----------------------------------------------------------------------------- reference
def reference_features(model: LanguageModel, pixels: torch.Tensor) -> torch.Tensor:
    """The image tokens by hand: stem, pre-norm, the blocks up to the feature layer, class token
    dropped (unless keep_cls), then linear / GELU / linear with the projector's weights."""
    tower, proj = model.towers["image"], model.projector
    x = tower.norm_pre(tower.stem(pixels))
    for block in tower.blocks[: model.spec.projector.blocks_used(tower.spec)]:
        x = block(x)
    if not model.spec.projector.keep_cls:
        x = x[:, 1:]
    x = F.linear(x, proj.fc1.weight, proj.fc1.bias)
    if proj.fc2 is not None:
        x = F.linear(F.gelu(x), proj.fc2.weight, proj.fc2.bias)
    return x


def reference_logits(model: LanguageModel, row: list[int], pixels: torch.Tensor) -> torch.Tensor:
    """[len(row), vocab] for ONE sample: its expanded embeddings built token by token, the
    decoder run on them alone, the logits read at each id's last position."""
    decoder: Decoder = model.decoder
    feats = reference_features(model, pixels) if len(pixels) else None
    pieces, last, k = [], [], 0
    for token in row:
        if token == IMG:
            pieces.append(feats[k])
            k += 1
        else:
            pieces.append(decoder.embed.weight[token][None])
        last.append(sum(len(p) for p in pieces) - 1)
    assert k == len(pixels)
    hidden = decoder.hidden(inputs_embeds=torch.cat(pieces)[None])[0]
    return decoder.head(hidden[last])


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- the spec's count
@pytest.mark.parametrize(
    "spec",
    [
        load_spec("tiny-vlm"),
        lm_spec(),
        lm_spec(tied=False),
        vlm_spec(kind="linear"),
        vlm_spec(kind="mlp", tied=False),
        vlm_spec(keep_cls=True, feature_layer=3),
    ],
    ids=["tiny-vlm", "lm", "lm-untied", "linear", "mlp-untied", "keep-cls"],
)
def test_built_module_has_the_parameters_the_spec_counts(spec):
    built = mmtrain.create_model(spec, device="meta")
    assert isinstance(built, LanguageModel)
    assert sum(p.numel() for p in built.parameters()) == spec.params()
    expected_towers = ["text"] if spec.projector is None else ["image", "text"]
    assert list(built.towers) == expected_towers
    assert isinstance(built.towers["text"], Decoder)
    assert (built.projector is None) == (spec.projector is None)


def test_llava_preset_has_the_published_size():
    """llava-hf/llava-1.5-7b-hf holds 7,063,427,072 parameters (its safetensors index)."""
    spec = load_spec("llava-1.5-7b")
    assert spec.params() == 7_063_427_072
    assert spec.image_tokens() == 576
    built = mmtrain.create_model(spec, device="meta")
    assert sum(p.numel() for p in built.parameters()) == spec.params()


def test_state_dict_keys_follow_the_contract():
    keys = set(mmtrain.create_model(vlm_spec(tied=False), device="meta").state_dict())
    for key in (
        "towers.image.stem.patch_embed.weight",
        "towers.text.embed.weight",
        "towers.text.blocks.1.attn.qkv.weight",
        "towers.text.blocks.1.mlp.fc2.weight",
        "towers.text.norm.weight",
        "towers.text.lm_head.weight",
        "projector.fc1.bias",
        "projector.fc2.weight",
    ):
        assert key in keys
    tied = set(mmtrain.create_model(load_spec("tiny-vlm"), device="meta").state_dict())
    assert "towers.text.lm_head.weight" not in tied


# ----------------------------------------------------------------------------- logits
def test_logits_equal_the_decoder_on_the_expanded_sequence(model):
    """Several images in a row, a text-only row and a row starting with an image, in one batch
    (expanded lengths 2 * 64 + 5, 7 and 64 + 6): every row of logits, at text ids and at
    placeholders (the image's last token), equals the per-sample reference."""
    rows = [
        ids(SOT, 72, IMG, 105, IMG, 33, 10),
        ids(SOT, 65, 66, 67, 68, 69, 70),
        ids(IMG, 87, 104, 97, 116, 63, 10),
    ]
    pixels = images(3)
    out = model.logits({"text": torch.tensor(rows), "image": pixels})
    assert out.shape == (3, 7, 259)
    per_row = [pixels[:2], pixels[:0], pixels[2:]]
    for r, row in enumerate(rows):
        close(out[r], reference_logits(model, row, per_row[r]))
    assert model({"text": torch.tensor(rows), "image": pixels})["logits"].equal(out)


@pytest.mark.parametrize("changes", [dict(kind="linear"), dict(keep_cls=True, feature_layer=5)])
def test_projector_variants_splice_what_they_compute(changes):
    vlm = mmtrain.create_model(vlm_spec(**changes), dtype=torch.float64, seed=2)
    assert vlm.spec.image_tokens() == P + int(changes.get("keep_cls", False))
    row = ids(SOT, IMG, 72, 105)
    out = vlm.logits({"text": torch.tensor([row]), "image": images(1)})
    close(out[0], reference_logits(vlm, row, images(1)))


def test_images_of_their_own_token_counts_splice_in_reading_order():
    # A native-resolution tower gives each image the tokens of its own size: 3, 1 and 2 here,
    # the second row with no image and shorter (right padding after its ids).
    from mmtrain.models.splice import make_layout, splice

    text = torch.tensor([[5, 9, 6, 9, 7], [9, 8, 8, 0, 0]])
    is_image = text == 9
    counts = torch.tensor([3, 1, 2])
    layout = make_layout(is_image, counts)
    text_embeds = text[..., None].double().expand(-1, -1, 2) * torch.tensor([1.0, -1.0])
    images = torch.arange(6, dtype=torch.float64)[:, None].expand(-1, 2) + 100
    starts = torch.tensor([0, 3, 4])  # where each image's tokens begin
    embeds = splice(text_embeds, images, is_image, layout, starts)
    assert layout.owner.shape == (2, 7)  # row 0: 3 text ids + 3 + 1 image tokens
    assert embeds[0, :, 0].tolist() == [5, 100, 101, 102, 6, 103, 7]
    assert embeds[1, :, 0].tolist() == [104, 105, 8, 8, 0, 0, 0]  # the last: padding, zero
    assert layout.ends.tolist() == [[0, 3, 4, 5, 6], [1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="2 image token counts for 3 placeholders"):
        make_layout(is_image, counts[:2])
    # one count for all equals the same count per image
    same = make_layout(is_image, torch.tensor([4, 4, 4]))
    assert torch.equal(same.owner, make_layout(is_image, 4).owner)


def test_language_model_alone_is_the_decoder():
    lm = mmtrain.create_model(lm_spec(tied=False), dtype=torch.float64, seed=3)
    text = torch.tensor([[SOT, 1, 2, 3, 4], [SOT, 9, 8, 7, 6]])
    close(lm.logits({"text": text}), lm.decoder(text))
    new = lm.generate({"text": text}, 5, eos_ids=())
    assert new.equal(lm.decoder.generate(text, 5, eos_ids=())[:, 5:])


def samples() -> list[EncodedSample]:
    rows = [
        ids(SOT, IMG, 72, 105, 33),
        ids(SOT, 65, 66, 67),
        ids(SOT, 87, IMG, 104, IMG, 63),
        ids(SOT, IMG, 10),
    ]
    return [EncodedSample(r, [-100] * len(r)) for r in rows]


def test_packed_rows_equal_the_samples_run_one_by_one(model):
    """Rows from the real packer (document_ids, position_ids in placeholder space, padding as
    document -1): each sample's logits equal the sample run alone; positions derived from the
    document ids give the same."""
    assert MODEL_PAD_DOCUMENT == PAD_DOCUMENT
    data = samples()
    packed = list(pack_rows(data, 2 * P + 12, image_token_id=IMG, image_length=P, open_rows=2))
    width = max(len(r.input_ids) for r in packed)

    def padded(values: list[int], fill: int) -> list[int]:
        return values + [fill] * (width - len(values))

    batch = {
        "text": torch.tensor([padded(r.input_ids, 0) for r in packed]),
        "document_ids": torch.tensor([padded(r.document_ids, PAD_DOCUMENT) for r in packed]),
        "position_ids": torch.tensor([padded(r.position_ids, 0) for r in packed]),
    }
    pixels = images(4)
    per_sample = {0: pixels[0:1], 1: pixels[:0], 2: pixels[1:3], 3: pixels[3:4]}
    order = [i for r in packed for i in r.samples]
    batch["image"] = torch.cat([per_sample[i] for i in order])
    assert sorted(order) == [0, 1, 2, 3] and len(packed) < 4  # some row holds two samples
    out = model.logits(batch)
    without_positions = model.logits({k: v for k, v in batch.items() if k != "position_ids"})
    close(without_positions, out)
    for r, row in enumerate(packed):
        for i in row.samples:
            where = [t for t, d in enumerate(row.document_ids) if d == i]
            alone = model.logits(
                {"text": torch.tensor([data[i].input_ids]), "image": per_sample[i]}
            )
            close(out[r, where], alone[0])


# ----------------------------------------------------------------------------- generation
def test_left_padded_generate_equals_each_prompt_alone(model):
    prompts = [ids(SOT, IMG, 72, 105), ids(SOT, 87, 104, IMG, 97, IMG, 116, 63), ids(SOT, 65)]
    pixels = images(4, seed=5)
    per_prompt = [pixels[0:1], pixels[1:3], pixels[:0]]
    width = max(map(len, prompts))
    batch = {
        "text": torch.tensor([[0] * (width - len(p)) + p for p in prompts]),
        "attention_mask": torch.tensor(
            [[False] * (width - len(p)) + [True] * len(p) for p in prompts]
        ),
        "image": pixels[:3],
    }
    together = model.generate(batch, 8, eos_ids=())
    assert together.shape == (3, 8)
    for r, prompt in enumerate(prompts):
        alone = model.generate(
            {"text": torch.tensor([prompt]), "image": per_prompt[r]}, 8, eos_ids=()
        )
        assert together[r].equal(alone[0]), r


def test_kv_cache_generation_equals_full_recomputation(model):
    """Greedy: each new token is the argmax of the full logits of prompt + tokens so far.
    Rows of equal ids but unequal expanded lengths (two images against none)."""
    text = torch.tensor([ids(SOT, IMG, 72, IMG, 10), ids(SOT, 65, 66, 67, 10)])
    pixels = images(2, seed=6)
    new = model.generate({"text": text, "image": pixels}, 6, eos_ids=())
    so_far = text
    for step in range(6):
        expected = model.logits({"text": so_far, "image": pixels})[:, -1].argmax(dim=-1)
        assert new[:, step].equal(expected), step
        so_far = torch.cat([so_far, expected[:, None]], dim=1)
    assert len(set(new.flatten().tolist())) > 2  # not one repeated token


def test_generation_stops_and_pads_after_eos(model):
    text = torch.tensor([ids(SOT, IMG, 72), ids(SOT, 65, 66)])
    pixels = images(1)
    free = model.generate({"text": text, "image": pixels}, 6, eos_ids=())
    eos = int(free[0, 1])  # row 0 ends at its second token
    out = model.generate({"text": text, "image": pixels}, 6, eos_ids=(eos,), pad_id=3)
    assert out[0, :2].equal(free[0, :2]) and out.shape[1] >= 2
    assert bool((out[0, 2:] == 3).all())
    assert model.generate({"text": text, "image": pixels}, 0).shape == (2, 0)
    sampled = [
        model.generate(
            {"text": text, "image": pixels},
            4,
            temperature=1.0,
            top_p=0.9,
            generator=torch.Generator().manual_seed(9),
        )
        for _ in range(2)
    ]
    assert sampled[0].equal(sampled[1])


# ----------------------------------------------------------------------------- no image, errors
def test_empty_image_batch_still_reaches_the_vision_tower():
    """The distributed rule (LanguageModel._image_embeds): "image" with no image runs the tower
    on the empty batch and backward reaches every trained parameter (zero gradients); without
    the key the vision tower sits out. Blocks after the feature layer are frozen."""
    vlm = mmtrain.create_model("tiny-vlm", dtype=torch.float64)
    text = torch.tensor([ids(SOT, 72, 105)])
    vlm.logits({"text": text, "image": images(0)}).sum().backward()
    trained = {n: p for n, p in vlm.named_parameters() if p.requires_grad}
    assert all(p.grad is not None for p in trained.values())
    assert all(not p.grad.any() for n, p in trained.items() if not n.startswith("towers.text"))
    frozen = [n for n, p in vlm.named_parameters() if not p.requires_grad]
    assert frozen and all(
        n.startswith(("towers.image.blocks.4.", "towers.image.norm_final")) for n in frozen
    )
    vlm.zero_grad(set_to_none=True)
    vlm.logits({"text": text}).sum().backward()
    assert all(
        p.grad is None for n, p in trained.items() if n.startswith(("towers.image", "projector"))
    )


def test_bad_batches_are_refused_with_the_reason(model):
    text = torch.tensor([ids(SOT, IMG, 72, IMG)])
    with pytest.raises(ValueError, match=r"1 image\(s\) but its text has 2 placeholder"):
        model.logits({"text": text, "image": images(1)})
    with pytest.raises(ValueError, match="no 'image' tensor"):
        model.logits({"text": text})
    with pytest.raises(ValueError, match="'document_ids' must have the shape"):
        model.logits({"text": text, "image": images(2), "document_ids": torch.zeros(1, 3).long()})
    with pytest.raises(ValueError, match="one prompt per row"):
        model.generate(
            {"text": text, "image": images(2), "document_ids": torch.zeros_like(text)}, 2
        )
    with pytest.raises(KeyError, match="token ids under 'text'"):
        model.logits({"image": images(2)})
    lm = mmtrain.create_model(lm_spec())
    with pytest.raises(ValueError, match="no image tower"):
        lm.logits({"text": torch.tensor([[SOT]]), "image": images(1)})


# ----------------------------------------------------------------------------- weights
def test_save_load_round_trip_is_bitwise(tmp_path, model):
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert isinstance(loaded, LanguageModel) and loaded.spec == model.spec
    state, back = model.state_dict(), loaded.state_dict()
    assert list(state) == list(back)
    assert all(state[k].dtype == back[k].dtype and state[k].equal(back[k]) for k in state)
    assert [p.requires_grad for p in loaded.parameters()] == [
        p.requires_grad for p in model.parameters()
    ]
    batch = {"text": torch.tensor([ids(SOT, IMG, 72)]), "image": images(1)}
    # The weights are bitwise equal; the outputs equal up to float64 rounding: on some CPUs
    # (measured on an AMD EPYC: 3e-15) the matmul kernels order their sums by the buffers'
    # alignment, which differs between a loaded and a freshly built tensor.
    assert torch.allclose(loaded.logits(batch), model.logits(batch), rtol=1e-12, atol=1e-12)
    lm = mmtrain.create_model(lm_spec())
    save_model(lm, tmp_path / "lm")
    assert load_model(tmp_path / "lm").spec == lm.spec


def test_init_is_a_function_of_the_seed_and_follows_the_rules():
    a, b = (mmtrain.create_model("tiny-vlm", seed=7) for _ in range(2))
    c = mmtrain.create_model("tiny-vlm", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(sa[k].equal(sb[k]) for k in sa)
    assert not sa["projector.fc1.weight"].equal(sc["projector.fc1.weight"])
    assert not sa["towers.text.embed.weight"].equal(sc["towers.text.embed.weight"])
    # The decoder draws through Decoder.init_weights; init_rules describes it (and the tower and
    # projector): every value is its rule's constant, or a sample of its normal (6 sigma bounds).
    rules = init_rules(a)
    for name, param in a.named_parameters():
        rule = rules[name]
        if rule.std is None:
            assert torch.all(param == rule.value), name
            continue
        x = param.detach().double().flatten()
        n = x.numel()
        assert abs(x.mean().item()) <= 6 * rule.std / math.sqrt(n), name
        assert abs(x.std().item() / rule.std - 1) <= 6 / math.sqrt(2 * (n - 1)), name


# ----------------------------------------------------------------------------- FSDP2, 2 ranks
def _fsdp_gradients(rank: int, world_size: int, state: dict, batches: list) -> dict:
    """One forward/backward of this rank's batch under FSDP2; the full (gathered) gradients."""
    from mmtrain.models.build import model_with_weights
    from mmtrain.train.parallel import apply_fsdp

    vlm = apply_fsdp(model_with_weights(load_spec("tiny-vlm"), state), "fp64")
    batch = batches[rank]
    weights = torch.linspace(-1, 1, 259, dtype=torch.float64)
    (vlm(batch)["logits"] * weights).sum().backward()
    return {
        name: None if p.grad is None else p.grad.full_tensor() for name, p in vlm.named_parameters()
    }


@pytest.mark.slow
def test_fsdp_ranks_with_and_without_images_follow_one_process():
    """Rank 0 holds an image, rank 1 an empty "image" batch: no collective is left unmatched
    (the run finishes) and the averaged gradients equal one process's, in float64."""
    from dist_helpers import run_distributed

    vlm = mmtrain.create_model("tiny-vlm", dtype=torch.float64, seed=4)
    state = {k: v.clone() for k, v in vlm.state_dict().items()}
    batches = [
        {"text": torch.tensor([ids(SOT, IMG, 72, 105)]), "image": images(1)},
        {"text": torch.tensor([ids(SOT, 65, 66, 67)]), "image": images(0)},
    ]
    ranks = run_distributed(_fsdp_gradients, 2, args=(state, batches))
    weights = torch.linspace(-1, 1, 259, dtype=torch.float64)
    for batch in batches:
        (vlm(batch)["logits"] * weights).sum().backward()
    for name, p in vlm.named_parameters():
        for got in ranks:
            if p.grad is None:
                assert got[name] is None, name
            else:
                close(got[name], p.grad / 2)
