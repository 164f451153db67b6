"""Direct preference optimisation (`train.objective: dpo`): a language model learns from pairs
of answers to one prompt, the chosen one over the rejected one (Rafailov et al. 2023).

Each micro-batch holds its pairs' sides as samples, the chosen answers first and the rejected
ones after them in the same order (data/stream/preference_batches.py), labels on each side's
final answer only: one sample a row, or packed several to a row (`document_ids`: each
position's sample), with `pairs` their count. A side's log-probability is the sum over its
answer tokens of log p(token | everything before it), in float32 at least. Against a reference model the pair's margin is

    m = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))

and its loss -log sigmoid(beta m) (sigmoid; with label smoothing eps, (1 - eps) of it plus eps
of -log sigmoid(-beta m): cDPO) or (m' - 1 / (2 beta))^2 (ipo, m' the margin of the log-ratios
averaged over each side's answer tokens, as TRL's DPOTrainer computes it, which its authors
confirmed is the paper's); train.dpo (config.DpoConfig). With `sft_weight` w, w times the
chosen answers' next-token loss is added (RPO): their summed negative log-probs over the
step's chosen answer tokens (all micro-batches and ranks), TRL's "sft" term.

The loss of the step is the mean over the step's pairs: every micro-batch on every rank adds
its pairs' losses divided by the pairs of the whole step (counted in `prepare`, one all-reduce),
as the next-token loss divides by the step's tokens.

The reference (train.dpo.reference) is the model without its LoRA adapters (a LoRA run: no
second copy), or a frozen copy of the model the run started from (`init`, rebuilt the same on a
resume; a full fine-tune), its log-probs computed in `prepare`, under no_grad, for every
micro-batch of the step. Reference log-probs cached once before training are not there yet.

Metrics under TRL's names, each the step's mean over its pairs: rewards/chosen and
rewards/rejected (beta times each side's log-ratio), rewards/margins (their difference),
rewards/accuracies (the share of pairs whose chosen reward is the higher), logps/chosen and
logps/rejected (the policy's summed log-probs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.config import DpoConfig
from mmtrain.data.stream.chat_templates import IGNORE_INDEX
from mmtrain.distributed import sum_tensor_over_ranks
from mmtrain.losses import at_least_fp32
from mmtrain.structured import FieldError
from mmtrain.train.lora import adapters_disabled, lora_modules

LABELS_KEY = "labels"
PAIRS_KEY = "pairs"  # the micro-batch's pairs (a packed batch's rows do not say)
DOCUMENTS_KEY = "document_ids"  # a native packed batch's positions' samples
SAMPLES_KEY = "sample_ids"  # a hub model's (its document_ids number a row's samples)
NOT_MODEL_INPUTS = (LABELS_KEY, PAIRS_KEY, SAMPLES_KEY)
Batch = Mapping[str, torch.Tensor]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")  # fmt: skip


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None = None,
    samples: int | None = None,
) -> torch.Tensor:
    """Per sample, the sum of log p(labels[t + 1] | logits[t]) over its targets (labels aligned
    with the ids, -100 where nothing is scored), the log-softmax in float32 at least: [R], a
    sample a row, or [`samples`] of packed rows (`documents`: each position's sample)."""
    targets = labels[:, 1:]
    scores = at_least_fp32(logits[:, :-1]).log_softmax(dim=-1)
    scored = targets != IGNORE_INDEX
    picked = scores.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return per_sample(picked * scored, documents, samples)


def per_sample(
    values: torch.Tensor, documents: torch.Tensor | None, samples: int | None
) -> torch.Tensor:
    """`values` [R, T - 1] (one per target position) summed per sample: per row, or by the
    sample of each target (`documents[:, 1:]`) into [samples]."""
    if documents is None:
        return values.sum(dim=1)
    owner = documents[:, 1:].clamp(min=0).reshape(-1)  # padding scores nothing: any owner
    out = torch.zeros(samples, dtype=values.dtype, device=values.device)
    return out.index_add(0, owner, values.reshape(-1))


def answer_tokens(
    labels: torch.Tensor, documents: torch.Tensor | None = None, samples: int | None = None
) -> torch.Tensor:
    """The tokens each sample's log-prob sums over (per row, or per sample of packed rows)."""
    return per_sample((labels[:, 1:] != IGNORE_INDEX).long(), documents, samples)


def _owners(batch: Batch) -> torch.Tensor | None:
    """Each position's sample in a packed micro-batch; None when a row is one sample."""
    if PAIRS_KEY not in batch:
        return None
    return batch.get(SAMPLES_KEY, batch.get(DOCUMENTS_KEY))


def batch_pairs(batch: Batch) -> int:
    """The pairs of a micro-batch: its `pairs` (a host int), or half its rows."""
    return int(batch[PAIRS_KEY]) if PAIRS_KEY in batch else batch[LABELS_KEY].shape[0] // 2


def pair_losses(
    policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, config: DpoConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses [n], chosen rewards [n], rejected rewards [n]) of n pairs from the rows'
    log-probs [2n] (chosen rows first) of the policy and the reference; `tokens` [2n] each
    row's answer tokens (ipo averages over them)."""
    n = policy.shape[0] // 2
    ratios = policy - reference
    chosen, rejected = ratios[:n], ratios[n:]
    margin = chosen - rejected
    if config.loss == "ipo":
        per_token = ratios / tokens.clamp(min=1).to(ratios.dtype)
        losses = (per_token[:n] - per_token[n:] - 1 / (2 * config.beta)).square()
    else:
        eps = config.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(config.beta * margin)
        if eps:
            losses = losses - eps * F.logsigmoid(-config.beta * margin)
    return losses, config.beta * chosen.detach(), config.beta * rejected.detach()


def uses_adapters(model: nn.Module, config: DpoConfig) -> bool:
    """Whether the reference is the model without its adapters (else a frozen copy); a
    FieldError for adapters asked of a model without LoRA."""
    has = bool(lora_modules(model))
    if config.reference == "adapters" and not has:
        raise FieldError("train.dpo.reference", "adapters: the model has no LoRA adapters to "
                         "disable; use copy (or auto)")  # fmt: skip
    return config.reference == "adapters" or (config.reference == "auto" and has)


class DpoObjective:
    """DPO over the pairs of each micro-batch (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        config: DpoConfig,
        world_size: int = 1,
        reference: nn.Module | None = None,
    ):
        """`reference`: the frozen copy, where the reference is not the model's base."""
        if not uses_adapters(model, config) and reference is None:
            raise FieldError("train.dpo.reference", "copy: no reference model was built")
        self.config, self.world, self.frozen = config, world_size, reference

    def prepare(
        self, trained: nn.Module, micro_batches: Sequence[Batch], precision: Any, step: int = 0
    ) -> None:
        local = sum(batch_pairs(b) for b in micro_batches)
        device = micro_batches[0][LABELS_KEY].device
        self.pairs = sum_tensor_over_ranks(torch.tensor(local, device=device))
        chosen = sum(self._tokens(b)[: batch_pairs(b)].sum() for b in micro_batches)
        self.chosen_tokens = sum_tensor_over_ranks(torch.as_tensor(chosen, device=device))
        self.reference = [self._reference(trained, b, precision) for b in micro_batches]
        self.total: torch.Tensor | None = None
        self.sums: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def _reference(self, trained: nn.Module, batch: Batch, precision: Any) -> torch.Tensor:
        autocast = contextlib.nullcontext() if precision is None else precision.autocast()
        if self.frozen is not None:
            with autocast:
                logits = self.frozen(self.inputs(batch, 0))["logits"]
        else:
            with adapters_disabled(trained), autocast:
                logits = trained(self.inputs(batch, 0))["logits"]
        return self._logps(logits, batch).float()

    def _logps(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return sequence_logps(logits, batch[LABELS_KEY], _owners(batch), 2 * batch_pairs(batch))

    def _tokens(self, batch: Batch) -> torch.Tensor:
        return answer_tokens(batch[LABELS_KEY], _owners(batch), 2 * batch_pairs(batch))

    def inputs(self, batch: Batch, j: int) -> Batch:
        """The model's input without the labels (it returns the logits the log-probs need)
        and the pair count."""
        return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}

    def reads(self, batch: Batch) -> set[str]:
        return {"logits"}

    def loss(self, out: Mapping[str, torch.Tensor], batch: Batch, j: int) -> torch.Tensor:
        policy = self._logps(out["logits"], batch)
        losses, chosen, rejected = pair_losses(
            policy, self.reference[j], self._tokens(batch), self.config
        )
        n = losses.shape[0]
        share = losses.sum() / self.pairs.clamp(min=1)
        if self.config.sft_weight:
            nll = -policy[:n].sum() / self.chosen_tokens.clamp(min=1)
            self._add("nll/chosen", nll.detach().double())  # the chosen answers' next-token loss
            share = share + self.config.sft_weight * nll
        self._add("", share.detach().double())
        parts = {"rewards/chosen": chosen, "rewards/rejected": rejected,
                 "rewards/margins": chosen - rejected,
                 "rewards/accuracies": (chosen > rejected).to(chosen.dtype),
                 "logps/chosen": policy[:n].detach(), "logps/rejected": policy[n:].detach()}  # fmt: skip
        for name, values in parts.items():
            self._add(name, values.double().sum() / self.pairs.clamp(min=1))
        return share * self.world  # the wrapper's average over ranks divides by world again

    def _add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = value if name not in self.sums else self.sums[name] + value

    def report(self) -> dict[str, torch.Tensor]:
        # As the next-token loss: the loop averages the reports over ranks, so each rank
        # reports world x its share of the step's mean.
        return {name: value * self.world for name, value in self.sums.items()}
