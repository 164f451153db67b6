"""Whether each sequence-parallel group sits inside one node (`mmtrain doctor`).

`train.sequence_parallel: N` splits every row over N consecutive ranks, and every attention
layer exchanges its keys and values (or its heads) within that group, forward and backward.
Inside a node that traffic rides NVLink (450 GB/s per GPU and direction on an H100); a group
that reaches past its node sends it through the network card (50 GB/s for InfiniBand NDR):
about a ninth of the bandwidth for the run's most frequent collective. The trainer records
how many ranks a node holds (torchrun's LOCAL_WORLD_SIZE) in its layout record; with groups
of consecutive ranks and nodes of consecutive ranks (torchrun's numbering), a group stays in
one node exactly when its size divides the node's ranks.
"""

from __future__ import annotations

from typing import Any

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.rundata import RunData

SEQUENCE_COLLECTIVES = ("all_to_all", "ring_exchange")  # sequence parallelism's (comm_timing)


def _spanning_groups(world: int, size: int, per_node: int) -> int:
    """Groups of `size` consecutive ranks (of `world`) with ranks on more than one node."""
    groups = [range(g * size, (g + 1) * size) for g in range(world // size)]
    return sum(1 for ranks in groups if len({r // per_node for r in ranks}) > 1)


def _catalog_gpu(device: str) -> tuple[dict[str, Any], str]:
    """The catalog's links of the GPU the run trained on (inside a node, and the catalog's
    default network between nodes) and its `--gpu` flag; nothing for a CPU or an unknown
    device."""
    from mmtrain.hardware import default_catalog
    from mmtrain.structured import FieldError

    if device in ("", "cpu"):
        return {}, ""
    catalog = default_catalog()
    try:
        gpu = catalog.resolve_device(device)[0]
    except FieldError:
        return {}, ""
    inside, between = catalog.link(gpu.intra_node), catalog.link(gpu.network)
    links = {
        "intra_node_link": f"{inside.name}, {inside.gbps:g} GB/s per GPU",
        "network_link": f"{between.name}, {between.gbps:g} GB/s per GPU (the catalog's default)",
    }
    return links, f" --gpu {gpu.key}"


def sequence_groups_across_nodes(run: RunData) -> Finding | None:
    layouts = run.events.get("layout", [])
    layout = layouts[-1] if layouts else {}
    world, size = int(layout.get("world_size", 1)), int(layout.get("sequence_parallel", 1))
    per_node = int(layout.get("ranks_per_node") or 0)
    if size <= 1 or not per_node or world % size:
        return None  # no sequence split, or where the nodes end is not on record
    spanning = _spanning_groups(world, size, per_node)
    if not spanning:
        return None
    within = max(d for d in range(1, size + 1) if per_node % d == 0)  # groups inside a node
    rows, names = run.train_rows, SEQUENCE_COLLECTIVES
    exposed = sum(r.get(f"comm_exposed_s/{name}", 0.0) for r in rows for name in names)
    attention = config_value(run, "train", "sequence_parallel_attention", "auto")
    ring = "" if attention == "ring" else (
        "; if the rows need more ranks than a node has, train.sequence_parallel_attention=ring, "
        "whose exchanges overlap the attention of the block in hand"
    )  # fmt: skip
    model = run.config.get("model", "MODEL")
    links, gpu = _catalog_gpu(str(layout.get("device", "")))
    return Finding(
        kind="communication",
        severity="warning",
        evidence={
            "train.sequence_parallel": size,
            "ranks_per_node": per_node,
            "world_size": world,
            "groups_across_nodes": spanning,
            "groups": world // size,
            **links,
        },
        why=(
            f"{spanning} of the {world // size} sequence-parallel groups of {size} ranks reach "
            f"past a node of {per_node}: every attention layer's exchanges, forward and "
            "backward, cross the network between nodes instead of the node's own links"
        ),
        advice=(
            f"keep each group in one node: train.sequence_parallel={within} (now {size}) if the "
            f"rows fit (mmtrain plan --model {model}{gpu} --gpus {world} --gpus-per-node {per_node} "
            f"--sequence-parallel {within}){ring}"
        ),
        cost_s=exposed,
        steps=[r["step"] for r in run.train_rows],
    )
