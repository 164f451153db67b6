"""Wan 2.1 text-to-video from its pipeline folder: `init: PIPELINE_DIR` alone trains diffusers'
own WanTransformer3DModel on latents `data encode-latents --pipeline` made with the folder's
AutoencoderKLWan and UMT5; the loss equals one computed with the class in float64; at lr 0 the
run folder is the pipeline, bitwise, and WanPipeline runs it; a LoRA run's adapter loads with
`load_lora_weights` and gives the merged export's outputs; `generate` writes MP4s through the
pipeline; a resumed run ends bitwise where the whole run ends. The pipeline is the tiny one of
tests/wan_pipeline.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mmtrain.cli import main
from mmtrain.config import DiffusionConfig, load_config
from mmtrain.models.model_source import load_model_spec
from mmtrain.train.diffusion import DiffusionObjective
from mmtrain.train.loop import train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from pipeline_runs import (  # noqa: E402
    WEIGHTS,
    check_fsdp_trains_what_ddp_trains,
    losses,
    objective_draws,
)
from wan_pipeline import (  # noqa: E402
    FRAMES,
    LATENT_CHANNELS,
    SHIFT,
    SIDE,
    SPACE_FACTOR,
    TEXT_TOKENS,
    TEXT_WIDTH,
    TIME_FACTOR,
    captioned_clips,
    wan_pipeline,
)

LATENT_FRAMES = 1 + (FRAMES - 1) // TIME_FACTOR
LATENT_SIDE = SIDE // SPACE_FACTOR


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    pipeline = wan_pipeline(root / "wan")
    clips = captioned_clips(root / "clips", n=4)
    # The captions at the pipeline's own length (WanPipeline's 512), what it samples with.
    argv = ["data", "encode-latents", clips, "--pipeline", str(pipeline), "--size", str(SIDE),
            "--out", str(root / "latents")]  # fmt: skip
    assert main(argv) == 0
    return root, pipeline, root / "latents"


def run_config(root: Path, pipeline: Path, latents: Path, run: str, **settings) -> Path:
    config = {"init": str(pipeline),
              "data": {"train": str(latents), "buckets": [[LATENT_FRAMES, LATENT_SIDE, LATENT_SIDE]]},
              "train": {"steps": 2, "batch_size": 2, "lr": 1e-3, "precision": "fp32", **settings},
              "metrics": {"tensorboard": False}, "out": str(root / run)}  # fmt: skip
    path = root / f"{run}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_loss_equals_diffusers_own_wan_in_float64(tmp_path):
    pipeline = wan_pipeline(tmp_path / "wan")
    spec = load_model_spec(str(pipeline))
    assert spec.hub.architecture == "WanTransformer3DModel" and not spec.hub.guidance
    assert spec.tower_names() == ["denoiser"]
    d = spec.denoiser
    assert (d.architecture, d.text_width, d.pooled_width) == ("cross_attention", TEXT_WIDTH, 0)
    from mmtrain.models.build import create_model
    from mmtrain.train.init_hub_denoiser import load_init_hub_denoiser

    model = create_model(spec, dtype=torch.float64)
    load_init_hub_denoiser(model, str(pipeline))
    g = torch.Generator().manual_seed(0)
    shape = (2, LATENT_CHANNELS, LATENT_FRAMES, LATENT_SIDE, LATENT_SIDE)
    batch = {"latent": torch.randn(shape, generator=g, dtype=torch.float64),
             "text_hidden": torch.randn(2, TEXT_TOKENS, TEXT_WIDTH, generator=g,
                                        dtype=torch.float64)}  # fmt: skip
    config = DiffusionConfig(cfg_dropout=0.0)  # the shift: the pipeline scheduler's
    objective = DiffusionObjective(spec, config, seed=5)
    objective.prepare(model, [batch], None, step=7)
    ours = objective.loss(model(objective.inputs(batch, 0)), batch, 0)

    # The reference: the objective's draws, then the latent video into diffusers' class as
    # WanPipeline feeds it (the timestep on the scheduler's 0-1000 scale), times shifted by
    # the scheduler's shift.
    noisy, target, t = objective_draws(batch["latent"], DiffusionConfig(shift=SHIFT), 5, 7)
    wan = diffusers.WanTransformer3DModel.from_pretrained(pipeline, subfolder="transformer")
    prediction = wan.to(torch.float64)(hidden_states=noisy, timestep=1000 * t,
                                       encoder_hidden_states=batch["text_hidden"],
                                       return_dict=False)[0]  # fmt: skip
    reference = (prediction - target).square().flatten(1).mean(dim=1).mean()
    assert torch.allclose(ours, reference, rtol=1e-12, atol=0)


def test_init_alone_trains_and_lr_0_exports_a_pipeline_wan_runs(made, tmp_path):
    root, pipeline, latents = made
    assert main(["train", str(run_config(tmp_path, pipeline, latents, "run", lr=0.0))]) == 0
    run = tmp_path / "run"
    found = losses(run)
    assert len(found) == 2 and all(math.isfinite(v) for v in found)
    source, exported = load_file(pipeline / WEIGHTS), load_file(run / WEIGHTS)
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[k], exported[k]) for k in source)
    pipe = diffusers.WanPipeline.from_pretrained(run)
    frames = pipe("a bar moves right", num_frames=FRAMES, height=SIDE, width=SIDE,
                  num_inference_steps=2, guidance_scale=1.0,
                  output_type="np", generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
    assert frames.shape == (1, FRAMES, SIDE, SIDE, 3) and frames.std() > 0
    size = f"{LATENT_FRAMES}x{LATENT_SIDE}x{LATENT_SIDE}"
    argv = ["generate", str(run), "--prompt", "a bar moves left", "--num", "2", "--steps", "2",
            "--size", size, "--out", str(tmp_path / "samples")]  # fmt: skip
    assert main(argv) == 0
    from mmtrain.data.stream.media import decode_video

    clips = sorted((tmp_path / "samples").glob("*.mp4"))
    assert len(clips) == 2
    decoded = decode_video(clips[0].read_bytes(), FRAMES)
    assert decoded.frames.shape == (FRAMES, SIDE, SIDE, 3)


def test_lora_with_ema_resumes_bitwise_and_its_adapters_load_in_wan(made, tmp_path):
    """A LoRA run with EMA: resumed after a crash it ends bitwise where the whole run ends, the
    averaged adapters included (OUT/ema is a pipeline folder too); the adapter, loaded by
    WanPipeline.load_lora_weights on the source pipeline, gives the merged export's outputs."""
    root, pipeline, latents = made
    towers = {"denoiser": {"lora": {"rank": 2, "alpha": 4, "targets": ["attn", "mlp"]}}}
    settings = dict(towers=towers, lr=3e-2, ema=0.5, steps=4)
    overrides = ["checkpoint.every_steps=2"]
    whole = train(load_config(run_config(tmp_path, pipeline, latents, "whole", **settings),
                              overrides))  # fmt: skip
    stopped = load_config(run_config(tmp_path, pipeline, latents, "stopped", **settings),
                          overrides)  # fmt: skip
    train(stopped, halt_after_step=3)
    resumed = train(stopped)
    assert resumed.resumed_from == 2
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history][2:]
    for name in (WEIGHTS, f"ema/{WEIGHTS}", "adapter/pytorch_lora_weights.safetensors",
                 "ema/adapter/pytorch_lora_weights.safetensors"):  # fmt: skip
        a, b = load_file(tmp_path / "whole" / name), load_file(tmp_path / "stopped" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    run = tmp_path / "whole"
    source, merged = load_file(pipeline / WEIGHTS), load_file(run / WEIGHTS)
    changed = {k for k in source if not torch.equal(source[k], merged[k])}
    assert "blocks.0.attn1.to_q.weight" in changed and "blocks.0.attn2.to_k.weight" in changed
    assert "blocks.1.ffn.net.2.weight" in changed
    assert all(k.startswith("blocks.") and k.endswith(".weight") for k in changed)
    averaged = load_file(run / "ema" / WEIGHTS)
    assert not torch.equal(averaged["blocks.0.attn1.to_q.weight"],
                           merged["blocks.0.attn1.to_q.weight"])  # fmt: skip

    # Both in float64, the merged weights rounded to float32 once: 1e-5 leaves a factor ~170
    # for that rounding through the two blocks' sums.
    with_adapter = diffusers.WanPipeline.from_pretrained(pipeline)
    with_adapter.load_lora_weights(run / "adapter")
    ours = diffusers.WanTransformer3DModel.from_pretrained(run, subfolder="transformer")
    g = torch.Generator().manual_seed(0)
    shape = (2, LATENT_CHANNELS, LATENT_FRAMES, LATENT_SIDE, LATENT_SIDE)
    inputs = {"hidden_states": torch.randn(shape, generator=g, dtype=torch.float64),
              "encoder_hidden_states": torch.randn(2, TEXT_TOKENS, TEXT_WIDTH, generator=g,
                                                   dtype=torch.float64),
              "timestep": torch.tensor([300.0, 800.0], dtype=torch.float64), "return_dict": False}  # fmt: skip
    with torch.no_grad():
        loaded = with_adapter.transformer.to(torch.float64)(**inputs)[0]
        expected = ours.to(torch.float64)(**inputs)[0]
        base = diffusers.WanTransformer3DModel.from_pretrained(pipeline, subfolder="transformer")
        plain = base.to(torch.float64)(**inputs)[0]
    bound = 1e-5 * expected.abs().max()
    assert (loaded - expected).abs().max() <= bound
    assert (plain - expected).abs().max() > 100 * bound  # the adapter does change the outputs


def test_a_pipeline_by_hub_name_trains_from_the_cache_offline(made, tmp_path, monkeypatch):
    """`init: org/name` of a pipeline in the Hugging Face cache: read offline, trained, the
    run folder the cached pipeline (lr 0: bitwise)."""
    from hub_folders import hub_cache

    root, pipeline, latents = made
    cache = tmp_path / "hf-cache"
    hub_cache(pipeline, "tiny-org/wan-tiny", cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the name is no path here
    config = run_config(tmp_path, pipeline, latents, "named", lr=0.0, steps=1)
    text = config.read_text().replace(f"init: {pipeline}", "init: tiny-org/wan-tiny")
    assert "init: tiny-org/wan-tiny" in text
    config.write_text(text)
    assert main(["train", str(config)]) == 0
    source, exported = load_file(pipeline / WEIGHTS), load_file(tmp_path / "named" / WEIGHTS)
    assert all(torch.equal(source[k], exported[k]) for k in source)
    assert (tmp_path / "named" / "vae" / "config.json").is_file()


@pytest.mark.slow
def test_fsdp_on_two_ranks_trains_what_ddp_trains(made, tmp_path):
    """FSDP2 (per block, the model's own output table with the root) on 2 gloo ranks trains
    what DDP on the same ranks trains (pipeline_runs.py says how closely)."""
    _, pipeline, latents = made
    trained = check_fsdp_trains_what_ddp_trains(run_config, tmp_path, pipeline, latents)
    source = load_file(pipeline / WEIGHTS)
    assert not torch.equal(trained["scale_shift_table"], source["scale_shift_table"])
