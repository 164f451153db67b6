"""LoRA on 2 real CPU processes (gloo): DDP and FSDP2 train the adapters as one process does,
write the same merged `model.safetensors` and `lora.safetensors`, and an FSDP2 run killed after
a (sharded) checkpoint resumes to the uninterrupted run's files bit for bit."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from dist_helpers import run_distributed
from micro import make_shards, micro_run
from mmtrain.train.lora import LORA_FILE

pytestmark = pytest.mark.slow

# Dropout stays 0: its masks follow each rank's RNG and micro-batch, so 2 ranks and 1 would
# draw different ones (exact resume with dropout is tests/test_finetune_parts.py's).
LORA = {
    "image": {"lora": {"rank": 4, "alpha": 8}},
    "text": {"lora": {"rank": 2, "targets": ["attn"]}},
}
FILES = ("model.safetensors", LORA_FILE)


def _config(folder, shards: str, **train):
    # fp64: the runs differ only in the order of their float sums (2 x 2 micro-batches on two
    # ranks vs 2 x 4 on one), which float64 rounds at ~1e-16 relative per operation.
    return micro_run(folder, shards, train={"precision": "fp64", "towers": LORA, **train})


def _runs(rank: int, world_size: int, configs: dict) -> dict:
    from mmtrain.train.loop import train

    losses = {name: [r["loss"] for r in train(configs[name]).history] for name in ("ddp", "fsdp")}
    losses["halted"] = [r["loss"] for r in train(configs["resumed"], halt_after_step=3).history]
    resumed = train(configs["resumed"])
    assert resumed.resumed_from == 2
    losses["resumed"] = [r["loss"] for r in resumed.history]
    return losses


def _files(run) -> dict[str, dict[str, torch.Tensor]]:
    return {name: safetensors.torch.load_file(run / name) for name in FILES}


def test_ddp_and_fsdp_train_lora_as_one_process_and_resume_exactly(tmp_path):
    from mmtrain.train.loop import train

    shards = make_shards(tmp_path / "shards", 32)
    one = [r["loss"] for r in train(_config(tmp_path / "one", shards, micro_batch=4)).history]
    assert len(one) == 4 and one[-1] < one[0]  # the adapters learn

    configs = {
        "ddp": _config(tmp_path / "ddp", shards, micro_batch=2, parallel="ddp"),
        "fsdp": _config(tmp_path / "fsdp", shards, micro_batch=2, parallel="fsdp"),
        "resumed": _config(tmp_path / "resumed", shards, micro_batch=2, parallel="fsdp"),
    }
    first, second = run_distributed(_runs, world_size=2, args=(configs,), timeout_s=400)
    assert first == second  # every rank logs the global loss

    # Float64 rounding (~1e-16 relative per operation) through 4 AdamW steps, whose update
    # m / (sqrt(v) + eps) amplifies a difference by at most ~1/eps (eps = 1e-6), stays far
    # below these bounds on any CPU (about 1e-16 absolute on O(0.1) weights here).
    for name in ("ddp", "fsdp"):
        torch.testing.assert_close(
            torch.tensor(first[name]), torch.tensor(one), rtol=1e-9, atol=1e-12
        )
    reference = _files(tmp_path / "one" / "run")
    for name in ("ddp", "fsdp"):
        got = _files(tmp_path / name / "run")
        for file, tensors in reference.items():
            assert set(got[file]) == set(tensors), (name, file)
            for key, value in tensors.items():
                torch.testing.assert_close(
                    got[file][key], value, rtol=1e-9, atol=1e-12, msg=f"{name} {file} {key}"
                )

    # Killed after step 3 (sharded checkpoint at step 2), run again: bit for bit the same.
    assert first["halted"] == first["fsdp"][:3]
    assert first["resumed"] == first["fsdp"][2:]
    fsdp, resumed = _files(tmp_path / "fsdp" / "run"), _files(tmp_path / "resumed" / "run")
    for file, tensors in fsdp.items():
        for key, value in tensors.items():
            assert torch.equal(resumed[file][key], value), (file, key)
