"""The next-token loss without the batch's logits: the LM head and the cross-entropy, a chunk of
positions at a time.

At 16 rows x 2048 positions x a 128k vocabulary the logits are 8 GiB in bf16 and their fp32
copy (and the log-softmax cross-entropy keeps) 17 GB each. Here each chunk of `chunk_rows`
positions computes its logits, its summed NLL, and drops them; its backward recomputes them
(non-reentrant activation checkpointing), so at most one chunk's logits and their gradient
exist at a time, in forward and in backward. Autograd keeps only each chunk's inputs: the
head's input rows (views of one tensor) and the targets. The price: the head's forward matmul
runs twice (a third more head FLOPs).

The head weight is passed in, not read from a module: the caller (`LanguageModel.forward`)
runs inside the module FSDP2 hooks as its root, so the weight is the gathered one in forward and
in the backward recomputation alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # "no target" label of data/stream/chat_templates.py (models import no data/)
# A batch's flag (host bool) beside its labels, and the output it asks for: each target's NLL
# [R, T - 1] instead of their sum (DPO's per-sample log-probs: train/dpo.py).
TOKEN_NLL = "token_nll"
CHUNK_ELEMENTS = 2**26  # logits per chunk: 256 MiB in fp32 (512 positions at a 128k vocabulary)


def default_chunk_rows(vocab: int) -> int:
    """Positions per chunk for a vocabulary of `vocab`: `CHUNK_ELEMENTS` logits."""
    return max(1, CHUNK_ELEMENTS // vocab)


def chunk_nll_sum(
    hidden: Tensor, weight: Tensor, targets: Tensor, reduction: str = "sum"
) -> Tensor:
    """Sum of -log softmax(hidden @ weight.T)[target] over rows whose target is not -100,
    the log-softmax in at least fp32 (as `train/objectives.py: token_nll_sum`); with
    `reduction` "none", each row's [N] (0 where the target is -100).

    Under autocast the weight is cast here, in each chunk: autocast would cast it once and
    reuse the copy in every chunk, so the chunks' head-weight gradients would be summed in
    bf16 (measured against fp64 under CPU bf16 autocast: 0.25% off with 1 chunk, 0.99% with
    64, 2.1% with 256). Cast per chunk, each chunk's gradient reaches the fp32 weight on its
    own and they add up in fp32; the price is one cast of the head weight per chunk."""
    device = hidden.device.type
    # (the meta device, where models/hub/trace.py runs the loss, has no autocast to ask about)
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    if autocast and weight.is_floating_point():
        dtype = torch.get_autocast_dtype(device)
        weight, hidden = weight.to(dtype), hidden.to(dtype)
    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def chunked_nll_sum(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int | None = None
) -> Tensor:
    """`chunk_nll_sum` of hidden [N, width] against targets [N], `chunk_rows` rows at a time
    (default `default_chunk_rows`); each chunk's logits are recomputed in backward."""
    total = None
    for value in _chunks(hidden, weight, targets, chunk_rows, "sum"):
        total = value if total is None else total + value
    return total


def chunked_token_nll(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int | None = None
) -> Tensor:
    """Each row's NLL [N] (0 where the target is -100), chunked as `chunked_nll_sum`: what a
    per-sample sum of log-probs needs (DPO, train/dpo.py) without the batch's logits."""
    return torch.cat(list(_chunks(hidden, weight, targets, chunk_rows, "none")))


def _chunks(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int | None, reduction: str
) -> Iterator[Tensor]:
    rows = hidden.shape[0]
    chunk = chunk_rows or default_chunk_rows(weight.shape[0])
    if chunk <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    # range(max(rows, 1)): an empty batch still yields a 0 with a graph, as cross_entropy does.
    for start in range(0, max(rows, 1), chunk):
        part = (hidden[start : start + chunk], weight, targets[start : start + chunk], reduction)
        if torch.is_grad_enabled():
            # No randomness in the head or the loss: no RNG state to stash and restore.
            yield checkpoint(chunk_nll_sum, *part, use_reentrant=False, preserve_rng_state=False)
        else:
            yield chunk_nll_sum(*part)
