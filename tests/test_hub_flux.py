"""A FLUX.1 pipeline folder trains as it is (issue 43): `init: PIPELINE_DIR` alone trains
diffusers' own FluxTransformer2DModel on latents and text features that `data encode-latents
--pipeline` wrote with the same pipeline.

The pipeline is a tiny one diffusers builds from configs (tests/test_pipeline_latents.py's
builder, guidance embedding on as FLUX.1-dev's). Proven here:
- mmtrain's flow-matching loss on a fixed batch (noise and timesteps drawn as the objective
  draws them) equals one computed with FluxTransformer2DModel and FluxPipeline's own packing
  helpers, in float64;
- `init:` alone trains 2 steps; at lr 0 the run folder is a pipeline folder that holds the
  source transformer bitwise and that FluxPipeline.from_pretrained runs end to end, as
  `mmtrain generate RUN --prompt` does;
- a run resumed from its step-1 checkpoint ends bitwise where the uninterrupted run ends;
- LoRA on both towers' attention and MLP trains and exports merged weights, and OUT/adapter/
  in diffusers' LoRA format (rank and alpha in its metadata) that `load_lora_weights` reads
  gives the merged export's outputs;
- a pipeline of a family not trained from its folder yet exits 2 naming the class.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from mmtrain.cli import main
from mmtrain.config import DiffusionConfig, load_config
from mmtrain.models.model_source import load_model_spec
from mmtrain.train.diffusion import DiffusionObjective
from mmtrain.train.loop import train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from pipeline_runs import check_fsdp_trains_what_ddp_trains, losses, objective_draws  # noqa: E402
from test_pipeline_latents import (  # noqa: E402
    VAE,
    clip_encoder,
    clip_tokenizer,
    encode,
    t5_encoder,
    t5_tokenizer,
)
from test_text_features import captioned_shards  # noqa: E402

LATENT = 8  # the tiny VAE's latents of 16-pixel images (2x)
GUIDANCE = 3.5


def flux_dev_pipeline(folder: Path) -> Path:
    """FLUX.1-dev's layout at toy widths (guidance embedding on): CLIP-L 8, T5 24 wide."""
    torch.manual_seed(1)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4), guidance_embeds=True)  # fmt: skip
    # FLUX.1-dev's published scheduler config: the shift grows with the image's tokens.
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)  # fmt: skip
    pipe = diffusers.FluxPipeline(
        transformer=transformer, scheduler=scheduler,
        vae=diffusers.AutoencoderKL(**{**VAE, "latent_channels": 16}),
        text_encoder=clip_encoder(8, projection=False), tokenizer=clip_tokenizer(),
        text_encoder_2=t5_encoder(24), tokenizer_2=t5_tokenizer())  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux")
    pipeline = flux_dev_pipeline(root / "flux")
    code, _ = encode(captioned_shards(root / "images"), pipeline, root / "latents")
    assert code == 0
    return root, pipeline, root / "latents"


def run_config(root: Path, pipeline: Path, latents: Path, run: str, **train) -> Path:
    config = {"init": str(pipeline), "data": {"train": str(latents), "buckets": [[LATENT, LATENT]]},
              "train": {"steps": 2, "batch_size": 2, "lr": 1e-3, "precision": "fp32",
                        "diffusion": {"guidance": GUIDANCE}, **train},
              "metrics": {"tensorboard": False}, "out": str(root / run)}  # fmt: skip
    path = root / f"{run}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_loss_equals_diffusers_own_flux_in_float64(made):
    _, pipeline, _ = made
    spec = load_model_spec(str(pipeline))
    assert spec.hub.architecture == "FluxTransformer2DModel" and spec.hub.guidance
    assert spec.tower_names() == ["denoiser", "denoiser_single"]
    from mmtrain.models.build import create_model
    from mmtrain.train.init_hub_denoiser import load_init_hub_denoiser

    model = create_model(spec, dtype=torch.float64)
    load_init_hub_denoiser(model, str(pipeline))
    g = torch.Generator().manual_seed(0)
    batch = {"latent": torch.randn(2, 16, LATENT, LATENT, generator=g, dtype=torch.float64),
             "text_hidden": torch.randn(2, 512, 24, generator=g, dtype=torch.float64),
             "text_pooled": torch.randn(2, 8, generator=g, dtype=torch.float64)}  # fmt: skip
    config = DiffusionConfig(cfg_dropout=0.0, guidance=GUIDANCE, shift=3.0)
    objective = DiffusionObjective(spec, config, seed=5)
    objective.prepare(model, [batch], None, step=7)
    ours = objective.loss(model(objective.inputs(batch, 0)), batch, 0)

    # The reference: the objective's draws, then FluxPipeline's packing around diffusers' class.
    noisy, target, t = objective_draws(batch["latent"], config, 5, 7)
    flux = diffusers.FluxTransformer2DModel.from_pretrained(pipeline, subfolder="transformer")
    flux = flux.to(torch.float64)
    pack = diffusers.FluxPipeline._pack_latents(noisy, 2, 16, LATENT, LATENT)
    ids = diffusers.FluxPipeline._prepare_latent_image_ids(2, LATENT // 2, LATENT // 2, "cpu",
                                                           torch.float64)  # fmt: skip
    out = flux(hidden_states=pack, encoder_hidden_states=batch["text_hidden"],
               pooled_projections=batch["text_pooled"], timestep=t,
               img_ids=ids, txt_ids=torch.zeros(512, 3, dtype=torch.float64),
               guidance=torch.full((2,), GUIDANCE, dtype=torch.float64), return_dict=False)[0]  # fmt: skip
    # _unpack_latents takes pixel sizes: the VAE's factor 2 here.
    prediction = diffusers.FluxPipeline._unpack_latents(out, 2 * LATENT, 2 * LATENT, 2)
    reference = (prediction - target).square().flatten(1).mean(dim=1).mean()
    assert torch.allclose(ours, reference, rtol=1e-12, atol=0)


def test_flux_times_shift_with_the_sample_size_as_its_scheduler_shifts_them(made):
    """FluxPipeline's dynamic shift: mu from the sample's latent tokens (its calculate_shift),
    and the scheduler's exponential time shift at mu equals the shift mmtrain applies."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from mmtrain.models.hub.pipeline import flow_shift
    from mmtrain.models.schedules import shift_flow_time

    _, pipeline, _ = made
    rule = flow_shift(pipeline)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(pipeline,
                                                                          subfolder="scheduler")  # fmt: skip
    c = scheduler.config
    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    for tokens in (64, 256, 1024, 4096):
        mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift,
                             c.max_shift)  # fmt: skip
        theirs = scheduler.time_shift(mu, 1.0, t)
        torch.testing.assert_close(shift_flow_time(t, rule.at(tokens)), theirs, rtol=1e-12,
                                   atol=0)  # fmt: skip
    assert rule.at(4096) > rule.at(256) > 1  # larger samples are pushed towards noise


def test_init_alone_trains_and_lr_0_exports_the_pipeline_bitwise(made, tmp_path):
    root, pipeline, latents = made
    assert main(["train", str(run_config(tmp_path, pipeline, latents, "run", lr=0.0))]) == 0
    run = tmp_path / "run"
    found = losses(run)
    assert len(found) == 2 and all(math.isfinite(v) for v in found)
    source = load_file(pipeline / "transformer" / "diffusion_pytorch_model.safetensors")
    exported = load_file(run / "transformer" / "diffusion_pytorch_model.safetensors")
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[k], exported[k]) for k in source)
    out = tmp_path / "exported"
    assert main(["convert", "--to", "diffusers", str(run), "--out", str(out)]) == 0
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    copy = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(source[k], copy[k]) for k in source)
    pipe = diffusers.FluxPipeline.from_pretrained(out)
    image = pipe("a red square", num_inference_steps=2, height=16, width=16,
                 max_sequence_length=8, generator=torch.Generator().manual_seed(0)).images[0]  # fmt: skip
    assert image.size == (16, 16) and np.asarray(image).std() > 0
    argv = ["generate", str(run), "--prompt", "a red square", "--num", "2", "--steps", "2",
            "--size", f"{LATENT}x{LATENT}", "--out", str(tmp_path / "samples")]  # fmt: skip
    assert main(argv) == 0
    pngs = sorted((tmp_path / "samples").glob("*.png"))
    assert [Image.open(p).size for p in pngs] == [(16, 16)] * 2


def test_a_resumed_run_ends_bitwise_where_the_whole_run_ends(made, tmp_path):
    root, pipeline, latents = made
    overrides = ["train.steps=4", "checkpoint.every_steps=2"]
    whole = train(load_config(run_config(tmp_path, pipeline, latents, "whole"), overrides))
    stopped = load_config(run_config(tmp_path, pipeline, latents, "stopped"), overrides)
    train(stopped, halt_after_step=3)  # dies after step 3; the step-2 checkpoint resumes
    resumed = train(stopped)
    assert resumed.resumed_from == 2
    a = load_file(tmp_path / "whole" / "transformer" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "stopped" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history][2:]


def test_lora_on_both_towers_exports_merged_and_an_adapter_diffusers_loads(made, tmp_path):
    root, pipeline, latents = made
    towers = {"denoiser": {"lora": {"rank": 2, "alpha": 4, "targets": ["attn", "mlp"]}},
              "denoiser_single": {"lora": {"rank": 4, "alpha": 2, "targets": ["attn", "mlp"]}}}  # fmt: skip
    config = run_config(tmp_path, pipeline, latents, "lora", towers=towers, lr=3e-2)
    assert main(["train", str(config)]) == 0
    run = tmp_path / "lora"
    source = load_file(pipeline / "transformer" / "diffusion_pytorch_model.safetensors")
    merged = load_file(run / "transformer" / "diffusion_pytorch_model.safetensors")
    assert source.keys() == merged.keys()
    changed = {k for k in source if not torch.equal(source[k], merged[k])}
    # Adapted: both streams' attention and MLP linears of both kinds of block; nothing else.
    assert "transformer_blocks.0.attn.to_q.weight" in changed
    assert "transformer_blocks.0.attn.add_k_proj.weight" in changed
    assert "transformer_blocks.0.ff.net.2.weight" in changed
    assert "transformer_blocks.0.ff_context.net.0.proj.weight" in changed
    assert "single_transformer_blocks.0.proj_mlp.weight" in changed
    assert all(k.endswith(".weight") and "blocks" in k for k in changed)

    # The adapter in diffusers' LoRA format, on the source pipeline, gives the merged export's
    # outputs: both in float64, the merged weights rounded to float32 once (2^-24 relative
    # each); 1e-5 leaves a factor ~170 for that rounding through the two blocks' sums.
    with_adapter = diffusers.FluxPipeline.from_pretrained(pipeline)
    with_adapter.load_lora_weights(run / "adapter")
    ours = diffusers.FluxTransformer2DModel.from_pretrained(run, subfolder="transformer")
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(2, 16, 64, generator=g, dtype=torch.float64),
              "encoder_hidden_states": torch.randn(2, 5, 24, generator=g, dtype=torch.float64),
              "pooled_projections": torch.randn(2, 8, generator=g, dtype=torch.float64),
              "timestep": torch.tensor([0.3, 0.8], dtype=torch.float64),
              "img_ids": diffusers.FluxPipeline._prepare_latent_image_ids(
                  1, 4, 4, "cpu", torch.float64),
              "txt_ids": torch.zeros(5, 3, dtype=torch.float64),
              "guidance": torch.full((2,), GUIDANCE, dtype=torch.float64), "return_dict": False}  # fmt: skip
    with torch.no_grad():
        loaded = with_adapter.transformer.to(torch.float64)(**inputs)[0]
        expected = ours.to(torch.float64)(**inputs)[0]
        base = diffusers.FluxTransformer2DModel.from_pretrained(pipeline, subfolder="transformer")
        plain = base.to(torch.float64)(**inputs)[0]
    bound = 1e-5 * expected.abs().max()
    assert (loaded - expected).abs().max() <= bound
    assert (plain - expected).abs().max() > 100 * bound  # the adapter does change the outputs


def test_activation_checkpointing_per_block_trains_the_same_weights(made, tmp_path):
    root, pipeline, latents = made
    plain = run_config(tmp_path, pipeline, latents, "plain")
    towers = {name: {"activation_checkpointing": True} for name in ("denoiser", "denoiser_single")}
    checkpointed = run_config(tmp_path, pipeline, latents, "ac", towers=towers)
    assert main(["train", str(plain)]) == 0 and main(["train", str(checkpointed)]) == 0
    a = load_file(tmp_path / "plain" / "transformer" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "ac" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "plain") == losses(tmp_path / "ac")


def test_a_pipeline_of_another_family_exits_2_naming_its_class(made, tmp_path, capsys):
    root, pipeline, latents = made
    other = tmp_path / "hunyuan"
    shutil.copytree(pipeline, other)
    config = json.loads((other / "transformer" / "config.json").read_text())
    config["_class_name"] = "HunyuanVideoTransformer3DModel"
    (other / "transformer" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["train", str(run_config(tmp_path, other, latents, "hunyuan"))]) == 2
    err = capsys.readouterr().err
    assert "HunyuanVideoTransformer3DModel" in err
    assert "FluxTransformer2DModel (FluxPipeline), WanTransformer3DModel (WanPipeline)" in err


def test_latents_of_another_pipelines_vae_are_refused_by_name(made, tmp_path, capsys):
    """A run from a pipeline whose VAE is not the one `encode-latents --pipeline` recorded
    exits 2 before the first step, naming the component and how to encode again."""
    _, pipeline, latents = made
    other = tmp_path / "other"
    shutil.copytree(pipeline, other)
    config = json.loads((other / "vae" / "config.json").read_text())
    config["scaling_factor"] = config["scaling_factor"] * 2  # another VAE's latent scale
    (other / "vae" / "config.json").write_text(json.dumps(config))
    assert main(["train", str(run_config(tmp_path, other, latents, "run"))]) == 2
    err = capsys.readouterr().err
    assert "data.train[0].path" in err and "vae" in err and "encode-latents --pipeline" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_fsdp_on_two_ranks_trains_what_ddp_trains(made, tmp_path):
    """FSDP2 (per block of both towers) on 2 gloo ranks trains what DDP on the same 2 ranks
    trains (pipeline_runs.py says how closely)."""
    _, pipeline, latents = made
    check_fsdp_trains_what_ddp_trains(run_config, tmp_path, pipeline, latents)
