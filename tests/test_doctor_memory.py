"""`mmtrain doctor`'s memory finding (report/memory_check.py).

It reads what only a CUDA run records: each step's peak allocated and peak reserved bytes and
the device's memory in the plan record (train/metrics.py). This machine has no GPU, so the
rules are checked on run folders holding those records as a CUDA run writes them, the numbers
chosen so that each rule's outcome follows by hand; a real CPU run records neither and gets no
finding. bench/memory_doctor.py (in bench/gpu.sh) makes the symptom for real on a GPU: the
micro CLIP beside a ballast of uneven blocks, every other one freed.
"""

from __future__ import annotations

import json

import yaml

from micro import make_shards, micro_run
from mmtrain.cli import main
from mmtrain.report.memory_check import EXPANDABLE, memory
from mmtrain.report.rundata import GIB, load_run
from mmtrain.train.loop import train


def _cuda_run(folder, *, allocated, reserved, total=80, planned=10, world=1, micro=8,
              recompute=(), parallel="ddp"):  # fmt: skip
    """A run folder as a CUDA run writes it (GiB in, bytes out); step 3 holds the peaks."""
    folder.mkdir()
    config = {"model": "tiny-clip", "train": {"parallel": parallel, "micro_batch": micro}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    plan = {
        "kind": "plan", "step": 0, "predicted_allocated_bytes": planned * GIB,
        "device_memory_bytes": total * GIB, "micro_batch": micro, "world_size": world,
        "recompute": list(recompute), "activations_by_tower": {"image": 3 * GIB, "text": GIB},
    }  # fmt: skip
    layout = {"kind": "layout", "step": 0, "world_size": world, "device": "NVIDIA H100"}
    rows = [
        {"step": step, "loss": 2.0, "step_s": 0.5,
         "peak_memory_bytes": (allocated if step == 3 else allocated / 2) * GIB,
         "peak_reserved_bytes": (reserved if step == 3 else reserved / 2) * GIB}
        for step in range(1, 5)
    ]  # fmt: skip
    lines = [json.dumps(r) for r in (layout, plan, *rows)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return load_run(folder)


def test_a_cpu_run_records_no_allocator_figures_and_gets_no_memory_finding(tmp_path):
    train(micro_run(tmp_path, make_shards(tmp_path / "shards", 16), train={"steps": 2}))
    run = load_run(tmp_path / "run")
    assert run.plan["predicted_allocated_bytes"] > 0 and "device_memory_bytes" not in run.plan
    assert all("peak_reserved_bytes" not in r for r in run.train_rows)
    assert memory(run) is None


def test_a_run_within_its_plan_and_with_room_is_quiet(tmp_path):
    # 12 GiB allocated of 10 planned (1.2x, under 1.25x); 40 of 80 GiB reserved
    assert memory(_cuda_run(tmp_path / "run", allocated=12, reserved=40)) is None
    # a small model: 5x its 0.1 GiB plan, but the 0.4 GiB past it is workspaces' size
    assert memory(_cuda_run(tmp_path / "small", allocated=0.5, reserved=1, planned=0.1)) is None


def test_allocating_past_the_plan_is_named_with_the_snapshot_to_find_why(tmp_path):
    finding = memory(_cuda_run(tmp_path / "run", allocated=15, reserved=16))
    assert finding.kind == "memory" and finding.severity == "info" and finding.steps == [3]
    assert finding.evidence["measured_over_planned"] == 1.5
    assert finding.evidence["headroom_fraction"] == 0.8  # 1 - 16/80
    assert "_record_memory_history" in finding.advice and "micro_batch" not in finding.advice


def test_a_full_fragmented_device_gets_the_changes_cheapest_first(tmp_path):
    # 76 of 80 GiB reserved (5% free), 38 GiB of it in tensors (half fragmented), 2 DDP ranks
    run = _cuda_run(tmp_path / "run", allocated=38, reserved=76, world=2)
    finding = memory(run)
    assert finding.severity == "warning"
    assert finding.evidence["headroom_fraction"] == 0.05
    assert finding.evidence["fragmentation_fraction"] == 0.5
    changes = finding.advice.split("; then ")
    assert changes[0].startswith(f"launch with {EXPANDABLE}")
    assert changes[1].startswith("recompute activations: train.towers.image.")  # 3 GiB > 1
    assert changes[2].endswith("train.parallel=fsdp") and changes[3].startswith(
        "train.micro_batch=4"
    )


def test_the_advice_follows_what_the_run_already_does(tmp_path):
    # image recomputed already, FSDP on, one sample per rank, 8% fragmented: text's recompute is left
    run = _cuda_run(tmp_path / "run", allocated=70, reserved=76, world=2, micro=1,
                    recompute=["image"], parallel="fsdp")  # fmt: skip
    (change,) = memory(run).advice.split("; then ")
    assert change.startswith("recompute activations: train.towers.text.")


def test_doctor_prints_the_memory_finding(tmp_path, capsys):
    _cuda_run(tmp_path / "run", allocated=38, reserved=76)
    assert main(["doctor", str(tmp_path / "run"), "--json"]) == 0
    (printed,) = json.loads(capsys.readouterr().out)["findings"]
    assert printed["kind"] == "memory" and printed["evidence"]["steps"] == [3]
    assert printed["evidence"]["peak_reserved_gib"] == 76.0
