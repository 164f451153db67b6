"""SD3's MMDiT: the spec counts what the module holds and computes (SD3 medium's 2.03B
exactly as diffusers builds it), both streams start as the identity, diffusers'
`SD3Transformer2DModel` folders read and predict as diffusers does (float64) and write back
strictly, and a tiny MMDiT trains on cached latents and text-encoder outputs, its loss going
down, resuming bit for bit."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import mmtrain
from mmtrain.cli import main
from mmtrain.config import DiffusionConfig
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.models.build import model_with_weights
from mmtrain.models.formats.diffusers import read_diffusers_dit, write_diffusers_dit
from mmtrain.models.formats.hf_common import HFFolderError
from mmtrain.models.schedules import draw_generator
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError
from mmtrain.train.diffusion import DiffusionObjective
from mmtrain.train.loop import train
from test_dit import _config

diffusers = pytest.importorskip("diffusers")

TEXT_TOKENS, TEXT_WIDTH, POOLED = 5, 24, 20


def tiny(**denoiser) -> ModelSpec:
    """A 2-block MMDiT on 8 x 8 x 4 latents (a 4 x 4 grid cut from a 6 x 6 position table)."""
    d = {"architecture": "mmdit", "sample_size": 8, "channels": 4, "patch_size": 2, "width": 32,
         "layers": 2, "heads": 2, "text_width": TEXT_WIDTH, "pooled_width": POOLED,
         "text_tokens": TEXT_TOKENS, "pos_embed_max_size": 6, "input": "latent", **denoiser}  # fmt: skip
    return ModelSpec.from_dict({"name": "tiny-mmdit", "objective": "flow_matching", "denoiser": d})


def batch(n: int = 3, dtype=torch.float32, size=(8, 8)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "latent": torch.randn(n, 4, *size, generator=g, dtype=dtype),
        "timestep": torch.tensor([3.0, 500.0, 999.0][:n], dtype=dtype),
        "text_hidden": torch.randn(n, TEXT_TOKENS, TEXT_WIDTH, generator=g, dtype=dtype),
        "text_pooled": torch.randn(n, POOLED, generator=g, dtype=dtype),
    }


# ----------------------------------------------------------------------------- the spec
@pytest.mark.parametrize("qk_norm", ["none", "rms_norm"])
def test_spec_counts_the_parameters_and_flops_the_module_holds_and_computes(qk_norm):
    spec = tiny(qk_norm=qk_norm)
    model = mmtrain.create_model(spec, seed=0)
    assert sum(p.numel() for p in model.parameters()) == spec.params()
    # the math kernel: its matmuls are what the counter sees of attention on a CPU
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.predict(batch(n=3))
    assert counter.get_total_flops() == 3 * spec.denoiser.forward_flops()  # FLOPs per sample


def test_the_presets_hold_what_they_count():
    spec = load_spec("tiny-mmdit")
    with torch.device("meta"):
        model = mmtrain.models.dit.DiffusionModel(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.params()


def test_sd3_medium_is_diffusers_sd3_medium():
    # diffusers' SD3Transformer2DModel at SD3 medium's config (its defaults are SD3's layout;
    # the medium checkpoint sets 24 layers of 24 heads, 1536 wide, a 192 position table)
    config = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                  attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                  caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                  pos_embed_max_size=192)  # fmt: skip
    with torch.device("meta"):
        peer = diffusers.SD3Transformer2DModel(**config)
    spec = load_spec("SD3-medium")
    assert spec.params() == sum(p.numel() for p in peer.parameters()) == 2_028_328_000
    assert spec.denoiser.tokens() == 64 * 64


def test_fields_that_do_not_fit_are_refused_by_name():
    for field, value in (("text_width", 0), ("num_classes", 10), ("pos_embed_max_size", 3),
                         ("qk_norm", "layer_norm"), ("learn_sigma", True)):  # fmt: skip
        with pytest.raises(FieldError, match=f"denoiser.{field}"):
            tiny(**{field: value})
    dit = load_spec("tiny-dit").to_dict()
    dit["denoiser"]["text_width"] = 64  # a DiT has no text
    with pytest.raises(FieldError, match="denoiser.text_width"):
        ModelSpec.from_dict(dit)


def test_both_streams_start_as_the_identity_and_the_first_prediction_is_zero():
    model = mmtrain.create_model(tiny(), seed=0)
    zero = {n for n, p in model.named_parameters() if p.dim() >= 2 and not p.any()}
    expected = {f"towers.denoiser.blocks.{i}.{m}.weight" for i in range(2)
                for m in ("modulation", "context_modulation")}  # fmt: skip
    expected |= {"towers.denoiser.modulation_out.weight", "towers.denoiser.out.weight"}
    assert zero == expected
    out = model.predict(batch())
    assert out.shape == (3, 4, 8, 8) and torch.count_nonzero(out) == 0


# ----------------------------------------------------------------------------- diffusers
SD3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
           num_attention_heads=2, joint_attention_dim=TEXT_WIDTH, caption_projection_dim=32,
           pooled_projection_dim=POOLED, out_channels=4, pos_embed_max_size=6)  # fmt: skip


def peer(seed: int = 0, **config):
    """diffusers' SD3 transformer with every weight random (its zero-initialised ones too)."""
    torch.manual_seed(seed)
    model = diffusers.SD3Transformer2DModel(**{**SD3, **config}).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model


def peer_predicts(model, b):
    with torch.no_grad():
        return model(b["latent"], encoder_hidden_states=b["text_hidden"],
                     pooled_projections=b["text_pooled"], timestep=b["timestep"]).sample  # fmt: skip


# The configured 8 x 8, and shape buckets: both crop the centre of the same 6 x 6 patch table.
@pytest.mark.parametrize(("qk_norm", "size"), [(None, (8, 8)), ("rms_norm", (8, 8)),
                                               (None, (4, 12)), (None, (12, 6))])  # fmt: skip
def test_an_sd3_folder_reads_and_predicts_as_diffusers(tmp_path, qk_norm, size):
    model = peer(qk_norm=qk_norm)
    model.save_pretrained(tmp_path / "sd3")
    spec, state = read_diffusers_dit(tmp_path / "sd3")
    assert spec.denoiser.is_mmdit() and spec.objective == "flow_matching"
    assert spec.params() == sum(p.numel() for p in model.parameters())
    ours = model_with_weights(spec, state)
    b = batch(dtype=torch.float64, size=size)
    want = peer_predicts(model, b)
    with torch.no_grad():
        got = ours.predict(b)
    # diffusers' RMSNorm takes its statistics in float32 (a relative error of 2^-24 in q and k,
    # which the blocks carry to the output at its own scale): 1e-6 of the output's scale
    # bounds that with room; without q/k norms the two are equal up to float64 rounding.
    tolerance = 1e-10 if qk_norm is None else 1e-6 * want.abs().max().item()
    assert torch.allclose(got, want, rtol=0, atol=tolerance)


def test_an_mmdit_written_for_diffusers_loads_strictly_and_predicts_the_same(tmp_path):
    model = peer(seed=2)
    model.save_pretrained(tmp_path / "sd3")
    spec, state = read_diffusers_dit(tmp_path / "sd3")
    write_diffusers_dit(spec, state, tmp_path / "back", max_shard_bytes=50_000)  # shards
    assert (tmp_path / "back" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    again, info = diffusers.SD3Transformer2DModel.from_pretrained(
        tmp_path / "back", output_loading_info=True, torch_dtype=torch.float64
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    written, source = again.state_dict(), model.state_dict()
    assert written.keys() == source.keys()
    assert all(torch.equal(written[k], source[k]) for k in source)  # the weights, bitwise
    # The same weights predict the same up to float64 rounding: how diffusers lays out the
    # loaded tensors (accelerate's low-memory loading, when installed) can pick other kernels.
    b = batch(dtype=torch.float64)
    want = peer_predicts(model, b)
    torch.testing.assert_close(
        peer_predicts(again, b), want, rtol=0, atol=1e-12 * want.abs().max().item()
    )


def test_convert_an_sd3_folder_from_and_to_diffusers_on_the_command_line(tmp_path, capsys):
    peer().float().save_pretrained(tmp_path / "sd3")
    argv = ["convert", "--from", "diffusers", str(tmp_path / "sd3"), "--out", str(tmp_path / "m")]
    assert main(argv) == 0
    model = mmtrain.load_model(tmp_path / "m")
    assert model.spec.denoiser.architecture == "mmdit"
    argv = ["convert", "--to", "diffusers", str(tmp_path / "m"), "--out", str(tmp_path / "d")]
    assert main(argv) == 0
    assert "SD3Transformer2DModel" in capsys.readouterr().out
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["_class_name"] == "SD3Transformer2DModel" and config["pos_embed_max_size"] == 6


def test_folders_mmtrain_cannot_build_are_refused_by_name(tmp_path):
    peer().save_pretrained(tmp_path / "sd3")
    config_file = tmp_path / "sd3" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "dual_attention_layers": [0]}))
    with pytest.raises(HFFolderError, match="config.json: dual_attention_layers"):
        read_diffusers_dit(tmp_path / "sd3")
    config_file.write_text(json.dumps({**config, "joint_attention_dim": 16}))  # not the weights'
    with pytest.raises(HFFolderError, match="context_embedder.weight is \\[32, 24\\], expected"):
        read_diffusers_dit(tmp_path / "sd3")
    config_file.write_text(json.dumps(config))
    weights = tmp_path / "sd3" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state["pos_embed.pos_embed"] = state["pos_embed.pos_embed"].flip(1)  # not SD3's positions
    save_file(state, str(weights))
    with pytest.raises(HFFolderError, match="pos_embed.pos_embed is not SD3's"):
        read_diffusers_dit(tmp_path / "sd3")


def test_init_from_an_sd3_folder_starts_from_its_network(tmp_path):
    from mmtrain.train.init_start import load_init

    model = peer(seed=3)
    model.save_pretrained(tmp_path / "sd3")
    ours = mmtrain.create_model(tiny(text_tokens=7), seed=0).double()  # another text length
    report = load_init(ours, str(tmp_path / "sd3"))
    assert report.loaded == len(ours.state_dict()) and not report.random
    b = batch(dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(ours.predict(b), peer_predicts(model, b), rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- training
def test_text_dropout_zeroes_hidden_and_pooled_together_at_its_rate():
    n, rate = 2000, 0.25
    objective = DiffusionObjective(tiny(), DiffusionConfig(cfg_dropout=rate), seed=7)
    objective.prepare(None, [None], None, 3)
    b = {"latent": torch.zeros(n, 4, 8, 8), "text_hidden": torch.ones(n, TEXT_TOKENS, TEXT_WIDTH),
         "text_pooled": torch.ones(n, POOLED)}  # fmt: skip
    inputs = objective.inputs(b, 0)
    dropped = inputs["text_pooled"].sum(1) == 0
    assert torch.equal(inputs["text_hidden"].flatten(1).sum(1) == 0, dropped)  # together
    assert torch.all(inputs["text_pooled"][~dropped] == 1)
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(int(dropped.sum()) - n * rate) < 6 * sigma
    # drawn where a DiT draws its class dropout: noise, timesteps, then one uniform per sample
    g = draw_generator(7, 3, 0, 0, device=torch.device("cpu"))
    torch.randn(b["latent"].shape, generator=g), torch.randn(n, generator=g)
    assert torch.equal(dropped, torch.rand(n, generator=g) < rate)


def latent_text_shards(folder: Path, d, n: int = 24) -> str:
    """Latents that are a shared image plus one of three patterns, each with the text that
    names it: a constant hidden state per pattern and a one-hot pooled vector, as a text
    encoder's cached outputs would be."""
    rng = np.random.default_rng(0)
    shared = rng.standard_normal(d.sample_shape()).astype(np.float32)
    patterns = shared + 0.5 * rng.standard_normal((3, *d.sample_shape())).astype(np.float32)
    with ShardWriter(folder, max_samples=8) as writer:
        for i in range(n):
            k = i % 3
            hidden = np.full((d.text_tokens, d.text_width), k - 1.0, np.float32)
            pooled = np.eye(d.pooled_width, dtype=np.float32)[k]
            latent = patterns[k] + 0.1 * rng.standard_normal(patterns[k].shape).astype(np.float32)
            members = {"latent.npy": latent, "text_hidden.npy": hidden, "text_pooled.npy": pooled}
            sample = {"__key__": f"s{i:04d}"}
            for name, array in members.items():
                buffer = io.BytesIO()
                np.save(buffer, array)
                sample[name] = buffer.getvalue()
            writer.write(sample)
    return str(folder)


def test_a_tiny_mmdit_trains_on_cached_text_and_resumes_bitwise(tmp_path):
    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.data.stream.denoiser_inputs import DenoiserDecoder
    from mmtrain.data.stream.transforms import collate

    spec = tiny()
    shards = latent_text_shards(tmp_path / "shards", spec.denoiser)
    spec_file = tmp_path / "spec.yaml"
    spec.save(spec_file)
    settings = {"steps": 8, "lr": 2e-2, "micro_batch": 8}
    whole = train(_config(tmp_path / "whole", shards, spec_file, **settings))
    stopped = _config(tmp_path / "stopped", shards, spec_file, **settings)
    train(stopped, halt_after_step=3)  # dies after step 3; the step-2 checkpoint resumes
    resumed = train(stopped)
    assert resumed.resumed_from == 2
    for name in ("model.safetensors", "ema/model.safetensors"):
        a = load_file(str(tmp_path / "whole" / name))
        b = load_file(str(tmp_path / "stopped" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history][2:]
    # on a fixed batch with fixed noise: the trained model's error below step 0's (the first
    # prediction is 0, so step 0's error is the target's mean square)
    decode = DenoiserDecoder(spec, train=False)
    fixed = collate([decode(ShardSet.open(shards).read(i), None) for i in range(12)])
    objective = DiffusionObjective(spec, DiffusionConfig(cfg_dropout=0.0), seed=0)
    objective.prepare(None, [None], None, 0)
    inputs = objective.inputs(fixed, 0)
    target = objective.targets[0][0]
    trained = mmtrain.load_model(tmp_path / "whole")
    with torch.no_grad():
        error = (trained.predict(inputs) - target).square().mean().item()
    assert error < 0.9 * target.square().mean().item()


# ----------------------------------------------------------------------------- sampling
def texts(n: int = 2, dtype=torch.float32) -> dict[str, torch.Tensor]:
    b = batch(n, dtype)
    return {"text_hidden": b["text_hidden"], "text_pooled": b["text_pooled"]}


def test_guidance_extrapolates_from_the_zero_text_prediction():
    from mmtrain.eval.sampling import null_condition, sample

    spec = tiny()
    model = mmtrain.create_model(spec, seed=0).double()
    with torch.no_grad():  # a non-zero output layer, so predictions depend on the text
        torch.nn.init.normal_(model.denoiser.out.weight, std=0.02)
        torch.nn.init.normal_(model.denoiser.modulation_out.weight, std=0.02)
    text = texts(dtype=torch.float64)
    plain = sample(model, text, 2, steps=3, seed=5)
    assert torch.equal(plain, sample(model, text, 2, steps=3, seed=5))  # deterministic
    assert not torch.allclose(plain, sample(model, text, 2, steps=3, seed=5, cfg=4.0))
    # the unconditional branch is the text the objective trains as "no text"
    objective = DiffusionObjective(spec, DiffusionConfig(cfg_dropout=1.0), seed=0)
    objective.prepare(None, [None], None, 0)
    dropped = objective.inputs({"latent": torch.zeros(2, 4, 8, 8), **text}, 0)
    null = null_condition(spec.denoiser, text)
    assert all(torch.equal(dropped[k], null[k]) for k in text)
    # one Euler step is linear in the prediction: guided = uncond + cfg (cond - uncond)
    cond, uncond = (sample(model, c, 2, steps=1, seed=5) for c in (text, null))
    guided = sample(model, text, 2, steps=1, seed=5, cfg=4.0)
    assert torch.allclose(guided, uncond + 4.0 * (cond - uncond), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="an MMDiT samples with 'text_hidden' \\+ 'text_pooled'"):
        sample(model, None, 2, steps=1)
    with pytest.raises(ValueError, match="'text_pooled' must be \\[2, 20\\]"):
        sample(model, {**text, "text_pooled": torch.zeros(2, 7)}, 2, steps=1)


def pixel_text_shards(folder: Path, d, n: int = 8) -> str:
    """RGB PNGs at the denoiser's size, each with the cached text of latent_text_shards."""
    from PIL import Image

    rng = np.random.default_rng(1)
    with ShardWriter(folder, max_samples=4) as writer:
        for i in range(n):
            k = i % 3
            png = io.BytesIO()
            pixels = rng.integers(0, 256, (d.sample_size, d.sample_size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(png, format="PNG")
            sample = {"__key__": f"p{i:04d}", "png": png.getvalue()}
            for name, array in {
                "text_hidden.npy": np.full((d.text_tokens, d.text_width), k - 1.0, np.float32),
                "text_pooled.npy": np.eye(d.pooled_width, dtype=np.float32)[k],
            }.items():
                buffer = io.BytesIO()
                np.save(buffer, array)
                sample[name] = buffer.getvalue()
            writer.write(sample)
    return str(folder)


def test_the_evaluator_samples_an_mmdit_for_the_held_out_texts(tmp_path):
    from micro import MICRO_SPEC
    from mmtrain.eval.diffusion import DenoiserEvaluator

    spec = tiny(input="image", channels=3)  # pixels, so the grid can be seen without a VAE
    shards = pixel_text_shards(tmp_path / "shards", spec.denoiser)
    model = mmtrain.create_model(spec, seed=0)
    with torch.no_grad():
        torch.nn.init.normal_(model.denoiser.out.weight, std=0.5)
        torch.nn.init.normal_(model.denoiser.modulation_out.weight, std=0.5)
    clip = mmtrain.create_model(ModelSpec.from_dict(MICRO_SPEC), seed=0).eval()
    evaluator = DenoiserEvaluator(spec, shards, batch_size=4, extractor=clip, samples=8,
                                  steps=2, cfg=2.0, rank=0, world_size=1)  # fmt: skip
    try:
        report = evaluator.report(model)["diffusion"]
        grid = evaluator.sample_grid(model, per_class=2, rows=3)
    finally:
        evaluator.close()
    assert report["n"] == 8 and math.isfinite(report["loss"]) and report["fd_n"] == 8
    assert report["fd"] >= 0
    # a row per held-out text (the first three: three different texts), two samples each
    assert grid.shape == (3 * 8, 2 * 8, 3)
    rows = grid.reshape(3, 8, 16, 3).astype(int)
    assert all(np.abs(rows[i] - rows[j]).sum() > 0 for i, j in ((0, 1), (1, 2), (0, 2)))


def test_an_mmdit_validates_during_training_and_generates_from_cached_text(tmp_path, capsys):
    from test_convert_diffusers import VAE_CONFIG

    spec = tiny()
    shards = latent_text_shards(tmp_path / "shards", spec.denoiser, n=12)
    spec_file = tmp_path / "spec.yaml"
    spec.save(spec_file)
    run = tmp_path / "run"
    config = _config(run, shards, spec_file, steps=4)
    config.data.val = config.data.train
    config.eval.every_steps, config.eval.sample_steps = 2, 2
    history = train(config).history
    val = {row["step"]: row["val/diffusion/loss"] for row in history if "val/diffusion/loss" in row}
    assert sorted(val) == [2, 4] and all(math.isfinite(v) for v in val.values())
    assert not (run / "samples").exists()  # latents: a grid needs the VAE to be seen
    out = tmp_path / "eval.json"  # `mmtrain eval`: the same held-out texts, the same noise
    assert main(["eval", str(run), "--data", shards, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["diffusion"]["loss"] == pytest.approx(val[4], rel=1e-6)
    # generate: one image per text of the first --num samples, decoded by the VAE, in a row
    torch.manual_seed(0)
    diffusers.AutoencoderKL(**VAE_CONFIG).save_pretrained(tmp_path / "vae")
    argv = ["generate", str(run), "--text-from", shards, "--num", "3", "--steps", "2"]
    samples = tmp_path / "samples"
    assert main([*argv, "--cfg", "3", "--vae", str(tmp_path / "vae"), "--out", str(samples)]) == 0
    assert sorted(p.name for p in samples.glob("text*.png")) == [
        "text0_s0000.png", "text1_s0001.png", "text2_s0002.png"]  # fmt: skip
    assert np.asarray(Image.open(samples / "grid.png")).shape == (16, 3 * 16, 3)
    capsys.readouterr()
    refused = {
        "give --vae": [*argv, "--out", str(tmp_path / "x")],  # latents, as for a latent DiT
        "give --text-from SHARDS": [*argv[:2], "--prompt", "a fox", "--out", str(samples)],
        "conditioned on text": [*argv, "--class", "1", "--out", str(samples)],
    }
    for message, refused_argv in refused.items():
        assert main(refused_argv) == 2
        assert message in capsys.readouterr().err
