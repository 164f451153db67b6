"""The planner's inputs: one strategy (precision, optimizer, parallelism, batch) on one GPU type.

Validation names the CLI flag a wrong value came from, so `mmtrain plan` can print it as is.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.plan.preference import OBJECTIVES, REFERENCES
from mmtrain.structured import FieldError, check_choice

PRECISIONS = ("fp32", "bf16", "bf16-weights", "bf16-pure", "fp16", "fp8")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
AC_MODES = ("none", "selective", "full")
ATTENTION = ("flash", "math")
BYTES_CONVENTIONS = (16, 18, 20)
SP_ATTENTION = ("auto", "all_to_all", "ring")  # train.sequence_parallel_attention's choices


@dataclass(frozen=True)
class PlanConfig:
    """A training strategy. `gpus` is the total count; data-parallel size = gpus / (tp * pp *
    sequence_parallel); ZeRO shards over dp x sequence_parallel ranks (`shard_ranks`).

    precision (what each keeps: states.py for the model states, activations.py for the rest):
    - fp32: fp32 weights, grads, optimizer states and activations.
    - bf16: torch autocast over an fp32 model. States: the mixed-precision convention of
      `bytes_per_param` (16: autocast's fp32 weights 4 + fp32 grads 4 + Adam 8); activations:
      16-bit copies, but the residual stream (norm inputs) stays fp32 (4 bytes).
    - bf16-weights: the model itself in bf16 (weights and activations, residual stream
      included: 2 bytes), fp32 master weights and Adam states in the optimizer: DeepSpeed's
      `bf16` with ZeRO, FSDP2's `MixedPrecisionPolicy(param_dtype=bfloat16)` without autocast.
      States: the same convention as bf16 (16: bf16 weights 2 + grads 2 + fp32 master,
      momentum, variance 12; 18 with fp32 grads, as DeepSpeed accumulates them).
    - bf16-pure: bf16 weights, grads and optimizer states, no fp32 copy (8 B/param for AdamW);
      activations as bf16-weights.
    - fp16: as bf16, with loss scaling. fp8: matmuls in fp8, states and activations as bf16
      (Transformer Engine keeps bf16/fp32 weights, so fp8 saves compute time, not memory).
    bytes_per_param: the mixed-precision AdamW convention (16: 16-bit grads, ZeRO paper; 18: fp32
    grads, Megatron/DeepSpeed/HF; 20: 16-bit grads plus an fp32 accumulation buffer, nanotron).
    sp: Megatron-LM's sequence parallelism inside a TP group (the norm inputs split over --tp).
    sequence_parallel: context parallelism (train.sequence_parallel): N consecutive ranks split
    each row of a decoder's or denoiser's sequence, T/N positions each, attending through
    all-to-alls (`all_to_all`, DeepSpeed-Ulysses) or a ring of key/value blocks (`ring`).
    offload: FSDP2's CPUOffloadPolicy (train.offload): ZeRO-3 whose shards of weights,
    gradients and optimizer states live in host memory, on any number of GPUs (one included:
    FSDP2 over a group of one); plan/offload.py.
    objective: sft (a sample is a row) or dpo (a sample is a preference pair of two rows, and
    micro_batch, global_batch and samples count pairs; plan/preference.py).
    reference: dpo's reference, as train.dpo.reference: adapters (the model without its LoRA
    adapters), copy (a frozen copy), cache (log-probs scored in one pass before training),
    auto (adapters with LoRA, else cache); what each costs: plan/preference.py.
    """

    gpu: str = "h100"
    gpus: int = 1
    gpus_per_node: int | None = None  # default: the GPU's usual node size
    precision: str = "bf16"
    optimizer: str = "adamw"
    bytes_per_param: int = 16
    zero: int = 0
    tp: int = 1
    sp: bool = False  # Megatron-LM sequence parallelism (with tp); not `sequence_parallel`
    pp: int = 1
    ac: str = "none"
    attention: str = "flash"
    micro_batch: int = 1
    global_batch: int | None = None  # default: micro_batch x data-parallel size
    samples: int = 0  # samples to train (time and cost); 0: skip
    price_per_gpu_hour: float | None = None  # default: the catalog's indicative price
    mfu: float | None = None  # achievable fraction of peak; default: see compute.py
    headroom: float = 0.07
    network: str | None = None  # inter-node interconnect key; default: the GPU's
    sequence_parallel: int = 1  # ranks splitting each row's sequence (context parallelism)
    sequence_parallel_attention: str = "auto"  # auto | all_to_all | ring
    offload: bool = False  # FSDP2 CPU offload (train.offload): needs zero 3
    host_memory_gib: float | None = None  # a server's host memory; default: the catalog's
    # sft: next-token training of one row a sample; dpo: preference pairs, two rows a sample
    # (micro_batch, global_batch and samples count pairs; plan/preference.py)
    objective: str = "sft"
    reference: str = "auto"  # dpo's reference (train.dpo.reference): auto|adapters|cache|copy

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the ranks that see different rows."""
        return self.gpus // (self.tp * self.pp * self.sequence_parallel)

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO/FSDP shards over and gradients are reduced over: every data-parallel and
        sequence-parallel rank (torchtitan's dp_shard_cp), i.e. gpus / (tp x pp)."""
        return self.gpus // (self.tp * self.pp)

    @property
    def accumulation(self) -> int:
        return self.effective_global_batch // (self.micro_batch * self.dp)

    @property
    def effective_global_batch(self) -> int:
        return self.global_batch or self.micro_batch * self.dp

    def sp_attention(self, split_heads: list[int]) -> str:
        """The attention layout of sequence parallelism for split stacks with `split_heads`
        heads, as the trainer resolves `auto`: all-to-all (DeepSpeed-Ulysses) when
        `sequence_parallel` divides every split stack's heads, else ring attention."""
        if self.sequence_parallel_attention != "auto":
            return self.sequence_parallel_attention
        n = self.sequence_parallel
        return "all_to_all" if all(h % n == 0 for h in split_heads) else "ring"

    def validate(
        self, heads: list[int] | None = None, split_heads: list[int] | None = None
    ) -> None:
        """Raise FieldError (path = the flag) for impossible strategies. `split_heads`: the
        heads of the stacks sequence parallelism splits (None: not checked)."""
        check_choice("--precision", self.precision, PRECISIONS)
        check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        check_choice("--ac", self.ac, AC_MODES)
        check_choice("--attention", self.attention, ATTENTION)
        check_choice("--objective", self.objective, OBJECTIVES)
        check_choice("--reference", self.reference, REFERENCES)
        if self.reference != "auto" and self.objective != "dpo":
            raise FieldError(
                "--reference",
                f"{self.reference}: the reference is dpo's (train.dpo.reference); add "
                "--objective dpo or leave --reference out",
            )
        if self.bytes_per_param not in BYTES_CONVENTIONS:
            raise FieldError(
                "--bytes-per-param", f"{self.bytes_per_param} is not one of 16, 18, 20"
            )
        for flag, value in (
            ("--gpus", self.gpus),
            ("--tp", self.tp),
            ("--pp", self.pp),
            ("--micro-batch", self.micro_batch),
            ("--sequence-parallel", self.sequence_parallel),
        ):
            if value < 1:
                raise FieldError(flag, f"must be at least 1, got {value}")
        if self.zero not in (0, 1, 2, 3):
            raise FieldError("--zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.gpus % (self.tp * self.pp):
            raise FieldError(
                "--tp", f"tp x pp = {self.tp * self.pp} does not divide --gpus {self.gpus}"
            )
        self._validate_sequence_parallel(split_heads)
        if self.offload and self.zero != 3:
            raise FieldError(
                "--offload",
                f"CPU offload is FSDP2's (ZeRO-3, train.parallel fsdp), not ZeRO-{self.zero}'s: "
                "use --zero 3 (or leave --zero out)",
            )
        if self.host_memory_gib is not None and self.host_memory_gib <= 0:
            raise FieldError("--host-memory-gib", f"must be positive, got {self.host_memory_gib}")
        if self.zero and self.shard_ranks == 1 and not self.offload:
            raise FieldError(
                "--zero",
                f"ZeRO-{self.zero} shards over data-parallel ranks, but there is only one (gpus {self.gpus} / (tp {self.tp} x pp {self.pp})); use --zero 0 or more GPUs",
            )
        if self.sp and self.tp == 1:
            raise FieldError(
                "--sp", "Megatron sequence parallelism needs --tp > 1 (see --sequence-parallel)"
            )
        for h in heads or []:
            if h % self.tp:
                raise FieldError(
                    "--tp", f"tensor parallel {self.tp} does not divide {h} attention heads"
                )
        if self.global_batch is not None:
            if self.micro_batch > self.global_batch:
                raise FieldError(
                    "--micro-batch",
                    f"{self.micro_batch} is larger than --global-batch {self.global_batch}",
                )
            if self.global_batch % (self.micro_batch * self.dp):
                raise FieldError(
                    "--global-batch",
                    f"{self.global_batch} is not a multiple of micro-batch x data-parallel size = {self.micro_batch} x {self.dp}",
                )
        if self.pp > 1 and self.accumulation < 1:
            raise FieldError(
                "--pp", "pipeline parallelism needs micro-batches; raise --global-batch"
            )
        if not 0 <= self.headroom < 0.5:
            raise FieldError("--headroom", f"must be in [0, 0.5), got {self.headroom}")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise FieldError("--mfu", f"must be in (0, 1], got {self.mfu}")
        if self.samples < 0:
            raise FieldError("--samples", f"must be >= 0, got {self.samples}")

    def _validate_sequence_parallel(self, split_heads: list[int] | None) -> None:
        n = self.sequence_parallel
        check_choice(
            "--sequence-parallel-attention", self.sequence_parallel_attention, SP_ATTENTION
        )
        replicas = self.gpus // (self.tp * self.pp)
        if replicas % n:
            raise FieldError(
                "--sequence-parallel",
                f"{n} does not divide gpus / (tp x pp) = {self.gpus} / ({self.tp} x {self.pp})"
                f" = {replicas}",
            )
        if n == 1 or split_heads is None:
            return
        if not split_heads:
            raise FieldError(
                "--sequence-parallel",
                "the model has no stack that sequence parallelism splits (a decoder LM or a "
                "denoiser); use 1",
            )
        if self.sequence_parallel_attention == "all_to_all":
            for h in split_heads:
                if h % n:
                    raise FieldError(
                        "--sequence-parallel-attention",
                        f"all_to_all needs --sequence-parallel {n} to divide the {h} attention "
                        "heads of every split stack; use ring (or auto)",
                    )
