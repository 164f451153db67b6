"""CPU offload (FSDP2's CPUOffloadPolicy, `--offload`, train.offload) in the plan: bytes on the GPU
and on the host, a server's host memory, the host link's time, by hand for Qwen2.5-VL-72B (its
published shapes: tests/test_plan_presets.py) trained whole on 8 x H100."""

from __future__ import annotations

import json
import math

import pytest

from mmtrain.cli import main
from mmtrain.hardware import GIB, default_catalog, get_gpu
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.fsdp_units import fsdp_units, unit_frozen_held
from mmtrain.plan.offload import pinned_size
from mmtrain.plan.states import frozen_model_bytes
from mmtrain.plan.workloads import load_model

PARAMS = 73_410_777_344
# Qwen2.5-VL-72B's parameter tensors, by FSDP unit (train/parallel.py's apply_fsdp): a text
# block (q/k/v fused with their biases, out, gate and value fused, down, two RMSNorms), a vision
# block (its MLP of 3456), the untied embedding, and the root (the head and final norm; the
# vision tower's patch projection and merger).
TEXT_BLOCK = (83_886_080, 67_108_864, 484_442_112, 242_221_056, 8192 + 2 * 1024 + 2 * 8192)
VISION_BLOCK = (4_915_200, 1_638_400, 8_847_360, 4_423_680, 3840 + 1280 + 2 * 3456 + 1280 + 2560)
EMBEDDING = 152_064 * 8192
ROOT = (704_573_696 - 32 * sum(VISION_BLOCK), EMBEDDING + 8192)
H100_PCIE5 = 64e9 * 0.75  # interconnects.yaml pcie5: 64 GB/s a direction at 75%


def _plan(**kw):
    cfg = PlanConfig(gpus=8, zero=3, ac="full", global_batch=8, **kw)
    return make_plan(load_model("Qwen2.5-VL-72B", context=8192), cfg, default_catalog())


def test_the_hand_counted_tensors_are_the_model():
    assert 80 * sum(TEXT_BLOCK) + 32 * sum(VISION_BLOCK) + EMBEDDING + sum(ROOT) == PARAMS


def test_offload_moves_every_state_to_the_host():
    resident, offloaded = _plan(), _plan(offload=True)
    m = offloaded.memory
    assert (m.weights_bytes, m.gradients_bytes, m.optimizer_bytes) == (0, 0, 0)
    # without offload the GPU holds a rank's 16 bytes a parameter: 147 GB, more than an H100
    assert resident.memory.model_state_bytes == pytest.approx(PARAMS * 16 / 8)
    assert not resident.fits and offloaded.fits
    h = offloaded.host
    assert h.params_bytes == pytest.approx(PARAMS * 4 / 8)  # fp32 parameters under autocast
    assert h.grads_bytes == pytest.approx(PARAMS * 4 / 8)  # reduce-scattered in fp32
    assert h.optimizer_bytes == pytest.approx(PARAMS * 8 / 8)  # AdamW's two fp32 moments


def test_pinned_memory_rounds_each_shard_to_a_power_of_two():
    assert pinned_size(33_554_432) == 2**25  # the out projection's fp32 shard: 32 MiB exactly
    assert pinned_size(41_943_040) == 2**26  # q/k/v's: 40 MiB takes 64 MiB
    assert pinned_size(1) == 1 and pinned_size(3) == 4

    def rounded(elements):  # a shard of fp32 parameters and of fp32 gradients
        return 2 * 2 ** math.ceil(math.log2(elements * 4 / 8))

    expected = 80 * sum(rounded(n) for n in TEXT_BLOCK)
    expected += 32 * sum(rounded(n) for n in VISION_BLOCK)
    expected += rounded(EMBEDDING) + sum(rounded(n) for n in ROOT)
    h = _plan(offload=True).host
    assert h.pinned_bytes == expected
    assert h.params_bytes + h.grads_bytes < h.pinned_bytes < 2 * (h.params_bytes + h.grads_bytes)


def test_a_server_needs_its_ranks_host_memory():
    h = _plan(offload=True).host
    assert h.ranks_per_server == 8  # DGX H100: 8 GPUs, 2 TB
    assert h.server_bytes == pytest.approx(8 * (h.pinned_bytes + h.optimizer_bytes))
    assert h.server_memory_bytes == 2048 * GIB
    assert h.fits and h.server_bytes <= 2048 * GIB * (1 - 0.07)
    small = _plan(offload=True, host_memory_gib=512)
    assert small.memory.fits and not small.host.fits and not small.fits


def test_host_link_traffic_and_time_per_step():
    plan = _plan(offload=True)
    h, t = plan.host, plan.time
    blocks = 80 * sum(TEXT_BLOCK) + 32 * sum(VISION_BLOCK)
    # each block's and the embedding's shards copied in twice (forward, backward), the root's once
    h2d = (2 * (blocks + EMBEDDING) + sum(ROOT)) * 4 / 8
    assert h.h2d_bytes == pytest.approx(h2d)
    assert h.d2h_bytes == pytest.approx(PARAMS * 4 / 8)
    assert h.link == "pcie5" and get_gpu("h100").host_link == "pcie5"
    assert h.h2d_s == pytest.approx(h2d / H100_PCIE5)
    compute = t.compute_s  # one micro-batch: copies hide behind 80% of it
    exposed = max(0, h2d / H100_PCIE5 - 0.8 * compute)
    exposed += max(0, PARAMS * 4 / 8 / H100_PCIE5 - 0.8 * compute * 2 / 3)
    assert h.exposed_s == pytest.approx(exposed) and t.offload_exposed_s == h.exposed_s
    assert t.step_time_s == _plan().time.step_time_s + h.exposed_s  # the same sum, plus it


def test_the_gpu_keeps_fsdp_buffers_and_the_copies():
    m = _plan(offload=True).memory
    root = 2 * sum(ROOT) + 2 * sum(ROOT)  # gathered in bf16, its unsharded bf16 gradients
    block = 2 * 2 * sum(TEXT_BLOCK) + 2 * sum(TEXT_BLOCK)  # two gathered, one's gradients
    staged = 2 * EMBEDDING * 4 / 8 + EMBEDDING * 4 / 8  # two units' shards in, one's out
    assert m.comm_buffers_bytes == pytest.approx(root + max(block, 4 * EMBEDDING) + staged)


@pytest.mark.parametrize(
    "name, tower",
    [("Qwen2.5-VL-7B", "text"), ("Qwen2.5-VL-3B", "text"), ("ViT-B-16", "image")],
)
def test_a_partly_frozen_towers_head_trains_in_its_fsdp_unit(name, tower):
    """`freeze_blocks` freezes a tower's stem and first blocks, not its final norm and head
    (an untied LM head: 545M parameters of Qwen2.5-VL-7B): the root unit holds their gradients
    (ZeRO-3's unsharded buffers, CPU offload's host shards and copies out)."""
    model = load_model(name, context=2048).with_frozen_blocks({tower: 4})
    units = fsdp_units(model, 8)
    assert sum(u.count * u.params for u in units) == model.params()
    assert sum(u.count * u.trainable for u in units) == model.trainable_params()
    held = sum(u.count * unit_frozen_held(u, "bf16", 8) for u in units)
    norms = sum(u.count * u.frozen_fp32 for u in units if u.kind == "block" and not u.trainable)
    # the frozen bytes the model states count (which plan the frozen blocks' norms in bf16),
    # summed in another order in float64
    states = frozen_model_bytes(model, "bf16", 8) + norms * (4 - 2) / 8
    assert held == pytest.approx(states, rel=1e-12)


def test_offload_on_one_gpu_and_the_flags(capsys):
    one = make_plan(
        load_model("tiny-vlm"), PlanConfig(gpus=1, zero=3, offload=True), default_catalog()
    )
    assert one.memory.model_state_bytes == 0 and one.host.ranks_per_server == 1
    argv = ["plan", "--model", "Qwen2.5-VL-72B", "--gpus", "8", "--context", "8192"]
    assert main([*argv, "--ac", "full", "--offload", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["zero"] == 3 and out["inputs"]["offload"] is True  # --offload is ZeRO-3
    assert out["memory"]["fits"] and out["host"]["fits"] and out["runs_in_mmtrain_train"]
    assert main([*argv, "--ac", "full", "--offload"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ZeRO-3 (FSDP2 + CPU offload)" in text and "A server of 8 ranks needs" in text
    assert "host link pcie5" in text
    assert main([*argv, "--offload", "--zero", "1"]) == 2
    assert "--offload: CPU offload is FSDP2's" in capsys.readouterr().err


def test_every_gpu_has_a_known_host_link():
    catalog = default_catalog()
    for gpu in catalog.gpus.values():
        assert gpu.host_link in catalog.links, gpu.key
        assert (gpu.server_memory_gib is None) == (gpu.server_gpus is None), gpu.key


def test_the_docs_show_what_the_plans_print():
    """docs/PLANNER.md, "Big models on fewer GPUs": its figures are these plans'."""
    from pathlib import Path

    docs = " ".join((Path(__file__).parents[1] / "docs" / "PLANNER.md").read_text().split())
    plan = _plan(offload=True)
    m, h = plan.memory, plan.host
    shown = [
        f"a GPU holds {m.total_bytes / GIB:.1f} GiB (activations "
        f"{m.saved_activations_bytes / GIB:.1f} GiB, buffers {m.comm_buffers_bytes / GIB:.1f} GiB)",
        f"a rank {h.rank_bytes / GIB:.1f} GiB of host memory, {h.server_bytes / GIB:,.0f} GiB",
        f"its {h.h2d_bytes / 1e9:.1f} GB in and {h.d2h_bytes / 1e9:.1f} GB out a step",
        f"hide behind the {plan.time.compute_s:.1f} s of compute",
        f"holds {(h.params_bytes + h.grads_bytes) / GIB:.1f} GiB of parameter and gradient shards "
        f"a rank, {h.pinned_bytes / GIB:.1f} GiB pinned",
    ]
    for text in shown:
        assert text in docs, text
    assert h.exposed_s == 0  # "hide behind"
