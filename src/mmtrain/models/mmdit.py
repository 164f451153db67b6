"""SD3's MMDiT (Esser et al. 2024, arXiv 2403.03206) built from a `DenoiserSpec` with
`architecture: mmdit` (denoiser_spec.py says what it is).

    MMDiT(spec)(x_t, t, text_hidden [B, L, text_width], text_pooled [B, pooled_width])
        -> [B, C, H, W]

Two streams of tokens, the image's patches and the text encoder's hidden states, each with its
own weights (adaLN-Zero modulation, q/k/v, output projection, MLP), meet in one attention per
block over both together, image tokens first. The conditioning vector c is the timestep's MLP
plus the pooled text's MLP; every modulation reads SiLU(c).

The blocks are at `.blocks` and each block's attention at `.attn` with the image stream's
projections under the names every block has (`attn.qkv`, `attn.out`, `mlp.fc1`, `mlp.fc2`), so
per-tower freezing, LoRA (on the image stream), activation checkpointing (selective: the joint
attention), compile and FSDP apply as to a DiT. The text stream's are `attn.context_qkv`,
`attn.context_out`, `context_mlp.*` and `context_modulation`.

Conventions that a checkpoint's numbers depend on follow diffusers' `SD3Transformer2DModel`,
so its folders convert by renaming (formats/diffusers_sd3.py): the timestep's sinusoid has
frequencies exp(-ln(1e4) i / half) (DiT's shift of 1 is 0 here); the pooled text goes through
linear, SiLU, linear; adaLN-Zero modulations are (shift, scale, gate) for the attention, then
the MLP, as DiT's, while the continuous ones (the final layer's, and the last block's text
stream, which only gives keys and values) are (scale, shift); norms have no weights (eps 1e-6),
the per-head q/k norms (`qk_norm: rms_norm`) do; positions are DiT's sine-cosine at the
coordinates of the centre of a larger grid (dit.position_table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmtrain.denoiser_spec import TIMESTEP_FREQUENCIES, DenoiserSpec
from mmtrain.models.attention import AttentionKernel
from mmtrain.models.dit import (
    PatchNetwork,
    modulate,
    sample_grid,
    timestep_features,
    unpatchify_image,
)
from mmtrain.models.layers import Mlp, merge_heads, split_heads
from mmtrain.models.sequence_split import SequenceSplit

QK_NORM_EPS = 1e-6  # SD3.5's RMSNorm of q and k
SD3_TIMESTEP_SHIFT = 0  # diffusers' downscale_freq_shift for SD3 (DiT's is 1)


def _qk_norm(spec: DenoiserSpec) -> nn.Module | None:
    if spec.qk_norm == "rms_norm":
        return nn.RMSNorm(spec.head_dim(), eps=QK_NORM_EPS)
    return None


class JointAttention(nn.Module):
    """One attention over the image's and the text's tokens together, each stream with its
    own q/k/v and output projections. `pre_only` (the last block): the text gives keys and
    values only; its queries are computed with its fused q/k/v (SD3's weights hold them) but
    do not attend, and it has no output projection."""

    def __init__(self, spec: DenoiserSpec, pre_only: bool):
        super().__init__()
        w = spec.width
        self.heads, self.pre_only = spec.heads, pre_only
        self.qkv = nn.Linear(w, 3 * w)
        self.out = nn.Linear(w, w)
        self.context_qkv = nn.Linear(w, 3 * w)
        self.context_out = None if pre_only else nn.Linear(w, w)
        self.q_norm, self.k_norm = _qk_norm(spec), _qk_norm(spec)
        self.context_q_norm, self.context_k_norm = _qk_norm(spec), _qk_norm(spec)
        if pre_only and self.context_q_norm is not None:
            # The text's queries do not attend here, so this norm never runs (SD3.5's weights
            # hold it): frozen, or DDP would wait for its gradient and AdamW carry it.
            self.context_q_norm.requires_grad_(False)

    def _split(self, qkv: Tensor, q_norm, k_norm) -> tuple[Tensor | None, Tensor, Tensor]:
        """Heads of q, k, v (q None without its norm: the last block's text queries)."""
        q, k, v = (split_heads(part, self.heads) for part in qkv.chunk(3, dim=-1))
        if k_norm is not None:
            q, k = (q_norm(q) if q_norm is not None else None), k_norm(k)
        return q, k, v

    def forward(
        self, x: Tensor, context: Tensor, kernel: AttentionKernel | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """`kernel`: x and context are this rank's slices (sequence parallelism); attention
        over both streams' whole tokens is unmasked, so the order the kernel sees them in
        (every rank's image slice, then its text slice) does not change any output."""
        q, k, v = self._split(self.qkv(x), self.q_norm, self.k_norm)
        text_q_norm = None if self.pre_only else self.context_q_norm
        cq, ck, cv = self._split(self.context_qkv(context), text_q_norm, self.context_k_norm)
        queries = q if self.pre_only else torch.cat([q, cq], dim=2)
        keys, values = torch.cat([k, ck], dim=2), torch.cat([v, cv], dim=2)
        attend = F.scaled_dot_product_attention if kernel is None else kernel
        y = merge_heads(attend(queries, keys, values))
        n = x.shape[1]
        if self.pre_only:
            return self.out(y), None
        return self.out(y[:, :n]), self.context_out(y[:, n:])


class MMDiTBlock(nn.Module):
    """Both streams through adaLN-Zero, the joint attention, then each stream's MLP; the last
    block (`pre_only`) modulates the text with a scale and shift and ends at the attention."""

    def __init__(self, spec: DenoiserSpec, index: int):
        super().__init__()
        w, hidden = spec.width, spec.mlp_hidden()
        self.pre_only = spec.is_context_pre_only(index)
        self.norm1 = nn.LayerNorm(w, elementwise_affine=False, eps=spec.norm_eps)
        self.norm2 = nn.LayerNorm(w, elementwise_affine=False, eps=spec.mlp_norm_eps)
        self.modulation = nn.Linear(w, 6 * w)
        self.attn = JointAttention(spec, self.pre_only)
        self.mlp = Mlp(w, hidden, "gelu_tanh")
        self.context_norm1 = nn.LayerNorm(w, elementwise_affine=False, eps=spec.norm_eps)
        self.context_modulation = nn.Linear(w, (2 if self.pre_only else 6) * w)
        if not self.pre_only:
            self.context_norm2 = nn.LayerNorm(w, elementwise_affine=False, eps=spec.mlp_norm_eps)
            self.context_mlp = Mlp(w, hidden, "gelu_tanh")

    def forward(
        self, x: Tensor, context: Tensor, c: Tensor, kernel: AttentionKernel | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(image tokens, text tokens) after the block; the last block's text is None."""
        silu_c = F.silu(c)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.modulation(silu_c).chunk(6, 1)
        text_mod = self.context_modulation(silu_c)
        if self.pre_only:
            scale_t, shift_t = text_mod.chunk(2, 1)  # continuous adaLN: scale first
        else:
            shift_t, scale_t, gate_t, shift_tm, scale_tm, gate_tm = text_mod.chunk(6, 1)
        image_out, text_out = self.attn(
            modulate(self.norm1(x), shift_a, scale_a),
            modulate(self.context_norm1(context), shift_t, scale_t),
            kernel,
        )
        x = x + gate_a[:, None, :] * image_out
        x = x + gate_m[:, None, :] * self.mlp(modulate(self.norm2(x), shift_m, scale_m))
        if self.pre_only:
            return x, None
        context = context + gate_t[:, None, :] * text_out
        text_mlp = self.context_mlp(modulate(self.context_norm2(context), shift_tm, scale_tm))
        return x, context + gate_tm[:, None, :] * text_mlp


class MMDiT(PatchNetwork):
    """Patches and text in, conditioning vector, joint blocks, patches out."""

    # What runs before the first block (train/optim.py: frozen with the first blocks, layer 0
    # of layer-wise LR decay).
    INPUT_MODULES = ("patch", "time_fc1", "time_fc2", "pooled_fc1", "pooled_fc2",
                     "context_embed")  # fmt: skip
    # Set by train/sequence_parallel.py: this rank then runs the blocks on its slices of the
    # image's and the text's tokens.
    sequence_split: SequenceSplit | None = None

    def __init__(self, spec: DenoiserSpec):
        super().__init__()
        self.spec = spec
        w, p = spec.width, spec.patch_size
        self.patch = nn.Conv2d(spec.channels, w, kernel_size=p, stride=p)
        self.time_fc1 = nn.Linear(TIMESTEP_FREQUENCIES, w)
        self.time_fc2 = nn.Linear(w, w)
        self.pooled_fc1 = nn.Linear(spec.pooled_width, w)
        self.pooled_fc2 = nn.Linear(w, w)
        self.context_embed = nn.Linear(spec.text_width, w)
        self.blocks = nn.ModuleList(MMDiTBlock(spec, i) for i in range(spec.layers))
        self.norm_out = nn.LayerNorm(w, elementwise_affine=False, eps=spec.norm_eps)
        self.modulation_out = nn.Linear(w, 2 * w)  # continuous adaLN: (scale, shift)
        self.out = nn.Linear(w, p * p * spec.out_channels())
        self.init_positions()

    def condition(self, t: Tensor, pooled: Tensor) -> Tensor:
        """c [B, W]: the timestep's MLP plus the pooled text's."""
        features = timestep_features(t, shift=SD3_TIMESTEP_SHIFT).to(self.time_fc1.weight.dtype)
        time = self.time_fc2(F.silu(self.time_fc1(features)))
        return time + self.pooled_fc2(F.silu(self.pooled_fc1(pooled)))

    def forward(self, x: Tensor, t: Tensor, text_hidden: Tensor, text_pooled: Tensor) -> Tensor:
        grid = self._check(x, text_hidden, text_pooled)
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = tokens + self.positions_for(grid).to(tokens.dtype)
        context = self.context_embed(text_hidden)
        c = self.condition(t, text_pooled)
        split, kernel = self.sequence_split, None
        if split is not None:
            tokens, context = split.split_tokens(tokens), split.split_tokens(context)
            kernel = split.full_attention()
        for block in self.blocks:
            tokens, context = block(tokens, context, c, kernel)
        scale, shift = self.modulation_out(F.silu(c)).chunk(2, dim=1)
        patches = self.out(modulate(self.norm_out(tokens), shift, scale))
        if split is not None:
            patches = split.gather_tokens(patches)
        s, (_, rows, cols) = self.spec, grid
        return unpatchify_image(patches, rows, cols, s.patch_size, s.out_channels())

    def _check(self, x: Tensor, text_hidden: Tensor, text_pooled: Tensor) -> tuple[int, int, int]:
        """The sample's patch grid, once the inputs' shapes fit the network."""
        s = self.spec
        grid = sample_grid(s, x)
        if s.pos_embed_max_size and max(grid[1:]) > s.pos_embed_max_size:
            raise ValueError(
                f"the MMDiT's positions cover {s.pos_embed_max_size} patches a side "
                f"(pos_embed_max_size), got a grid of {grid[1]} x {grid[2]}"
            )
        wanted = {
            "text_hidden's width": (text_hidden.shape[-1:], (s.text_width,)),
            "text_pooled": (tuple(text_pooled.shape[1:]), (s.pooled_width,)),
        }
        for what, (got, want) in wanted.items():
            if tuple(got) != tuple(want):
                raise ValueError(f"the MMDiT takes {what} of {list(want)}, got {list(got)}")
        if text_hidden.dim() != 3:
            raise ValueError(
                f"text_hidden is [B, L, {s.text_width}], got {list(text_hidden.shape)}"
            )
        return grid
