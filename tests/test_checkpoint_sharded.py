"""Sharded checkpoints (`checkpoint.format: sharded`, the default under FSDP on several ranks):
every rank writes its shards through torch.distributed.checkpoint into the same atomic,
manifest-verified folder; a killed run resumes bit for bit; the checkpoint loads on another
number of ranks, in one plain process and into the full format; a damaged shard file makes the
checkpoint skipped for the previous one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import mmtrain
from dist_helpers import run_distributed
from micro import MICRO_SPEC, make_shards, micro_run
from mmtrain.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    read_sharded,
    save_sharded_checkpoint,
    verify_checkpoint,
)
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train import parallel
from mmtrain.train.loop import train

STEP2, STEP4 = "checkpoints/step_00000002", "checkpoints/step_00000004"


def _config(folder, shards: str, fmt: str = "auto", **train):
    """4 steps of the micro CLIP, checkpoints at steps 2 and 4, FSDP unless told otherwise."""
    return micro_run(
        folder,
        shards,
        train={"parallel": "fsdp", "micro_batch": 2, **train},
        checkpoint={"format": fmt},
    )


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size: only the sha256 can tell
    path.write_bytes(bytes(data))


def _run(folder):
    return folder / "run"


# ----------------------------------------------------------------------------- one process
def _plain_model_and_optimizer(config):
    from mmtrain.train.optim import make_optimizer, resolve_optimizer_defaults

    spec = ModelSpec.from_dict(MICRO_SPEC)
    model = mmtrain.create_model(spec, seed=7)
    resolve_optimizer_defaults(config.train, spec)  # as the trainer does
    return model, make_optimizer(model, config.train, torch.device("cpu"))


def test_format_key_is_validated_and_auto_means_sharded_under_fsdp_only(tmp_path):
    config = _config(tmp_path, "unused")
    assert config.checkpoint.format_for("fsdp", 2) == "sharded"
    assert config.checkpoint.format_for("fsdp", 1) == "full"
    assert config.checkpoint.format_for("ddp", 8) == "full"
    config.checkpoint.format = "full"
    assert config.checkpoint.format_for("fsdp", 2) == "full"
    config.checkpoint.format = "shards"
    with pytest.raises(FieldError, match=r"checkpoint\.format: 'shards' is not one of"):
        config.validate()


def test_one_process_sharded_round_trip_manifest_and_damage(tmp_path):
    """Without a process group the sharded format still works: a plain model's full tensors
    go through DCP, every file (dcp/* too) is in the manifest, damage is detected."""
    config = _config(tmp_path, "unused")
    model, optimizer = _plain_model_and_optimizer(config)
    sum(p.square().sum() for p in model.parameters()).backward()
    optimizer.step()
    root = tmp_path / "checkpoints"
    state = {"counters": {"step": 1}}
    for step in (1, 2):
        shards = parallel.sharded_state_dict(model, optimizer)
        save_sharded_checkpoint(root, step, shards, state, {"world_size": 1}, keep=2)
    newest = root / "step_00000002"
    manifest = json.loads((newest / "manifest.json").read_text())["files"]
    assert {"dcp/.metadata", "state.pt", "meta.json"} <= set(manifest)
    assert any(name.endswith(".distcp") for name in manifest)
    assert not (newest / "model.safetensors").exists()
    ckpt = load_checkpoint(newest)
    assert ckpt.format == "sharded" and ckpt.model == {} and ckpt.state == state

    fresh, fresh_optimizer = _plain_model_and_optimizer(config)
    shards = parallel.sharded_state_dict(fresh, fresh_optimizer)
    read_sharded(newest, shards)
    parallel.load_sharded_state_dict(fresh, fresh_optimizer, shards)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert str(fresh_optimizer.state_dict()) == str(optimizer.state_dict())
    weights = load_weights(newest)  # no model or optimizer needed: shapes come from DCP
    assert weights.keys() == model.state_dict().keys()

    distcp = next(newest.glob("dcp/*.distcp"))
    _flip_last_byte(distcp)
    assert any(
        "sha256" in problem and distcp.name in problem for problem in verify_checkpoint(newest)
    )
    assert latest_checkpoint(root) == root / "step_00000001"
    with pytest.raises(CheckpointError, match="step_00000002"):
        load_weights(newest)


# ----------------------------------------------------------------------------- 2 ranks
def _runs(rank: int, world_size: int, configs: dict, folders: dict) -> dict:
    """On 2 FSDP ranks: an uninterrupted run; a run halted after step 3 (last checkpoint:
    step 2), copied aside, then run again; the copy resumed writing the full format; a run
    rolled back to step 2 after a NaN step 3; the non-finite check of a sharded save."""
    out: dict = {"nonfinite": _nonfinite_error(rank)}
    out["whole"] = [row["loss"] for row in train(configs["whole"]).history]
    train(configs["resumed"], halt_after_step=3)
    if rank == 0:
        shutil.copytree(_run(folders["resumed"]), _run(folders["to_full"]))
    torch.distributed.barrier()
    resumed = train(configs["resumed"])
    out["resumed"] = (resumed.resumed_from, [row["loss"] for row in resumed.history])
    out["to_full"] = train(configs["to_full"]).resumed_from
    out["rollbacks"] = train(configs["rollback"]).rollbacks
    return out


def _nonfinite_error(rank: int) -> str | None:
    """The error of a sharded save's weight check when only rank 1's shard holds a NaN."""
    from mmtrain.train.checkpointer import check_finite_weights

    model = parallel.apply_fsdp(mmtrain.create_model(ModelSpec.from_dict(MICRO_SPEC)))
    if rank == 1:
        with torch.no_grad():
            model.towers["image"].blocks[0].mlp.fc1.weight.to_local().fill_(float("nan"))
    shards = parallel.sharded_state_dict(model, torch.optim.AdamW(model.parameters()))
    try:
        check_finite_weights(shards["model"], sharded=True)
    except FloatingPointError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_two_rank_sharded_checkpoints_resume_exactly_and_reshard(tmp_path, caplog):
    shards = make_shards(tmp_path / "shards", 32)
    names = ("whole", "resumed", "to_full", "rollback", "one")
    folders = {name: tmp_path / name for name in names}
    configs = {name: _config(folders[name], shards) for name in ("whole", "resumed", "rollback")}
    configs["to_full"] = _config(folders["to_full"], shards, fmt="full")
    configs["rollback"].guards.inject_nan_steps = [3]  # NaN inputs in step 3, once
    configs["rollback"].guards.max_nonfinite_in_a_row = 1
    first, second = run_distributed(_runs, 2, (configs, folders), timeout_s=400)
    whole = _run(folders["whole"])

    # Non-finite weights are never saved: rank 1's NaN shard stops both ranks.
    assert "towers.image.blocks.0.mlp.fc1.weight" in second.pop("nonfinite")
    assert "another rank's shards" in first.pop("nonfinite")
    assert first == second  # every rank logs the global loss

    # Each checkpoint: every rank's shards in dcp/, no gathered weights, all in the manifest.
    for step_dir in (STEP2, STEP4):
        ckpt = load_checkpoint(whole / step_dir)
        assert ckpt.format == "sharded" and ckpt.meta["world_size"] == 2
        files = json.loads((whole / step_dir / "manifest.json").read_text())["files"]
        assert len([name for name in files if name.endswith(".distcp")]) == 2  # one per rank
        assert "dcp/.metadata" in files and "model.safetensors" not in files
        assert len(ckpt.state["rng"]) == 2 and "optimizer" not in ckpt.state
    # The final weights stay one gathered file, equal to the sharded checkpoint of that step.
    final = mmtrain.load_model(whole).state_dict()
    assert load_weights(whole / STEP4).keys() == final.keys()
    for name, value in load_weights(whole / STEP4).items():
        assert torch.equal(final[name], value), name

    # (1) Halted after step 3, resumed from step 2 on 2 ranks: steps 3-4 and the final weights
    # are the uninterrupted run's, bit for bit (same ranks, same reductions, same order).
    assert first["resumed"] == (2, first["whole"][2:])
    resumed = mmtrain.load_model(_run(folders["resumed"])).state_dict()
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name

    # (2a) The same checkpoint resumed on 2 FSDP ranks writing the full format: bitwise too,
    # and its step-4 optimizer state (gathered) equals the sharded one read in one process.
    assert first["to_full"] == 2
    to_full = _run(folders["to_full"])
    full4 = load_checkpoint(to_full / STEP4)
    assert full4.format == "full"
    for name, value in mmtrain.load_model(to_full).state_dict().items():
        assert torch.equal(final[name], value), name
    model, optimizer = _plain_model_and_optimizer(configs["whole"])
    state = parallel.sharded_state_dict(model, optimizer)
    read_sharded(whole / STEP4, state)
    parallel.load_sharded_state_dict(model, optimizer, state)
    for name, value in model.state_dict().items():
        assert torch.equal(full4.model[name], value), name
    moments = parallel.sharded_state_dict(model, optimizer)["optimizer"]["state"]
    assert moments.keys() == full4.state["optimizer"]["state"].keys()
    for name, saved in full4.state["optimizer"]["state"].items():
        for key, value in saved.items():
            assert torch.equal(moments[name][key], value), (name, key)

    # The rollback reloaded the sharded step 2 into the live FSDP model and optimizer, and the
    # replayed steps 3-4 (clean this time) reach the uninterrupted run's weights exactly.
    assert first["rollbacks"] == 1
    for name, value in mmtrain.load_model(_run(folders["rollback"])).state_dict().items():
        assert torch.equal(final[name], value), name

    # (2b, 3) The finished run copied with one shard file of step 4 damaged, resumed in this
    # single process (no process group, no FSDP): the manifest rejects step 4, the 2-rank
    # sharded step 2 loads into the plain model, and the run trains on to a full checkpoint.
    one = _run(folders["one"])
    shutil.copytree(whole, one)
    (one / "model.safetensors").unlink()
    _flip_last_byte(one / STEP4 / "dcp" / "__1_0.distcp")
    result = train(_config(folders["one"], shards, parallel="auto"))
    assert "dcp/__1_0.distcp: sha256 differs" in caplog.text
    assert result.resumed_from == 2 and result.step == 4
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in result.history)
    assert load_checkpoint(one / STEP4).format == "full"
    assert (one / "model.safetensors").is_file()
