"""Preference tuning (`--objective dpo`, train.objective: dpo; train/dpo.py) as the planner
counts it. A sample of the plan is a PAIR: `--micro-batch`, `--global-batch` and `--samples`
count pairs, and each pair is two rows of the micro-batch (the chosen answer's and the
rejected one's, data/stream/preference_batches.py), each row with its own images.

What DPO changes against next-token training (SFT) of the same rows:
- the policy's forward and backward run over 2 rows a pair: every stack's activations and
  FLOPs are those of twice the rows (a VLM's image tower encodes each side's images);
- the policy's log-probs come from the whole logits [rows, logit rows, vocabulary], not the
  chunked head of the next-token loss (models/token_loss.py): the step holds the head's output
  (in the activation dtype; the step's `out` keeps it until the backward is over) and autograd
  keeps its fp32 log-softmax (over each row's ids but the last), the int64 index of the
  gathered targets and the boolean mask of the scored ones (`logits_bytes`); the backward
  holds two fp32 gradients of that size at once, the log-softmax's output's and input's
  (`logits_working_bytes`), where SFT held one chunk. The head reads one row more per sample
  (the last id's) than the chunked loss, whose input it keeps;
- the reference's log-probs come first, once per step, from a forward without gradients
  over the same rows: the model with its LoRA adapters disabled (`adapters`: a LoRA or QLoRA
  run, no second copy) or a frozen copy of the model (`copy`: a full fine-tune), held whole
  on every rank in the compute dtype (train/model_setup.py's `build_reference`: the autocast
  dtype under bf16 / fp16, the parameters' dtype (fp32) otherwise, fp8 included). Its
  forward is one more forward of the model per row (model FLOPs: a frozen model's forward,
  counted as the planner counts a frozen tower's); its transient memory (one layer at a time,
  then its logits, their fp32 copy and log-softmax) stays under what the policy holds at its
  loss (the same logits plus their fp32 log-softmax and two fp32 gradients), so it adds none.

A hub model's text tower is priced from its next-token trace (plan/hub.py): what the trace
counted outside its blocks (the head's input and the targets among it) stays as traced, and the
logits term comes on top of it (its head's input is not adjusted as a native head's is).

What is not planned for dpo yet is refused (packed rows: the trainer packs a native model's
pairs, but the planner lays them out padded; sequence parallelism, which the trainer refuses
with dpo) or, for
a plan that is a what-if anyway, named. A frozen copy under FSDP is sharded as the policy is
(`reference_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmtrain.plan.model import PlanModel, Stack
from mmtrain.structured import FieldError

if TYPE_CHECKING:  # activations.py imports this module
    from mmtrain.plan.activations import ActivationOptions
    from mmtrain.plan.config import PlanConfig

OBJECTIVES = ("sft", "dpo")
ROWS_PER_PAIR = 2  # the chosen and the rejected answer's rows
FP32, INT64, BOOL = 4, 8, 1


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
    head, packed rows (not planned for pairs yet) and sequence parallelism
    (train.sequence_parallel is refused with dpo)."""
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


def reference_kind(model: PlanModel) -> str:
    """`adapters` when a stack is LoRA-adapted (--lora / --qlora: the reference is the model
    without them), else `copy` (a full fine-tune: a frozen copy of the model), as
    train.dpo.reference `auto` resolves it."""
    return "adapters" if any(s.mode == "lora" for s in model.stacks) else "copy"


def reference_weight_bytes(precision: str) -> int:
    """Bytes a parameter of the frozen copy: the dtype `build_reference` creates it in."""
    return {"fp32": 4, "fp8": 4}.get(precision, 2)


def reference_bytes(model: PlanModel, cfg: PlanConfig) -> float:
    """The frozen copy's weights on one GPU (0 with adapters, or for SFT): the whole model, or
    under ZeRO-3 (FSDP2, train/model_setup.py `build_reference`: sharded as the policy is) its
    shard (in host memory with offload: 0 here), divided by TP x PP for a what-if that splits
    the layers. The block a sharded copy gathers for its forward is transient, gone before the
    policy's activations peak."""
    if not is_dpo(cfg) or reference_kind(model) != "copy":
        return 0.0
    whole = model.params() * reference_weight_bytes(cfg.precision) / (cfg.tp * cfg.pp)
    if cfg.zero == 3:
        return 0.0 if cfg.offload else whole / cfg.shard_ranks
    return whole


def reference_forward_flops(model: PlanModel) -> float:
    """FLOPs per pair of the reference's forward: one forward of the model per row."""
    return ROWS_PER_PAIR * model.forward_flops()


def logit_rows(stack: Stack) -> float:
    """Rows of logits per sample: one per text id (native models), or per position."""
    return stack.logit_rows or stack.tokens


def logits_bytes(stack: Stack, rows: float, o: ActivationOptions) -> float:
    """What DPO's log-probs keep for `rows` rows of `stack` until the backward (module
    docstring): the head's output [rows, logit rows, vocab] in the activation dtype, the fp32
    log-softmax and int64 target index and boolean mask of every logit row but the last and,
    per pair, the fp32 input and buffer of the sigmoid loss's log-sigmoid (one fp32 a row).
    Vocabulary-wide terms are split by TP (a vocabulary-parallel head). In place of the
    next-token loss's int64 targets (activations.py's `_loss_bytes`)."""
    n = logit_rows(stack)
    held = rows * n * stack.vocab * o.act_bytes / o.tp
    kept = rows * (n - 1) * (stack.vocab * FP32 / o.tp + INT64 + BOOL)
    return held + kept + rows * FP32


def head_input_change(stack: Stack, rows: float, o: ActivationOptions) -> float:
    """What DPO's head keeps of its input against the chunked next-token loss, which keeps it
    at every logit row but the last, frozen head or not (it recomputes each chunk's logits):
    a trained head's weight gradient reads it at every logit row (one row more), a frozen
    head's input gradient reads only its weight (none of it)."""
    n = logit_rows(stack)
    if stack.head_trained():
        return rows * stack.width * o.act_bytes
    return -rows * (n - 1) * stack.width * o.act_bytes


def logits_working_bytes(stack: Stack, rows: float, o: ActivationOptions) -> float:
    """The backward's transient at the log-probs: the fp32 gradients of the log-softmax's
    output and of its input, live together (in the forward, a 16-bit run's fp32 copy of the
    logits is one such tensor: less)."""
    return 2 * rows * (logit_rows(stack) - 1) * stack.vocab * FP32 / o.tp


def describe(model: PlanModel, cfg: PlanConfig) -> str:
    """The note a DPO plan prints: what it adds to SFT of the same rows."""
    kind = reference_kind(model)
    if kind == "adapters":
        reference = ("the reference is the model with its LoRA adapters disabled (no second "
                     "copy of the weights): one more forward of the base per row")  # fmt: skip
    else:
        reference = (f"the reference is a frozen copy of the model ({model.params():,} "
                     f"parameters at {reference_weight_bytes(cfg.precision)} bytes, whole on "
                     "every GPU): one more forward per row")  # fmt: skip
    return (
        "dpo: a sample is a preference pair (--micro-batch, --global-batch and --samples count "
        "pairs), two rows in the micro-batch, so activations and FLOPs are those of twice the "
        "rows; the log-probs read the whole logits (the head's output, its fp32 log-softmax "
        f"and gradients) instead of the chunked next-token loss; {reference}, before the "
        "backward passes, without gradients"
    )
