"""The planner's inputs: one strategy (precision, optimizer, parallelism, batch) on one GPU type.

Validation names the CLI flag a wrong value came from, so `mmtrain plan` can print it as is.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.structured import FieldError, check_choice

PRECISIONS = ("fp32", "bf16", "bf16-weights", "bf16-pure", "fp16", "fp8")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
AC_MODES = ("none", "selective", "full")
ATTENTION = ("flash", "math")
BYTES_CONVENTIONS = (16, 18, 20)


@dataclass(frozen=True)
class PlanConfig:
    """A training strategy. `gpus` is the total count; data-parallel size = gpus / (tp * pp).

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
    """

    gpu: str = "h100"
    gpus: int = 1
    gpus_per_node: int | None = None  # default: the GPU's usual node size
    precision: str = "bf16"
    optimizer: str = "adamw"
    bytes_per_param: int = 16
    zero: int = 0
    tp: int = 1
    sp: bool = False
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

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def accumulation(self) -> int:
        return self.effective_global_batch // (self.micro_batch * self.dp)

    @property
    def effective_global_batch(self) -> int:
        return self.global_batch or self.micro_batch * self.dp

    def validate(self, heads: list[int] | None = None) -> None:
        """Raise FieldError (path = the flag) for impossible strategies."""
        check_choice("--precision", self.precision, PRECISIONS)
        check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        check_choice("--ac", self.ac, AC_MODES)
        check_choice("--attention", self.attention, ATTENTION)
        if self.bytes_per_param not in BYTES_CONVENTIONS:
            raise FieldError(
                "--bytes-per-param", f"{self.bytes_per_param} is not one of 16, 18, 20"
            )
        for flag, value in (
            ("--gpus", self.gpus),
            ("--tp", self.tp),
            ("--pp", self.pp),
            ("--micro-batch", self.micro_batch),
        ):
            if value < 1:
                raise FieldError(flag, f"must be at least 1, got {value}")
        if self.zero not in (0, 1, 2, 3):
            raise FieldError("--zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.gpus % (self.tp * self.pp):
            raise FieldError(
                "--tp", f"tp x pp = {self.tp * self.pp} does not divide --gpus {self.gpus}"
            )
        if self.zero and self.dp == 1:
            raise FieldError(
                "--zero",
                f"ZeRO-{self.zero} shards over data-parallel ranks, but there is only one (gpus {self.gpus} / (tp {self.tp} x pp {self.pp})); use --zero 0 or more GPUs",
            )
        if self.sp and self.tp == 1:
            raise FieldError("--sp", "sequence parallelism needs --tp > 1")
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
