"""`train` with `train.parallel=fsdp` on 2 real CPU processes (gloo): FSDP2 follows DDP's losses,
its final `model.safetensors` is the full single-process model, and a run killed after a
checkpoint resumes to the uninterrupted run's weights."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import mmtrain
from dist_helpers import run_distributed
from micro import COLORS, make_shards, micro_run
from mmtrain.checkpoint import load_checkpoint
from mmtrain.data.storage.shard_writer import ShardWriter

pytestmark = pytest.mark.slow
EXACT = {"rtol": 1e-9, "atol": 1e-12}


def _val_shards(folder) -> str:
    """32 held-out pairs, each with a caption of its own. `make_shards` has 4 captions, so 8
    texts are one and a query's rank among them is decided by the last bit of rounding, which
    FSDP's and DDP's sums (in different orders) need not share."""
    rng = np.random.default_rng(1)
    with ShardWriter(folder, max_samples=16) as writer:
        for i in range(32):
            png = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (20, 24, 3), np.uint8)).save(png, format="PNG")
            text = f"square {i} of {COLORS[i % len(COLORS)]}".encode()
            writer.write({"__key__": f"v{i:05d}", "png": png.getvalue(), "txt": text})
    return str(folder)


def _config(folder, shards: str, val: str | None = None, **train):
    # 2 ranks x micro-batch 2 x 2 accumulation: FSDP's skipped reduction on the first one.
    # Checkpoints in the gathered single-process format (the default under FSDP is sharded,
    # see tests/test_checkpoint_sharded.py). float64 (fp64): FSDP's reduce-scatter and DDP's
    # all-reduce sum in different orders; float64 rounding (~1e-16 per operation, ~1e-12 after
    # 4 steps of a micro model) keeps EXACT true on any CPU, float32's does not.
    return micro_run(
        folder,
        shards,
        data={"val": val} if val else {},
        eval={"every_steps": 2 if val else None},
        train={"micro_batch": 2, "precision": "fp64", **train},
        checkpoint={"format": "full"},
    )


def _runs(rank: int, world_size: int, configs: dict) -> dict:
    """Each run of `configs` in turn on this rank: losses by run ("halted" stops after step 3,
    "resumed" then reruns its folder), and the error message of a refused configuration."""
    from mmtrain.train.loop import train

    losses = {}
    for name in ("ddp", "fsdp"):
        history = train(configs[name]).history
        losses[name] = [row["loss"] for row in history]
        losses[f"{name}_val"] = [
            (row["step"], key, value) for row in history for key, value in row.items()
            if key.startswith("val/retrieval/")
        ]  # fmt: skip
    halted = train(configs["resumed"], halt_after_step=3)
    losses["halted"] = [row["loss"] for row in halted.history]
    resumed = train(configs["resumed"])
    assert resumed.resumed_from == 2
    losses["resumed"] = [row["loss"] for row in resumed.history]
    return losses


def test_fsdp_follows_ddp_saves_full_weights_and_resumes_exactly(tmp_path):
    shards = make_shards(tmp_path / "shards", 32)
    val = _val_shards(tmp_path / "val")
    configs = {
        "ddp": _config(tmp_path / "ddp", shards, val=val, parallel="ddp"),
        "fsdp": _config(tmp_path / "fsdp", shards, val=val, parallel="fsdp"),
        "resumed": _config(tmp_path / "resumed", shards, parallel="fsdp"),
    }
    first, second = run_distributed(_runs, world_size=2, args=(configs,), timeout_s=300)
    assert first == second  # every rank logs the global loss

    ddp = torch.tensor(first["ddp"], dtype=torch.float64)
    fsdp = torch.tensor(first["fsdp"], dtype=torch.float64)
    assert len(fsdp) == 4 and fsdp[-1] < fsdp[0]  # it learns
    torch.testing.assert_close(fsdp, ddp, **EXACT)
    # Periodic validation runs under FSDP (every rank embeds its share) and ranks the held-out
    # pairs as DDP's replica does.
    assert {step for step, _, _ in first["fsdp_val"]} == {2, 4}
    assert [(s, k) for s, k, _ in first["fsdp_val"]] == [(s, k) for s, k, _ in first["ddp_val"]]
    for (_, key, got), (_, _, want) in zip(first["fsdp_val"], first["ddp_val"], strict=True):
        assert got == pytest.approx(want, rel=1e-9) or key.endswith("rank"), key

    # The final weights were gathered from the shards into the single-process format.
    ddp_model = mmtrain.load_model(tmp_path / "ddp" / "run").state_dict()
    fsdp_model = mmtrain.load_model(tmp_path / "fsdp" / "run").state_dict()
    assert list(fsdp_model) == list(ddp_model)
    for name, value in ddp_model.items():
        torch.testing.assert_close(fsdp_model[name], value, **EXACT, msg=name)
    # So were the checkpoint's: full weights and a name-keyed, unsharded optimizer state.
    saved = load_checkpoint(tmp_path / "fsdp" / "run" / "checkpoints" / "step_00000004")
    assert set(saved.model) == set(ddp_model)  # stored sorted by name
    for name, value in saved.model.items():
        torch.testing.assert_close(value, fsdp_model[name], rtol=0, atol=0, msg=name)
    moments = saved.state["optimizer"]["state"]
    assert set(moments) == set(ddp_model) and len(saved.state["rng"]) == 2
    assert moments["logit_scale"]["exp_avg"].shape == ()  # the unsharded scalar too
    weight = next(name for name in ddp_model if ddp_model[name].dim() == 2)
    assert moments[weight]["exp_avg"].shape == ddp_model[weight].shape

    # Killed after step 3 (last checkpoint at step 2), then run again: the same steps 3-4 and
    # the same final weights, bit for bit, as the run that was never interrupted.
    assert first["halted"] == first["fsdp"][:3]
    assert first["resumed"] == first["fsdp"][2:]
    resumed_model = mmtrain.load_model(tmp_path / "resumed" / "run").state_dict()
    for name, value in fsdp_model.items():
        assert torch.equal(resumed_model[name], value), name
