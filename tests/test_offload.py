"""`train.offload`: FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer states
in host memory, the optimizer stepping on the CPU).

On a CPU-only machine the "device" is the CPU already, so what these tests can show is that the
policy is applied to every FSDP unit with the shards built in host memory (never on the device
first), and that the run computes what the run without offload computes: on 2 gloo ranks, on
one process (FSDP2 with a group of one, which CPU offload on one GPU needs), and across a resume
of each checkpoint format (the full one rebuilds the shards from a whole model on the CPU).
What only a GPU shows (pinned host shards, peak GPU memory and step time with and without
offload) is bench/gpu_offload.py's.

float64 (train.precision fp64), as the other FSDP tests: FSDP2's reduce-scatter and one
process's sum add in different orders, which float64 rounds at ~1e-16 relative per operation.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from micro import make_shards, micro_run
from mmtrain.structured import FieldError
from mmtrain.train import parallel

EXACT = {"rtol": 1e-9, "atol": 1e-12}


def _config(folder, shards: str, **train):
    return micro_run(
        folder, shards, train={"precision": "fp64", "micro_batch": 2, "parallel": "fsdp", **train}
    )


def _weights(run) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(run / "model.safetensors")


def _offload_layout(config, rank: int, world: int) -> dict:
    """The set-up of an offloading run on this rank: its FSDP units' policy and where the
    shards live."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from mmtrain.spec import ModelSpec
    from mmtrain.train.model_setup import build_model
    from mmtrain.train.precision import make_precision

    env = parallel.DistributedEnv(torch.device("cpu"), rank, world, rank, owns_group=False)
    spec = ModelSpec.load(config.model)
    built = build_model(config, spec, make_precision("fp64", env.device), env, None)
    units = [m for m in built.model.modules() if isinstance(m, FSDPModule)]
    policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in units]
    params = [p for m in units for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params]
    return {
        "units": len(units),
        "offloaded": all(isinstance(p, CPUOffloadPolicy) for p in policies),
        "pinned": {p.pin_memory for p in policies},
        "to_cpu": all(p.offload_to_cpu for p in params),
        "devices": {p.sharded_param.to_local().device.type for p in params},
    }


def _runs(rank: int, world: int, configs: dict) -> dict:
    from mmtrain.train.loop import train

    layout = _offload_layout(configs["offload"], rank, world)
    losses = {name: [r["loss"] for r in train(configs[name]).history] for name in ("plain", "offload")}  # fmt: skip
    losses["halted"] = [r["loss"] for r in train(configs["resumed"], halt_after_step=3).history]
    resumed = train(configs["resumed"])
    assert resumed.resumed_from == 2
    losses["resumed"] = [r["loss"] for r in resumed.history]
    return {"losses": losses, "layout": layout}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1], ids=["2-ranks-sharded-ckpt", "1-rank-full-ckpt"])
def test_offload_trains_as_without_it_and_resumes_exactly(tmp_path, world):
    from mmtrain.train.loop import train

    shards = make_shards(tmp_path / "shards", 32)
    one = [r["loss"] for r in train(_config(tmp_path / "one", shards, parallel="ddp",
                                            micro_batch=4)).history]  # fmt: skip
    configs = {
        "plain": _config(tmp_path / "plain", shards),
        "offload": _config(tmp_path / "offload", shards, offload=True),
        "resumed": _config(tmp_path / "resumed", shards, offload=True),
    }
    results = run_distributed(_runs, world_size=world, args=(configs,), timeout_s=600)
    first = results[0]
    assert all(r["losses"] == first["losses"] for r in results)
    layout = first["layout"]
    assert layout["units"] > 1 and layout["offloaded"] and layout["to_cpu"]
    assert layout["pinned"] == {torch.cuda.is_available()}  # pinning needs CUDA's host memory
    assert layout["devices"] == {"cpu"}

    # With offload, the run computes what it computes without (the same sums, in the same
    # order) and what one process without FSDP computes (up to float64 rounding).
    assert first["losses"]["offload"] == first["losses"]["plain"]
    plain, offload = _weights(tmp_path / "plain" / "run"), _weights(tmp_path / "offload" / "run")
    assert set(plain) == set(offload)
    for key, value in plain.items():
        assert torch.equal(offload[key], value), key
    torch.testing.assert_close(torch.tensor(first["losses"]["offload"]), torch.tensor(one), **EXACT)
    reference = _weights(tmp_path / "one" / "run")
    for key, value in reference.items():
        torch.testing.assert_close(offload[key], value, **EXACT, msg=key)

    # Killed after step 3, run again from the step-2 checkpoint (2 ranks: sharded; 1: full,
    # whose weights are built whole on the CPU and copied into the host shards): bit for bit.
    assert first["losses"]["halted"] == first["losses"]["offload"][:3]
    assert first["losses"]["resumed"] == first["losses"]["offload"][2:]
    resumed = _weights(tmp_path / "resumed" / "run")
    for key, value in offload.items():
        assert torch.equal(resumed[key], value), key


def test_one_process_gets_a_group_of_its_own_for_fsdp():
    if dist.is_initialized():  # another test's group: init_distributed would reuse it
        pytest.skip("this process has a process group already")
    env = parallel.init_distributed("cpu", group_of_one=True)
    try:
        assert dist.is_initialized() and env.owns_group
        assert (env.rank, env.world_size) == (0, 1)
    finally:
        parallel.shutdown(env)
    assert not dist.is_initialized()
    alone = parallel.init_distributed("cpu")  # without offload one process stays groupless
    assert not dist.is_initialized() and not alone.owns_group


def test_offload_needs_fsdp_and_picks_it_under_auto(tmp_path):
    shards = str(tmp_path)  # not read: the config is refused or resolved before any data
    with pytest.raises(FieldError, match=r"train\.offload.*train\.parallel=fsdp"):
        micro_run(tmp_path, shards, train={"offload": True, "parallel": "ddp"})
    config = micro_run(tmp_path, shards, train={"offload": True})
    assert config.train.parallel == "fsdp"
    assert micro_run(tmp_path, shards).train.parallel == "auto"  # nothing changes without
