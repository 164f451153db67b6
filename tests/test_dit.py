"""Diffusion transformers: the spec counts what the module holds and computes, adaLN-Zero
starts every block as the identity, the flow-matching and DDPM objectives build their inputs
and targets as their papers define them from seeded draws, and a class-conditional DiT trains
on pixel shards and resumes bitwise."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import mmtrain
from micro import MICRO_SPEC
from mmtrain.cli import main
from mmtrain.config import DiffusionConfig, config_from_dict
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.eval.sampling import sample
from mmtrain.models.dit import DiffusionModel, positions_of, sincos_positions
from mmtrain.models.schedules import ddpm_alphas_cumprod, draw_generator
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError
from mmtrain.train.diffusion import DiffusionObjective
from mmtrain.train.loop import train

CLASSES = 4


def tiny(objective: str = "flow_matching", prediction: str = "velocity", **denoiser) -> ModelSpec:
    spec = load_spec("tiny-dit").to_dict()
    spec["objective"] = objective
    spec["denoiser"].update({"prediction": prediction, "num_classes": CLASSES, **denoiser})
    return ModelSpec.from_dict(spec)


@pytest.mark.parametrize("name", ["tiny-dit", "DiT-XL-2"])
def test_spec_counts_the_parameters_the_module_holds(name):
    spec = load_spec(name)
    with torch.device("meta"):
        model = DiffusionModel(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.params()


def test_spec_counts_the_flops_the_module_computes():
    spec = tiny(learn_sigma=True)
    model = mmtrain.create_model(spec, seed=0)
    batch = {
        "image": torch.randn(2, 3, 32, 32),
        "timestep": torch.tensor([1.0, 999.0]),
        "class": torch.tensor([0, CLASSES]),
    }
    # the math kernel: its matmuls are what the counter sees of attention on a CPU
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.predict(batch)
    assert counter.get_total_flops() == 2 * spec.denoiser.forward_flops()


def test_dit_xl_2_is_the_papers_size():
    # Peebles & Xie 2023, Table 1 / 4: 675M parameters, 118.6 GFLOPs (multiply-adds) at 256 px.
    spec = load_spec("DiT-XL-2")
    assert round(spec.params() / 1e6) == 675
    assert spec.denoiser.forward_flops() / 2 / 1e9 == pytest.approx(118.6, rel=0.005)


def test_blocks_start_as_the_identity_and_the_first_prediction_is_zero():
    model = mmtrain.create_model(tiny(), seed=0)
    batch = {"image": torch.randn(3, 3, 32, 32), "timestep": torch.rand(3) * 1000}
    batch["class"] = torch.tensor([0, 1, CLASSES])
    out = model.predict(batch)
    assert out.shape == (3, 3, 32, 32) and torch.count_nonzero(out) == 0
    out.square().sum().backward()  # zero output, but the zero-initialised layers learn
    assert model.denoiser.out.bias.grad is not None


def test_positions_are_sine_cosine_over_columns_then_rows():
    width, grid = 8, 3
    pos = sincos_positions(width, grid, grid, grid).double()
    omega = 1 / 10_000 ** (torch.arange(2, dtype=torch.float64) / 2)
    row, col = 1, 2  # token row * grid + col
    expected = torch.cat(
        [(col * omega).sin(), (col * omega).cos(), (row * omega).sin(), (row * omega).cos()]
    )
    assert torch.allclose(pos[row * grid + col], expected, atol=1e-7)


def test_unpatchify_puts_each_patch_back_where_it_came_from():
    spec = tiny(patch_size=4)
    model = DiffusionModel(spec).denoiser
    p = spec.denoiser.patch_size
    for rows, cols in ((8, 8), (4, 10)):  # the spec's 32 x 32, and a 16 x 40 bucket
        image = torch.arange(3 * rows * p * cols * p, dtype=torch.float32)
        image = image.reshape(1, 3, rows * p, cols * p)
        # token (i, j), row-major, holds patch pixels (a, b) of every channel, channel last
        patches = image.reshape(1, 3, rows, p, cols, p).permute(0, 2, 4, 3, 5, 1)
        assert torch.equal(
            model._unpatchify(patches.reshape(1, rows * cols, -1), (1, rows, cols)), image
        )


def _objective(spec, config=None, seed=7, rank=0, step=3, k=1):
    objective = DiffusionObjective(spec, config or DiffusionConfig(), seed=seed, rank=rank)
    objective.prepare(None, [None] * k, None, step)
    return objective


def test_flow_matching_inputs_and_target_follow_rectified_flow():
    spec = tiny()
    x0 = torch.randn(5, 3, 32, 32, dtype=torch.float64)
    batch = {"image": x0, "class": torch.arange(5) % CLASSES}
    objective = _objective(spec, DiffusionConfig(cfg_dropout=0.0))
    inputs = objective.inputs(batch, 0)
    # the same draws again, in the objective's order: noise, then the timesteps
    g = draw_generator(7, 3, 0, 0, device=x0.device)
    noise = torch.randn(x0.shape, generator=g, dtype=x0.dtype)
    t = torch.sigmoid(torch.randn(5, generator=g)).double()
    tb = t.view(-1, 1, 1, 1)
    assert torch.allclose(inputs["image"], (1 - tb) * x0 + tb * noise, rtol=0, atol=1e-12)
    assert torch.allclose(inputs["timestep"], 1000 * t, rtol=0, atol=1e-9)
    assert torch.equal(inputs["class"], batch["class"])
    target, weight = objective.targets[0]
    assert torch.equal(target, noise - x0) and torch.equal(weight, torch.ones(5, dtype=x0.dtype))


def test_draws_depend_on_seed_step_rank_and_micro_batch_alone():
    spec = tiny()
    batch = {"image": torch.zeros(4, 3, 32, 32), "class": torch.zeros(4, dtype=torch.long)}
    first = _objective(spec).inputs(batch, 0)["image"]
    assert torch.equal(first, _objective(spec).inputs(batch, 0)["image"])
    for other in (_objective(spec, step=4), _objective(spec, rank=1), _objective(spec, seed=8)):
        assert not torch.equal(first, other.inputs(batch, 0)["image"])
    assert not torch.equal(first, _objective(spec, k=2).inputs(batch, 1)["image"])


def test_ddpm_v_target_and_min_snr_weights():
    spec = tiny("diffusion", "v")
    config = DiffusionConfig(min_snr=5.0, cfg_dropout=0.0)
    x0 = torch.randn(6, 3, 32, 32, dtype=torch.float64)
    objective = _objective(spec, config)
    inputs = objective.inputs({"image": x0, "class": torch.zeros(6, dtype=torch.long)}, 0)
    g = draw_generator(7, 3, 0, 0, device=x0.device)
    noise = torch.randn(x0.shape, generator=g, dtype=x0.dtype)
    steps = torch.randint(0, 1000, (6,), generator=g)
    abar = ddpm_alphas_cumprod(config)[steps]
    a, b = abar.sqrt().view(-1, 1, 1, 1), (1 - abar).sqrt().view(-1, 1, 1, 1)
    assert torch.allclose(inputs["image"], a * x0 + b * noise, rtol=0, atol=1e-12)
    assert torch.equal(inputs["timestep"], steps.double())
    target, weight = objective.targets[0]
    assert torch.allclose(target, a * noise - b * x0, rtol=0, atol=1e-12)
    snr = abar / (1 - abar)
    assert torch.allclose(weight, torch.minimum(snr, torch.tensor(5.0)) / (snr + 1), atol=1e-12)
    # the schedule: DDPM's linear betas 1e-4 .. 0.02 over 1000 steps
    assert ddpm_alphas_cumprod(config)[0] == pytest.approx(1 - 1e-4)


def test_condition_dropout_trains_the_no_class_id_at_its_rate():
    spec = tiny()
    n, rate = 4000, 0.25
    objective = _objective(spec, DiffusionConfig(cfg_dropout=rate))
    classes = torch.arange(n) % CLASSES
    dropped = objective.inputs({"image": torch.zeros(n, 3, 32, 32), "class": classes}, 0)["class"]
    is_null = dropped == CLASSES
    assert torch.equal(dropped[~is_null], classes[~is_null])  # the others keep their class
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(int(is_null.sum()) - n * rate) < 6 * sigma


def test_a_prediction_the_objective_cannot_train_is_refused_by_field():
    with pytest.raises(FieldError, match="denoiser.prediction"):
        tiny("flow_matching", "epsilon")
    with pytest.raises(FieldError, match="denoiser.patch_size"):
        tiny(patch_size=5)


# ----------------------------------------------------------------------------- training
def class_shards(folder: Path, n: int = 48, broken: tuple[int, ...] = ()) -> str:
    """Noisy squares of CLASSES colours, the colour index as the `.cls` label; `broken` ones
    carry a truncated PNG."""
    rng = np.random.default_rng(0)
    with ShardWriter(folder, max_samples=16) as writer:
        for i in range(n):
            c = i % CLASSES
            pixels = np.zeros((36, 40, 3), np.uint8)
            pixels[..., c % 3] = 60 + 60 * c
            pixels = (pixels + rng.integers(0, 30, pixels.shape)).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            png = buffer.getvalue()[: 50 if i in broken else None]
            writer.write({"__key__": f"s{i:05d}", "png": png, "cls": str(c).encode()})
    return str(folder)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return class_shards(tmp_path_factory.mktemp("dit-shards"), broken=(5,))


def _config(out: Path, shards: str, spec_file: Path, **train_settings):
    return config_from_dict(
        {
            "model": str(spec_file),
            "data": {"train": shards, "shuffle_window": 8},
            "train": {
                "steps": 6,
                "batch_size": 8,
                "micro_batch": 4,
                "lr": 2e-3,
                "warmup_steps": 1,
                "ema": 0.9,
                **train_settings,
            },  # fmt: skip
            "checkpoint": {"every_steps": 2, "keep": 3},
            "metrics": {"tensorboard": False},
            "out": str(out),
        }
    )


@pytest.mark.parametrize("objective", ["flow_matching", "diffusion"])
def test_a_class_conditional_dit_trains_and_resumes_bitwise(tmp_path, shards, objective):
    spec = tiny(objective, "velocity" if objective == "flow_matching" else "epsilon")
    spec_file = tmp_path / "spec.yaml"
    spec.save(spec_file)
    whole = train(_config(tmp_path / "whole", shards, spec_file))
    assert whole.step == 6 and whole.corrupt_samples >= 1  # the broken PNG is skipped
    losses = [row["loss"] for row in whole.history]
    assert all(math.isfinite(v) for v in losses)
    stopped = _config(tmp_path / "stopped", shards, spec_file)
    train(stopped, halt_after_step=3)  # dies after step 3; the step-2 checkpoint resumes
    resumed = train(stopped)
    assert resumed.resumed_from == 2
    for name in ("model.safetensors", "ema/model.safetensors"):
        a = load_file(str(tmp_path / "whole" / name))
        b = load_file(str(tmp_path / "stopped" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert [r["loss"] for r in resumed.history] == losses[2:]


# ----------------------------------------------------------------------------- sampling
class PointMassOracle(torch.nn.Module):
    """The exact prediction for data that is one image `a`: velocity (x - a) / t for flow,
    epsilon or v from x_t = sqrt(abar) a + sqrt(1 - abar) eps for DDPM. A sampler that
    integrates it right lands on `a`, from any noise, up to rounding."""

    def __init__(self, spec: ModelSpec, a: torch.Tensor, config: DiffusionConfig):
        super().__init__()
        self.spec, self.a = spec, a
        self.weight = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))  # the device
        self.abar = ddpm_alphas_cumprod(config)

    def forward(self, batch):
        return {"prediction": self.predict(batch)}

    def predict(self, batch):
        x, t = batch["image"], batch["timestep"]
        if self.spec.objective == "flow_matching":
            return (x - self.a) / (t / 1000).view(-1, 1, 1, 1)
        abar = self.abar[t.long()].view(-1, 1, 1, 1)
        eps = (x - abar.sqrt() * self.a) / (1 - abar).sqrt()
        if self.spec.denoiser.prediction == "v":
            return abar.sqrt() * eps - (1 - abar).sqrt() * self.a
        return eps


@pytest.mark.parametrize(
    "objective, prediction, sampler, shift",
    [("flow_matching", "velocity", "euler", 1.0), ("flow_matching", "velocity", "heun", 3.0),
     ("diffusion", "epsilon", "ddim", 1.0), ("diffusion", "v", "ddim", 1.0)],
)  # fmt: skip
def test_samplers_land_on_the_data_given_the_exact_prediction(
    objective, prediction, sampler, shift
):
    spec = tiny(objective, prediction, num_classes=0)
    config = DiffusionConfig(shift=shift)
    a = torch.rand(1, 3, 32, 32, dtype=torch.float64) * 2 - 1
    oracle = PointMassOracle(spec, a, config)
    out = sample(oracle, None, 3, steps=7, seed=1, config=config, sampler=sampler)
    assert torch.allclose(out, a.expand(3, -1, -1, -1), rtol=0, atol=1e-9)


def test_guidance_extrapolates_from_the_unconditional_prediction():
    spec = tiny()
    model = mmtrain.create_model(spec, seed=0)
    with torch.no_grad():  # a non-zero output layer, so predictions depend on the class
        torch.nn.init.normal_(model.denoiser.out.weight, std=0.02)
        torch.nn.init.normal_(model.denoiser.modulation_out.weight, std=0.02)
    classes = {"class": torch.tensor([1, 2])}
    plain = sample(model, classes, 2, steps=3, seed=5)
    assert torch.equal(plain, sample(model, classes, 2, steps=3, seed=5))  # deterministic
    guided = sample(model, classes, 2, steps=3, seed=5, cfg=4.0)
    assert not torch.allclose(plain, guided)
    none = {"class": torch.full((2,), CLASSES)}  # cfg 0: the unconditional prediction alone
    assert torch.allclose(sample(model, classes, 2, steps=3, seed=5, cfg=0.0),
                          sample(model, none, 2, steps=3, seed=5), atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="samples with 'class'"):
        sample(model, None, 2, steps=1)


def test_generate_writes_a_grid_of_the_classes_asked_for(tmp_path, shards, capsys):
    spec = tiny()
    spec_file = tmp_path / "spec.yaml"
    spec.save(spec_file)
    run = tmp_path / "run"
    train(_config(run, shards, spec_file, steps=2))
    argv = ["generate", str(run), "--class", "1", "--class", "3", "--num", "2", "--steps", "4"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    grid = np.asarray(Image.open(tmp_path / "out" / "grid.png"))
    assert grid.shape == (2 * 32, 2 * 32, 3)  # a row per class, --num columns
    assert sorted(p.name for p in (tmp_path / "out").glob("class*.png")) == [
        "class1_0.png", "class1_1.png", "class3_0.png", "class3_1.png"
    ]  # fmt: skip
    assert main([*argv[:2], "--out", str(tmp_path / "x")]) == 2  # no --class: refused
    assert "give --class" in capsys.readouterr().err


def _dit_runs(rank: int, world_size: int, configs: dict) -> dict:
    losses = {}
    for name in ("ddp", "fsdp"):
        losses[name] = [row["loss"] for row in train(configs[name]).history]
    train(configs["resumed"], halt_after_step=3)  # a sharded checkpoint at step 2, EMA in it
    losses["resumed"] = [row["loss"] for row in train(configs["resumed"]).history]
    return losses


def test_fsdp_on_two_ranks_trains_a_dit_and_its_ema_as_ddp_does(tmp_path, shards):
    # FSDP2 builds the DiT on the meta device, shards it per block and materialises the shards
    # (the fixed positions rebuilt where the weights are); each rank averages its own shards.
    # In float64 its steps, weights and EMA are DDP's; a run killed after a sharded checkpoint
    # resumes to the same EMA bit for bit.
    from dist_helpers import run_distributed

    spec_file = tmp_path / "spec.yaml"
    tiny().save(spec_file)
    configs = {
        name: _config(
            tmp_path / name,
            shards,
            spec_file,
            steps=4,
            precision="fp64",
            parallel="ddp" if name == "ddp" else "fsdp",
        )  # fmt: skip
        for name in ("ddp", "fsdp", "resumed")
    }
    first, second = run_distributed(_dit_runs, world_size=2, args=(configs,), timeout_s=300)
    assert first == second
    torch.testing.assert_close(torch.tensor(first["fsdp"]), torch.tensor(first["ddp"]),
                               rtol=1e-9, atol=1e-12)  # fmt: skip
    assert first["resumed"] == first["fsdp"][2:]
    for name in ("model.safetensors", "ema/model.safetensors"):
        a, b = (load_file(str(tmp_path / run / name)) for run in ("ddp", "fsdp"))
        assert all(torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-12) for k in a), name
        c = load_file(str(tmp_path / "resumed" / name))
        assert all(torch.equal(b[k], c[k]) for k in b), name
    assert (tmp_path / "fsdp" / "checkpoints" / "step_00000004" / "dcp").is_dir()  # sharded


def test_every_held_out_image_counts_once_whatever_the_batch(tmp_path, shards):
    # 47 readable images (one of the 48 is broken): a batch larger than the set, or one that
    # does not divide it, makes the loader pad its last step with images from the start.
    from mmtrain.eval.diffusion import DenoiserEvaluator

    clip = tmp_path / "clip"
    mmtrain.save_model(mmtrain.create_model(ModelSpec.from_dict(MICRO_SPEC), seed=0), clip)
    model = mmtrain.create_model(tiny(), seed=0).eval()
    for batch_size in (64, 10):
        evaluator = DenoiserEvaluator(tiny(), shards, batch_size=batch_size, rank=0, world_size=1,
                                      extractor=mmtrain.load_model(clip), samples=100, steps=1)  # fmt: skip
        try:
            report = evaluator.report(model)["diffusion"]
        finally:
            evaluator.close()
        assert report["n"] == 47 and report["fd_n"] == 47, batch_size


def test_validation_reports_the_loss_at_fixed_timesteps_and_eval_adds_the_fd(tmp_path, shards):
    spec_file = tmp_path / "spec.yaml"
    tiny().save(spec_file)
    # the feature extractor: an image tower with a text tower beside it (a micro CLIP, untrained)
    clip = tmp_path / "clip"
    mmtrain.save_model(mmtrain.create_model(ModelSpec.from_dict(MICRO_SPEC), seed=0), clip)
    config = _config(tmp_path / "run", shards, spec_file, steps=4)
    config.data.val = config.data.train
    config.data.class_names = ["red", "green", "blue", "white"]
    config.eval.every_steps = 2
    config.eval.extractor, config.eval.samples, config.eval.sample_steps = str(clip), 8, 2
    history = train(config).history
    val = {row["step"]: row["val/diffusion/loss"] for row in history if "val/diffusion/loss" in row}
    assert sorted(val) == [2, 4] and all(math.isfinite(v) for v in val.values())
    last = next(row for row in history if row["step"] == 4)
    assert last["val/diffusion/fd_n"] == 8 and last["val/diffusion/fd"] >= 0
    for key in ("cond_accuracy", "real_accuracy"):  # fractions of the 8 samples / images
        assert last[f"val/diffusion/{key}"] * 8 in range(9)
    assert 0 <= last["val/diffusion/clip_score"] <= 100
    # a grid of samples at each validation (a row per class), and the report shows them
    grids = sorted(p.name for p in (tmp_path / "run" / "samples").glob("*.png"))
    assert grids == ["step_00000002.png", "step_00000004.png"]
    grid = np.asarray(Image.open(tmp_path / "run" / "samples" / grids[-1]))
    assert grid.shape == (CLASSES * 32, 4 * 32, 3)
    from mmtrain.report import build_report

    report = build_report(tmp_path / "run", gallery=False)
    drawn = {plot.name for plot in report.plots if plot.png is not None}
    assert {"denoiser", "samples_2", "samples_4"} <= drawn
    # `mmtrain eval` with the extractor
    out = tmp_path / "eval.json"
    argv = ["eval", str(tmp_path / "run"), "--data", shards, "--extractor", str(clip),
            "--samples", "12", "--steps", "3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())["diffusion"]
    assert report["fd_n"] == 12 and report["fd"] >= 0 and report["fd_real_floor"] >= 0
    # the final weights on the same images and the same noise: the last validation's loss
    assert report["loss"] == pytest.approx(val[4], rel=1e-6)
    assert main(argv[:4] + ["--out", str(tmp_path / "again.json")]) == 0  # deterministic
    again = json.loads((tmp_path / "again.json").read_text())["diffusion"]
    assert again["loss_at"] == report["loss_at"]


# ----------------------------------------------------------------------------- video
def video_spec() -> ModelSpec:
    return ModelSpec.from_dict({"name": "tiny-video-dit", "objective": "flow_matching",
                                "denoiser": {"sample_size": 16, "channels": 3, "patch_size": 4,
                                             "width": 32, "layers": 2, "heads": 2, "frames": 4,
                                             "temporal_patch": 2, "input": "video"}})  # fmt: skip


def test_a_video_dit_counts_what_it_holds_and_computes_and_puts_tubes_back():
    spec = video_spec()
    model = mmtrain.create_model(spec, seed=0)
    assert sum(p.numel() for p in model.parameters()) == spec.params()
    batch = {"video": torch.randn(2, 3, 4, 16, 16), "timestep": torch.tensor([1.0, 900.0])}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.predict(batch)
    assert counter.get_total_flops() == 2 * spec.denoiser.forward_flops()
    d = spec.denoiser
    clip = torch.arange(3 * 4 * 16 * 16, dtype=torch.float32).reshape(1, 3, 4, 16, 16)
    tg, g, tp, p = d.time_grid(), d.grid(), d.temporal_patch, d.patch_size
    # token (time, row, col) holds its tube's (frame, pixel row, pixel col) values, channel last
    tubes = clip.reshape(1, 3, tg, tp, g, p, g, p).permute(0, 2, 4, 6, 3, 5, 7, 1)
    assert torch.equal(
        model.denoiser._unpatchify(tubes.reshape(1, tg * g * g, -1), (tg, g, g)), clip
    )


def video_shards(folder: Path, n: int = 8) -> str:
    """Clips of 6 frames of a moving coloured bar, class = colour."""
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with ShardWriter(folder, max_samples=8) as writer:
        for i in range(n):
            buffer = io.BytesIO()
            with av.open(buffer, "w", format="mp4") as container:
                stream = container.add_stream(codec, rate=8)
                stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
                for f in range(6):
                    pixels = np.zeros((24, 32, 3), np.uint8)
                    pixels[:, 4 * f : 4 * f + 8, i % 3] = 200
                    for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                        container.mux(packet)
                for packet in stream.encode():
                    container.mux(packet)
            writer.write({"__key__": f"v{i:03d}", "mp4": buffer.getvalue(), "cls": b"0"})
    return str(folder)


def test_a_video_dit_trains_on_clips_and_generates_mp4s(tmp_path):
    from mmtrain.data.stream.media import decode_video

    shards = video_shards(tmp_path / "clips")
    spec_file = tmp_path / "spec.yaml"
    video_spec().save(spec_file)
    run = tmp_path / "run"
    result = train(_config(run, shards, spec_file, steps=2, micro_batch=2, batch_size=4))
    assert result.step == 2 and all(math.isfinite(r["loss"]) for r in result.history)
    assert (
        main(["generate", str(run), "--num", "2", "--steps", "2", "--out", str(tmp_path / "out")])
        == 0
    )
    clip = decode_video((tmp_path / "out" / "sample_0.mp4").read_bytes(), 4)
    assert clip.frames.shape == (4, 16, 16, 3)
    assert np.asarray(Image.open(tmp_path / "out" / "grid.png")).shape == (16, 32, 3)


def test_factorised_attention_keeps_frames_then_places_apart_and_counts_their_cost():
    spec = ModelSpec.from_dict({**video_spec().to_dict(), "denoiser": {
        **video_spec().denoiser.to_dict(), "attention": "factorised"}})  # fmt: skip
    d = spec.denoiser
    model = mmtrain.create_model(spec, seed=0)
    batch = {"video": torch.randn(2, 3, 4, 16, 16), "timestep": torch.tensor([1.0, 900.0])}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.predict(batch)
    assert counter.get_total_flops() == 2 * d.forward_flops()
    assert d.forward_flops() < video_spec().denoiser.forward_flops()  # T S^2 + S T^2 < (T S)^2
    space, time = d.grid() ** 2, d.time_grid()
    x = torch.randn(1, time * space, d.width)
    for block, changed, kept in ((0, "frame 1", "frame 0"), (1, "place 1", "place 0")):
        y = x.clone().reshape(1, time, space, d.width)
        if block == 0:
            y[:, 1] += 1.0  # every token of frame 1
            rows = slice(0, space)  # frame 0's tokens
        else:
            y[:, :, 1] += 1.0  # place 1 in every frame
            rows = slice(0, 1)  # place 0 of frame 0
        with torch.no_grad():
            a = model.denoiser.blocks[block]._attend(x, time)
            b = model.denoiser.blocks[block]._attend(y.reshape(x.shape), time)
        assert torch.allclose(a[:, rows], b[:, rows]), (changed, kept)
        assert not torch.allclose(a, b)


@pytest.mark.parametrize("attention", ["full", "factorised"])
def test_a_video_dit_takes_any_clip_size_its_patches_divide_and_counts_it(attention):
    spec = ModelSpec.from_dict({**video_spec().to_dict(), "denoiser": {
        **video_spec().denoiser.to_dict(), "attention": attention}})  # fmt: skip
    model = mmtrain.create_model(spec, seed=0)
    t = torch.tensor([1.0, 900.0])
    for size in ((6, 8, 20), (4, 16, 16), (4, 12, 8)):  # frames x height x width buckets
        clip = torch.randn(2, 3, *size)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            out = model.predict({"video": clip, "timestep": t})
        assert out.shape == clip.shape
        assert counter.get_total_flops() == 2 * spec.denoiser.forward_flops(size)
    # another grid's positions are that grid's own fixed table
    grid = spec.denoiser.grid_of((6, 8, 20))
    assert torch.equal(model.denoiser.positions_for(grid), positions_of(spec.denoiser, grid))
    for bad, words in (((5, 16, 16), "frames 5"), ((4, 16, 18), "width 18")):
        with pytest.raises(ValueError, match=words):
            model.predict({"video": torch.randn(1, 3, *bad), "timestep": t[:1]})


def test_the_init_zeroes_the_modulations_and_the_output_layer_only():
    # DiT's adaLN-Zero: each block's modulation and the final layer start at zero; the
    # attention's and MLP's own projections are drawn (Xavier variance), as DiT draws them.
    model = mmtrain.create_model(tiny(), seed=0)
    zero = {n for n, p in model.named_parameters() if p.dim() >= 2 and not p.any()}
    expected = {f"towers.denoiser.blocks.{i}.modulation.weight" for i in range(2)}
    expected |= {"towers.denoiser.modulation_out.weight", "towers.denoiser.out.weight"}
    assert zero == expected
    w = model.denoiser.blocks[0].attn.out.weight
    assert w.std().item() == pytest.approx((2 / (2 * w.shape[0])) ** 0.5, rel=0.1)


def _losses_on_rank(rank: int, world: int, config) -> list[float]:
    return [row["loss"] for row in train(config).history]


@pytest.mark.slow
def test_a_video_dit_splitting_its_tokens_over_two_ranks_trains_as_one_rank(tmp_path):
    """Sequence parallelism of 2 (all-to-all over the clip's frames x patches tokens, one data
    rank) and 1 rank: the same losses, weights and EMA in float64."""
    from dist_helpers import run_distributed

    shards = video_shards(tmp_path / "clips")
    spec_file = tmp_path / "spec.yaml"
    video_spec().save(spec_file)
    settings = {"steps": 3, "micro_batch": 2, "batch_size": 4, "precision": "fp64"}
    one = train(_config(tmp_path / "one", shards, spec_file, **settings))
    split = _config(tmp_path / "sp", shards, spec_file, **settings, sequence_parallel=2,
                    sequence_parallel_attention="all_to_all")  # fmt: skip
    for losses in run_distributed(_losses_on_rank, world_size=2, args=(split,)):
        torch.testing.assert_close(torch.tensor(losses),
                                   torch.tensor([r["loss"] for r in one.history]),
                                   rtol=1e-9, atol=1e-12)  # fmt: skip
    for name in ("model.safetensors", "ema/model.safetensors"):
        a, b = (load_file(str(tmp_path / run / name)) for run in ("one", "sp"))
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-9, atol=1e-12, msg=key)
