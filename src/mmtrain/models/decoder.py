"""A decoder-only language model of the Llama / Qwen2 family, in plain PyTorch.

Read top to bottom: rotary positions, RMSNorm, positions of packed documents, the KV cache,
attention (its kernels and masks: models/attention.py), the gated MLP, the block, the model,
sampling. The shape comes from a `DecoderSpec` (mmtrain.decoder_spec), so the planner counts what
this module holds.

Parameter names follow the encoder blocks of layers.py (`norm1`, `attn.qkv`, `attn.out`, `norm2`,
`mlp.fc1`, `mlp.fc2`), so LoRA targets, activation checkpointing and the planner's per-block
formulas know one shape: `attn.qkv` stacks the q, k and v projections (rows q, k, v; k and v are
`kv_heads` heads wide) and `mlp.fc1` stacks the SwiGLU gate and value (gate first).

Numerics follow the checkpoints' own implementations, so converted weights compute what they
were trained to compute: rotary angles are computed in float32 whatever the model's dtype (q
and k are rotated in float32 and rounded once back to their dtype, so attention gets q, k and v
in one dtype), and RMSNorm normalises in at least float32 before casting back and scaling.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models.attention import AttentionKernel, Mask, attend, attention_inputs
from mmtrain.models.materialize import copy_full_, initialised_parameters

ROTARY_DTYPE = torch.float32  # angle tables, as Meta's and HF's Llama compute them


# ----------------------------------------------------------------------------- rotary positions
def rope_frequencies(spec: DecoderSpec, device: torch.device | None = None) -> Tensor:
    """Inverse wavelengths [head_dim / 2] of the rotary embedding, with `spec.rope_scaling`.

    Computed in float32 with the same operations, in the same order, as the reference
    implementations: pre-trained weights expect exactly these (rounded) frequencies.
    """
    d = spec.head_dim
    exponents = torch.arange(0, d, 2, device=device).to(ROTARY_DTYPE) / d
    inv_freq = 1.0 / (spec.rope_theta**exponents)
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":  # position interpolation: every position / factor
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the pre-training context / low_freq_factor are stretched
    # by `factor`, shorter than context / high_freq_factor kept; in between, a linear blend in
    # context / wavelength.
    context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > context / low, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    middle = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(middle, blended, stretched)


def rotary_cos_sin(
    inv_freq: Tensor, position_ids: Tensor, mrope_section: tuple[int, ...] | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin [B, T, head_dim] in float32 of each position's angles, the halves repeated
    (the q/k channels are rotated as pairs (i, i + head_dim / 2), HF's layout of Llama weights).
    Kept in float32 whatever the model's dtype: `apply_rotary` rotates in float32.

    `position_ids` [B, T], or [3, B, T] (time, height, width) with `mrope_section`: the first
    `mrope_section[0]` frequencies turn with the time position, the next ones with the height,
    the last ones with the width (Qwen2-VL's M-RoPE). Each angle is the same float32 product
    as in 1-D RoPE, only its position differs, so three equal axes give 1-D RoPE exactly.
    """
    positions = position_ids.to(ROTARY_DTYPE)
    if positions.dim() == 3:
        if mrope_section is None:
            raise ValueError("[3, B, T] position_ids need an mrope_section")
        # slices, not a gathered index: no host data travels to the device per forward
        per_axis = zip(positions, inv_freq.split(list(mrope_section)), strict=True)
        angles = torch.cat([axis[..., None] * freqs for axis, freqs in per_axis], dim=-1)
    else:
        angles = positions[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x_i, x_{i + d/2}) of x [B, heads, T, d] (cos, sin [B, T, d]; the
    native vision tower's x [N, heads, d], cos, sin [N, d]) by its position's angle, in
    at least the tables' float32, and round once back to x's dtype: a bf16 q (autocast's
    projection) stays bf16 like v, so attention gets one dtype, without the error of bf16 angle
    tables; multiplied by the fp32 tables as it is, it would come out fp32 beside a bf16 v."""
    h = x.to(torch.promote_types(x.dtype, cos.dtype))
    first, second = h.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (h * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


# ----------------------------------------------------------------------------- RMSNorm
class RMSNorm(nn.Module):
    """x / rms(x) * weight. Normalised in at least float32 (bf16 sums of squares lose the small
    channels), cast back to the input dtype, then scaled, as Llama's reference does."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# ----------------------------------------------------------------------------- positions
def document_positions(document_ids: Tensor) -> Tensor:
    """[B, T] positions that restart at 0 at every document of a packed row."""
    t = document_ids.shape[1]
    index = torch.arange(t, device=document_ids.device).expand_as(document_ids)
    changed = F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0), value=True)
    starts = torch.where(changed, index, 0).cummax(dim=1).values
    return index - starts


def next_positions(position_ids: Tensor) -> Tensor:
    """[B, 1] position of each row's next token after `position_ids` [B, T] or [3, B, T]: one
    past the largest position of the row, on every axis (a text token after an image continues
    after the image's furthest time, row or column; padding holds 0, below every real one)."""
    if position_ids.dim() == 3:
        position_ids = position_ids.amax(dim=0)
    return position_ids.amax(dim=-1, keepdim=True) + 1


def rotary_positions(position_ids: Tensor, batch: int, tokens: int, mrope: bool) -> Tensor:
    """`position_ids` broadcast to [B, T], or to [3, B, T] for M-RoPE; ValueError for a shape
    the decoder cannot rotate by. [T] and [B, T] positions are text positions for M-RoPE too
    (the three axes equal)."""
    shape = tuple(position_ids.shape)
    if position_ids.dim() == 3:
        if not mrope:
            raise ValueError(
                f"position_ids of shape {shape} are M-RoPE positions [3, B, T]; this decoder has "
                "1-D rotary positions (decoder.mrope_section is unset): give [B, T] or [T]"
            )
        if shape[0] != 3 or shape[1] not in (1, batch) or shape[2] != tokens:
            raise ValueError(
                f"M-RoPE position_ids must be [3, B, T] = [3, {batch}, {tokens}], got {shape}"
            )
        return position_ids.expand(3, batch, tokens)
    if position_ids.dim() not in (1, 2) or shape[-1] != tokens:
        expected = "[T], [B, T] or [3, B, T]" if mrope else "[T] or [B, T]"
        raise ValueError(
            f"position_ids must be {expected} for {batch} rows of {tokens} tokens, got {shape}"
        )
    return position_ids.expand(batch, tokens)


# ----------------------------------------------------------------------------- KV cache
class KVCache:
    """Keys and values of every layer for the tokens seen so far, preallocated for `max_tokens`
    (no re-allocation per generated token). Every row holds the same number of tokens; padding
    is masked, not skipped."""

    def __init__(
        self,
        spec: DecoderSpec,
        batch: int,
        max_tokens: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        shape = (spec.layers, batch, spec.kv_heads, max_tokens, spec.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.max_tokens = max_tokens
        self.length = 0  # tokens cached; advanced once per forward, after every layer wrote

    def check_room(self, tokens: int) -> None:
        if self.length + tokens > self.max_tokens:
            raise ValueError(
                f"KV cache: {self.length} cached + {tokens} new tokens exceed its "
                f"{self.max_tokens}; make it larger"
            )

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new tokens' k, v [B, kv_heads, T, d] after the cached ones; return all of
        this layer's keys and values so far."""
        end = self.length + k.shape[2]
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


# ----------------------------------------------------------------------------- the block
class DecoderAttention(nn.Module):
    """Causal self-attention with grouped-query attention: `heads` query heads share
    `kv_heads` key/value heads in consecutive groups (query head h reads kv head h // group).
    The kernel and mask are `models/attention.py`'s, chosen once per forward."""

    def __init__(self, spec: DecoderSpec, layer: int):
        super().__init__()
        self.layer = layer  # its slot in the KV cache
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.qkv = nn.Linear(spec.width, spec.qkv_width(), bias=spec.qkv_bias)
        self.out = nn.Linear(spec.q_width(), spec.width, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Mask,
        is_causal: bool,
        cache: KVCache | None = None,
    ) -> Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q = q.view(b, t, self.heads, d).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, d).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.write(self.layer, k, v)
        y = attend(q, k, v, mask, is_causal)
        return self.out(y.transpose(1, 2).reshape(b, t, self.heads * d))


class GatedMlp(nn.Module):
    """SwiGLU: fc2(silu(gate) * value), where fc1 yields gate and value (gate first)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * hidden, bias=False)
        self.fc2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * value)


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, spec: DecoderSpec, layer: int):
        super().__init__()
        self.norm1 = RMSNorm(spec.width, spec.rms_eps)
        self.attn = DecoderAttention(spec, layer)
        self.norm2 = RMSNorm(spec.width, spec.rms_eps)
        self.mlp = GatedMlp(spec.width, spec.mlp_hidden)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Mask,
        is_causal: bool,
        cache: KVCache | None = None,
    ) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask, is_causal, cache)
        return x + self.mlp(self.norm2(x))


# ----------------------------------------------------------------------------- the model
class Decoder(nn.Module):
    """Token embedding, `spec.layers` blocks, final RMSNorm, LM head (the embedding when tied).

    `forward` returns logits [B, T, vocab]; `hidden` the final normalised states [B, T, width]
    (a VLM or a chunked loss applies `head` itself); `generate` samples with a KV cache.
    """

    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.width)
        self.blocks = nn.ModuleList(DecoderBlock(spec, i) for i in range(spec.layers))
        self.norm = RMSNorm(spec.width, spec.rms_eps)
        # Tied: no module of its own, so the state dict and the parameter count hold it once.
        self.lm_head = (
            None if spec.tie_embeddings else nn.Linear(spec.width, spec.vocab_size, bias=False)
        )

    @property
    def head_weight(self) -> Tensor:
        """The LM head's weight [vocab, width] (the embedding's when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def head(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.head_weight)

    def hidden(
        self,
        input_ids: Tensor | None = None,
        *,
        inputs_embeds: Tensor | None = None,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        cache: KVCache | None = None,
        right_padded: bool = False,
        attention: AttentionKernel | None = None,
    ) -> Tensor:
        """Final normalised hidden states [B, T, width] of `input_ids` [B, T] or, for a caller
        that splices in other tokens (image features), of `inputs_embeds` [B, T, width].

        - `position_ids` [B, T] or [T]: rotary positions; default the next positions after the
          cache, or, with `document_ids`, positions restarting at every packed document. With
          `spec.mrope_section` also [3, B, T]: (time, height, width) positions of
          `models.mrope.rope_index_batch` ([B, T] ones are then text positions on all axes).
        - `attention_mask` bool: False marks padding keys (see `models/attention.py: build_attention_mask` for shapes;
          with a cache it covers the cached tokens too).
        - `document_ids` [B, T]: packed documents see only themselves (no cache).
        - `cache`: the new tokens' keys and values are appended and the cached ones attended.
        - `right_padded`: the caller knows `attention_mask` [B, T] is False only after each
          row's real tokens; without a cache the mask is then not built (causal attention is
          exact for every real token; `models/attention.py`). Padding tokens' states differ.
        - `attention`: the rows are this rank's slice of longer ones (sequence parallelism);
          the kernel attends over the whole rows with their masks, so `attention_mask` and
          `document_ids` must not be given, and `position_ids` must (the slice's own).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if attention is not None and (
            position_ids is None
            or any(v is not None for v in (cache, attention_mask, document_ids))
        ):
            raise ValueError(
                "an attention kernel applies the rows' masks itself: give it the slice's "
                "position_ids and no cache, attention_mask or document_ids"
            )
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = x.shape
        past = 0 if cache is None else cache.length
        if cache is not None:
            cache.check_room(t)
        if position_ids is None:
            if document_ids is not None:
                position_ids = document_positions(document_ids)
            else:
                position_ids = torch.arange(past, past + t, device=x.device)
        mrope = self.spec.mrope_section
        position_ids = rotary_positions(position_ids, b, t, mrope is not None)
        inv_freq = rope_frequencies(self.spec, x.device)
        cos, sin = rotary_cos_sin(inv_freq, position_ids, mrope)
        if attention is not None:
            mask, is_causal = attention, False
        else:
            mask, is_causal = attention_inputs(
                t, past, x.device, x.dtype, attention_mask, document_ids, right_padded
            )
        for block in self.blocks:
            x = block(x, cos, sin, mask, is_causal, cache)
        if cache is not None:
            cache.length += t
        return self.norm(x)

    def forward(self, input_ids: Tensor | None = None, **kwargs) -> Tensor:
        """Logits [B, T, vocab]; the keyword arguments are `hidden`'s."""
        return self.head(self.hidden(input_ids, **kwargs))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Fan-in random init for training from scratch: each linear's output starts near unit
        variance (std fan_in**-0.5), the two residual outputs per block smaller by
        (2 * layers)**-0.5 so the stream's growth is bounded over depth (GPT-2), the embedding
        width**-0.5 (tied, it is the head: unit-variance logits); norms 1, biases 0.

        Drawn on the CPU in float32 from `generator` in `named_parameters()` order, then copied:
        the same generator state gives the same weights on any device."""
        residual = (2 * self.spec.layers) ** -0.5
        for name, param in initialised_parameters(self):
            if name.endswith("bias"):
                param.zero_()
                continue
            if "norm" in name:
                param.fill_(1.0)
                continue
            std = param.shape[-1] ** -0.5
            if name.endswith(("attn.out.weight", "mlp.fc2.weight")):
                std *= residual
            copy_full_(param, torch.empty(param.shape).normal_(0.0, std, generator=generator))

    # ------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        eos_ids: tuple[int, ...] | None = None,
        pad_id: int | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Prompt plus up to `max_new_tokens` sampled tokens [B, T + n], with a KV cache.

        `temperature` 0 is greedy (argmax); otherwise logits / temperature are sampled from the
        smallest set of tokens whose probability reaches `top_p`, drawing from `generator`.
        A row ends at any of `eos_ids` (default the spec's), keeps it, and is filled with
        `pad_id` (default the first eos id) afterwards; generation stops when every row ended.
        `attention_mask` bool [B, T] marks left padding of a batch of prompts (False).
        `position_ids` are the prompt's, when not counted from its real tokens: M-RoPE's
        [3, B, T] (`models.mrope.rope_index_batch`) or [B, T]; new tokens are text and continue
        one past each row's largest prompt position (`next_positions`), all axes equal.
        """
        eos = tuple(self.spec.eos_ids if eos_ids is None else eos_ids)
        pad = pad_id if pad_id is not None else (eos[0] if eos else 0)
        b, t = input_ids.shape
        cache = KVCache(self.spec, b, t + max_new_tokens, input_ids.device, self.embed.weight.dtype)
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if position_ids is not None:
            positions = position_ids
        elif attention_mask is None:  # no padding: SDPA's causal fast path for the prompt
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        else:  # left padding: each row's positions count its real tokens only
            positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        eos_tensor = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
        done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        tokens, step_ids = input_ids, input_ids
        for _ in range(max_new_tokens):
            h = self.hidden(
                step_ids, position_ids=positions, attention_mask=attention_mask, cache=cache
            )
            logits = self.head(h[:, -1])
            new = sample(logits, temperature, top_p, generator)
            new = torch.where(done, torch.full_like(new, pad), new)
            tokens = torch.cat([tokens, new[:, None]], dim=1)
            done = done | torch.isin(new, eos_tensor)
            if bool(done.all()):
                break
            step_ids = new[:, None]
            positions = next_positions(positions)
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, 1), value=True)
        return tokens


def sample(
    logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> Tensor:
    """One token id per row of `logits` [B, vocab]: argmax at temperature 0, else nucleus
    sampling (the most probable tokens up to cumulative probability `top_p`)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token if the tokens before it have not reached top_p yet (the first always)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
