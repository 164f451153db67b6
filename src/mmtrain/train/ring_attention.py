"""Ring attention: exact attention over a sequence that a group of N ranks holds in slices,
without any rank ever holding all of the keys.

Each rank keeps its queries; the key/value blocks travel around the ring (sequence_comm's
`RingPass`). At step s a rank holds the block of group rank (rank - s) mod N, attends its
queries to it, and merges the partial result into its running (output, log-sum-exp) with the
online softmax; the pass of the next block is started before the computation on the current one,
so communication hides behind it. After N steps every query has seen every key.

Layouts (`local_chunks`). A rank's slice is made of equal chunks of the global sequence:
- contiguous: rank r holds chunk r of N;
- zigzag: rank r holds chunks r and 2N-1-r of 2N. Under a causal mask the contiguous layout
  gives the last rank N times the work of the first; zig-zag gives every rank one early and one
  late chunk, so each ring step costs every rank about the same.
Causal blocks are skipped (or cut to their lower triangle) from the chunk indices alone, decided
on the host without reading the device.

Each block is computed by train/ring_blocks.py: a fused SDPA kernel that returns the block's
log-sum-exp (flash / memory-efficient on CUDA, flash on the CPU) in the inputs' one dtype, or,
where none applies, the block math in fp32 matmuls; the merge and the accumulators are at
least fp32 either way.

Backward (a custom autograd.Function that saves q, k, v, the output and the log-sum-exp, never
the N blocks' scores): flash attention's backward, block by block, in the same ring (the fused
kernels' own backward, given the whole row's output and log-sum-exp). The gradients of a
key/value block are accumulated by every rank its block visits: the accumulators travel with
the block, and after N steps one more hop brings each block's dk, dv home.

Grouped-query attention: k and v travel with their Hkv heads (H / Hkv times less traffic than
repeated heads); the queries are viewed as [B, Hkv, H / Hkv, T, d] so every block product
broadcasts over the group, and dk, dv sum over it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmtrain.models.attention import attention_dtype
from mmtrain.train.ring_blocks import (
    MATH,
    block_kernel,
    finite,
    fused_backward,
    fused_forward,
    math_backward,
    math_forward,
)
from mmtrain.train.sequence_comm import RingPass, SequenceGroup

logger = logging.getLogger(__name__)

CONTIGUOUS = "contiguous"
ZIGZAG = "zigzag"
LAYOUTS = (CONTIGUOUS, ZIGZAG)

_FULL = "full"  # every (query, key) pair of the block may attend (before the doc / key masks)
_DIAGONAL = "diagonal"  # the block on the causal diagonal: its lower triangle

# The most score elements one block computes at once (fp32: 64 MiB; the block math holds a
# few tensors of that size): longer local rows are cut into blocks of fewer queries.
SCORE_ELEMENTS = 2**24

# Tags of the two kinds of ring pass that may be in flight together in the backward
# (RingPass: gloo matches messages by tag). The key/value pass uses at most 4.
_KV_TAG = 0
_GRAD_TAG = 8


def local_chunks(layout: str, rank: int, size: int) -> tuple[int, ...]:
    """Global chunk indices of the slice group rank `rank` holds, in local order: contiguous ->
    (rank,) of `size` chunks; zigzag -> (rank, 2 * size - 1 - rank) of 2 * size chunks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if not 0 <= rank < size:
        raise ValueError(f"rank: {rank} outside a group of size {size}")
    return (rank,) if layout == CONTIGUOUS else (rank, 2 * size - 1 - rank)


def local_indices(layout: str, rank: int, size: int, length: int) -> Tensor:
    """[length / size] global positions of this rank's tokens (local order) in a sequence of
    `length`: slice a full row with `x.index_select(dim, ...)`, or use as rotary positions."""
    chunks = local_chunks(layout, rank, size)
    count = len(chunks) * size
    if length % count:
        raise ValueError(f"length: {length} is not divisible by the {count} chunks of {layout!r}")
    chunk = length // count
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])


# ----------------------------------------------------------------------------- block plan
@dataclass(frozen=True)
class _Pair:
    """One (query rows, key rows) block a rank computes: local slices and its kind. A diagonal
    block's queries start `offset` rows into their chunk, its keys at the chunk's start."""

    queries: slice
    keys: slice
    kind: str
    offset: int = 0


def _block_pairs(
    causal: bool,
    layout: str,
    rank: int,
    source: int,
    size: int,
    t_q: int,
    t_k: int,
    max_rows: int,
) -> list[_Pair]:
    """The blocks of this rank's queries against the key block of group rank `source`, with the
    causal skipping: a key chunk after the query chunk is skipped, the same chunk is cut to its
    lower triangle, an earlier one is full. Without a causal mask: one full block. Each block
    holds at most `max_rows` queries (its score matrix is the block math's memory); a diagonal
    one's keys stop at its last query."""
    if not causal:
        return [_Pair(rows, slice(0, t_k), _FULL) for rows in _row_slices(0, t_q, max_rows)]
    query_chunks = local_chunks(layout, rank, size)
    key_chunks = local_chunks(layout, source, size)
    chunk = t_q // len(query_chunks)
    pairs = []
    for i, qc in enumerate(query_chunks):
        for j, kc in enumerate(key_chunks):
            if kc > qc:
                continue
            keys = slice(j * chunk, (j + 1) * chunk)
            for rows in _row_slices(i * chunk, (i + 1) * chunk, max_rows):
                if kc < qc:
                    pairs.append(_Pair(rows, keys, _FULL))
                    continue
                offset = rows.start - i * chunk
                last_key = keys.start + offset + (rows.stop - rows.start)
                pairs.append(_Pair(rows, slice(keys.start, last_key), _DIAGONAL, offset))
    return pairs


def _row_slices(start: int, stop: int, max_rows: int) -> list[slice]:
    return [slice(a, min(a + max_rows, stop)) for a in range(start, stop, max_rows)]


def _allowed(
    pair: _Pair,
    query_documents: Tensor | None,
    key_documents: Tensor | None,
    key_valid: Tensor | None,
    device: torch.device,
) -> Tensor | None:
    """Boolean [B or 1, 1, 1, Lq, Lk] (broadcast over kv heads and their query groups) of the
    pairs of `pair` that may attend; None when all may."""
    mask = None
    if key_documents is not None:
        mask = query_documents[:, pair.queries, None] == key_documents[:, None, pair.keys]
    if key_valid is not None:
        valid = key_valid[:, None, pair.keys]
        mask = valid if mask is None else mask & valid
    if pair.kind == _DIAGONAL:
        # query i sits at key row offset + i of the block: it sees the keys up to itself
        rows = pair.offset + torch.arange(pair.queries.stop - pair.queries.start, device=device)
        keys = torch.arange(pair.keys.stop - pair.keys.start, device=device)
        lower = keys[None] <= rows[:, None]
        if mask is None:
            mask = lower
        else:
            # A query always sees itself, as the unsplit path does (`mask | eye`): a padding
            # query whose every key is masked would otherwise have no key at all.
            mask = (mask & lower) | (keys[None] == rows[:, None])
    if mask is None:
        return None
    return mask[:, None, None] if mask.dim() == 3 else mask


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The online-softmax merge of two partial results over disjoint key sets; -inf safe (a side
    without keys weighs 0; both without keys stay output 0, lse -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = finite(lse)
    weight_a = torch.exp(lse_a - base).unsqueeze(-1)
    weight_b = torch.exp(lse_b - base).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


# ----------------------------------------------------------------------------- the ring
@dataclass
class _Setting:
    """What both passes need besides the tensors (one ring_attention call)."""

    group: SequenceGroup
    causal: bool
    layout: str
    scale: float
    masked: bool  # packed documents or padding keys: a mask beyond the causal one
    kernel: str  # ring_blocks' kernel of every block
    block_dtype: torch.dtype  # what the blocks read: the inputs' dtype (math: `dtype`)
    dtype: torch.dtype  # the merge's and the accumulators': at least float32


def _key_block(
    k: Tensor, v: Tensor, documents: Tensor | None, valid: Tensor | None
) -> list[Tensor]:
    """What travels the ring with a key block: k, v and the key masks that are given."""
    return [k, v] + [m for m in (documents, valid) if m is not None]


def _unpack(block: list[Tensor], documents: bool, valid: bool) -> tuple:
    """(k, v, key documents or None, key valid or None) of a block `_key_block` packed."""
    k, v, rest = block[0], block[1], list(block[2:])
    key_documents = rest.pop(0) if documents else None
    key_valid = rest.pop(0) if valid else None
    return k, v, key_documents, key_valid


def _max_rows(s: _Setting, q5: Tensor, t_k: int) -> int:
    """Query rows per block: the math's scores [B, Hkv, G, rows, Tk], or a fused kernel's
    additive mask [B, 1, rows, Tk], hold at most SCORE_ELEMENTS; a fused kernel without a mask
    holds nothing quadratic and takes every row at once (its diagonal blocks stay square)."""
    if s.kernel == MATH:
        per_row = q5.shape[0] * q5.shape[1] * q5.shape[2] * t_k
    elif s.masked:
        per_row = q5.shape[0] * t_k
    else:
        return q5.shape[-2]
    return max(1, SCORE_ELEMENTS // max(per_row, 1))


def _pairs(s: _Setting, q5: Tensor, source: int, t_k: int) -> list[_Pair]:
    group, t_q = s.group, q5.shape[-2]
    max_rows = _max_rows(s, q5, t_k)
    return _block_pairs(s.causal, s.layout, group.rank, source, group.size, t_q, t_k, max_rows)


def _block_allowed(
    s: _Setting,
    pair: _Pair,
    query_documents: Tensor | None,
    key_documents: Tensor | None,
    key_valid: Tensor | None,
    device: torch.device,
) -> Tensor | None:
    """`_allowed` where a kernel reads it: not for a fused kernel without documents or padding
    keys (its diagonal blocks use the kernel's causal flag; an [L, L] triangle is not made)."""
    if s.kernel != MATH and not s.masked:
        return None
    return _allowed(pair, query_documents, key_documents, key_valid, device)


def _fused_mask(s: _Setting, pair: _Pair, allowed: Tensor | None) -> tuple[Tensor | None, bool]:
    """(mask, causal flag) of a fused kernel: without documents or padding keys, a diagonal
    block is the kernel's own causal case, the others need no mask."""
    if s.masked:
        return allowed, False
    return None, pair.kind == _DIAGONAL


def _forward_block(
    s: _Setting, q: Tensor, k: Tensor, v: Tensor, pair: _Pair, allowed: Tensor | None
) -> tuple[Tensor, Tensor]:
    if s.kernel == MATH:
        return math_forward(q, k, v, allowed, s.scale)
    mask, causal = _fused_mask(s, pair, allowed)
    out, lse = fused_forward(s.kernel, q, k, v, mask, causal, s.scale)
    return out.to(s.dtype), lse.to(s.dtype)


def _ring_forward(
    s: _Setting,
    q5: Tensor,
    k: Tensor,
    v: Tensor,
    q_docs: Tensor | None,
    docs: Tensor | None,
    valid: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(output [B, Hkv, G, Tq, dv], lse [B, Hkv, G, Tq]) in the merge's dtype."""
    group = s.group
    out = q5.new_zeros(*q5.shape[:-1], v.shape[-1], dtype=s.dtype)
    lse = q5.new_full(q5.shape[:-1], -math.inf, dtype=s.dtype)
    block = _key_block(k, v, docs, valid)
    for step in range(group.size):
        source = (group.rank - step) % group.size
        hop = RingPass(block, group, _KV_TAG) if step < group.size - 1 else None
        k_b, v_b, k_docs, k_valid = _unpack(block, docs is not None, valid is not None)
        k_b, v_b = k_b.to(s.block_dtype), v_b.to(s.block_dtype)
        for pair in _pairs(s, q5, source, k_b.shape[-2]):
            allowed = _block_allowed(s, pair, q_docs, k_docs, k_valid, q5.device)
            rows, keys = pair.queries, pair.keys
            part = _forward_block(
                s, q5[..., rows, :], k_b[:, :, keys], v_b[:, :, keys], pair, allowed
            )
            out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], *part)
        if hop is not None:
            block = hop.wait()
    return out, lse


def _backward_block(
    s: _Setting, saved: tuple, pair: _Pair, allowed: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block in the merge's dtype, from `saved` = (q, k, v, dout, out, lse,
    delta) of its rows and keys."""
    q, k, v, dout, out, lse, delta = saved
    if s.kernel == MATH:
        return math_backward(q, k, v, dout, lse, delta, allowed, s.scale)
    mask, causal = _fused_mask(s, pair, allowed)
    grads = fused_backward(s.kernel, q, k, v, dout, out, lse, mask, causal, s.scale)
    return tuple(g.to(s.dtype) for g in grads)


def _ring_backward(s: _Setting, saved: tuple, dout5: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq5, dk, dv) in the merge's dtype: dq local, dk/dv accumulated around the ring."""
    q5, k, v, out5, lse, q_docs, docs, valid = saved
    group = s.group
    delta = (dout5.to(s.dtype) * out5.to(s.dtype)).sum(dim=-1) if s.kernel == MATH else None
    dq = torch.zeros_like(q5, dtype=s.dtype)
    block = _key_block(k, v, docs, valid)
    grads_hop = None
    for step in range(group.size):
        source = (group.rank - step) % group.size
        hop = RingPass(block, group, _KV_TAG) if step < group.size - 1 else None
        k_b, v_b, k_docs, k_valid = _unpack(block, docs is not None, valid is not None)
        k_b, v_b = k_b.to(s.block_dtype), v_b.to(s.block_dtype)
        dk = torch.zeros_like(k_b, dtype=s.dtype)
        dv = torch.zeros_like(v_b, dtype=s.dtype)
        for pair in _pairs(s, q5, source, k_b.shape[-2]):
            rows, keys = pair.queries, pair.keys
            allowed = _block_allowed(s, pair, q_docs, k_docs, k_valid, q5.device)
            block_saved = (
                q5[..., rows, :], k_b[:, :, keys], v_b[:, :, keys], dout5[..., rows, :],
                out5[..., rows, :], lse[..., rows], None if delta is None else delta[..., rows],
            )  # fmt: skip
            dq_b, dk_b, dv_b = _backward_block(s, block_saved, pair, allowed)
            dq[..., rows, :] += dq_b
            dk[:, :, keys] += dk_b
            dv[:, :, keys] += dv_b
        if grads_hop is not None:
            # The accumulators of this same block, from the ranks it visited before.
            dk_before, dv_before = grads_hop.wait()
            dk, dv = dk + dk_before, dv + dv_before
        if group.size > 1:
            # After the last step this is the hop home: the next rank owns the block held now.
            grads_hop = RingPass([dk, dv], group, _GRAD_TAG)
        if hop is not None:
            block = hop.wait()
    if grads_hop is not None:
        dk, dv = grads_hop.wait()
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """Forward and backward around the ring; saves q, k, v, the output, the log-sum-exp and the
    masks (module docstring). q, k and v arrive in one dtype (`ring_attention`)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        setting: _Setting,
        query_documents: Tensor | None,
        documents: Tensor | None,
        key_valid: Tensor | None,
    ) -> Tensor:
        b, h, t_q, _ = q.shape
        groups = h // k.shape[1]
        # The merge (and the math kernel) run in at least float32 whatever autocast says around
        # them: the exponentials and the merge lose too much in half precision.
        with torch.autocast(q.device.type, enabled=False):
            q5 = q.to(setting.block_dtype).reshape(b, k.shape[1], groups, t_q, q.shape[-1])
            out5, lse = _ring_forward(setting, q5, k, v, query_documents, documents, key_valid)
        out = out5.reshape(b, h, t_q, v.shape[-1]).to(q.dtype)
        ctx.setting = setting
        ctx.save_for_backward(q, k, v, out, lse, query_documents, documents, key_valid)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        setting = ctx.setting
        q, k, v, out, lse, query_documents, documents, key_valid = ctx.saved_tensors
        b, h, t_q, _ = q.shape
        shape5 = (b, k.shape[1], h // k.shape[1], t_q)
        with torch.autocast(q.device.type, enabled=False):
            q5 = q.to(setting.block_dtype).reshape(*shape5, q.shape[-1])
            out5 = out.to(setting.block_dtype).reshape(*shape5, v.shape[-1])
            dout5 = dout.to(setting.block_dtype).reshape(*shape5, v.shape[-1])
            saved = (q5, k, v, out5, lse, query_documents, documents, key_valid)
            dq, dk, dv = _ring_backward(setting, saved, dout5)
        dq = dq.reshape(q.shape).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    layout: str,
    chunks: int,
    query_documents: Tensor | None,
    documents: Tensor | None,
    key_valid: Tensor | None,
) -> None:
    """ValueErrors that name the argument misused."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v: expected [B, heads, T, d], got {list(q.shape)}, {list(k.shape)}, "
            f"{list(v.shape)}"
        )
    b, h, t_q, d = q.shape
    if k.shape[0] != b or k.shape[-1] != d or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k, v: expected [{b}, kv_heads, S, {d}] alike, got {list(k.shape)}, {list(v.shape)}"
        )
    if h % k.shape[1]:
        raise ValueError(f"k: query heads ({h}) must be a multiple of kv heads ({k.shape[1]})")
    t_k = k.shape[2]
    if causal and t_q != t_k:
        raise ValueError(f"causal: needs as many queries as keys, got q T={t_q} and k T={t_k}")
    if causal and t_q % chunks:
        raise ValueError(
            f"q: the local length {t_q} is not divisible by the {chunks} chunks of layout "
            f"{layout!r}"
        )
    for name, mask, length in (
        ("documents", documents, t_k),
        ("key_valid", key_valid, t_k),
        ("query_documents", query_documents, t_q),
    ):
        if mask is not None and tuple(mask.shape) != (b, length):
            raise ValueError(f"{name}: expected [{b}, {length}], got {list(mask.shape)}")
    if documents is None and query_documents is not None:
        raise ValueError("query_documents: given without documents (the keys' runs)")
    if documents is not None and query_documents is None and t_q != t_k:
        raise ValueError(
            f"documents: with {t_q} queries and {t_k} keys, pass query_documents [B, {t_q}] too"
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: SequenceGroup,
    *,
    causal: bool,
    layout: str = CONTIGUOUS,
    documents: Tensor | None = None,
    key_valid: Tensor | None = None,
    query_documents: Tensor | None = None,
) -> Tensor:
    """Attention of this rank's queries q [B, H, Tq, d] over the keys and values k, v
    [B, Hkv, Tk, d] of every rank of `group` (this rank's are local slices; H % Hkv == 0, query
    head h reads kv head h // (H / Hkv)) -> [B, H, Tq, d] in their one dtype
    (models.attention.attention_dtype: autocast's where it is on, as SDPA's output would be).
    Scale 1 / sqrt(d).

    A (query, key) pair may attend when: (not `causal` or the key's global position is at or
    before the query's) and (`documents` is None or both are in the same document) and
    (`key_valid` is None or the key is valid); under `causal` a query always sees itself. Global
    positions follow `layout` (`local_chunks`); every rank passes the same shapes.

    `documents` [B, Tk] int64: run ids (models.attention.document_runs of the full rows, then
    sliced), the same on every rank; `key_valid` [B, Tk] bool. Both are local and travel with
    the keys. `query_documents` [B, Tq]: the queries' runs, needed only when Tq != Tk (default:
    `documents`). `causal` needs Tq == Tk, divisible by the layout's chunk count.

    A query row without any allowed key (only possible without `causal`) gives output 0 and
    zero gradients. Gradients flow to q, k and v; with one rank no communication happens.
    """
    chunks = len(local_chunks(layout, 0, 1)) if layout in LAYOUTS else 1
    _check_inputs(q, k, v, causal, layout, chunks, query_documents, documents, key_valid)
    if documents is not None and query_documents is None:
        query_documents = documents
    dtype = attention_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # autograd casts the gradients back
    masked = documents is not None or key_valid is not None
    kernel = block_kernel(q, k, v, masked)
    merge_dtype = torch.promote_types(dtype, torch.float32)
    logger.debug("ring attention: %s blocks in %s, merged in %s", kernel, dtype, merge_dtype)
    setting = _Setting(
        group=group,
        causal=causal,
        layout=layout,
        scale=1.0 / math.sqrt(q.shape[-1]),
        masked=masked,
        kernel=kernel,
        block_dtype=merge_dtype if kernel == MATH else dtype,
        dtype=merge_dtype,
    )
    return _RingAttention.apply(q, k, v, setting, query_documents, documents, key_valid)
