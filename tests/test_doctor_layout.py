"""`mmtrain doctor`'s check that each sequence-parallel group sits inside one node
(report/layout_check.py), on the layout records of jobs larger than this machine: a group of
consecutive ranks stays in a node exactly when its size divides the node's ranks. A real
two-rank run on "two nodes" is in tests/test_train_vlm.py; that torchrun's agents record
their nodes, in tests/test_launch_local.py."""

from __future__ import annotations

import json

import pytest
import yaml

from mmtrain.cli import main
from mmtrain.report.layout_check import sequence_groups_across_nodes
from mmtrain.report.rundata import load_run


def _job(folder, *, world, per_node, sequence, device="NVIDIA H100 80GB HBM3"):
    """A run folder as the trainer writes it for `world` ranks on nodes of `per_node`."""
    folder.mkdir()
    config = {"model": "tiny-vlm", "train": {"sequence_parallel": sequence}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    layout = {"kind": "layout", "step": 0, "world_size": world, "data_ranks": world // sequence,
              "sequence_parallel": sequence, "device": device, "ranks_per_node": per_node}  # fmt: skip
    rows = [{"step": s, "loss": 2.0, "step_s": 1.0} for s in (1, 2)]
    text = "\n".join(json.dumps(r) for r in (layout, *rows)) + "\n"
    (folder / "metrics.jsonl").write_text(text)
    return load_run(folder)


@pytest.mark.parametrize(
    ("world", "per_node", "sequence", "across", "advised"),
    [(16, 8, 16, 1, 8), (12, 4, 3, 2, 2), (32, 8, 4, 0, None), (16, 8, 8, 0, None)],
)
def test_groups_that_reach_past_a_node_are_named_with_the_size_that_fits(
    tmp_path, world, per_node, sequence, across, advised
):
    # 12 ranks, groups of 3 on nodes of 4: ranks 3-5 and 6-8 straddle a boundary
    finding = sequence_groups_across_nodes(
        _job(tmp_path / "job", world=world, per_node=per_node, sequence=sequence)
    )
    if not across:
        assert finding is None
        return
    assert finding.kind == "communication"
    assert finding.evidence["groups_across_nodes"] == across
    assert finding.evidence["groups"] == world // sequence
    assert f"train.sequence_parallel={advised} (now {sequence})" in finding.advice
    assert (
        f"--gpu h100 --gpus {world} --gpus-per-node {per_node} --sequence-parallel {advised}"
        in (finding.advice)
    )
    # the command the advice gives runs as written
    command = finding.advice.split("(mmtrain plan ")[1].split(")")[0]
    assert main(["plan", *command.split()]) == 0
    assert finding.evidence["intra_node_link"].startswith("NVLink 4")
    assert "50 GB/s" in finding.evidence["network_link"]


def test_a_job_whose_nodes_are_not_on_record_gets_no_finding(tmp_path):
    run = _job(tmp_path / "job", world=16, per_node=8, sequence=16)
    del run.events["layout"][-1]["ranks_per_node"]  # ranks started by hand: unknown
    assert sequence_groups_across_nodes(run) is None
