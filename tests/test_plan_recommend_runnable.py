"""`mmtrain plan --recommend` searches only what `mmtrain train` runs (DDP, FSDP2, FSDP2 with CPU
offload, sequence parallelism, checkpointing, LoRA/QLoRA as given), and when nothing fits names
the cheapest change that does; TP and ZeRO-1/2 stay in `plan` as what-ifs, marked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mmtrain.cli import main
from mmtrain.hardware import default_catalog
from mmtrain.plan.changes import cheapest_changes
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.recommend import _rounded, recommend
from mmtrain.plan.workloads import load_model

BIG = ["plan", "--model", "Qwen2.5-VL-72B", "--recommend", "--gpu", "h100", "--max-gpus", "8"]


def _runnable(plan) -> bool:
    c = plan.config
    return c.tp == 1 and c.pp == 1 and c.zero in (0, 3) and not plan.not_run_by_train


def test_a_72b_vlm_on_8_h100_gets_a_layout_the_trainer_runs(capsys):
    """Issue 41: "nothing fits" before; rows of its 128,000 positions fit with FSDP2's CPU
    offload (its 1.2 TB of states in the DGX's 2 TB) and sequence parallelism."""
    assert main([*BIG, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    win = out["ranked"][0]
    assert win["inputs"]["offload"] and win["inputs"]["zero"] == 3 and win["inputs"]["tp"] == 1
    assert win["memory"]["fits"] and win["host"]["fits"] and win["runs_in_mmtrain_train"]
    rec = recommend(
        load_model("Qwen2.5-VL-72B", context=8192),
        PlanConfig(global_batch=64, samples=10**6),
        default_catalog(),
        ["h100", "a100"],
        64,
    )
    assert rec.ranked and all(_runnable(p) for p in rec.ranked)  # never TP, ZeRO-1/2
    assert {p.config.offload for p in rec.ranked} == {False, True}


def test_offload_on_one_gpu_is_searched():
    rec = recommend(
        load_model("Qwen2.5-VL-7B", context=2048),
        PlanConfig(global_batch=8),
        default_catalog(),
        ["h100"],
        1,
    )
    win = rec.ranked[0].config  # 8.3B x 16 bytes do not fit an H100: its states go to the host
    assert win.gpus == 1 and win.offload and win.zero == 3


def test_nothing_fits_names_the_cheapest_change(capsys):
    argv = [*BIG, "--context", "8192", "--host-memory-gib", "512"]  # offload's states: 1.2 TB
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "nothing fits" in err
    model, catalog = load_model("Qwen2.5-VL-72B", context=8192), default_catalog()
    base = PlanConfig(global_batch=256, host_memory_gib=512)
    rec = recommend(model, base, catalog, ["h100"], 8)
    assert not rec.ranked and rec.host_short is not None
    changes = cheapest_changes(model, base, catalog, ["h100"], 8, rec)
    kinds = {c.flags[0] for c in changes}
    assert kinds == {"--host-memory-gib", "--max-gpus", "--lora", "--qlora"}
    best = changes[0]  # cheapest to the three significant figures ranking ties at
    assert _rounded(best.cost_per_sample) == min(_rounded(c.cost_per_sample) for c in changes)
    assert f"cheapest change that fits: {best.what} ({' '.join(best.flags)}" in err
    # the change, applied, fits at the cost it was named with
    assert main([*argv, *best.flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t, c = out["ranked"][0]["time"], out["ranked"][0]["inputs"]
    cost = c["gpus"] * t["price_per_gpu_hour"] * t["step_time_s"] / c["global_batch"] / 3600
    # the JSON rounds the step time and the price to 6 decimals (up to 5e-7 each), float64 the
    # arithmetic (far below 1e-12)
    rounding = 5e-7 / t["step_time_s"] + 5e-7 / t["price_per_gpu_hour"] + 1e-12
    assert cost == pytest.approx(best.cost_per_sample, rel=rounding)


def test_the_docs_show_what_nothing_fits_prints(capsys):
    """docs/PLANNER.md, "When nothing fits": its command is this one and its answer, elided at
    each "...", what it prints."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "PLANNER.md").read_text()
    argv = [*BIG, "--context", "8192", "--host-memory-gib", "512"]
    assert f"`mmtrain {' '.join(argv)}`" in " ".join(docs.split())
    (block,) = re.findall(r"```text\n(nothing fits;.*?)```", docs, flags=re.S)
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    for shown in " ".join(block.split()).split("..."):
        assert shown.strip() in err, shown


@pytest.mark.parametrize(
    "flags, what_if",
    [
        (["--tp", "2"], "tensor parallelism (TP 2)"),
        (["--zero", "1"], "ZeRO-1"),
        (["--zero", "2", "--pp", "2", "--global-batch", "16"], "pipeline parallelism (PP 2)"),
    ],
)
def test_plan_marks_what_the_trainer_does_not_run(capsys, flags, what_if):
    argv = ["plan", "--model", "tiny-vlm", "--gpus", "8", *flags]
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "what-if: not run by mmtrain train:" in text and what_if in text
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["runs_in_mmtrain_train"] and what_if in out["not_run_by_train"]
    assert main(["plan", "--model", "tiny-vlm", "--gpus", "8", "--zero", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs_in_mmtrain_train"]


def test_rank_by_cost_without_samples(capsys):
    argv = ["plan", "--model", "tiny-clip", "--recommend", "--gpu", "h100", "--max-gpus", "8"]
    assert main([*argv, "--rank-by", "cost"]) == 0
    assert "ranked by cost per sample (cheapest first" in " ".join(capsys.readouterr().out.split())
