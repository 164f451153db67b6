"""diffusers' DiT <-> mmtrain's: a `DiTTransformer2DModel` built by diffusers from a config,
saved by diffusers, read by mmtrain, gives diffusers' output (float64, to rounding) and writes
back a folder diffusers loads with no missing or unexpected key and the same output."""

from __future__ import annotations

import json

import pytest
import torch

import mmtrain
from mmtrain.cli import main
from mmtrain.models.formats.diffusers import read_diffusers_dit, write_diffusers_dit
from mmtrain.models.formats.hf_common import HFFolderError

diffusers = pytest.importorskip("diffusers")

CONFIG = dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
              num_layers=2, sample_size=16, patch_size=2, num_embeds_ada_norm=10)  # fmt: skip


def peer(seed: int = 0):
    """diffusers' DiT with every weight random (its zero-initialised ones too), in float64."""
    torch.manual_seed(seed)
    model = diffusers.DiTTransformer2DModel(**CONFIG).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
        emb = model.transformer_blocks[0].norm1.emb  # DiT has one embedder: copies agree
        for block in model.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(emb.state_dict())
    return model


def inputs(n: int = 3, size: tuple[int, int] = (16, 16)):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, *size, generator=g, dtype=torch.float64)
    return x, torch.tensor([3.0, 500.0, 999.0]), torch.tensor([0, 7, 10])  # 10: "no class"


# The configured 16 x 16, and two shape buckets: diffusers stretches the positions of a grid
# other than the configured one to span it, and so does mmtrain.
@pytest.mark.parametrize("size", [(16, 16), (8, 24), (20, 12)])
def test_a_diffusers_dit_reads_and_predicts_as_diffusers(tmp_path, size):
    model = peer()
    model.save_pretrained(tmp_path / "dit")
    spec, state = read_diffusers_dit(tmp_path / "dit")
    assert spec.objective == "diffusion" and spec.denoiser.learn_sigma
    # diffusers repeats the timestep MLP and class table in every block: ours has them once
    copy = sum(p.numel() for p in model.transformer_blocks[0].norm1.emb.parameters())
    assert spec.params() == sum(p.numel() for p in model.parameters()) - (2 - 1) * copy
    ours = mmtrain.models.build.model_with_weights(spec, state)
    x, t, y = inputs(size=size)
    with torch.no_grad():
        want = _patch_tokens(model, x, t, y)
        got = ours.predict({"latent": x, "timestep": t, "class": y})
    rows, cols = size[0] // 2, size[1] // 2
    want = ours.denoiser._unpatchify(want, (1, rows, cols))
    assert torch.allclose(got, want, rtol=0, atol=1e-10)


def test_a_dit_written_for_diffusers_loads_strictly_and_predicts_the_same(tmp_path):
    model = peer(seed=2)
    model.save_pretrained(tmp_path / "dit")
    spec, state = read_diffusers_dit(tmp_path / "dit")
    write_diffusers_dit(spec, state, tmp_path / "back", max_shard_bytes=200_000)  # shards
    assert (tmp_path / "back" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    again, info = diffusers.DiTTransformer2DModel.from_pretrained(
        tmp_path / "back", output_loading_info=True, torch_dtype=torch.float64
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    x, t, y = inputs()
    with torch.no_grad():
        assert torch.equal(again(x, timestep=t, class_labels=y).sample,
                           model(x, timestep=t, class_labels=y).sample)  # fmt: skip


def test_convert_from_and_to_diffusers_on_the_command_line(tmp_path):
    peer().float().save_pretrained(tmp_path / "dit")
    assert (
        main(
            ["convert", "--from", "diffusers", str(tmp_path / "dit"), "--out", str(tmp_path / "m")]
        )
        == 0
    )
    model = mmtrain.load_model(tmp_path / "m")
    assert model.spec.denoiser.num_classes == 10
    assert (
        main(["convert", "--to", "diffusers", str(tmp_path / "m"), "--out", str(tmp_path / "d")])
        == 0
    )
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["_class_name"] == "DiTTransformer2DModel" and config["out_channels"] == 8


def test_blocks_whose_embedder_copies_differ_are_refused_by_name(tmp_path):
    model = peer()
    with torch.no_grad():
        model.transformer_blocks[1].norm1.emb.timestep_embedder.linear_1.weight.add_(1.0)
    model.save_pretrained(tmp_path / "dit")
    with pytest.raises(HFFolderError, match="transformer_blocks.1.norm1.emb"):
        read_diffusers_dit(tmp_path / "dit")


def test_init_from_a_diffusers_dit_fine_tunes_its_network(tmp_path):
    # A flow model started from DiT's DDPM checkpoint: the same network, the prediction's
    # output rows kept and the learned-sigma rows dropped.
    from mmtrain.spec import ModelSpec
    from mmtrain.train.init_start import load_init

    model = peer(seed=3)
    model.save_pretrained(tmp_path / "dit")
    spec, _ = read_diffusers_dit(tmp_path / "dit")
    flow = ModelSpec.from_dict({**spec.to_dict(), "objective": "flow_matching",
                                "denoiser": {**spec.denoiser.to_dict(), "prediction": "velocity",
                                             "learn_sigma": False}})  # fmt: skip
    ours = mmtrain.create_model(flow).double()
    report = load_init(ours, str(tmp_path / "dit"))
    assert report.loaded == len(ours.state_dict()) and not report.random
    x, t, y = inputs()
    with torch.no_grad():
        want = model(x, timestep=t, class_labels=y).sample[:, :4]
        got = ours.predict({"latent": x, "timestep": t, "class": y})
    assert torch.allclose(got, want, rtol=0, atol=1e-10)


VAE_CONFIG = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
                  block_out_channels=(32, 64), norm_num_groups=8, sample_size=32,
                  down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2)  # fmt: skip


def test_a_diffusers_autoencoder_encodes_and_decodes_as_diffusers(tmp_path):
    from mmtrain.models.formats.diffusers import read_diffusers_vae, write_diffusers_vae

    torch.manual_seed(0)
    peer_vae = diffusers.AutoencoderKL(**VAE_CONFIG).double().eval()
    with torch.no_grad():
        for param in peer_vae.parameters():
            param.add_(0.05 * torch.randn_like(param))  # off its init, so every layer counts
    peer_vae.save_pretrained(tmp_path / "vae")
    vae = read_diffusers_vae(tmp_path / "vae").double().eval()
    images = torch.rand(2, 3, 32, 32, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        mean = peer_vae.encode(images).latent_dist.mean
        got = vae.encode_latent(images)
        assert got.shape == (2, 4, 16, 16)
        assert torch.allclose(got, mean, rtol=0, atol=1e-10)
        assert torch.allclose(
            vae.decode_latent(mean), peer_vae.decode(mean).sample, rtol=0, atol=1e-10
        )
        assert torch.allclose(vae.from_diffusion(vae.to_diffusion(mean)), mean, atol=1e-12)
    write_diffusers_vae(vae, tmp_path / "back")
    again, info = diffusers.AutoencoderKL.from_pretrained(
        tmp_path / "back", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert again.config.scaling_factor == peer_vae.config.scaling_factor


def test_latent_shards_train_a_latent_dit_and_generate_decodes_its_samples(tmp_path):
    # image shards -> a VAE encodes them once (mirror images as their own samples) -> a latent
    # DiT trains on the .npy latents with their classes -> `generate --vae` decodes samples
    import io

    import numpy as np
    from PIL import Image

    from mmtrain.config import config_from_dict
    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.spec import ModelSpec
    from mmtrain.train.loop import train
    from test_dit import class_shards

    torch.manual_seed(0)
    diffusers.AutoencoderKL(**VAE_CONFIG).save_pretrained(tmp_path / "vae")
    images = class_shards(tmp_path / "images", n=12, broken=(3,))
    argv = ["data", "encode-latents", images, "--vae", str(tmp_path / "vae"), "--size", "32",
            "--out", str(tmp_path / "latents"), "--flip", "--batch-size", "5"]  # fmt: skip
    assert main(argv) == 0
    latents = ShardSet.open(tmp_path / "latents")
    assert len(latents) == 2 * 11  # the broken PNG skipped, every other image twice
    first = latents.read(0)
    assert set(first) >= {"__key__", "npy", "cls"}
    assert np.load(io.BytesIO(first["npy"])).shape == (4, 16, 16)
    spec = ModelSpec.from_dict({"name": "latent-dit", "objective": "flow_matching", "denoiser": {
        "sample_size": 16, "channels": 4, "patch_size": 2, "width": 32, "layers": 1, "heads": 2,
        "num_classes": 4, "input": "latent"}})  # fmt: skip
    spec.save(tmp_path / "spec.yaml")
    run = tmp_path / "run"
    # validation decodes the samples through eval.vae: a sample grid and the FD per validation
    from test_dit import MICRO_SPEC

    clip = tmp_path / "clip"
    mmtrain.save_model(mmtrain.create_model(ModelSpec.from_dict(MICRO_SPEC), seed=0), clip)
    latents = str(tmp_path / "latents")
    config = config_from_dict({
        "model": str(tmp_path / "spec.yaml"), "data": {"train": latents, "val": latents},
        "train": {"steps": 2, "batch_size": 4, "lr": 1e-3}, "metrics": {"tensorboard": False},
        "eval": {"every_steps": 2, "extractor": str(clip), "vae": str(tmp_path / "vae"),
                 "samples": 4, "sample_steps": 2},
        "out": str(run)})  # fmt: skip
    history = train(config).history
    assert any("val/diffusion/fd" in row for row in history)
    grid = np.asarray(Image.open(run / "samples" / "step_00000002.png"))
    assert grid.shape == (4 * 32, 4 * 32, 3)  # a row per class, 4 decoded 32 px samples each
    out = tmp_path / "samples"
    assert main(["generate", str(run), "--class", "2", "--num", "2", "--steps", "2",
                 "--vae", str(tmp_path / "vae"), "--out", str(out)]) == 0  # fmt: skip
    assert np.asarray(Image.open(out / "grid.png")).shape == (32, 64, 3)  # decoded to pixels
    assert main(["generate", str(run), "--class", "2", "--out", str(out)]) == 2  # no --vae

    # `mmtrain eval --extractor` sees the latents through the VAE that encoded them (it used to
    # hand latents to the extractor's image tower and crash); without --vae it says so.
    argv = ["eval", str(run), "--data", latents, "--extractor", str(clip), "--samples", "6",
            "--steps", "2", "--out", str(tmp_path / "eval.json")]  # fmt: skip
    assert main(argv) == 2
    assert main([*argv, "--vae", str(tmp_path / "vae")]) == 0
    report = json.loads((tmp_path / "eval.json").read_text())["diffusion"]
    assert report["fd_n"] == 6 and report["fd"] >= 0 and report["fd_real_floor"] >= 0


class _Tokens(Exception):
    """Carries the patch tokens out of diffusers' forward, before its unpatchify."""


def _patch_tokens(model, x, t, y):
    """diffusers' DiT output as patch tokens [B, rows * cols, p * p * C], before its unpatchify
    (which takes the grid to be square: another grid's output is not an image, or no shape)."""

    def stop(_module, _inputs, out):
        raise _Tokens(out)

    hook = model.proj_out_2.register_forward_hook(stop)
    try:
        model(x, timestep=t, class_labels=y)
    except _Tokens as tokens:
        return tokens.args[0]
    finally:
        hook.remove()
    raise AssertionError("diffusers' DiT never reached its output projection")


def test_video_shards_given_to_an_image_vae_are_refused_not_skipped(tmp_path, capsys):
    """`data encode-latents` on clips with an image VAE exits 2 naming the sample and what it
    would take, before writing anything (it used to skip every clip and report success)."""
    from test_dit import video_shards

    torch.manual_seed(0)
    diffusers.AutoencoderKL(**VAE_CONFIG).save_pretrained(tmp_path / "vae")
    clips = video_shards(tmp_path / "clips", n=2)
    out = tmp_path / "latents"
    argv = ["data", "encode-latents", clips, "--vae", str(tmp_path / "vae"), "--size", "32",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "v000" in err and "video clip (.mp4)" in err and "video VAE" in err
    assert not (out / "manifest.json").exists()
