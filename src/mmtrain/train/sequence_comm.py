"""The communication of sequence (context) parallelism: a group of N ranks that each hold a slice
of the same sequences.

- `SequenceGroup`: the group, this rank's place in it and its peers' global ranks.
- `sequence_to_heads` / `heads_to_sequence`: DeepSpeed-Ulysses's all-to-all. Before attention
  each rank trades its slice of the sequence (all heads) for all of the sequence of 1/N of the
  heads, attends locally, and trades back. Autograd-correct: each is the other's backward.
- `RingPass`: one hop of a ring (send to the next rank, receive from the previous one), started
  without waiting so that the caller computes while it is in flight (ring_attention.py).

Every collective here is timed by the trainer's comm timer (mmtrain.distributed): the
all-to-alls as blocking (exposed) communication; a ring hop as in flight from launch to
completion, with only the wait for it exposed. Works on gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mmtrain import distributed


@dataclass(frozen=True)
class SequenceGroup:
    """The ranks that share sequences: `group` (a ProcessGroup; None allowed when `size` is 1),
    `size` N, this rank's index `rank` in 0..N-1, and `ranks`, the group's global ranks in group
    order (point-to-point ops name their peers by global rank)."""

    group: Any
    size: int
    rank: int
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"SequenceGroup: rank {self.rank} outside a group of size {self.size}")
        if len(self.ranks) != self.size:
            raise ValueError(
                f"SequenceGroup: ranks {self.ranks} must list the {self.size} global ranks"
            )
        if self.group is None and self.size > 1:
            raise ValueError(f"SequenceGroup: a group of size {self.size} needs a process group")

    @classmethod
    def single(cls) -> SequenceGroup:
        """A group of one rank: every operation here is then the identity (no communication)."""
        return cls(group=None, size=1, rank=0, ranks=(distributed.rank(),))

    @classmethod
    def from_process_group(cls, group: Any) -> SequenceGroup:
        """The SequenceGroup of `group` (e.g. from `dist.new_group`), seen from this rank."""
        ranks = tuple(dist.get_process_group_ranks(group))
        return cls(group=group, size=len(ranks), rank=dist.get_rank(group), ranks=ranks)

    @property
    def next_rank(self) -> int:
        """Global rank of group rank (rank + 1) % size: where a ring sends."""
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def previous_rank(self) -> int:
        """Global rank of group rank (rank - 1) % size: where a ring receives from."""
        return self.ranks[(self.rank - 1) % self.size]


# ----------------------------------------------------------------------------- all-to-all
def _all_to_all(parts: Tensor, group: SequenceGroup) -> Tensor:
    """Part i of `parts` [N, ...] goes to group rank i; part i of the result came from it."""
    parts = parts.contiguous()
    received = torch.empty_like(parts)
    with distributed.timed_collective("all_to_all"):
        dist.all_to_all_single(received, parts, group=group.group)
    return received


def _sequence_to_heads(x: Tensor, group: SequenceGroup) -> Tensor:
    n = group.size
    b, h, t, d = x.shape
    # [N, B, H/N, T, d]: part i holds the heads group rank i will own.
    parts = x.reshape(b, n, h // n, t, d).transpose(0, 1)
    received = _all_to_all(parts, group)  # part i: rank i's slice of the sequence
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def _heads_to_sequence(x: Tensor, group: SequenceGroup) -> Tensor:
    n = group.size
    b, hn, nt, d = x.shape
    # [N, B, H/N, T, d]: part i is group rank i's slice of the sequence.
    parts = x.reshape(b, hn, n, nt // n, d).permute(2, 0, 1, 3, 4)
    received = _all_to_all(parts, group)  # part i: heads i*H/N.. of this rank's slice
    return received.transpose(0, 1).reshape(b, n * hn, nt // n, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: SequenceGroup) -> Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: SequenceGroup) -> Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _sequence_to_heads(grad, ctx.group), None


def sequence_to_heads(x: Tensor, group: SequenceGroup) -> Tensor:
    """[B, H, T_local, d] (this rank's slice of the sequence, all heads) -> [B, H / N,
    N * T_local, d] (heads rank * H/N .. (rank + 1) * H/N - 1 of the whole sequence, the ranks'
    slices in group order). Needs H % N == 0. Backward: `heads_to_sequence`."""
    if x.dim() != 4:
        raise ValueError(f"sequence_to_heads: expected x [B, H, T, d], got {list(x.shape)}")
    if x.shape[1] % group.size:
        raise ValueError(
            f"sequence_to_heads: heads ({x.shape[1]}) must be divisible by the sequence-parallel "
            f"size N ({group.size})"
        )
    if group.size == 1:
        return x
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: Tensor, group: SequenceGroup) -> Tensor:
    """The inverse of `sequence_to_heads`: [B, H / N, N * T_local, d] -> [B, H, T_local, d].
    Backward: `sequence_to_heads`."""
    if x.dim() != 4:
        raise ValueError(f"heads_to_sequence: expected x [B, H/N, N*T, d], got {list(x.shape)}")
    if x.shape[2] % group.size:
        raise ValueError(
            f"heads_to_sequence: sequence length ({x.shape[2]}) must be divisible by the "
            f"sequence-parallel size N ({group.size})"
        )
    if group.size == 1:
        return x
    return _HeadsToSequence.apply(x, group)


# ----------------------------------------------------------------------------- ring
class RingPass:
    """One hop of a ring, in flight from construction until `wait()`:

        hop = RingPass([k, v], group)   # sends to group.next_rank, receives from previous_rank
        ...compute on the current k, v...
        k, v = hop.wait()

    Every rank of the group must start the same sequence of passes (same count, shapes and
    dtypes per pass, same `tag`): one `batch_isend_irecv` per pass holds all its sends and
    receives, so no rank waits on a peer that is itself waiting (N = 2, where the next and the
    previous rank are the same peer, included). Two passes in flight at once need different
    `tag`s: gloo matches messages by tag (tensor i travels with tag `tag + i`); NCCL ignores
    tags and matches by issue order, which is the same on every rank.
    """

    def __init__(self, tensors: list[Tensor], group: SequenceGroup, tag: int = 0) -> None:
        # Kept until `wait`: a send must not outlive its buffer.
        self._sent = [t.contiguous() for t in tensors]
        self._received = [torch.empty_like(t) for t in self._sent]
        sends = [
            dist.P2POp(dist.isend, t, group.next_rank, group.group, tag + i)
            for i, t in enumerate(self._sent)
        ]
        receives = [
            dist.P2POp(dist.irecv, t, group.previous_rank, group.group, tag + i)
            for i, t in enumerate(self._received)
        ]
        self._span = distributed.begin_in_flight("ring_exchange")
        self._works = dist.batch_isend_irecv(sends + receives)

    def wait(self) -> list[Tensor]:
        """The tensors the previous rank sent (same shapes and dtypes as the ones sent)."""
        with distributed.timed_collective("ring_exchange"):
            for work in self._works:
                work.wait()
        distributed.end_in_flight(self._span)
        self._sent, self._works = [], []
        return self._received
