"""What a model asks of sequence parallelism: this rank's slice of each row's tokens, attention
over the whole rows, and the whole rows back where the output needs them.

The models call it at their sequence's two ends and nowhere else (`LanguageModel.nll_sum`
after the images are spliced in; `DiT` / `MMDiT` after the patches get their positions, and
before unpatchifying); every attention layer in between gets the kernel it hands out in place
of a mask. train/sequence_parallel.py implements it over a group of ranks; models import no
`torch.distributed` code.
"""

from __future__ import annotations

import abc

from torch import Tensor

from mmtrain.models.attention import AttentionKernel


class SequenceSplit(abc.ABC):
    """The split of every row's sequence over `size` ranks, from one rank's side."""

    size: int

    @abc.abstractmethod
    def split_rows(
        self, embeds: Tensor, inputs: dict[str, Tensor | bool], targets: Tensor
    ) -> tuple[Tensor, dict[str, Tensor | AttentionKernel], Tensor]:
        """A decoder's rows: embeddings [R, L, W], `Decoder.hidden`'s position and mask
        arguments and the next-token targets [R, L] (-100: none) of the whole rows -> this
        rank's positions of each, and the `hidden` arguments that attend causally over the
        whole rows (`position_ids` and `attention`)."""

    @abc.abstractmethod
    def split_tokens(self, tokens: Tensor) -> Tensor:
        """This rank's contiguous slice of tokens [B, T, W]."""

    @abc.abstractmethod
    def gather_tokens(self, local: Tensor) -> Tensor:
        """Every rank's slice [B, T / size, ...] -> the whole tokens [B, T, ...], gradients
        flowing back to each slice's rank."""

    @abc.abstractmethod
    def full_attention(self) -> AttentionKernel:
        """The kernel of non-causal attention over every rank's tokens, unmasked (a
        denoiser's)."""
