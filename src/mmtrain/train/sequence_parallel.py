"""Sequence (context) parallelism: `train.sequence_parallel: N` consecutive ranks split every
row's sequence, T / N positions each, and attend over the whole rows.

The mesh is data parallel x sequence parallel with the sequence innermost: ranks g N .. g N +
N - 1 form group g, read the same samples (data rank g of world / N) and each run the blocks on
its slice; DDP or FSDP still spans every rank (gradients are reduced over all of them). Where
the split happens is the models' business (models/sequence_split.py): a decoder's rows after
the images are spliced in (an image is never cut: its tokens are positions like any other),
a denoiser's patches after their positions are added.

Attention over the whole rows, two ways (`train.sequence_parallel_attention`):
- all_to_all (DeepSpeed-Ulysses): q, k and v trade the sequence split for a head split (each
  rank: H / N heads of the whole sequence), attend with the unsplit path's kernel and masks
  (models/attention.py), and trade back. Needs N to divide the heads; kv heads are repeated
  up to a multiple of N where it does not divide them. Rows are split contiguously.
- ring: keys and values travel round the group (train/ring_attention.py); any head count, and
  nothing whole-sequence is ever held. A decoder's causal rows are split zig-zag (rank r holds
  chunks r and 2N - 1 - r of 2N), so every rank has as much of the triangle to compute.
- auto: all_to_all where N divides the heads, else ring (the planner resolves it alike).

Rows are padded at their end to a multiple of N (2N for the zig-zag) with positions that
attend causally like padding does and have no target, so the NLL and its gradient are those
of the unsplit rows. Validation runs unsplit (`unsplit`): its evaluators shard their data by
rank and need no group to agree.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mmtrain.distributed import all_gather_with_grad
from mmtrain.models.attention import AttentionKernel, Mask, attend, attention_inputs, document_runs
from mmtrain.models.sequence_split import SequenceSplit
from mmtrain.models.splice import PAD_DOCUMENT
from mmtrain.models.token_loss import IGNORE_INDEX
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train.ring_attention import (
    CONTIGUOUS,
    ZIGZAG,
    local_chunks,
    local_indices,
    ring_attention,
)
from mmtrain.train.sequence_comm import SequenceGroup, heads_to_sequence, sequence_to_heads

ALL_TO_ALL, RING = "all_to_all", "ring"


def split_heads(spec: ModelSpec) -> tuple[int, int]:
    """(heads, kv heads) of the attention sequence parallelism splits: the decoder's or the
    denoiser's."""
    if spec.decoder is not None:
        return spec.decoder.heads, spec.decoder.kv_heads
    if spec.denoiser is not None:
        return spec.denoiser.heads, spec.denoiser.heads
    raise FieldError(
        "train.sequence_parallel",
        f"model {spec.name!r} has no decoder or denoiser, whose sequence it would split; use 1",
    )


def resolve_attention(choice: str, heads: int, size: int) -> str:
    """`train.sequence_parallel_attention` for `heads` heads over `size` ranks."""
    if choice == "auto":
        return ALL_TO_ALL if heads % size == 0 else RING
    if choice == ALL_TO_ALL and heads % size:
        raise FieldError(
            "train.sequence_parallel_attention",
            f"all_to_all splits the {heads} attention heads over the {size} ranks of "
            "train.sequence_parallel, which do not divide them; use ring (or auto)",
        )
    return choice


class UlyssesAttention(AttentionKernel):
    """All-to-all attention: heads of the whole sequence per rank, the unsplit path's kernel
    under `mask` (built for the whole rows)."""

    def __init__(self, group: SequenceGroup, mask: Mask, is_causal: bool):
        self.group, self.mask, self.is_causal = group, mask, is_causal

    @torch.compiler.disable  # collectives inside: a compiled block calls it as it is
    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = self.group.size
        kv_heads = k.shape[1]
        if kv_heads % n:  # the fewest copies of each kv head that N divides
            copies = math.lcm(kv_heads, n) // kv_heads
            k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        q, k, v = (sequence_to_heads(x, self.group) for x in (q, k, v))
        return heads_to_sequence(attend(q, k, v, self.mask, self.is_causal), self.group)


class RingAttention(AttentionKernel):
    """Ring attention over the group (train/ring_attention.py) with this forward's masks:
    `documents` (runs of packed rows) and `key_valid`, this rank's slices."""

    def __init__(
        self,
        group: SequenceGroup,
        causal: bool,
        layout: str,
        documents: Tensor | None = None,
        key_valid: Tensor | None = None,
    ):
        self.group, self.causal, self.layout = group, causal, layout
        self.documents, self.key_valid = documents, key_valid

    @torch.compiler.disable  # point-to-point traffic inside
    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return ring_attention(
            q, k, v, self.group, causal=self.causal, layout=self.layout,
            documents=self.documents, key_valid=self.key_valid,
        )  # fmt: skip


class SequenceShard(SequenceSplit):
    """This rank's side of a sequence-parallel group (models/sequence_split.py's contract)."""

    def __init__(self, group: SequenceGroup, attention: str):
        self.group, self.size, self.rank = group, group.size, group.rank
        self.attention = attention
        # a causal ring is balanced zig-zag; all_to_all gathers whole rows in rank order
        self.row_layout = ZIGZAG if attention == RING else CONTIGUOUS

    def local(self, x: Tensor, dim: int, layout: str = CONTIGUOUS) -> Tensor:
        """This rank's positions of `x` along `dim`, in local order (`ring_attention.
        local_indices`: the one definition of the layouts)."""
        index = local_indices(layout, self.rank, self.size, x.shape[dim])
        return x.index_select(dim, index.to(x.device))

    # ------------------------------------------------------------------------- a decoder
    def split_rows(
        self, embeds: Tensor, inputs: dict[str, Tensor | bool], targets: Tensor
    ) -> tuple[Tensor, dict[str, Tensor | AttentionKernel], Tensor]:
        rows, length = targets.shape
        multiple = self.size * len(local_chunks(self.row_layout, 0, self.size))
        pad = (length + multiple - 1) // multiple * multiple - length
        positions = inputs.get("position_ids")
        if positions is None:  # the decoder's default without documents
            positions = torch.arange(length, device=embeds.device).expand(rows, length)
        documents = inputs.get("document_ids")
        key_mask = inputs.get("attention_mask")
        if key_mask is not None and inputs.get("right_padded", False):
            key_mask = None  # causal alone is exact for every real token (models/attention.py)
        if key_mask is not None and key_mask.dim() != 2:
            raise ValueError("sequence parallelism takes a key mask [R, L], not one per query")
        if pad:  # appended padding: no target, sees causally, as right padding does
            embeds = F.pad(embeds, (0, 0, 0, pad))
            targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
            positions = F.pad(positions, (0, pad))
            documents = (
                None if documents is None else F.pad(documents, (0, pad), value=PAD_DOCUMENT)
            )
            key_mask = None if key_mask is None else F.pad(key_mask, (0, pad), value=False)
        kernel = self._causal_kernel(length + pad, embeds, documents, key_mask)
        layout = self.row_layout
        local_inputs = {"position_ids": self.local(positions, -1, layout), "attention": kernel}
        return self.local(embeds, 1, layout), local_inputs, self.local(targets, 1, layout)

    def _causal_kernel(
        self, length: int, embeds: Tensor, documents: Tensor | None, key_mask: Tensor | None
    ) -> AttentionKernel:
        if self.attention == ALL_TO_ALL:
            mask, is_causal = attention_inputs(
                length, 0, embeds.device, embeds.dtype, key_mask, documents
            )
            return UlyssesAttention(self.group, mask, is_causal)
        runs = None if documents is None else self.local(document_runs(documents), 1, ZIGZAG)
        valid = None if key_mask is None else self.local(key_mask, 1, ZIGZAG)
        return RingAttention(
            self.group, causal=True, layout=ZIGZAG, documents=runs, key_valid=valid
        )

    # ------------------------------------------------------------------------- a denoiser
    def split_tokens(self, tokens: Tensor) -> Tensor:
        count = tokens.shape[1]
        if count % self.size:
            raise ValueError(
                f"train.sequence_parallel {self.size} does not divide the {count} tokens of "
                "each sample; pick a divisor (or a sample size whose patches it divides)"
            )
        return self.local(tokens, 1)

    def gather_tokens(self, local: Tensor) -> Tensor:
        whole = all_gather_with_grad(local.transpose(0, 1).contiguous(), self.group.group)
        return whole.transpose(0, 1)

    def full_attention(self) -> AttentionKernel:
        if self.attention == ALL_TO_ALL:
            return UlyssesAttention(self.group, None, False)
        return RingAttention(self.group, causal=False, layout=CONTIGUOUS)


# ----------------------------------------------------------------------------- set-up
def sequence_group(size: int) -> SequenceGroup:
    """This rank's group of `size` consecutive ranks. Every rank creates every group (as
    `dist.new_group` requires), in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = SequenceGroup.from_process_group(group)
    return mine


def splitting_module(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """The module whose forward splits the sequence: the language model, or the denoiser
    network (a DiT or an MMDiT)."""
    return model.denoiser if spec.denoiser is not None else model


def check_splittable(spec: ModelSpec) -> None:
    """FieldError for the models sequence parallelism does not split (yet)."""
    d = spec.denoiser
    if d is not None and any(d.attention_group(i) == "place" for i in range(d.layers)):
        raise FieldError(
            "train.sequence_parallel",
            "a factorised video DiT's blocks across frames (attention at each place) are not "
            "split over ranks (the frames would need an all-to-all of their own); use full "
            "attention (denoiser.attention: full) or 1",
        )


def apply_sequence_parallel(model: nn.Module, spec: ModelSpec, size: int, choice: str) -> str:
    """Split `model`'s sequence over groups of `size` ranks; returns the attention resolved
    from `choice` (`train.sequence_parallel_attention`). Every rank calls it."""
    heads, _ = split_heads(spec)
    check_splittable(spec)
    attention = resolve_attention(choice, heads, size)
    splitting_module(model, spec).sequence_split = SequenceShard(sequence_group(size), attention)
    return attention


@contextlib.contextmanager
def unsplit(model: nn.Module, spec: ModelSpec) -> Iterator[None]:
    """The model runs whole on every rank inside (validation: its evaluators shard the data by
    rank)."""
    module = splitting_module(model, spec)
    split = getattr(module, "sequence_split", None)
    module.sequence_split = None
    try:
        yield
    finally:
        module.sequence_split = split
