"""How the decoder attends: which kernel, with which mask, built once per forward.

`attention_inputs` turns a forward's masks into what every layer passes to `attend`, choosing
the cheapest exact path:

- causal, no mask: rows without padding, and right-padded rows (training and eval batches:
  each row's padding comes after its real tokens). A real query never sees a later key, so
  causal attention alone gives every real token the masked result; padding queries then see
  earlier padding keys too, but their outputs are never read (their labels are -100). SDPA's
  `is_causal` path runs its flash kernel, which a dense mask would rule out.
- every key, no mask: one new token after a cache without padding.
- flex attention: packed rows (`document_ids`) on CUDA in fp16 / bf16 / fp32. A `BlockMask`
  (same document and k <= q) replaces the L x L mask: blocks outside a document are skipped
  and nothing quadratic is kept for backward, nor made: its block tables are read from the
  documents' boundaries (`document_block_mask`).
- a dense boolean [B, 1, T, S] mask, the explicit fallback: left padding with a KV cache
  (generation), and packed rows where flex attention cannot train: on the CPU (torch 2.13's
  flex attention has no CPU backward, and inductor's CPU flex kernel refuses float64) and in
  float64 on CUDA. `flex_attention_trains` says which.

- an `AttentionKernel`: attention computed by someone else over a sequence this rank holds a
  slice of (train/sequence_parallel.py's all-to-all and ring kernels); it applies the
  forward's masks itself.

Every kernel gets q, k and v in one dtype (`attention_dtype`): autocast's where it is on.

Grouped-query attention hands SDPA the `kv_heads` keys and values with `enable_gqa=True`
where the chosen kernel takes them grouped (CPU flash kernel; CUDA flash kernel: fp16/bf16,
no mask) and flex attention always; elsewhere on CUDA SDPA would fall back to its math kernel,
which materialises the scores, so k and v are repeated to every query head instead.
"""

from __future__ import annotations

import abc
import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLEX_BLOCK = 128  # flex attention's default sparse block: tokens per query / key block
HALF_DTYPES = (torch.float16, torch.bfloat16)


class AttentionKernel(abc.ABC):
    """Attention of this rank's queries over keys and values of which it holds a slice, with
    the forward's masks built in: sequence parallelism's kernels (train/sequence_parallel.py).
    Passed to every layer in place of a mask; models never build one."""

    @abc.abstractmethod
    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, heads, T, d], k and v [B, kv_heads, S, d] (local slices) -> [B, heads, T, d]."""


Mask = Tensor | BlockMask | AttentionKernel | None


def document_runs(document_ids: Tensor) -> Tensor:
    """[B, T] index of each token's document within its row: a new document starts wherever the
    id changes, so two packed documents never share a run even if their ids repeat later."""
    changed = document_ids[:, 1:] != document_ids[:, :-1]
    return F.pad(changed, (1, 0)).long().cumsum(dim=1)


def flex_attention_trains(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed rows take the flex-attention path on `device` in `dtype` (module
    docstring): CUDA in fp16 / bf16 / fp32; elsewhere the dense block-diagonal mask."""
    return device.type == "cuda" and dtype in FLEX_DTYPES


def document_block_mask(document_ids: Tensor) -> BlockMask:
    """Block-diagonal causal `BlockMask` of packed rows `document_ids` [B, T]: a query sees the
    keys of its own document (run) at or before it.

    The block structure is read from the runs' boundaries, per (query block, key block) of
    `FLEX_BLOCK` tokens, never from the mask itself: `create_block_mask` run eagerly evaluates
    the mask at every pair, a [B, 1, T, T] tensor (64 MiB per row at 8k tokens, 1 GiB at
    32k). Runs never decrease along a row, so a block's runs are the interval between its
    first and last token's: a key block can hold a query block's document iff the intervals
    meet (and it is not after it), and is wholly visible iff both blocks lie in one document
    and the key block is strictly before. Built once per forward and shared by every layer."""
    runs = document_runs(document_ids)
    b, t = runs.shape
    blocks = -(-t // FLEX_BLOCK)
    # pad with each row's last run: no run is added, so the intervals stay the real tokens'
    padded = torch.cat([runs, runs[:, -1:].expand(b, blocks * FLEX_BLOCK - t)], dim=1)
    first = padded[:, ::FLEX_BLOCK]  # [B, blocks]
    last = padded[:, FLEX_BLOCK - 1 :: FLEX_BLOCK]
    index = torch.arange(blocks, device=runs.device)
    not_after = index[None, :] <= index[:, None]  # [query block, key block]
    meets = (first[:, None, :] <= last[:, :, None]) & (last[:, None, :] >= first[:, :, None])
    one_run = first == last
    inside = (index + 1) * FLEX_BLOCK <= t  # a last, partial block is never full
    whole = one_run & inside[None]
    full = (
        (index[None, :] < index[:, None])
        & whole[:, :, None]
        & whole[:, None, :]
        & (first[:, :, None] == first[:, None, :])
    )
    partial = not_after & meets & ~full

    def same_document_causal(batch: Tensor, head: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (runs[batch, q] == runs[batch, k]) & (k <= q)

    return BlockMask.from_kv_blocks(
        *_ordered_blocks(partial),
        *_ordered_blocks(full),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=same_document_causal,
        seq_lengths=(t, t),
    )


def _ordered_blocks(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(count [B, 1, Q], indices [B, 1, Q, K]) of the key blocks marked in `blocks` [B, Q, K],
    in ascending order first: `BlockMask`'s layout (int32), as `create_block_mask` makes it."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(blocks.int(), dim=-1, descending=True, stable=True)
    return counts[:, None], order.to(torch.int32)[:, None]


def build_attention_mask(
    queries: int,
    past: int,
    device: torch.device,
    key_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> tuple[Tensor | None, bool]:
    """The dense (attn_mask, is_causal) pair for `scaled_dot_product_attention`: `queries` new
    tokens after `past` cached ones, causal, AND the optional masks:

    - `key_mask` bool [B, past + queries] (False: a padding key) or [B, queries, past + queries]
      (per query);
    - `document_ids` [B, queries]: packed documents attend only within themselves.

    Without extra masks, SDPA's `is_causal` fast path is used (or no mask at all for one token
    after a cache, which sees every key). A token always sees itself: a left-padding query whose
    every key is masked would otherwise make SDPA return NaN (its output is never read).
    """
    if key_mask is None and document_ids is None:
        if past == 0:
            return None, True
        if queries == 1:
            return None, False
    total = past + queries
    q_pos = torch.arange(past, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]  # [1, 1, T, S]
    if key_mask is not None:
        per_key, per_query = (total,), (queries, total)
        if tuple(key_mask.shape[1:]) not in (per_key, per_query):
            raise ValueError(
                f"attention_mask: expected [B, {total}] or [B, {queries}, {total}] "
                f"({past} cached + {queries} new tokens), got {list(key_mask.shape)}"
            )
        key_mask = key_mask.bool()
        mask = mask & (key_mask[:, None, None, :] if key_mask.dim() == 2 else key_mask[:, None])
    if document_ids is not None:
        if past:
            raise ValueError("document_ids: packed documents are for whole sequences, not a cache")
        runs = document_runs(document_ids)
        mask = mask & (runs[:, :, None] == runs[:, None, :])[:, None]
    return mask | (k_pos == q_pos)[None, None], False


def attention_inputs(
    queries: int,
    past: int,
    device: torch.device,
    dtype: torch.dtype,
    key_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    right_padded: bool = False,
) -> tuple[Mask, bool]:
    """The (mask, is_causal) pair every layer of one forward passes to `attend` (module
    docstring): `right_padded` says `key_mask` masks only keys after each row's real tokens, so
    without a cache it is dropped; packed rows get a `BlockMask` where flex attention trains."""
    if right_padded and past == 0 and key_mask is not None and key_mask.dim() == 2:
        key_mask = None
    if document_ids is not None and key_mask is None and flex_attention_trains(device, dtype):
        if past:
            raise ValueError("document_ids: packed documents are for whole sequences, not a cache")
        return document_block_mask(document_ids), False
    return build_attention_mask(queries, past, device, key_mask, document_ids)


@functools.cache
def _compiled_flex_attention():
    # Compiled once, on first use (not at import): uncompiled flex attention materialises the
    # whole score matrix.
    return torch.compile(flex_attention)


def attention_dtype(q: Tensor, k: Tensor, v: Tensor) -> torch.dtype:
    """The one dtype attention runs in: autocast's where it is on for q's device (as autocast
    would cast SDPA's inputs; flex attention is not covered, so its inputs are cast here), else
    the common dtype of q, k and v. Under autocast, fp32 q and k (rotated in fp32) beside a
    bf16 v would otherwise reach flex attention mixed, and make SDPA's grouped-query choice
    on the fp32 dtype (`sdpa_groups_kv`)."""
    device_type = q.device.type
    floats = all(t.dtype in FLEX_DTYPES for t in (q, k, v))
    if floats and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def sdpa_groups_kv(device: torch.device, dtype: torch.dtype, mask: Tensor | None) -> bool:
    """Whether SDPA gets the `kv_heads` keys and values grouped (`enable_gqa`) rather than
    repeated to every query head (module docstring): on the CPU always; on CUDA where its
    flash kernel takes them, 16-bit without a mask."""
    return device.type == "cpu" or (dtype in HALF_DTYPES and mask is None)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask, is_causal: bool) -> Tensor:
    """Attention of q [B, heads, T, d] over k, v [B, kv_heads, S, d] (each kv head serves
    `heads / kv_heads` consecutive query heads) under `attention_inputs`'s (mask, is_causal),
    in one dtype (`attention_dtype`)."""
    if isinstance(mask, AttentionKernel):
        return mask(q, k, v)
    dtype = attention_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    grouped = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        # Compiled where it trains; eager elsewhere (forward only, e.g. the CPU checks of
        # the mask in tests/test_attention.py). Inside a compiled block (train/parallel.py's
        # compile) the enclosing graph compiles the plain call itself.
        compiled = q.is_cuda and not torch.compiler.is_compiling()
        kernel = _compiled_flex_attention() if compiled else flex_attention
        return kernel(q, k, v, block_mask=mask, enable_gqa=grouped)
    native = sdpa_groups_kv(q.device, dtype, mask)
    if grouped and not native:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=grouped and native
    )
