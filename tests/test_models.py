"""The model builder: exact parameter counts, forward/backward over five modalities, pooling and
masking semantics, the audio front end, fusion, and the model folder round trip."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mmtrain
from mmtrain.models import ModelFileError, MultimodalModel
from mmtrain.models.stems import mel_filterbank
from mmtrain.spec import load_spec, preset_names, with_tower

SOT, EOT = 256, 257  # byte-level tokenizer ids (contracts.md)


def text_ids(lengths: list[int], context: int, g: torch.Generator) -> torch.Tensor:
    """SOT, random bytes, EOT, then padding: `lengths` counts SOT and EOT."""
    ids = torch.zeros(len(lengths), context, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 0] = SOT
        ids[i, 1 : n - 1] = torch.randint(1, 256, (n - 2,), generator=g)
        ids[i, n - 1] = EOT
    return ids


def make_batch(model: MultimodalModel, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch with one input per tower, shaped as contracts.md says."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tower in model.spec.towers.items():
        s = tower.stem
        if tower.modality == "image":
            out[name] = torch.randn(batch, s.channels, s.image_size, s.image_size, generator=g)
        elif tower.modality == "video":
            shape = (batch, s.frames, s.channels, s.image_size, s.image_size)
            out[name] = torch.randn(*shape, generator=g)
        elif tower.modality == "audio":
            out[name] = 0.1 * torch.randn(batch, s.samples(), generator=g)
        elif tower.modality == "timeseries":
            out[name] = torch.randn(batch, s.channels, s.length, generator=g)
        else:
            lengths = [3 + (7 * i) % (s.context_length - 3) for i in range(batch)]
            out[name] = text_ids(lengths, s.context_length, g)
    return out


def contrastive_loss(model: MultimodalModel, out: dict[str, torch.Tensor]) -> torch.Tensor:
    """A small CLIP loss over the spec's pairs (the real one lives in mmtrain.losses)."""
    total = out["fusion"].logsumexp(-1).mean() if "fusion" in out else 0.0
    for a, b in model.spec.pairs:
        logits = model.logit_scale.exp() * out[a] @ out[b].T
        labels = torch.arange(len(logits))
        total = total + (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    return total


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- counts
@pytest.mark.parametrize("name", preset_names())
def test_built_parameter_count_equals_spec(name):
    model = mmtrain.create_model(name, device="meta")
    assert n_params(model) == load_spec(name).params()
    for tower_name, count in model.spec.tower_params().items():
        assert n_params(model.towers[tower_name]) == count
    if model.spec.decoder is not None:  # the decoder LM is the model's "text" tower
        assert n_params(model.towers["text"]) == model.spec.decoder.params()


def test_vit_b_32_has_openclips_parameter_count():
    assert n_params(mmtrain.create_model("ViT-B-32", device="meta")) == 151_277_313


VARIANTS = {
    "swiglu+rmsnorm": dict(activation="swiglu", norm="rmsnorm"),
    "map+gelu_tanh": dict(pooling="map", activation="gelu_tanh", output_proj=True),
    "mean+quick_gelu": dict(pooling="mean", activation="quick_gelu", qkv_bias=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_count_and_run(variant):
    spec = with_tower(load_spec("tiny-clip"), "image", **VARIANTS[variant])
    spec = with_tower(spec, "text", pooling="last", stem={"causal": False}, proj_bias=True)
    model = mmtrain.create_model(spec)
    assert n_params(model) == spec.params()
    out = model(make_batch(model, 2))
    assert out["image"].shape == (2, spec.embed_dim) and torch.isfinite(out["text"]).all()


# ----------------------------------------------------------------------------- training
def test_forward_backward_all_five_modalities():
    model = mmtrain.create_model("tiny-multimodal")
    batch = make_batch(model, 4)
    assert set(batch) == {"image", "video", "audio", "timeseries", "text"}
    out = model(batch)
    assert set(out) == set(batch)
    for emb in out.values():
        assert emb.shape == (4, model.spec.embed_dim)
        torch.testing.assert_close(emb.norm(dim=-1), torch.ones(4))
    contrastive_loss(model, out).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


def test_encode_ignores_other_keys_and_needs_a_tower():
    model = mmtrain.create_model("tiny-clip")
    batch = make_batch(model, 2)
    out = model.encode({"image": batch["image"], "label": torch.zeros(2)})
    assert set(out) == {"image"}
    with pytest.raises(KeyError, match="none of this model's towers"):
        model.encode({"label": torch.zeros(2)})


def test_fusion_head_returns_logits_and_trains():
    model = mmtrain.create_model("tiny-fusion")
    batch = make_batch(model, 3)
    out = model(batch)
    assert out["fusion"].shape == (3, model.spec.fusion.num_outputs)
    assert "fusion" not in model({"image": batch["image"]})  # needs every fused tower
    labels = torch.tensor([0, 1, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(batch)["fusion"], labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, p in model.fusion.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_fusion_memory_ignores_text_padding():
    model = mmtrain.create_model("tiny-fusion").eval()
    batch = make_batch(model, 2)
    short = dict(batch, text=batch["text"][:, :12])  # the same texts without trailing padding
    assert (batch["text"][:, 12:] == 0).all()
    torch.testing.assert_close(model(batch)["fusion"], model(short)["fusion"])


# ----------------------------------------------------------------------------- text pooling
def test_eot_pooling_reads_the_last_non_padding_token():
    model = mmtrain.create_model("tiny-clip").eval()
    tower = model.towers["text"]
    ids = text_ids([5, 9], 48, torch.Generator().manual_seed(1))
    tokens = tower.forward_tokens(ids)
    expected = tower.proj(torch.stack([tokens[0, 4], tokens[1, 8]]))
    torch.testing.assert_close(tower(ids), expected)
    # Padding does not matter: the unpadded text gives the same embedding.
    torch.testing.assert_close(tower(ids[:1, :5]), tower(ids[:1]))


def test_causal_mask_hides_later_tokens():
    model = mmtrain.create_model("tiny-clip").eval()
    tower = model.towers["text"]
    ids = text_ids([20], 48, torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] % 255) + 1
    a, b = tower.forward_tokens(ids), tower.forward_tokens(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:20], b[:, 10:20])


def test_bidirectional_mean_pooling_masks_padding():
    model = mmtrain.create_model("tiny-fusion").eval()
    tower = model.towers["text"]
    ids = text_ids([6, 11], 32, torch.Generator().manual_seed(3))
    torch.testing.assert_close(tower(ids[:1, :6]), tower(ids[:1]))
    # Bidirectional: a later token does change earlier representations.
    changed = ids.clone()
    changed[0, 4] = (ids[0, 4] % 255) + 1
    assert not torch.allclose(
        tower.forward_tokens(ids)[0, :4], tower.forward_tokens(changed)[0, :4]
    )


# ----------------------------------------------------------------------------- audio
def test_audio_stem_tokens_match_spec_and_length_is_fixed():
    model = mmtrain.create_model("tiny-multimodal").eval()
    tower = model.towers["audio"]
    s = tower.spec.stem
    wave = 0.1 * torch.randn(2, s.samples(), generator=torch.Generator().manual_seed(4))
    mel = tower.stem.log_mel(wave)
    assert mel.shape == (2, s.n_mels, s.mel_frames())
    assert tower.stem(wave).shape == (2, tower.spec.tokens(), tower.spec.width)
    # Short clips are zero-padded, long ones cropped: always the spec's token count.
    short, long = wave[:, : s.samples() // 2], torch.cat([wave, wave], dim=1)
    assert tower.stem(short).shape == tower.stem(wave).shape == tower.stem(long).shape
    torch.testing.assert_close(tower(long), tower(wave))
    padded = torch.cat([short, torch.zeros_like(short)], dim=1)
    torch.testing.assert_close(tower(short), tower(padded))


def test_log_mel_peaks_at_the_tones_band():
    """A pure tone lands in the mel band whose filter covers its frequency."""
    sample_rate, n_fft, n_mels = 16000, 400, 32
    fb = mel_filterbank(sample_rate, n_fft, n_mels)
    assert fb.shape == (n_fft // 2 + 1, n_mels) and (fb >= 0).all() and fb.max() <= 1
    model = mmtrain.create_model("tiny-multimodal")
    stem = model.towers["audio"].stem
    t = torch.arange(stem.spec.samples()) / sample_rate
    freq_bin = 40  # 1600 Hz, exactly on an FFT bin
    tone = torch.sin(2 * math.pi * freq_bin * sample_rate / n_fft * t)[None]
    mel = stem.log_mel(tone)[0, :, 5:-5].mean(dim=1)
    assert int(mel.argmax()) == int(fb[freq_bin].argmax())


# ----------------------------------------------------------------------------- init and files
def test_init_is_seeded_and_logit_scale_from_spec():
    a = mmtrain.create_model("tiny-clip", seed=3)
    b = mmtrain.create_model("tiny-clip", seed=3)
    c = mmtrain.create_model("tiny-clip", seed=4)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.towers["image"].proj.weight, c.towers["image"].proj.weight)
    assert a.logit_scale.shape == () and a.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    siglip = mmtrain.create_model("ViT-SO400M-14-SigLIP-384", device="meta")
    assert siglip.logit_bias.shape == ()
    qkv = a.towers["image"].blocks[0].attn.qkv.weight
    # width**-0.5 (tests/test_init_weights.py); 6 standard errors of a sample std of n draws
    bound = 6 / math.sqrt(2 * (qkv.numel() - 1))
    assert qkv.std().item() == pytest.approx(128**-0.5, rel=bound)


def test_save_load_round_trip_gives_identical_outputs(tmp_path):
    model = mmtrain.create_model("tiny-multimodal", seed=5).eval()
    batch = make_batch(model, 2)
    folder = mmtrain.save_model(model, tmp_path / "run")
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "spec.yaml"]
    loaded = mmtrain.load_model(folder).eval()
    assert loaded.spec == model.spec
    expected, got = model(batch), loaded(batch)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    also = mmtrain.load_model(folder / "model.safetensors")  # the weights file itself
    assert torch.equal(also.logit_scale, model.logit_scale)


def test_missing_file_is_named(tmp_path):
    folder = mmtrain.save_model(mmtrain.create_model("tiny-clip"), tmp_path / "m")
    (folder / "spec.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="spec.yaml is missing"):
        mmtrain.load_model(folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mmtrain.load_model(tmp_path / "nowhere")


def test_corrupt_weights_give_a_clear_error(tmp_path):
    folder = mmtrain.save_model(mmtrain.create_model("tiny-clip"), tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(ModelFileError, match="not a readable safetensors file"):
        mmtrain.load_model(folder)


def test_weights_of_another_model_list_the_keys(tmp_path):
    folder = mmtrain.save_model(mmtrain.create_model("tiny-clip"), tmp_path / "m")
    other = mmtrain.save_model(mmtrain.create_model("tiny-fusion"), tmp_path / "other")
    (folder / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(ModelFileError) as err:
        mmtrain.load_model(folder)
    message = str(err.value)
    assert "missing keys: logit_scale" in message
    assert "unexpected keys: fusion." in message
    assert "mis-shaped keys: towers.image." in message and "(model: [" in message


def test_low_precision_model_accepts_float32_inputs():
    model = mmtrain.create_model("tiny-multimodal", dtype=torch.bfloat16)
    out = model(make_batch(model, 2))
    for name, emb in out.items():
        assert emb.dtype == torch.bfloat16 and torch.isfinite(emb).all(), name
