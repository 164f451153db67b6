"""Collective communication times (ring algorithms, nccl-tests doc/PERFORMANCE.md).

all-reduce: t = S/B x 2(n-1)/n; reduce-scatter and all-gather: t = S/B x (n-1)/n, with B the
achievable per-GPU bandwidth of the slowest link the ring crosses (NVLink inside a node, the
network card between nodes).
"""

from __future__ import annotations

from mmtrain.hardware import GPU, Catalog, Interconnect


def all_reduce_s(size_bytes: float, n: int, link: Interconnect) -> float:
    return 0.0 if n <= 1 else size_bytes / link.bytes_per_s() * 2 * (n - 1) / n


def reduce_scatter_s(size_bytes: float, n: int, link: Interconnect) -> float:
    return 0.0 if n <= 1 else size_bytes / link.bytes_per_s() * (n - 1) / n


all_gather_s = reduce_scatter_s


def group_link(
    catalog: Catalog, gpu: GPU, group_span: int, gpus_per_node: int, network: str | None
) -> Interconnect:
    """The bottleneck link of a group spanning `group_span` consecutive GPUs: the node's
    interconnect when the group fits in one node, the network otherwise."""
    if group_span <= gpus_per_node:
        return catalog.link(gpu.intra_node, "gpu")
    return catalog.link(network or gpu.network, "--network")
