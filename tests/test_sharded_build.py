"""A model larger than one rank's share: under FSDP2 on several ranks the trainer builds the model
on the meta device, shards it, and gives each rank memory for its shards only; the random init
is drawn full one parameter at a time and each rank keeps its rows, and `init` from a HF folder
(sharded safetensors written by transformers) reads only the rows a rank owns.

Bitwise checks: gathered after the sharded build, the weights must equal those of the whole
model built in one process with the same seed and baseline (init copies, the random init is a
pure function of the seed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from dist_helpers import run_distributed
from micro import micro_run
from mmtrain.models.formats.hf import read_hf_model
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.init_sliced import plan_sliced_init
from mmtrain.train.model_setup import build_model
from mmtrain.train.precision import make_precision
from test_hf_llava import hf_lm

OLD_VOCAB, NEW_VOCAB = 96, 100  # the embedding and the untied head grow (mean rows)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf_lm("llama-sharded", seed=5, vocab_size=OLD_VOCAB).save_pretrained(
        folder, max_shard_size="20KB"
    )
    assert (folder / "model.safetensors.index.json").is_file()  # several shard files
    return folder


def _config(tmp_path, llama, init: bool):
    spec, _ = read_hf_model(llama)
    spec = dataclasses.replace(
        spec, decoder=dataclasses.replace(spec.decoder, vocab_size=NEW_VOCAB)
    )
    train = {"parallel": "fsdp", "towers": {"text": {"lora": {"rank": 4}}}}
    config = micro_run(tmp_path, "unused", spec=spec.to_dict(), train=train)
    return dataclasses.replace(config, init=str(llama) if init else None)


def _built_weights(rank: int, world: int, config) -> dict[str, torch.Tensor] | None:
    env = parallel.DistributedEnv(torch.device("cpu"), rank, world, rank, owns_group=False)
    precision = make_precision("fp32", env.device)
    spec = ModelSpec.from_dict(yaml.safe_load(open(config.model)))
    built = build_model(config, spec, precision, env, None)
    local = sum(p.to_local().numel() for p in built.model.parameters())
    total = sum(p.numel() for p in built.model.parameters())
    # FSDP2's dim-0 split: at most ceil(rows / ranks) rows of each parameter on a rank.
    share = sum(
        -(-p.shape[0] // world) * (p.numel() // max(p.shape[0], 1)) if p.dim() else 1
        for p in built.model.parameters()
    )
    state = parallel.full_model_state_dict(built.model)  # gathered, for the comparison only
    return {"state": state if rank == 0 else None, "local": local, "total": total,
            "share": share, "sha256": built.config.init_sha256}  # fmt: skip


def _whole_weights(config) -> dict[str, torch.Tensor]:
    spec = ModelSpec.from_dict(yaml.safe_load(open(config.model)))
    env = parallel.DistributedEnv(torch.device("cpu"), 0, 1, 0, owns_group=False)
    built = build_model(config, spec, make_precision("fp32", env.device), env, None)
    return built.model.state_dict()


@pytest.mark.parametrize("init", [True, False], ids=["init-hf-sharded", "random-init"])
def test_sharded_build_equals_the_whole_model_bitwise(tmp_path, llama, init):
    config = _config(tmp_path, llama, init)
    if init:  # the sliced path is the one taken (not the whole-model fallback)
        from mmtrain.models import create_model
        from mmtrain.train.lora import apply_lora, lora_towers

        probe = create_model(ModelSpec.from_dict(yaml.safe_load(open(config.model))),
                             device="meta")  # fmt: skip
        apply_lora(probe, lora_towers(config.train))
        assert plan_sliced_init(probe, config.init) is not None
    results = run_distributed(_built_weights, world_size=2, args=(config,), timeout_s=240)
    expected = _whole_weights(config)
    got = results[0]["state"]
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    # Each rank allocated its rows of dim 0 (about half of the model), never all of it.
    for result in results:
        assert result["local"] <= result["share"] < result["total"]
    assert results[0]["sha256"] == results[1]["sha256"] and bool(results[0]["sha256"]) == init


def test_a_baseline_not_read_in_slices_is_read_whole(tmp_path, llama):
    """A VLM whose decoder AND image tower come from baselines: the image tower's source is not
    read in slices, so the plan says so (the set-up then reads the baselines whole)."""
    from mmtrain.models import create_model

    spec, _ = read_hf_model(llama)
    probe = create_model(spec, device="meta")
    assert plan_sliced_init(probe, str(llama)) is not None
    assert plan_sliced_init(probe, {"image": str(llama), "text": str(llama)}) is None
    assert plan_sliced_init(probe, str(tmp_path)) is None  # no weights there at all
