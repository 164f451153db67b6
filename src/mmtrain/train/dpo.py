"""Direct preference optimisation (`train.objective: dpo`): a language model learns from pairs
of answers to one prompt, the chosen one over the rejected one (Rafailov et al. 2023).

Each micro-batch holds its pairs' sides as samples, the chosen answers first and the rejected
ones after them in the same order (data/stream/preference_batches.py), labels on each side's
final answer only: one sample a row, or packed several to a row (`document_ids`: each
position's sample), with `pairs` their count. A side's log-probability is the sum over its
answer tokens of log p(token | everything before it), in float32 at least: the model gives
each target's NLL, its head run a chunk of positions at a time (models/token_loss.py: the
batch's logits never exist whole; a hub class that transforms its logits beyond the head gives
them whole). Against a
reference model the pair's margin is

    m = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))

and its loss -log sigmoid(beta m) (sigmoid; with label smoothing eps, (1 - eps) of it plus eps
of -log sigmoid(-beta m): cDPO) or (m' - 1 / (2 beta))^2 (ipo, m' the margin of the log-ratios
averaged over each side's answer tokens, as TRL's DPOTrainer computes it, which its authors
confirmed is the paper's); train.dpo (config.DpoConfig). With `sft_weight` w, w times the
chosen answers' next-token loss is added (RPO): their summed negative log-probs over the
step's chosen answer tokens (all micro-batches and ranks), TRL's "sft" term.

The loss of the step is the mean over the step's pairs: every micro-batch on every rank adds
its pairs' losses divided by the pairs of the whole step (counted in `prepare`: host ints, one
all-reduce on the host), as the next-token loss divides by the step's tokens.

The reference (train.dpo.reference, `reference_mode`) is the model without its LoRA adapters
(a LoRA run: no second copy), the log-probs of every training pair scored once before the first
step by the model the run starts from (a full fine-tune: train/reference_cache.py, read by each
pair's `pair_index`), or a frozen copy of that model (`init`, rebuilt the same on a resume).
The adapters' and the copy's log-probs are computed in `prepare`, under no_grad, for every
micro-batch of the step.

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
from mmtrain.data.stream.preference_batches import PAIR_INDEX
from mmtrain.distributed import sum_over_ranks, sum_tensor_over_ranks
from mmtrain.losses import at_least_fp32
from mmtrain.models.hub.model import HubModel
from mmtrain.models.token_loss import TOKEN_NLL
from mmtrain.models.vlm import LanguageModel
from mmtrain.structured import FieldError
from mmtrain.train.lora import adapters_disabled, is_adapter, lora_modules
from mmtrain.train.reference_cache import ReferenceLogps

LABELS_KEY = "labels"
PAIRS_KEY = "pairs"  # the micro-batch's pairs (a packed batch's rows do not say)
DOCUMENTS_KEY = "document_ids"  # a native packed batch's positions' samples
SAMPLES_KEY = "sample_ids"  # a hub model's (its document_ids number a row's samples)
BOOKKEEPING = (PAIRS_KEY, SAMPLES_KEY, PAIR_INDEX)  # what the loss reads, not the model
NOT_MODEL_INPUTS = (LABELS_KEY, *BOOKKEEPING)
Batch = Mapping[str, torch.Tensor]


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


def reference_mode(model: nn.Module, config: DpoConfig, inputs_vary: bool = False) -> str:
    """What train.dpo.reference resolves to: adapters, cache or copy (config.DpoConfig; auto
    takes adapters only where nothing else trains); `inputs_vary`: a pair's inputs are drawn
    anew at each read (random crops), which one stored score cannot follow. A FieldError for
    a choice the run cannot take."""
    has = bool(lora_modules(model))
    if config.reference == "adapters" and not has:
        raise FieldError("train.dpo.reference", "adapters: the model has no LoRA adapters to "
                         "disable; use cache or copy (or auto)")  # fmt: skip
    beside = trained_beside_adapters(model) if has else []
    if config.reference == "adapters" and beside:
        raise FieldError("train.dpo.reference", f"adapters: {len(beside)} parameter(s) train "
                         f"besides the LoRA adapters ({beside[0]}, ...), so the model without "
                         "its adapters is not the model the run started from; freeze them, or "
                         "use cache or copy (or auto)")  # fmt: skip
    if config.reference == "cache" and inputs_vary:
        raise FieldError("train.dpo.reference", "cache scores each pair once, but this run's "
                         "images are cropped and flipped at random at each read; use copy "
                         "(or auto)")  # fmt: skip
    if config.reference == "auto":
        return "adapters" if has and not beside else "copy" if inputs_vary else "cache"
    return config.reference


def trained_beside_adapters(model: nn.Module) -> list[str]:
    """The trained parameters that are no LoRA adapter (a tower trained whole beside another's
    adapters, a projector): disabling the adapters leaves their updates in."""
    return [n for n, p in model.named_parameters() if p.requires_grad and not is_adapter(n)]


def scores_by_token(model: nn.Module) -> bool:
    """Whether the model gives each target's NLL without the batch's logits, its head a chunk
    of positions at a time (models/token_loss.py): mmtrain's own language models, and hub
    models but those whose class transforms its logits beyond the head (a soft cap), whose
    whole logits the log-probs then read."""
    if isinstance(model, HubModel):
        return not model.own_logits
    return isinstance(model, LanguageModel)


def model_inputs(batch: Batch, by_token: bool = False) -> Batch:
    """The model's input without the pair count and the pairs' names: with the labels and
    TOKEN_NLL (`by_token`: the model returns each target's NLL), else without the labels (it
    returns the logits)."""
    dropped = BOOKKEEPING if by_token else NOT_MODEL_INPUTS
    inputs = {k: v for k, v in batch.items() if k not in dropped}
    return {**inputs, TOKEN_NLL: True} if by_token else inputs


def batch_logps(out: Mapping[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """The summed answer log-probs of every side of the micro-batch [2n], chosen first, from
    the model's output: its targets' NLL, or its logits."""
    owners, samples = _owners(batch), 2 * batch_pairs(batch)
    if TOKEN_NLL in out:
        return -per_sample(out[TOKEN_NLL], owners, samples)
    return sequence_logps(out["logits"], batch[LABELS_KEY], owners, samples)


@torch.no_grad()
def reference_logps(
    model: nn.Module,
    batch: Batch,
    precision: Any,
    without_adapters: bool = False,
    by_token: bool = False,
) -> torch.Tensor:
    """`batch_logps` of `model` (with its LoRA adapters disabled when asked) under the run's
    autocast, without gradients, in float32 at least."""
    autocast = contextlib.nullcontext() if precision is None else precision.autocast()
    adapters = adapters_disabled(model) if without_adapters else contextlib.nullcontext()
    with adapters, autocast:
        out = model(model_inputs(batch, by_token))
    return at_least_fp32(batch_logps(out, batch))


class DpoObjective:
    """DPO over the pairs of each micro-batch (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        config: DpoConfig,
        world_size: int = 1,
        reference: nn.Module | None = None,
        cached: ReferenceLogps | None = None,
    ):
        """The reference: `cached` log-probs, else the frozen copy `reference`, else the model
        without its LoRA adapters."""
        if cached is None and reference is None and not lora_modules(model):
            raise FieldError("train.dpo.reference", "adapters: the model has no LoRA adapters "
                             "to disable, and no copy or cached log-probs were made")  # fmt: skip
        self.config, self.world = config, world_size
        self.frozen, self.cached = reference, cached
        self.by_token = scores_by_token(model)  # the frozen copy is the same class

    def prepare(
        self, trained: nn.Module, micro_batches: Sequence[Batch], precision: Any, step: int = 0
    ) -> None:
        local = sum(batch_pairs(b) for b in micro_batches)
        device = micro_batches[0][LABELS_KEY].device
        # Host ints summed over the ranks on the host: making a device tensor of a host value
        # would be a blocking copy a step.
        self.pairs = max(1, round(sum_over_ranks([local])[0]))
        chosen = sum(self._tokens(b)[: batch_pairs(b)].sum() for b in micro_batches)
        self.chosen_tokens = sum_tensor_over_ranks(torch.as_tensor(chosen, device=device))
        self.reference = [self._reference(trained, b, precision, device) for b in micro_batches]
        self.total: torch.Tensor | None = None
        self.sums: dict[str, torch.Tensor] = {}

    def _reference(
        self, trained: nn.Module, batch: Batch, precision: Any, device: torch.device
    ) -> torch.Tensor:
        if self.cached is not None:
            return self.cached.lookup(batch[PAIR_INDEX], device)
        if self.frozen is not None:
            return reference_logps(self.frozen, batch, precision, by_token=self.by_token)
        return reference_logps(trained, batch, precision, True, self.by_token)

    def _tokens(self, batch: Batch) -> torch.Tensor:
        return answer_tokens(batch[LABELS_KEY], _owners(batch), 2 * batch_pairs(batch))

    def inputs(self, batch: Batch, j: int) -> Batch:
        return model_inputs(batch, self.by_token)

    def reads(self, batch: Batch) -> set[str]:
        return {TOKEN_NLL if self.by_token else "logits"}

    def loss(self, out: Mapping[str, torch.Tensor], batch: Batch, j: int) -> torch.Tensor:
        policy = batch_logps(out, batch)
        losses, chosen, rejected = pair_losses(
            policy, self.reference[j], self._tokens(batch), self.config
        )
        n = losses.shape[0]
        share = losses.sum() / self.pairs
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
            self._add(name, values.double().sum() / self.pairs)
        return share * self.world  # the wrapper's average over ranks divides by world again

    def _add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = value if name not in self.sums else self.sums[name] + value

    def report(self) -> dict[str, torch.Tensor]:
        # As the next-token loss: the loop averages the reports over ranks, so each rank
        # reports world x its share of the step's mean.
        return {name: value * self.world for name, value in self.sums.items()}
