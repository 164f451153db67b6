"""`mmtrain train` starts a rank whose tensors change shape from step to step (a language
model's rows, a native VLM's pages) with CUDA's allocator growing its segments in place
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), unless the user chose an allocator setting.
The variable must be in the environment before CUDA initialises; the CLI sets it before the
trainer touches a device, here on a CPU where the variable is all there is to see."""

from __future__ import annotations

import os

import pytest
import yaml

from micro import make_shards, micro_run
from mmtrain.cli import main
from mmtrain.distributed import default_allocator_settings
from test_train_vlm import _config as vlm_config
from test_train_vlm import shards as vlm_shards  # noqa: F401  (a fixture)

VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def test_set_when_absent_and_shapes_vary_else_left_alone():
    environ: dict[str, str] = {}
    assert default_allocator_settings(True, environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in VARIABLES:  # the user's setting, under either name, wins
        mine = {name: "max_split_size_mb:128"}
        assert not default_allocator_settings(True, mine)
        assert mine == {name: "max_split_size_mb:128"}
    fixed: dict[str, str] = {}
    assert not default_allocator_settings(False, fixed) and fixed == {}


def _train_cli(config, tmp_path) -> int:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return main(["train", str(path), "train.steps=1"])


@pytest.fixture
def no_allocator_setting(monkeypatch):
    """Neither variable, and the environment restored afterwards: the CLI sets the variable
    in os.environ itself, and delenv of an absent name records nothing to undo."""
    for name in VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_cli_sets_it_for_a_vlm_and_keeps_the_users(
    tmp_path,
    vlm_shards,  # noqa: F811  (the fixture imported above)
    no_allocator_setting,
    monkeypatch,
):
    assert _train_cli(vlm_config(tmp_path / "a", vlm_shards), tmp_path) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert _train_cli(vlm_config(tmp_path / "b", vlm_shards), tmp_path) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_a_model_of_fixed_shapes_is_left_as_torch_starts(tmp_path, no_allocator_setting):
    shards = make_shards(tmp_path / "shards", 16)
    assert _train_cli(micro_run(tmp_path, shards), tmp_path) == 0
    assert not any(name in os.environ for name in VARIABLES)
