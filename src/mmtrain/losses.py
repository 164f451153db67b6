"""Contrastive objectives over any set of tower pairs: CLIP InfoNCE, SigLIP sigmoid, triplet.

Features are a dict {tower name: [B, D] L2-normalised embeddings} (what `model.encode` returns)
and `pairs` lists which towers to align, e.g. [("image", "text"), ("audio", "text")]. Nothing
here knows a modality by name.

One shape serves all three objectives, one process or many, with or without gradient
accumulation: a loss is computed for some ROWS of the global batch against ALL its COLUMNS.
Sample i's positive is column i, so a row's label is its global index.

- One process: rows = all samples.
- Distributed (features gathered with gradient across ranks, equal per-rank batch sizes):
  "local" variant: each rank computes its own rows against all columns (memory B_local x
  B_global); the loss a rank returns is its share and the MEAN over ranks is the global loss.
  "full" variant: every rank computes every row (B_global x B_global) and returns the global loss.
  Either way, the gradient a rank gets for its own features, averaged over ranks as DDP does for
  parameter gradients, equals the single-process gradient on the concatenated batch.
- Gradient accumulation (`extra_negatives`): features of the other micro-batches of the step,
  computed earlier without grad, join the batch as further samples (rows and columns, positives
  aligned by index). Each micro-batch then returns the loss of the whole accumulated batch, and
  its backward yields exactly this micro-batch's part of the full-batch gradient: summing the
  backward of all K micro-batches (no division by K) gives the gradient of one big batch,
  for the features and for the logit scale and bias (cached rows use a detached scale/bias, so
  each row's scale gradient is counted once, in its own micro-batch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mmtrain.distributed import all_gather, all_gather_with_grad, is_initialized, rank, world_size
from mmtrain.structured import FieldError, check_choice

__all__ = [
    "OBJECTIVES",
    "VARIANTS",
    "NEGATIVES",
    "MAX_LOGIT_SCALE",
    "ContrastiveLoss",
    "logit_scale_value",
    "clip_loss",
    "siglip_loss",
    "triplet_loss",
]

OBJECTIVES = ("clip", "siglip", "triplet")
VARIANTS = ("local", "full")
NEGATIVES = ("hardest", "semi-hard")
MAX_LOGIT_SCALE = math.log(100.0)  # CLIP's cap on the temperature: scale <= 100

Features = Mapping[str, torch.Tensor]


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in fp32 for losses and metrics (they need its range), float64 kept as it is (fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def logit_scale_value(logit_scale: torch.Tensor, max_logit_scale: float = MAX_LOGIT_SCALE):
    """exp(logit_scale clamped to [0, max_logit_scale]).

    The clamp lives in the loss, not in the parameter: the parameter keeps its value (and gets
    no gradient while it is outside the range), so nothing has to edit it in place after a step.
    """
    return logit_scale.clamp(0.0, max_logit_scale).exp()


def _all_rows(a: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return torch.arange(a.shape[0], device=a.device) if rows is None else rows


def _similarity(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries @ keys.T, in at least float32: the matmul may run in bf16/fp16, but softmax and
    log-sigmoid over a large batch need the wider type."""
    sim = queries @ keys.T
    return sim.to(torch.promote_types(sim.dtype, torch.float32))


def _per_row(value: torch.Tensor, rows: torch.Tensor, n_live: int | None) -> torch.Tensor:
    """`value` for each row as [R, 1]; rows with global index >= n_live (cached samples from
    other micro-batches) get a detached copy so its gradient is counted in their own micro-batch."""
    if n_live is None:
        return value
    live = (rows < n_live).unsqueeze(1)
    return torch.where(live, value, value.detach())


def clip_loss(
    a: torch.Tensor,
    b: torch.Tensor,
    logit_scale: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    n_live: int | None = None,
    max_logit_scale: float = MAX_LOGIT_SCALE,
) -> torch.Tensor:
    """Symmetric InfoNCE: mean over `rows` of (CE(a_i vs all b) + CE(b_i vs all a)) / 2.

    a, b: [N, D] (all samples; sample i of a pairs with sample i of b). rows: global indices of
    the rows to compute (default all). n_live: samples >= n_live are cached ones (see module doc).
    """
    rows = _all_rows(a, rows)
    scale = _per_row(logit_scale_value(logit_scale, max_logit_scale), rows, n_live)
    logits_ab = scale * _similarity(a[rows], b)
    logits_ba = scale * _similarity(b[rows], a)
    return (F.cross_entropy(logits_ab, rows) + F.cross_entropy(logits_ba, rows)) / 2


def siglip_loss(
    a: torch.Tensor,
    b: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    n_live: int | None = None,
    max_logit_scale: float = MAX_LOGIT_SCALE,
) -> torch.Tensor:
    """Sigmoid loss: -1/R * sum over rows i and all columns j of log sigmoid(z_ij * logit_ij),
    logit_ij = scale * a_i.b_j + bias, z = +1 for the pair (j == i), -1 otherwise.

    Normalised by the number of rows R, as in the SigLIP paper (so the value grows with the
    batch: each row sums over all columns). Arguments as in `clip_loss`.
    """
    rows = _all_rows(a, rows)
    scale = _per_row(logit_scale_value(logit_scale, max_logit_scale), rows, n_live)
    bias = _per_row(logit_bias, rows, n_live)
    logits = scale * _similarity(a[rows], b) + bias
    signs = 2 * F.one_hot(rows, b.shape[0]).to(logits.dtype) - 1
    return -F.logsigmoid(signs * logits).sum() / rows.numel()


def _triplet_direction(
    queries: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, margin: float, negatives: str
) -> torch.Tensor:
    """Mean hinge max(0, d(q, positive) - d(q, negative) + margin) with cosine distance 1 - q.k."""
    distance = 1 - _similarity(queries, keys)  # [R, N]
    is_positive = F.one_hot(rows, keys.shape[0]).bool()
    d_pos = distance[torch.arange(rows.numel(), device=rows.device), rows]
    d_neg_all = distance.masked_fill(is_positive, math.inf)
    d_neg = d_neg_all.min(dim=1).values  # hardest: the closest negative
    if negatives == "semi-hard":
        # Farther than the positive but inside the margin; the closest such one. Rows without
        # one keep the hardest negative.
        window = (d_neg_all > d_pos[:, None]) & (d_neg_all < d_pos[:, None] + margin)
        semi = d_neg_all.masked_fill(~window, math.inf).min(dim=1).values
        d_neg = torch.where(window.any(dim=1), semi, d_neg)
    return F.relu(d_pos - d_neg + margin).mean()


def triplet_loss(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    margin: float = 0.2,
    negatives: str = "hardest",
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Symmetric triplet loss over cosine distances: anchors from a against candidates from b,
    and b against a, averaged. `negatives`: "hardest" (closest negative) or "semi-hard"
    (closest negative farther than the positive but within the margin; hardest when none).
    Features must be L2-normalised (cosine = dot product). A batch of one has no negative: 0.
    """
    check_choice("negatives", negatives, NEGATIVES)
    rows = _all_rows(a, rows)
    ab = _triplet_direction(a[rows], b, rows, margin, negatives)
    ba = _triplet_direction(b[rows], a, rows, margin, negatives)
    return (ab + ba) / 2


@dataclass(frozen=True)
class ContrastiveLoss:
    """The training loss over tower pairs: `loss(features, pairs, logit_scale, logit_bias,
    extra_negatives) -> (mean over pairs, {"a-b": loss of that pair})`.

    objective: "clip" | "siglip" | "triplet" (triplet ignores the scale and bias; only siglip
    uses the bias). variant: "local" | "full", how ranks split the work (module doc).
    distributed: None gathers across ranks whenever `torch.distributed` runs with more than one
    rank in `group`; False never gathers; True requires a process group.
    """

    objective: str = "clip"
    variant: str = "local"
    margin: float = 0.2
    negatives: str = "hardest"
    max_logit_scale: float = MAX_LOGIT_SCALE
    distributed: bool | None = None
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_choice("objective", self.objective, OBJECTIVES)
        check_choice("variant", self.variant, VARIANTS)
        check_choice("negatives", self.negatives, NEGATIVES)
        if not self.margin >= 0:
            raise FieldError("margin", f"must be >= 0, got {self.margin}")
        if not self.max_logit_scale > 0:
            raise FieldError("max_logit_scale", f"must be > 0, got {self.max_logit_scale}")

    @classmethod
    def from_spec(cls, spec: Any, **options: Any) -> ContrastiveLoss:
        """The loss a `ModelSpec` asks for (its `objective`), with `options` for the rest."""
        return cls(objective=spec.objective, **options)

    def __call__(
        self,
        features: Features,
        pairs: Sequence[tuple[str, str]],
        logit_scale: torch.Tensor | float | None = None,
        logit_bias: torch.Tensor | float | None = None,
        extra_negatives: Features | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        pairs = _check_pairs(pairs)
        # Validate everything before the first collective, so a bad input fails alike on all
        # ranks instead of leaving some of them waiting in an all_gather.
        for a_name, b_name in pairs:
            _check_pair(features, a_name, b_name, "features")
            if extra_negatives is not None:
                _check_pair(extra_negatives, a_name, b_name, "extra_negatives")
                for name in (a_name, b_name):
                    _check_extra(features[name], extra_negatives[name], name)
        gathering = self._gathering()
        columns: dict[str, torch.Tensor] = {}  # gather a tower shared by several pairs once

        def global_batch(name: str) -> torch.Tensor:
            if name not in columns:
                extra = None if extra_negatives is None else extra_negatives[name]
                columns[name] = self._columns(features[name], extra, gathering)
            return columns[name]

        losses = {}
        for a_name, b_name in pairs:
            a, b = global_batch(a_name), global_batch(b_name)
            extra = None if extra_negatives is None else extra_negatives[a_name]
            rows, n_live = self._rows(features[a_name], extra, gathering)
            losses[f"{a_name}-{b_name}"] = self._pair_loss(
                a, b, rows, n_live, logit_scale, logit_bias
            )
        total = torch.stack(list(losses.values())).mean()
        return total, losses

    def _gathering(self) -> bool:
        if self.distributed is False:
            return False
        if self.distributed and not is_initialized():
            raise RuntimeError(
                "ContrastiveLoss(distributed=True) needs torch.distributed.init_process_group() "
                "first (or distributed=None to gather only when it is initialised)"
            )
        return world_size(self.group) > 1

    def _columns(self, live: torch.Tensor, extra: torch.Tensor | None, gathering: bool):
        """All samples of the global batch: live ones of every rank, then cached ones."""
        if gathering:
            live = all_gather_with_grad(live, self.group)
            extra = None if extra is None else all_gather(extra.detach(), self.group)
        return live if extra is None else torch.cat([live, extra.detach()])

    def _rows(self, live: torch.Tensor, extra: torch.Tensor | None, gathering: bool):
        """Global indices of the rows this rank computes, and n_live (None without extras)."""
        n_ranks, me = (world_size(self.group), rank(self.group)) if gathering else (1, 0)
        b_live = live.shape[0]
        b_extra = 0 if extra is None else extra.shape[0]
        n_live = n_ranks * b_live
        device = live.device
        if self.variant == "full" or n_ranks == 1:
            rows = torch.arange(n_ranks * (b_live + b_extra), device=device)
        else:
            rows = torch.cat(
                [
                    torch.arange(me * b_live, (me + 1) * b_live, device=device),
                    n_live + torch.arange(me * b_extra, (me + 1) * b_extra, device=device),
                ]
            )
        return rows, (n_live if b_extra else None)

    def _pair_loss(self, a, b, rows, n_live, logit_scale, logit_bias) -> torch.Tensor:
        if self.objective == "triplet":
            return triplet_loss(a, b, margin=self.margin, negatives=self.negatives, rows=rows)
        if logit_scale is None:
            raise ValueError(f"objective {self.objective!r} needs logit_scale (model.logit_scale)")
        scale = _as_tensor(logit_scale, a)
        if self.objective == "clip":
            return clip_loss(
                a, b, scale, rows=rows, n_live=n_live, max_logit_scale=self.max_logit_scale
            )
        if logit_bias is None:
            raise ValueError(
                "objective 'siglip' needs logit_bias (model.logit_bias; set the spec's "
                "logit_bias_init, e.g. -10)"
            )
        bias = _as_tensor(logit_bias, a)
        return siglip_loss(
            a, b, scale, bias, rows=rows, n_live=n_live, max_logit_scale=self.max_logit_scale
        )


def _as_tensor(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Parameters pass through untouched (their gradient matters); a plain number becomes a
    tensor as wide as the loss computes in (float64 for float64 features, else float32)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(
        value, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device
    )


def _check_pairs(pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    checked = [tuple(p) for p in pairs]
    if not checked:
        raise ValueError("pairs is empty: give the tower pairs to align, e.g. [('image', 'text')]")
    for i, pair in enumerate(checked):
        if len(pair) != 2 or pair[0] == pair[1]:
            raise ValueError(f"pairs[{i}] must name two different towers, got {pair}")
    if len(set(checked)) != len(checked):
        raise ValueError(f"pairs has duplicates: {checked}")
    return checked  # type: ignore[return-value]


def _check_pair(features: Features, a_name: str, b_name: str, where: str) -> None:
    for name in (a_name, b_name):
        if name not in features:
            raise ValueError(
                f"{where} has no tower {name!r} (has: {', '.join(features) or 'nothing'}); "
                "every tower named in pairs needs its embeddings"
            )
    a, b = features[a_name], features[b_name]
    if a.dim() != 2 or b.dim() != 2 or a.shape != b.shape:
        raise ValueError(
            f"{where}[{a_name!r}] and {where}[{b_name!r}] must both be [batch, embed_dim] with "
            f"the same shape, got {list(a.shape)} and {list(b.shape)}"
        )


def _check_extra(live: torch.Tensor, extra: torch.Tensor, name: str) -> None:
    if extra.shape[1:] != live.shape[1:]:
        raise ValueError(
            f"extra_negatives[{name!r}] has embed_dim {extra.shape[1]}, "
            f"features[{name!r}] has {live.shape[1]}"
        )
