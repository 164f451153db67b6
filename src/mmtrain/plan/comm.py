"""Collective communication times (ring algorithms, nccl-tests doc/PERFORMANCE.md).

all-reduce: t = S/B x 2(n-1)/n; reduce-scatter, all-gather and all-to-all: t = S/B x (n-1)/n,
with B the achievable per-GPU bandwidth of the slowest link the ring crosses (NVLink inside a
node, the network card between nodes).

Sequence parallelism over n ranks (`Traffic`, per rank, per layer and micro-batch):
- all-to-all (DeepSpeed-Ulysses): each forward moves q, k, v in and the attention output back,
  four all-to-alls of the rank's local tensors (S bytes together), (n-1)/n of each; backward
  the same four again. On the critical path: all of it is exposed.
- ring attention: the forward passes the local k and v block n-1 times; backward passes k, v
  and their gradients n-1 times (twice the bytes) and the k, v gradients once more to their
  owner. Each pass is a send of the block to the next rank at B, overlapped with the
  attention of one block: exposed max(0, pass - block compute) per pass (the final pass has
  no block to hide behind).
- a denoiser all-gathers its output patches once per forward and all-reduces their gradient
  in backward (exposed).
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.hardware import GPU, Catalog, Interconnect

# Past this share of a step spent waiting for communication another parallel layout (or more
# intra-node bandwidth) pays: the run warns (train/loop.py), `mmtrain doctor` and the plan say so.
COMM_SHARE_LIMIT = 0.2


def all_reduce_s(size_bytes: float, n: int, link: Interconnect) -> float:
    return 0.0 if n <= 1 else size_bytes / link.bytes_per_s() * 2 * (n - 1) / n


def reduce_scatter_s(size_bytes: float, n: int, link: Interconnect) -> float:
    return 0.0 if n <= 1 else size_bytes / link.bytes_per_s() * (n - 1) / n


all_gather_s = reduce_scatter_s
all_to_all_s = reduce_scatter_s  # each rank keeps 1/n of its S bytes and sends the rest


def group_link(
    catalog: Catalog, gpu: GPU, group_span: int, gpus_per_node: int, network: str | None
) -> Interconnect:
    """The bottleneck link of a group spanning `group_span` consecutive GPUs: the node's
    interconnect when the group fits in one node, the network otherwise."""
    if group_span <= gpus_per_node:
        return catalog.link(gpu.intra_node, "gpu")
    return catalog.link(network or gpu.network, "--network")


@dataclass(frozen=True)
class Traffic:
    """What one rank sends (`sent_bytes`), the link time it takes (`seconds`) and the part of
    that time no compute hides (`exposed_s`)."""

    sent_bytes: float = 0.0
    seconds: float = 0.0
    exposed_s: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.sent_bytes + other.sent_bytes,
            self.seconds + other.seconds,
            self.exposed_s + other.exposed_s,
        )

    def scaled(self, k: float) -> Traffic:
        return Traffic(self.sent_bytes * k, self.seconds * k, self.exposed_s * k)


def ulysses_layer(local_bytes: float, n: int, link: Interconnect, passes: int) -> Traffic:
    """`passes` rounds (forward, backward, a recomputed forward) of one layer's four
    all-to-alls of q, k, v and the output, `local_bytes` of the rank's tensors together."""
    if n <= 1:
        return Traffic()
    seconds = passes * all_to_all_s(local_bytes, n, link)
    return Traffic(passes * local_bytes * (n - 1) / n, seconds, seconds)


def ring_layer(
    kv_bytes: float,
    n: int,
    link: Interconnect,
    block_forward_s: float,
    forwards: int,
    backward: bool,
) -> Traffic:
    """One layer of ring attention: `forwards` forward rounds (2 with full recompute) of n-1
    passes of the local k, v block (`kv_bytes`), each hidden behind one block's attention
    (`block_forward_s`); backward n-1 passes of k, v and their gradients behind one block's
    backward (twice its forward), then the gradients' final pass, exposed."""
    if n <= 1:
        return Traffic()
    pass_s = kv_bytes / link.bytes_per_s()
    sent = forwards * (n - 1) * kv_bytes
    seconds = forwards * (n - 1) * pass_s
    exposed = forwards * (n - 1) * max(0.0, pass_s - block_forward_s)
    if backward:
        sent += (2 * (n - 1) + 1) * kv_bytes
        seconds += (2 * (n - 1) + 1) * pass_s
        exposed += (n - 1) * max(0.0, 2 * pass_s - 2 * block_forward_s) + pass_s
    return Traffic(sent, seconds, exposed)


def output_gather(size_bytes: float, n: int, link: Interconnect, backward: bool) -> Traffic:
    """A split denoiser's output patches (`size_bytes` gathered): an all-gather in forward,
    an all-reduce of their gradient in backward; nothing overlaps them."""
    if n <= 1:
        return Traffic()
    sent = size_bytes * (n - 1) / n
    seconds = all_gather_s(size_bytes, n, link)
    if backward:
        sent += 2 * size_bytes * (n - 1) / n
        seconds += all_reduce_s(size_bytes, n, link)
    return Traffic(sent, seconds, seconds)
