"""The training loop: contrastive-correct accumulation, exact resume after a crash (also with a
corrupt sample), signals, precision modes, parameter groups, freezing, schedules, guards, metrics."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

import mmtrain
from micro import MICRO_SPEC, make_shards, micro_run
from mmtrain.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from mmtrain.losses import ContrastiveLoss
from mmtrain.structured import FieldError
from mmtrain.train.loop import forward_backward, optimizer_step, train
from mmtrain.train.metrics import LossSpikes
from mmtrain.train.objectives import ContrastiveObjective
from mmtrain.train.optim import freeze_parameters, lr_factor, param_groups
from mmtrain.train.parallel import apply_activation_checkpointing
from mmtrain.train.precision import make_precision


def make_config(tmp_path, shards: str, **train):
    settings = {"steps": 6, "micro_batch": 4, "lr": 1e-3, "warmup_steps": 2, **train}
    return micro_run(tmp_path, shards, seed=3, train=settings)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"), 40, corrupt=(5,))


def micro_model(seed: int = 0):
    return mmtrain.create_model(mmtrain.spec.ModelSpec.from_dict(MICRO_SPEC), seed=seed)


def random_batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text = torch.zeros(n, 16, dtype=torch.long)
    text[:, 0] = 256
    text[:, 1:6] = torch.randint(1, 256, (n, 5), generator=g)
    text[:, 6] = 257
    return {"image": torch.randn(n, 3, 16, 16, generator=g), "text": text}


# ----------------------------------------------------------------------------- accumulation
def test_accumulated_gradient_equals_one_big_batch():
    # In float64 the two ways differ only by rounding (~1e-16 relative per operation), so a
    # 1e-10 tolerance holds on any CPU; float32's rounding depends on the CPU's summation order.
    batch = random_batch(8, seed=1)
    batch["image"] = batch["image"].double()
    precision = make_precision("fp64", torch.device("cpu"))
    loss_fn = ContrastiveLoss("clip")

    model = micro_model().double()
    big_loss, _ = forward_backward(
        model, [ContrastiveObjective(model, loss_fn)], [batch], precision
    )
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    micro = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    acc_loss, _ = forward_backward(model, [ContrastiveObjective(model, loss_fn)], micro, precision)
    assert acc_loss.item() == pytest.approx(big_loss.item(), rel=1e-12)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)

    # Independent micro-batches (the naive way) train on smaller batches: a different gradient.
    model.zero_grad(set_to_none=True)
    naive = sum(loss_fn(model(m), [("image", "text")], model.logit_scale)[0] for m in micro) / 4
    naive.backward()
    assert not torch.allclose(model.logit_scale.grad, expected["logit_scale"], rtol=1e-3)


# ----------------------------------------------------------------------------- resume
@pytest.mark.slow
def test_crash_and_resume_ends_bitwise_identical(tmp_path, shards):
    straight = make_config(tmp_path / "a", shards)
    full = train(straight)
    # 48 samples from 40 (one corrupt) run into a second epoch; each read of s00005 is counted.
    assert full.step == 6 and full.corrupt_samples >= 2

    crashed = make_config(tmp_path / "b", shards)
    first = train(crashed, halt_after_step=3)  # "kill -9" after step 3: last checkpoint is step 2
    assert first.step == 3 and not (tmp_path / "b" / "run" / "model.safetensors").exists()
    run = tmp_path / "b" / "run"
    # A checkpoint cut short by the crash: a leftover .tmp and a newer one with a bad file.
    shutil.copytree(run / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000003")
    (run / "checkpoints" / "step_00000003" / "model.safetensors").write_bytes(b"torn")
    (run / "checkpoints" / "step_00000004.tmp").mkdir()

    resumed = train(make_config(tmp_path / "b", shards))
    assert resumed.resumed_from == 2 and resumed.step == 6
    a = (tmp_path / "a" / "run" / "model.safetensors").read_bytes()
    b = (run / "model.safetensors").read_bytes()
    assert a == b, "a resumed run must end with the same weights, bit for bit"

    # The run folder reads like one run: each step logged once, same losses as the straight run.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if "kind" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # One memory plan per start: the first run's (step 0) and the resumed run's (step 2).
    assert [r["step"] for r in records if r.get("kind") == "plan"] == [0, 2]
    assert [r["loss"] for r in rows] == [r["loss"] for r in full.history]
    assert rows[-1]["corrupt_samples"] == full.corrupt_samples and rows[-1]["samples_seen"] == 48

    loaded = mmtrain.load_model(run)
    assert loaded.spec.name == "micro-clip"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["steps"] == 6 and saved["data"]["train"][0]["path"] == shards
    steps = [s for s, _ in list_checkpoints(run / "checkpoints")]
    assert 6 in steps and latest_checkpoint(run / "checkpoints").name == "step_00000006"
    state = load_checkpoint(run / "checkpoints" / "step_00000006").state  # weights_only load
    assert set(state) >= {"optimizer", "scheduler", "loader", "rng", "counters"}
    assert state["counters"]["samples_seen"] == 48


def test_sigterm_finishes_the_step_checkpoints_and_returns(tmp_path, shards):
    config = make_config(tmp_path, shards, steps=20)
    config.checkpoint.every_steps = 100
    config.metrics.log_every = 1  # rows (and on_step) every step: the signal comes at step 2

    def preempt(row):
        if row["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    result = train(config, on_step=preempt)
    assert result.stopped_by_signal and result.step == 2
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_00000002"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler removed again


# ----------------------------------------------------------------------------- precision
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_fp32_weights(tmp_path, shards, precision):
    config = make_config(tmp_path, shards, steps=2, precision=precision)
    result = train(config)
    assert all(math.isfinite(r["loss"]) for r in result.history)
    if precision == "fp16":
        assert result.history[-1]["loss_scale"] > 0  # dynamic loss scaling is on
    weights = mmtrain.load_model(tmp_path / "run").state_dict()
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_fp8_on_cpu_is_refused_with_a_clear_message():
    with pytest.raises(FieldError, match=r"train\.precision: fp8 needs an NVIDIA GPU"):
        make_precision("fp8", torch.device("cpu"))


def test_fp16_overflow_is_skipped_and_counted():
    model = micro_model()
    precision = make_precision("fp16", torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    forward_backward(
        model,
        [ContrastiveObjective(model, ContrastiveLoss("clip"))],
        [random_batch(4, seed=2)],
        precision,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.towers["text"].proj.weight.grad[0, 0] = math.inf  # an fp16 overflow
    _, stepped, _ = optimizer_step(model, optimizer, precision, grad_clip=1.0)
    assert not stepped and precision.scaler.get_scale() < 65536.0
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_non_finite_gradient_skips_the_step():
    model = micro_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.logit_scale.grad = torch.tensor(math.nan)
    norm, stepped, _ = optimizer_step(
        model, optimizer, make_precision("fp32", torch.device("cpu")), 1.0
    )
    assert not stepped and math.isnan(norm)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


# ----------------------------------------------------------------------------- optimizer
def test_param_groups_per_tower_lr_and_no_decay_on_1d_embeddings_and_scale(tmp_path):
    config = make_config(tmp_path, "unused")
    config.train.weight_decay = 0.1
    config.train.towers = {"image": mmtrain.config.TowerTrainConfig(lr=1e-4, weight_decay=0.05)}
    model = micro_model()
    groups = {g["name"]: g for g in param_groups(model, config.train)}
    names = {id(p): n for n, p in model.named_parameters()}
    members = {key: {names[id(p)] for p in g["params"]} for key, g in groups.items()}

    assert groups["image/decay"]["lr"] == 1e-4 and groups["image/decay"]["weight_decay"] == 0.05
    assert groups["text/decay"]["lr"] == 1e-3 and groups["text/decay"]["weight_decay"] == 0.1
    assert all(g["weight_decay"] == 0.0 for k, g in groups.items() if k.endswith("no_decay"))
    no_decay = set().union(*(m for k, m in members.items() if k.endswith("no_decay")))
    assert {
        "logit_scale",
        "towers.text.stem.token_embed.weight",
        "towers.text.stem.pos_embed",
    } <= no_decay
    assert {"towers.image.stem.cls_token", "towers.image.blocks.0.norm1.weight"} <= no_decay
    assert "towers.image.blocks.0.attn.qkv.bias" in no_decay
    assert "towers.image.blocks.0.attn.qkv.weight" in members["image/decay"]
    assert "towers.image.stem.patch_embed.weight" in members["image/decay"]
    every = set().union(*members.values())
    assert every == set(names.values())  # each trainable parameter in exactly one group
    assert sum(len(m) for m in members.values()) == len(every)


def test_freezing_a_tower_or_its_first_blocks(tmp_path, shards):
    config = make_config(tmp_path, shards, steps=2)
    config.train.towers = {
        "image": mmtrain.config.TowerTrainConfig(freeze=True),
        "text": mmtrain.config.TowerTrainConfig(freeze_blocks=1),
    }
    initial = micro_model(seed=config.seed).state_dict()
    train(config)
    trained = mmtrain.load_model(tmp_path / "run").state_dict()
    changed = {k for k in initial if not torch.equal(initial[k], trained[k])}
    assert not any(k.startswith("towers.image.") for k in changed)
    assert not any(k.startswith(("towers.text.stem.", "towers.text.blocks.0.")) for k in changed)
    assert any(k.startswith("towers.text.blocks.1.") for k in changed)
    assert "logit_scale" in changed

    model = micro_model()
    config.train.towers = {"imag": mmtrain.config.TowerTrainConfig(freeze=True)}
    with pytest.raises(FieldError, match="did you mean 'image'"):
        freeze_parameters(model, config.train)


def test_warmup_then_cosine_or_constant(tmp_path):
    config = make_config(tmp_path, "unused", steps=10, warmup_steps=2, lr=1.0, min_lr=0.1)
    f = lr_factor(config.train)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.1)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5)
    assert all(f(s) >= f(s + 1) for s in range(2, 10))
    config.train.schedule = "constant"
    assert lr_factor(config.train)(7) == 1.0


# ----------------------------------------------------------------------------- metrics
def test_metrics_rows_hold_what_users_watch(tmp_path, shards):
    config = make_config(tmp_path, shards, steps=2)
    config.metrics.tensorboard = True
    config.metrics.peak_tflops = 1.0  # a known peak gives MFU also on a CPU
    config.train.ema = 0.9
    train(config)
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    rows = [r for r in records if "kind" not in r]
    assert len(rows) == 2
    expected = {
        "loss", "loss/image-text", "lr", "logit_scale", "grad_norm", "samples_per_s", "step_s",
        "data_wait_s", "compute_s", "optimizer_s", "data_wait_fraction", "mfu", "peak_rss_gib",
        "skipped_steps", "corrupt_samples", "samples_seen",
    }  # fmt: skip
    assert expected <= set(rows[0])
    assert 0 <= rows[0]["data_wait_fraction"] <= 1 and 0 < rows[0]["mfu"] < 1
    assert rows[1]["samples_seen"] == 16
    assert any((tmp_path / "run" / "tensorboard").iterdir())
    ema = mmtrain.load_model(tmp_path / "run" / "ema").state_dict()
    final = mmtrain.load_model(tmp_path / "run").state_dict()
    assert ema.keys() == final.keys() and not torch.equal(ema["logit_scale"], final["logit_scale"])


def test_loss_spikes_are_flagged_after_warmup():
    spikes = LossSpikes(sigmas=4.0, warmup=5)
    levels = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02]
    assert not any(spikes.check(v) for v in levels)
    assert spikes.check(9.0) and spikes.check(math.nan)
    assert not spikes.check(2.01)  # the spike did not move the bar


def test_activation_checkpointing_per_tower_keeps_the_gradient():
    batch = random_batch(4, seed=5)
    precision = make_precision("fp32", torch.device("cpu"))
    plain = micro_model()
    forward_backward(
        plain, [ContrastiveObjective(plain, ContrastiveLoss("clip"))], [batch], precision
    )
    recomputed = apply_activation_checkpointing(micro_model(), "full", ["image"])
    forward_backward(
        recomputed, [ContrastiveObjective(recomputed, ContrastiveLoss("clip"))], [batch], precision
    )
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    with pytest.raises(FieldError, match="no tower 'audio'"):
        apply_activation_checkpointing(micro_model(), "full", ["audio"])


def test_pixels_normalised_on_the_device_train_exactly_like_the_workers(tmp_path, shards):
    # uint8 pixels to the device, normalised there (what CUDA runs do by default), against the
    # workers' float32 pixels: the same float32 arithmetic, so the same weights bit for bit.
    runs = {}
    for on_device in (False, True):
        config = micro_run(
            tmp_path / str(on_device), shards, data={"normalise_on_device": on_device}
        )
        train(config)
        runs[on_device] = load_file(str(tmp_path / str(on_device) / "run" / "model.safetensors"))
    assert runs[True].keys() == runs[False].keys()
    assert all(torch.equal(runs[True][k], runs[False][k]) for k in runs[False])
    # ... and the on-device run did get uint8 pixels, with the values to normalise them by
    from mmtrain.spec import load_spec
    from mmtrain.train.data import TrainData

    config = micro_run(tmp_path / "probe", shards, data={"normalise_on_device": True})
    data = TrainData(config, load_spec(config.model), rank=0, world_size=1, micro_batch=4,
                     uint8_pixels=True)  # fmt: skip
    assert data.next_batch()["image"].dtype == torch.uint8
    assert set(data.pixel_normalisation()) == {"image"}
    data.close()
