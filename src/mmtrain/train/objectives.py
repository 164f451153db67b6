"""Training objectives: each turns the model's output and the batch into a loss.

The loop does not know what it trains. It runs K micro-batches per optimizer step and, for
every micro-batch, asks each of the run's objectives for its share of the step's loss; the
shares are summed, backpropagated, and their gradients accumulate into the gradient of ONE
batch of all K micro-batches on all ranks. How a share is normalised is each objective's
business, because it differs:

- `ContrastiveObjective` (CLIP / SigLIP / triplet over tower pairs) couples samples: every
  sample is a negative for every other, so the share of micro-batch j is the loss of its rows
  against the whole accumulated batch (the other micro-batches' embeddings, computed once
  without gradient in `prepare`, join as extra negatives; OpenCLIP's accum-freq). Summed over
  j, no division by K.
- `FusionObjective` (the fusion head's classification / regression) is a per-sample mean:
  each micro-batch adds its mean / K.
- `DiffusionObjective` (a denoiser, train/diffusion.py) is a per-sample mean too; it also
  makes the model's input (`inputs`: the noisy sample) from the clean batch.
- `NextTokenObjective` (a decoder LM) is a sum over target tokens divided by the number of
  target tokens in the whole step, over every micro-batch and every rank (counted in
  `prepare`, one all-reduce). Micro-batches and ranks hold different numbers of targets, so
  a mean of per-micro-batch means would weigh a token of a short micro-batch more than one
  of a long micro-batch; this is the gradient of one big batch exactly.

Every objective states which outputs it reads (`reads`): under DDP the loop adds a zero term
for the outputs no objective reads, so their parameters still get a (zero) gradient.

Data-parallel wrappers average gradients over ranks. A share that is already normalised by a
global count (next-token) is multiplied by the number of ranks to undo that average; the
contrastive loss's gathered-rows formulation and the per-sample means are rank means already.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.config import DiffusionConfig, DpoConfig
from mmtrain.data.stream.chat_templates import IGNORE_INDEX
from mmtrain.distributed import sum_tensor_over_ranks
from mmtrain.losses import ContrastiveLoss, at_least_fp32
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train.data import LABEL_KEY  # the fusion head's targets
from mmtrain.train.diffusion import DiffusionObjective
from mmtrain.train.dpo import DpoObjective
from mmtrain.train.reference_cache import ReferenceLogps

LABELS_KEY = "labels"  # batch key of a decoder's next-token targets (aligned with "text")

Batch = Mapping[str, torch.Tensor]


class Objective(Protocol):
    """One term of the training loss."""

    def prepare(
        self, trained: nn.Module, micro_batches: Sequence[Batch], precision: Any, step: int = 0
    ) -> None:
        """Look at the whole step before its first backward (caches, global counts); `step`
        numbers the step (what per-step random draws are seeded by)."""

    def inputs(self, batch: Batch, j: int) -> Batch:
        """Micro-batch j as the model takes it (a denoiser's noisy sample; others: as it is)."""

    def reads(self, batch: Batch) -> set[str]:
        """The model outputs this objective reads for `batch`."""

    def loss(self, out: Mapping[str, torch.Tensor], batch: Batch, j: int) -> torch.Tensor:
        """Micro-batch j's share of the step's loss (what its backward differentiates)."""

    def report(self) -> dict[str, torch.Tensor]:
        """The step's loss of this objective under "" and its named parts, detached, for the
        metrics row."""


# ----------------------------------------------------------------------------- contrastive
class ContrastiveObjective:
    """CLIP / SigLIP / triplet over the spec's tower pairs that the step's batches hold."""

    def __init__(self, model: nn.Module, loss_fn: ContrastiveLoss):
        self.pairs_of_model = list(model.spec.pairs)
        self.loss_fn = loss_fn
        self.scale = getattr(model, "logit_scale", None)
        self.bias = getattr(model, "logit_bias", None)

    def prepare(
        self, trained: nn.Module, micro_batches: Sequence[Batch], precision: Any, step: int = 0
    ) -> None:
        # Sources of different modalities are mixed by step (train/data.py): every micro-batch
        # of a step holds the same towers, and the step aligns the pairs it holds both of.
        present = micro_batches[0].keys()
        self.pairs = [p for p in self.pairs_of_model if p[0] in present and p[1] in present]
        self.names = sorted({name for pair in self.pairs for name in pair})
        self.k = len(micro_batches)
        self.cached: list[dict[str, torch.Tensor]] = []
        self.last: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
        if self.pairs and self.k > 1:
            with torch.no_grad(), precision.autocast():
                self.cached = [
                    _features(trained({n: b[n] for n in self.names}), self.names)
                    for b in micro_batches
                ]

    def inputs(self, batch: Batch, j: int) -> Batch:
        return batch

    def reads(self, batch: Batch) -> set[str]:
        return set(self.names)

    def loss(self, out: Mapping[str, torch.Tensor], batch: Batch, j: int) -> torch.Tensor:
        if not self.pairs:
            return _zero(out)
        extra = None
        if self.k > 1:
            extra = {
                n: torch.cat([self.cached[i][n] for i in range(self.k) if i != j])
                for n in self.names
            }
        total, parts = self.loss_fn(
            _features(out, self.names), self.pairs, self.scale, self.bias, extra_negatives=extra
        )
        self.last = (total.detach(), {name: v.detach() for name, v in parts.items()})
        return total

    def report(self) -> dict[str, torch.Tensor]:
        # Every micro-batch's share is the loss of its rows against the whole step's batch;
        # the last one stands for the step (as before the objectives were split out).
        if self.last is None:
            return {}
        total, parts = self.last
        return {"": total, **parts}


def _features(out: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    # The loss runs in fp32 whatever the autocast dtype: logits of a large batch need the range.
    return {name: at_least_fp32(out[name]) for name in names}


# ----------------------------------------------------------------------------- fusion head
class FusionObjective:
    """Cross-entropy (`classify`) or mean squared error (`regress`) of the fusion head's output
    against `batch["label"]`, weighted by `weight` beside the other objectives."""

    def __init__(self, task: str, weight: float = 1.0):
        self.task, self.weight = task, weight

    def prepare(
        self, trained: nn.Module, micro_batches: Sequence[Batch], precision: Any, step: int = 0
    ) -> None:
        self.k = len(micro_batches)
        self.total: torch.Tensor | None = None  # on the device: read by the metrics recorder

    def inputs(self, batch: Batch, j: int) -> Batch:
        return batch

    def reads(self, batch: Batch) -> set[str]:
        return {"fusion"}

    def loss(self, out: Mapping[str, torch.Tensor], batch: Batch, j: int) -> torch.Tensor:
        head = fusion_loss(at_least_fp32(out["fusion"]), batch[LABEL_KEY], self.task)
        share = head.detach() / self.k
        self.total = share if self.total is None else self.total + share
        return self.weight * head / self.k

    def report(self) -> dict[str, torch.Tensor]:
        return {"fusion": self.total, "": self.weight * self.total}


def fusion_loss(output: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Cross-entropy of class logits [B, C] against int64 labels [B] (`classify`), or the mean
    squared error of values [B, C] against float targets [B, C] (`regress`)."""
    if task == "classify":
        return F.cross_entropy(output, labels)
    return F.mse_loss(output, labels.to(output.dtype).reshape(output.shape))


# ----------------------------------------------------------------------------- next token
class NextTokenObjective:
    """Cross-entropy of a decoder's logits at position t against `labels[t + 1]` (labels are
    aligned with the ids, -100 where nothing is predicted), summed over target tokens and
    divided by the step's target tokens on all ranks: the mean over the step's tokens.

    Under sequence parallelism (`sequence_parallel` ranks share each row, each scoring the
    targets at its positions) every rank of a group holds the same labels: the targets summed
    over ranks count each one `sequence_parallel` times."""

    def __init__(self, world_size: int = 1, sequence_parallel: int = 1):
        self.world, self.sequence_parallel = world_size, sequence_parallel

    def prepare(
        self, trained: nn.Module, micro_batches: Sequence[Batch], precision: Any, step: int = 0
    ) -> None:
        # Counted and summed over ranks on the device (one all-reduce, no host read): the
        # step's target tokens, int64 [].
        local = sum(count_targets(b[LABELS_KEY]) for b in micro_batches)
        self.targets = sum_tensor_over_ranks(local) // self.sequence_parallel
        self.total: torch.Tensor | None = None

    def inputs(self, batch: Batch, j: int) -> Batch:
        return batch

    def reads(self, batch: Batch) -> set[str]:
        return {"nll_sum", "logits"}  # a LanguageModel given labels returns the sum alone

    def loss(self, out: Mapping[str, torch.Tensor], batch: Batch, j: int) -> torch.Tensor:
        # A LanguageModel given "labels" sums the NLL itself, chunk by chunk, without the
        # batch's logits (models/token_loss.py); other decoders return logits.
        if "nll_sum" in out:
            nll = out["nll_sum"]
        else:
            nll = token_nll_sum(out["logits"], batch[LABELS_KEY])
        # No target anywhere in the step: the sum is 0 and so is its gradient (no 0 / 0).
        share = nll / self.targets.clamp(min=1)
        detached = share.detach().double()
        self.total = detached if self.total is None else self.total + detached
        return share * self.world  # the wrapper's average over ranks divides by world again

    def report(self) -> dict[str, torch.Tensor]:
        # Each rank holds its tokens' share of the step mean; the loop averages the reports
        # over ranks, so report world x share: the mean over ranks is then the step's mean.
        return {"": self.total * self.world}


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Target tokens of a batch: labels after the one-step shift that are not -100."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def token_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(labels[t + 1] | logits[t]) over the target positions, in fp32 at least."""
    shifted = labels[:, 1:].reshape(-1)
    scores = at_least_fp32(logits[:, :-1]).reshape(shifted.numel(), -1)
    return F.cross_entropy(scores, shifted, ignore_index=IGNORE_INDEX, reduction="sum")


def _zero(out: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.zeros((), device=next(iter(out.values())).device)


# ----------------------------------------------------------------------------- per model
def objectives_for(
    model: nn.Module,
    spec: ModelSpec,
    *,
    fusion_weight: float = 1.0,
    world_size: int = 1,
    diffusion: DiffusionConfig | None = None,
    seed: int = 0,
    rank: int = 0,
    sequence_parallel: int = 1,
    objective: str | None = None,
    dpo: DpoConfig | None = None,
    reference: nn.Module | None = None,
    cached: ReferenceLogps | None = None,
) -> list[Objective]:
    """The objectives a spec trains with: next-token for a decoder; flow matching or DDPM for
    a denoiser (`diffusion`: its settings; `seed`, `rank`: what its draws are seeded by, the
    data rank: a sequence-parallel group draws alike); `sequence_parallel`: ranks per row;
    otherwise contrastive over its pairs and/or the fusion head's loss."""
    if spec.is_language_model():  # a native decoder LM or a hub model
        if objective == "dpo":
            if sequence_parallel > 1:
                raise FieldError("train.sequence_parallel", "is not there yet for dpo")
            return [DpoObjective(model, dpo or DpoConfig(), world_size, reference, cached)]
        return [NextTokenObjective(world_size, sequence_parallel)]
    if objective is not None:
        raise FieldError("train.objective", f"{objective} trains a language model; "
                         f"{spec.name} is none")  # fmt: skip
    if spec.denoiser is not None:
        return [DiffusionObjective(spec, diffusion or DiffusionConfig(), seed=seed, rank=rank)]
    found: list[Objective] = []
    if spec.pairs:
        found.append(ContrastiveObjective(model, ContrastiveLoss.from_spec(spec)))
    if spec.fusion is not None:
        found.append(FusionObjective(spec.fusion.task, fusion_weight))
    return found


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """What the model's forward takes: the batch without the fusion head's targets. A language
    model's "labels" stay: its forward computes the next-token NLL sum from them."""
    return {name: value for name, value in batch.items() if name != LABEL_KEY}
