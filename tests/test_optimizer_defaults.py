"""AdamW's settings follow the workload when a config leaves them out: a language or
vision-language model trains with transformers' defaults (weight decay 0, betas 0.9/0.999, eps
1e-8), a contrastive model with OpenCLIP's (0.2, 0.9/0.98, 1e-6), a denoiser with diffusers'
training scripts' (1e-2, 0.9/0.999, 1e-8). Explicit values win; the optimizer the trainer sets
up, the run's resolved config.yaml and the start log all say what the run trains with.

Real parts: the trainer's own set-up (`Trainer`) on the micro CLIP, the tiny VLM and the tiny
DiT with their shards; nothing is trained past the set-up."""

from __future__ import annotations

import logging

import pytest
import yaml

from micro import make_shards, micro_run
from mmtrain.config import RunConfig
from mmtrain.structured import FieldError
from mmtrain.train.loop import Trainer
from test_dit import _config as dit_config
from test_dit import shards as dit_shards  # noqa: F401  (a fixture)
from test_dit import tiny
from test_train_vlm import _config as vlm_config
from test_train_vlm import shards as vlm_shards  # noqa: F401  (a fixture)

# (weight decay, betas, eps) of each workload's anchor
TRANSFORMERS = (0.0, (0.9, 0.999), 1e-8)  # transformers' TrainingArguments
OPENCLIP = (0.2, (0.9, 0.98), 1e-6)  # open_clip_train/params.py, ViT models
DIFFUSERS = (1e-2, (0.9, 0.999), 1e-8)  # diffusers' examples: --adam_* defaults


@pytest.fixture(scope="module")
def clip_shards(tmp_path_factory) -> str:
    return make_shards(tmp_path_factory.mktemp("clip-shards"), 16)


def _configs(kind: str, folder, request) -> RunConfig:
    """A run config of `kind` that sets none of train.weight_decay, betas, eps."""
    if kind == "clip":
        return micro_run(folder, request.getfixturevalue("clip_shards"))
    if kind == "vlm":
        return vlm_config(folder / "run", request.getfixturevalue("vlm_shards"))
    spec_file = folder / "spec.yaml"
    tiny().save(spec_file)
    return dit_config(folder / "run", request.getfixturevalue("dit_shards"), spec_file)


def _set_up(config: RunConfig, caplog) -> tuple[list[dict], dict, str]:
    """The optimizer's groups after the trainer's set-up, its resolved config.yaml and the
    start log."""
    with caplog.at_level(logging.INFO, logger="mmtrain"):
        trainer = Trainer(config)
    try:
        groups = [dict(g, params=None) for g in trainer.optimizer.param_groups]
        written = yaml.safe_load((trainer.out / "config.yaml").read_text())
    finally:
        trainer.halt()
    return groups, written, caplog.text


def _decays(groups: list[dict]) -> set[float]:
    return {g["weight_decay"] for g in groups if g["name"].endswith("/decay")}


@pytest.mark.parametrize(
    ("kind", "expected", "source"),
    [
        ("vlm", TRANSFORMERS, "transformers"),
        ("clip", OPENCLIP, "OpenCLIP"),
        ("dit", DIFFUSERS, "diffusers"),
    ],
)
def test_settings_left_out_take_the_workloads_defaults(kind, expected, source, tmp_path,
                                                       request, caplog):  # fmt: skip
    config = _configs(kind, tmp_path, request)
    assert (config.train.weight_decay, config.train.betas, config.train.eps) == (None,) * 3
    groups, written, log = _set_up(config, caplog)
    decay, betas, eps = expected
    assert _decays(groups) == {decay}
    assert {g["weight_decay"] for g in groups if g["name"].endswith("/no_decay")} == {0.0}
    assert {g["betas"] for g in groups} == {betas} and {g["eps"] for g in groups} == {eps}
    # the run folder records what the run trains with, so a resume or a reader sees it
    train = written["train"]
    assert (train["weight_decay"], tuple(train["betas"]), train["eps"]) == expected
    # the start log names them and whose defaults they are
    line = next(x for x in log.splitlines() if "optimizer AdamW" in x)
    assert f"weight decay {decay:g}" in line and f"betas ({betas[0]:g}, {betas[1]:g})" in line
    assert f"eps {eps:g}" in line
    filled = next(x for x in log.splitlines() if "left out" in x)
    assert "train.weight_decay, train.betas, train.eps left out" in filled and source in filled


def test_explicit_settings_win_and_a_towers_decay_overrides_the_runs(tmp_path, request, caplog):
    shards = request.getfixturevalue("vlm_shards")
    config = vlm_config(tmp_path / "run", shards, train={
        "weight_decay": 0.05, "betas": [0.8, 0.95], "towers": {"image": {"weight_decay": 0.3}},
    })  # fmt: skip
    groups, written, log = _set_up(config, caplog)
    assert {g["weight_decay"] for g in groups if g["name"] == "image/decay"} == {0.3}
    assert {g["weight_decay"] for g in groups if g["name"] == "text/decay"} == {0.05}
    assert {g["betas"] for g in groups} == {(0.8, 0.95)}
    assert {g["eps"] for g in groups} == {1e-8}  # the one left out: transformers' default
    assert written["train"]["weight_decay"] == 0.05 and written["train"]["eps"] == 1e-8
    line = next(x for x in log.splitlines() if "optimizer AdamW" in x)
    assert "weight decay 0.05 (image 0.3)" in line and "betas (0.8, 0.95)" in line
    filled = next(x for x in log.splitlines() if "left out" in x)
    assert "train.eps left out" in filled and "train.betas" not in filled
    assert "train.weight_decay" not in filled


def test_a_set_value_is_still_checked(tmp_path, clip_shards):
    for key, value in (("weight_decay", -0.1), ("eps", 0.0), ("betas", [0.9, 1.0])):
        with pytest.raises(FieldError, match=f"train.{key}"):
            micro_run(tmp_path, clip_shards, train={key: value})
    micro_run(tmp_path, clip_shards).validate()  # left out: the workload decides, later
