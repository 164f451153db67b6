"""Preference tuning (`--objective dpo`, train.objective: dpo; train/dpo.py) as the planner
counts it. A sample of the plan is a PAIR: `--micro-batch`, `--global-batch` and `--samples`
count pairs, and each pair is two rows of the micro-batch (the chosen answer's and the
rejected one's, data/stream/preference_batches.py) about the same images.

What DPO changes against next-token training (SFT) of the same rows, as the trainer runs
mmtrain's own models (native) and transformers' classes (hub):
- the language model's forward and backward run over 2 rows a pair: the decoder's
  activations and FLOPs are those of twice the rows;
- a native VLM's vision stacks (image tower and projector, or the native-resolution tower)
  run on ONE set of images a pair: the micro-batch holds each image and clip once and both
  rows take its features (models/visual_inputs.py `image_sources`; `shares_inputs`), so their
  activations and FLOPs are those of one row a pair (`input_rows`), and each row keeps the
  int64 index it takes them by (`taken_index_bytes`) where they need a gradient. A hub
  model's padded pair batch runs its vision encoder once a pair too (models/hub/
  shared_pixels.py: the features repeated, no index kept);
- the log-probs: the model gives each target's NLL (models/vlm.py `token_nll`, models/hub/
  model.py for a hub model), computed by the next-token loss's chunked head (models/
  token_loss.py: the head and the cross-entropy a chunk of positions at a time, recomputed in
  backward), so its head, loss and their working set are SFT's at twice the rows, plus the
  per-target NLL [rows, logit rows - 1] in fp32, which the step's output holds until the
  backward is over, and the pair loss's log-sigmoid (`token_nll_bytes`); the backward holds
  that NLL's gradient beside a chunk (`token_nll_gradient_bytes`); no logits exist whole (a
  hub class that transforms its logits beyond the head, Gemma's soft cap, reads them whole,
  as its next-token trace counted them);
- the reference's log-probs (`--reference`, train.dpo.reference; `auto`: `adapters` with
  --lora / --qlora, else `cache`), each priced as what it costs:
  - `adapters` (a LoRA or QLoRA run): the model with its adapters disabled, no second copy;
    each step, before the policy's forward, one more forward of the base over the pair
    without gradients (under ZeRO-3 one more all-gather of the weights a micro-batch; with
    CPU offload one more copy of them in from the host);
  - `copy`: a frozen copy of the model (`reference_bytes`), held in the compute dtype
    (train/model_setup.py's `build_reference`: the autocast dtype under bf16 / fp16, the
    parameters' dtype (fp32) otherwise, fp8 included), whole on every rank under DDP and
    sharded as the policy is under ZeRO-3 (one more all-gather a micro-batch, of the copy's
    weights; with CPU offload its shards live in pinned host memory, plan/offload.py, and are
    copied in for that gather); each step one more forward of it over the pair without
    gradients;
  - `cache` (train/reference_cache.py): no copy in memory and no reference forward a step;
    instead a one-time pass before the first step scores every training pair once (`--samples`
    pairs) with the model as it starts, a forward of the pair without gradients
    (`reference_pass_flops`), at the plan's rate (compute.py's `reference_pass_s`), added to
    the run's time and cost (`--samples` taken as the pairs scored: a run of E epochs over
    them scores each pair once, 1/E of that, where the other references' forwards run every
    epoch). It adds nothing to the memory peak: it runs before the first step, when no
    gradient and no optimizer state exists yet (torch's optimizers create theirs at their
    first step), and a forward without gradients holds less than the step does. The
    trainer's `auto` gives `copy` instead to a model whose images are randomly cropped (one
    stored score cannot match every crop), which the plan cannot see: plan such a run with
    `--reference copy`.
  A forward of the pair (`pair_forward_flops`) runs each stack over its `input_rows`: the
  reference's shares the images as the policy's does. In the step it is model FLOPs (a
  frozen model's forward, counted as the planner counts a frozen tower's); its transient
  memory (one layer at a time, then the head's chunk) comes before the policy's forward and
  stays under what the policy holds at its loss, so it adds none.

FLOPs follow the MFU convention every plan counts (spec.py's `train_flops`: a language model's
head at every position, 3 passes of a trained layer). What the trainer computes departs from
it as SFT's step does, and tests/test_plan_dpo.py measures it so: the chunked head runs at
the positions that predict an id and recomputes its forward in backward, and the patch
embedding's backward computes no gradient for the pixels.

What is not planned for dpo yet is refused (packed rows: the trainer packs a native model's
pairs, but the planner lays them out padded; sequence parallelism, which the trainer refuses
with dpo) or, for a plan that is a what-if anyway, named; so is `--reference adapters` without
LoRA (the trainer refuses it too). A frozen copy under FSDP is sharded as the policy is
(`reference_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmtrain.plan.model import PlanModel, Stack
from mmtrain.structured import FieldError

if TYPE_CHECKING:  # activations.py imports this module
    from mmtrain.plan.config import PlanConfig

OBJECTIVES = ("sft", "dpo")
REFERENCES = ("auto", "adapters", "cache", "copy")  # train.dpo.reference's choices
IN_STEP = ("adapters", "copy")  # the references that run a forward in every step
ROWS_PER_PAIR = 2  # the chosen and the rejected answer's rows
FP32, INT64 = 4, 8


def is_dpo(cfg: PlanConfig) -> bool:
    return cfg.objective == "dpo"


def rows_per_sample(objective: str) -> int:
    """Rows of the model's batch per sample of the plan: 2 for a DPO pair, else 1."""
    return ROWS_PER_PAIR if objective == "dpo" else 1


def scored_stack(model: PlanModel) -> Stack | None:
    """The stack whose LM head scores the rows (a decoder with a vocabulary), if any."""
    return next((s for s in model.stacks if s.kind == "decoder" and s.vocab), None)


def check_preference(model: PlanModel, cfg: PlanConfig) -> None:
    """FieldError naming the flag for what DPO cannot plan: a model without a language model's
    head, packed rows (not planned for pairs yet), sequence parallelism
    (train.sequence_parallel is refused with dpo) and an `adapters` reference without
    adapters (the trainer refuses train.dpo.reference adapters without LoRA)."""
    if not is_dpo(cfg):
        return
    stack = scored_stack(model)
    if stack is None:
        raise FieldError(
            "--objective",
            f"dpo tunes a language model on preference pairs; {model.name} has no decoder with "
            "an LM head (a contrastive, fusion or diffusion model trains with its own "
            "objective: leave --objective at sft)",
        )
    if stack.document_mask:
        raise FieldError(
            "--packed",
            "the planner lays each pair out as two padded rows (packed pairs are not planned "
            "yet); plan without --packed",
        )
    if cfg.sequence_parallel > 1:
        raise FieldError(
            "--sequence-parallel",
            "the trainer's dpo does not split rows over ranks yet (train.sequence_parallel "
            "1); plan it with --sequence-parallel 1",
        )
    if cfg.reference == "adapters" and not has_adapters(model):
        raise FieldError(
            "--reference",
            "adapters: the reference is the model with its LoRA adapters disabled, and no "
            "tower has adapters; add --lora / --qlora TOWER, or use cache or copy (or auto)",
        )


def has_adapters(model: PlanModel) -> bool:
    """Whether a stack is LoRA-adapted (--lora / --qlora)."""
    return any(s.mode == "lora" for s in model.stacks)


def reference_kind(model: PlanModel, cfg: PlanConfig) -> str:
    """The reference a DPO plan prices (module docstring): `cfg.reference`, with `auto`
    resolved as train.dpo.reference resolves it for a model whose images are not randomly
    cropped: `adapters` when a stack is LoRA-adapted, else `cache`."""
    if cfg.reference != "auto":
        return cfg.reference
    return "adapters" if has_adapters(model) else "cache"


def reference_in_step(model: PlanModel, cfg: PlanConfig) -> bool:
    """Whether every step of the plan runs the reference's forward (adapters, copy)."""
    return is_dpo(cfg) and reference_kind(model, cfg) in IN_STEP


def reference_weight_bytes(precision: str) -> int:
    """Bytes a parameter of the frozen copy: the dtype `build_reference` creates it in."""
    return {"fp32": 4, "fp8": 4}.get(precision, 2)


def reference_copy_bytes(model: PlanModel, cfg: PlanConfig) -> float:
    """The frozen copy's whole weights over TP x PP (what a ZeRO-3 rank all-gathers for its
    forward, a block at a time); 0 unless the reference is a copy."""
    if not is_dpo(cfg) or reference_kind(model, cfg) != "copy":
        return 0.0
    return model.params() * reference_weight_bytes(cfg.precision) / (cfg.tp * cfg.pp)


def reference_bytes(model: PlanModel, cfg: PlanConfig) -> float:
    """The frozen copy's weights on one GPU (0 with adapters or a cache, or for SFT): the whole
    model, or under ZeRO-3 (FSDP2, train/model_setup.py `build_reference`: sharded as the
    policy is) its shard (in host memory with offload: 0 here), divided by TP x PP for a
    what-if that splits the layers. The block a sharded copy gathers for its forward is
    transient, gone before the policy's activations peak."""
    whole = reference_copy_bytes(model, cfg)
    if cfg.zero == 3:
        return 0.0 if cfg.offload else whole / cfg.shard_ranks
    return whole


def shares_inputs(stack: Stack) -> bool:
    """Whether a DPO pair's two rows share `stack`'s inputs, so that it runs on one set of them
    a pair: a VLM's vision stacks. A native VLM's micro-batch holds each image and clip once
    (models/visual_inputs.py `image_sources`); a hub model's padded pair batch runs its
    vision encoder on one side's pixels and repeats the features (models/hub/
    shared_pixels.py), whose projector, where it is a module apart (InternVL, Gemma 3), then
    takes both rows' (counted at one row a pair here with the encoder: its small share)."""
    return stack.kind in ("encoder", "projector")


def input_rows(stack: Stack, objective: str) -> int:
    """Rows' worth of inputs `stack` runs on per sample of the plan: a DPO pair's two, or one
    where the pair's rows share them (`shares_inputs`); one for SFT."""
    if objective != "dpo":
        return 1
    return 1 if shares_inputs(stack) else ROWS_PER_PAIR


def row_share(stack: Stack, objective: str) -> float:
    """Of a micro-batch's rows, the share whose inputs `stack` runs on (1/2: the pairs')."""
    return input_rows(stack, objective) / rows_per_sample(objective)


def taken_index_bytes(stack: Stack, rows: float) -> float:
    """What `rows` rows of a DPO micro-batch keep to take a shared stack's output: the int64
    index of their inputs into the pairs' one set (`Stack.taken_index_int64`), read by the
    backward of that gather (so kept only where the output needs a gradient: a stack that
    keeps nothing keeps no index either)."""
    return rows * stack.per_sample * stack.taken_index_int64 * INT64


def stack_rows(model: PlanModel, objective: str) -> tuple[int, ...]:
    """`input_rows` of each of the model's stacks, in order."""
    return tuple(input_rows(s, objective) for s in model.stacks)


def pair_forward_flops(model: PlanModel) -> float:
    """Forward FLOPs of one pair: each stack over its `input_rows`."""
    rows = stack_rows(model, "dpo")
    return sum(r * s.forward_flops for r, s in zip(rows, model.stacks, strict=True))


def reference_forward_flops(model: PlanModel, cfg: PlanConfig) -> float:
    """FLOPs per pair of the reference's forward in every step: one forward of the pair
    (adapters, copy; `pair_forward_flops`); 0 with a cache (or for SFT)."""
    return pair_forward_flops(model) if reference_in_step(model, cfg) else 0.0


def reference_pass_flops(model: PlanModel, cfg: PlanConfig) -> float:
    """FLOPs per pair of a cache's one-time pass before the first step: one forward of the
    pair, once per training pair; 0 for the other references (or for SFT)."""
    if not is_dpo(cfg) or reference_kind(model, cfg) != "cache":
        return 0.0
    return pair_forward_flops(model)


def logit_rows(stack: Stack) -> float:
    """Rows of logits per sample: one per text id (native models), or per position."""
    return stack.logit_rows or stack.tokens


def pair_loss_bytes(rows: float) -> float:
    """What the sigmoid loss keeps: per pair its log-sigmoid's fp32 input and buffer (one fp32
    a row); the per-sample sums and the margins keep nothing."""
    return rows * FP32


def token_nll_bytes(stack: Stack, rows: float) -> float:
    """What DPO's log-probs keep beyond the next-token loss of the same rows
    (whose targets, chunked head and head input they share): the per-target NLL [rows, logit
    rows - 1] in fp32, which the step's output holds until the backward is over, and the pair
    loss's (`pair_loss_bytes`)."""
    return rows * (logit_rows(stack) - 1) * FP32 + pair_loss_bytes(rows)


def token_nll_gradient_bytes(stack: Stack, rows: float) -> float:
    """The backward's fp32 gradient of that NLL [rows, logit rows - 1], live while the head's
    chunks are recomputed (each chunk reads its slice)."""
    return rows * (logit_rows(stack) - 1) * FP32


def describe(model: PlanModel, cfg: PlanConfig) -> str:
    """The note a DPO plan prints: what it adds to SFT of the same rows, what its reference
    costs, and what the other references would."""
    kind = reference_kind(model, cfg)
    return (
        "dpo: a sample is a preference pair (--micro-batch, --global-batch and --samples count "
        "pairs), two rows in the micro-batch, so the language model's activations and FLOPs "
        f"are those of twice the rows; {_images_note(model)}{_head_note(model)}; "
        f"{_reference_note(model, cfg)}. --reference {kind} (auto: adapters with LoRA, else "
        "cache); each reference costs: adapters one more forward of the base a step, copy a "
        "frozen copy of the weights and one more forward a step, cache one pass over the "
        "pairs before training and nothing a step"
    )


def _images_note(model: PlanModel) -> str:
    if not any(shares_inputs(s) for s in model.stacks):
        return ""
    return ("the vision tower encodes each pair's images once, for both rows (their "
            "activations and FLOPs are one row's a pair); ")  # fmt: skip


def _head_note(model: PlanModel) -> str:
    return ("the log-probs sum each target's NLL from the next-token loss's chunked head "
            "(no logits held; on top of the next-token step's, the fp32 NLL of each "
            "position)")  # fmt: skip


def _reference_note(model: PlanModel, cfg: PlanConfig) -> str:
    kind = reference_kind(model, cfg)
    if kind == "adapters":
        return ("the reference is the model with its LoRA adapters disabled (no second copy of "
                "the weights): one more forward of the base over the pair, each step, before "
                "the backward passes, without gradients")  # fmt: skip
    if kind == "copy":
        if cfg.zero != 3:
            where = "whole on every GPU"
        else:
            where = f"sharded over {cfg.shard_ranks} ranks as the policy is"
            where += ", in host memory" if cfg.offload else ""
        return (f"the reference is a frozen copy of the model ({model.params():,} parameters "
                f"at {reference_weight_bytes(cfg.precision)} bytes, {where}): one more forward "
                "over the pair, each step, before the backward passes, without "
                "gradients")  # fmt: skip
    return ("the reference's log-probs are cached: one pass before the first step scores "
            "each training pair once with the model as it starts (one forward of the pair, "
            "without gradients: the \"reference pass\", in the run's time and cost), then no "
            "copy of the weights and no reference forward a step (the trainer's auto gives a "
            "model whose images are randomly cropped a frozen copy instead, as one stored "
            "score cannot match every crop: plan it with --reference copy)")  # fmt: skip
