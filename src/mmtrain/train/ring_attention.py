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

Backward (a custom autograd.Function that saves q, k, v, the output and the log-sum-exp, never
the N blocks' scores): flash attention's backward, block by block, in the same ring. The
gradients of a key/value block are accumulated by every rank its block visits: the accumulators
travel with the block, and after N steps one more hop brings each block's dk, dv home.

Grouped-query attention: k and v travel with their Hkv heads (H / Hkv times less traffic than
repeated heads); the queries are viewed as [B, Hkv, H / Hkv, T, d] so every block product
broadcasts over the group, and dk, dv sum over it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmtrain.train.sequence_comm import RingPass, SequenceGroup

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


def _max_rows(q5: Tensor, t_k: int) -> int:
    """Query rows per block so that one block's scores [B, Hkv, G, rows, Tk] hold at most
    SCORE_ELEMENTS."""
    per_row = q5.shape[0] * q5.shape[1] * q5.shape[2] * t_k
    return max(1, SCORE_ELEMENTS // max(per_row, 1))


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


# ----------------------------------------------------------------------------- block math
def _scores(q: Tensor, k: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    """q [B, Hkv, G, Lq, d], k [B, Hkv, Lk, d] -> scaled scores [B, Hkv, G, Lq, Lk], -inf where
    not allowed."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return scores if allowed is None else scores.masked_fill(~allowed, -math.inf)


def _finite(lse: Tensor) -> Tensor:
    """`lse` with -inf (a row without any allowed key) replaced by 0, so that exp(s - lse) is
    exp(-inf) = 0 there instead of exp(-inf + inf) = NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp) of one block, normalised within the block; rows without an
    allowed key: output 0, lse -inf."""
    scores = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), lse


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The online-softmax merge of two partial results over disjoint key sets; -inf safe (a side
    without keys weighs 0; both without keys stay output 0, lse -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = _finite(lse)
    weight_a = torch.exp(lse_a - base).unsqueeze(-1)
    weight_b = torch.exp(lse_b - base).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def _block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    allowed: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Flash attention's backward for one block: (dq [B, Hkv, G, Lq, d], dk, dv [B, Hkv, Lk, d]),
    from the saved global log-sum-exp `lse` and `delta` = rowsum(dout * out)."""
    p = torch.exp(_scores(q, k, allowed, scale) - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(dim=2)
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(dim=2) * scale
    return dq, dk, dv


# ----------------------------------------------------------------------------- the ring
@dataclass
class _Setting:
    """What both passes need besides the tensors (one ring_attention call)."""

    group: SequenceGroup
    causal: bool
    layout: str
    scale: float
    dtype: torch.dtype  # the block math's: at least float32


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


def _ring_forward(
    s: _Setting,
    q5: Tensor,
    k: Tensor,
    v: Tensor,
    q_docs: Tensor | None,
    docs: Tensor | None,
    valid: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """(output [B, Hkv, G, Tq, dv], lse [B, Hkv, G, Tq]) in the block math's dtype."""
    group = s.group
    out = q5.new_zeros(*q5.shape[:-1], v.shape[-1])
    lse = q5.new_full(q5.shape[:-1], -math.inf)
    block = _key_block(k, v, docs, valid)
    for step in range(group.size):
        source = (group.rank - step) % group.size
        hop = RingPass(block, group, _KV_TAG) if step < group.size - 1 else None
        k_b, v_b, k_docs, k_valid = _unpack(block, docs is not None, valid is not None)
        k_b, v_b = k_b.to(s.dtype), v_b.to(s.dtype)
        t_q, t_k = q5.shape[-2], k_b.shape[-2]
        pairs = _block_pairs(
            s.causal, s.layout, group.rank, source, group.size, t_q, t_k, _max_rows(q5, t_k)
        )
        for pair in pairs:
            allowed = _allowed(pair, q_docs, k_docs, k_valid, q5.device)
            part = _block_forward(
                q5[..., pair.queries, :],
                k_b[:, :, pair.keys],
                v_b[:, :, pair.keys],
                allowed,
                s.scale,
            )
            rows = pair.queries
            out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], *part)
        if hop is not None:
            block = hop.wait()
    return out, lse


def _ring_backward(s: _Setting, saved: tuple, dout5: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq5, dk, dv) in the block math's dtype: dq local, dk/dv accumulated around the ring."""
    q5, k, v, out5, lse, q_docs, docs, valid = saved
    group = s.group
    delta = (dout5 * out5).sum(dim=-1)
    dq = torch.zeros_like(q5)
    block = _key_block(k, v, docs, valid)
    grads_hop = None
    for step in range(group.size):
        source = (group.rank - step) % group.size
        hop = RingPass(block, group, _KV_TAG) if step < group.size - 1 else None
        k_b, v_b, k_docs, k_valid = _unpack(block, docs is not None, valid is not None)
        k_b, v_b = k_b.to(s.dtype), v_b.to(s.dtype)
        dk = torch.zeros_like(k_b)
        dv = torch.zeros_like(v_b)
        t_q, t_k = q5.shape[-2], k_b.shape[-2]
        pairs = _block_pairs(
            s.causal, s.layout, group.rank, source, group.size, t_q, t_k, _max_rows(q5, t_k)
        )
        for pair in pairs:
            rows, keys = pair.queries, pair.keys
            allowed = _allowed(pair, q_docs, k_docs, k_valid, q5.device)
            dq_b, dk_b, dv_b = _block_backward(
                q5[..., rows, :],
                k_b[:, :, keys],
                v_b[:, :, keys],
                dout5[..., rows, :],
                lse[..., rows],
                delta[..., rows],
                allowed,
                s.scale,
            )
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
    masks (module docstring)."""

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
        # The block math runs in at least float32 whatever autocast says around it: the
        # exponentials and the merge lose too much in half precision.
        with torch.autocast(q.device.type, enabled=False):
            q5 = q.to(setting.dtype).reshape(b, k.shape[1], groups, t_q, q.shape[-1])
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
            q5 = q.to(setting.dtype).reshape(*shape5, q.shape[-1])
            out5 = out.to(setting.dtype).reshape(*shape5, v.shape[-1])
            dout5 = dout.to(setting.dtype).reshape(*shape5, v.shape[-1])
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
    head h reads kv head h // (H / Hkv)) -> [B, H, Tq, d] in q's dtype. Scale 1 / sqrt(d).

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
    setting = _Setting(
        group=group,
        causal=causal,
        layout=layout,
        scale=1.0 / math.sqrt(q.shape[-1]),
        dtype=torch.promote_types(q.dtype, torch.float32),
    )
    return _RingAttention.apply(q, k, v, setting, query_documents, documents, key_valid)
