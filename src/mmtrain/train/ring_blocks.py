"""One block of ring attention (train/ring_attention.py): the attention of some query rows over
one key block, as (output, log-sum-exp) normalised within the block, and its backward from the
whole row's log-sum-exp and output (flash attention's backward, which is exact block by block).

Two ways to compute a block (`block_kernel` picks one per ring call, and the ring logs it):
- fused: SDPA's own kernels, which return the log-sum-exp and never hold the block's scores:
  the CPU flash kernel (`cpu_flash`: fp64, fp32, bf16, fp16; any mask as an additive bias),
  CUDA's flash kernel (`flash`: fp16 / bf16, no mask: the unmasked and the causal-diagonal
  blocks of a causal row) and CUDA's memory-efficient kernel (`efficient`: fp32 too, and a
  bias for packed documents and padding keys). They read the inputs' one dtype (bf16 under
  autocast) and accumulate in fp32; the ring merges their results in fp32.
- math (`math`): the block's scores written out in at least fp32 (matmul, logsumexp, exp): the
  fallback where no fused kernel applies (fp64 on CUDA, head sizes not a multiple of 8 on
  CUDA, SDPA's fused backends switched off with `torch.nn.attention.sdpa_kernel`, other
  devices). Estimated 10-20x slower than flash on a GPU; bench/gpu_attention.py measures it.

Grouped-query attention: the flash kernels read the Hkv key/value heads as they are; the
memory-efficient one gets them repeated to the H query heads per block (on the rank, never on
the wire), and their gradients summed back.

Shapes: q [B, Hkv, G, Lq, d] (the G = H / Hkv query heads of each kv head), k, v
[B, Hkv, Lk, d]; outputs and log-sum-exps [B, Hkv, G, Lq(, d)]. A block mask `allowed` is
boolean [B, 1, 1, Lq, Lk] (or [Lq, Lk]); a row without any allowed key has output 0 and
log-sum-exp -inf, so it weighs nothing in the merge.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

MATH, CPU_FLASH, FLASH, EFFICIENT = "math", "cpu_flash", "flash", "efficient"
CPU_FLASH_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_BIAS_ALIGNMENT = 16  # the efficient kernel's bias rows start on 16-element boundaries
_LSE_ALIGNMENT = 32  # ... and its log-sum-exp rows are padded to 32 queries
_HEAD_DIM_ALIGNMENT = 8  # CUDA's fused kernels read head sizes in multiples of 8

aten = torch.ops.aten


def block_kernel(q: Tensor, k: Tensor, v: Tensor, masked: bool) -> str:
    """The kernel of this ring call's blocks (module docstring): q [B, H, T, d], k and v
    [B, Hkv, S, d] in their one dtype; `masked`: packed documents or padding keys."""
    grouped = q.shape[1] != k.shape[1]
    flash_on = torch.backends.cuda.flash_sdp_enabled()  # also SDPA's CPU flash switch
    if q.device.type == "cpu":
        return CPU_FLASH if flash_on and q.dtype in CPU_FLASH_DTYPES else MATH
    if q.device.type != "cuda" or q.shape[-1] % _HEAD_DIM_ALIGNMENT:
        return MATH  # (SDPA pads other head sizes before these kernels; the ring does not)
    flash_params = SDPAParams(q, k, v, None, 0.0, False, grouped)
    if not masked and flash_on and can_use_flash_attention(flash_params):
        return FLASH
    if torch.backends.cuda.mem_efficient_sdp_enabled() and can_use_efficient_attention(
        SDPAParams(q, q, q, None, 0.0, False, False)  # k, v repeated to q's heads
    ):
        return EFFICIENT
    return MATH


# ----------------------------------------------------------------------------- math
def _scores(q: Tensor, k: Tensor, allowed: Tensor | None, scale: float) -> Tensor:
    """q [B, Hkv, G, Lq, d], k [B, Hkv, Lk, d] -> scaled scores [B, Hkv, G, Lq, Lk], -inf where
    not allowed."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return scores if allowed is None else scores.masked_fill(~allowed, -math.inf)


def finite(lse: Tensor) -> Tensor:
    """`lse` with -inf (a row without any allowed key) replaced by 0, so that exp(s - lse) is
    exp(-inf) = 0 there instead of exp(-inf + inf) = NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def math_forward(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp) of one block in q's dtype (at least fp32: the ring's)."""
    scores = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - finite(lse).unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), lse


def math_backward(
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
    p = torch.exp(_scores(q, k, allowed, scale) - finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(dim=2)
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(dim=2) * scale
    return dq, dk, dv


# ----------------------------------------------------------------------------- fused
def _heads(x5: Tensor) -> Tensor:
    """[B, Hkv, G, L, d] -> [B, H, L, d] (query head h = kv head h // G, as the kernels read)."""
    return x5.flatten(1, 2)


def _kv_for(kernel: str, x: Tensor, groups: int) -> Tensor:
    """k or v as the kernel takes them: grouped (flash kernels read Hkv heads), else repeated
    to every query head."""
    if kernel == EFFICIENT and groups > 1:
        return x.repeat_interleave(groups, dim=1)
    return x


def _bias(kernel: str, allowed: Tensor | None, q: Tensor) -> Tensor | None:
    """The additive mask [B, 1 or H, Lq, Lk] (0 allowed, -inf not) in q's dtype, for q
    [B, H, Lq, d]."""
    if allowed is None:
        return None
    if allowed.dim() == 2:
        allowed = allowed[None, None, None]
    b, heads, lq, _ = q.shape
    lk = allowed.shape[-1]
    allowed = allowed.flatten(1, 2).expand(allowed.shape[0], 1, lq, lk)
    width = lk
    if kernel == EFFICIENT:  # rows aligned as SDPA pads them for this kernel, whole shape
        width = -(-lk // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    shape = (allowed.shape[0], 1, lq, width)
    bias = torch.zeros(shape, dtype=q.dtype, device=q.device)[..., :lk]
    bias.masked_fill_(~allowed, -math.inf)
    return bias.expand(b, heads, lq, lk) if kernel == EFFICIENT else bias


def fused_forward(
    kernel: str, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp) [B, Hkv, G, Lq(, d)] of one block through `kernel`, in the
    kernel's dtypes (output: the inputs'; log-sum-exp: at least fp32). `causal`: a square
    block on the diagonal without any other mask (the kernels' own causal flag)."""
    _, kv_heads, groups, lq, _ = q.shape
    if kernel == FLASH and allowed is not None:
        raise ValueError("ring blocks: CUDA's flash kernel takes no mask; block_kernel picks it")
    q4 = _heads(q)
    k4, v4 = _kv_for(kernel, k, groups), _kv_for(kernel, v, groups)
    bias = _bias(kernel, allowed, q4)
    if kernel == CPU_FLASH:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, attn_mask=bias, scale=scale
        )
    elif kernel == FLASH:
        out, lse = aten._scaled_dot_product_flash_attention(
            q4, k4, v4, 0.0, causal, False, scale=scale
        )[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(
            q4, k4, v4, bias, True, 0.0, causal, scale=scale
        )[:2]
        lse = lse[..., :lq]
    out = out.unflatten(1, (kv_heads, groups))
    lse = lse.unflatten(1, (kv_heads, groups))
    if allowed is not None:  # a row without any allowed key: weight 0 in the merge, output 0
        empty = ~allowed.any(dim=-1)
        lse = lse.masked_fill(empty, -math.inf)
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def fused_backward(
    kernel: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    out: Tensor,
    lse: Tensor,
    allowed: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq [B, Hkv, G, Lq, d], dk, dv [B, Hkv, Lk, d]) of one block through `kernel`'s
    backward, given the whole row's output `out` and log-sum-exp `lse` (the kernel takes
    delta = rowsum(dout * out) from them, as the ring's math does)."""
    _, kv_heads, groups, lq, _ = q.shape
    q4, dout4, out4 = _heads(q), _heads(dout), _heads(out)
    k4, v4 = _kv_for(kernel, k, groups), _kv_for(kernel, v, groups)
    lse4 = _heads(finite(lse)).contiguous()
    bias = _bias(kernel, allowed, q4)
    if kernel == CPU_FLASH:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout4, q4, k4, v4, out4, lse4, 0.0, causal, attn_mask=bias, scale=scale
        )
    elif kernel == FLASH:
        unused = torch.empty(2, dtype=torch.int64, device=q.device)  # dropout's RNG state
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout4, q4, k4, v4, out4, lse4, None, None, lq, k.shape[2], 0.0, causal,
            unused, unused, scale=scale,
        )  # fmt: skip
    else:
        padded = -(-lq // _LSE_ALIGNMENT) * _LSE_ALIGNMENT
        lse4 = torch.nn.functional.pad(lse4, (0, padded - lq)).contiguous()
        unused = torch.empty(2, dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout4, q4, k4, v4, bias, out4, lse4, unused, unused, 0.0,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
    dq = dq.unflatten(1, (kv_heads, groups))
    if dk.shape[1] != kv_heads:  # repeated heads: each kv head's gradient sums its group's
        dk = dk.unflatten(1, (kv_heads, groups)).sum(dim=2)
        dv = dv.unflatten(1, (kv_heads, groups)).sum(dim=2)
    return dq, dk, dv
