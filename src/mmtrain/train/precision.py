"""Numeric precision of a training run: fp32, bf16 autocast, fp16 autocast with dynamic loss
scaling, fp8 matmuls through torchao; and fp64, a reference mode.

Weights and optimizer state stay fp32 in every mode (mixed precision, not pure low precision):
autocast runs matmuls and convolutions in the low dtype and keeps reductions in fp32. fp16's
narrow range needs loss scaling: `torch.amp.GradScaler` multiplies the loss, unscales the
gradients before clipping, and skips the step (lowering the scale) when a gradient overflowed;
the loop counts those skipped steps.

fp64 keeps weights, inputs, activations and optimizer state in float64. It is not for speed:
it is how a test (or a user in doubt) checks that two runs which differ only in the order of
their float sums (2 ranks vs 1, accumulation vs one big batch) compute the same thing, because
float64 rounding (~1e-16) stays far below any tolerance on any CPU, where float32's does not.

fp32 on a CUDA device runs its matmuls and convolutions on TF32 tensor cores (10-bit mantissa
inputs, fp32 accumulate) unless `train.tf32: false`: this is the speed the planner plans fp32 at
(the catalog's `tf32_tflops`), and full-IEEE fp32 matmuls are 8-16x slower on Ampere and newer.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mmtrain.structured import FieldError

AUTOCAST_DTYPES = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
    "fp64": None,
}
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper (sm_90), Blackwell: hardware fp8 matmuls


@dataclass
class Precision:
    """How forward/backward run: `autocast()` around the forward and the loss, `scaler` for fp16."""

    name: str
    device_type: str
    dtype: torch.dtype | None  # autocast dtype; None: no autocast
    scaler: torch.amp.GradScaler | None = None
    param_dtype: torch.dtype = torch.float32  # weights and float inputs (float64 for fp64)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            yield


def make_precision(name: str, device: torch.device, *, tf32: bool = True) -> Precision:
    """The Precision for `name` on `device`; raises FieldError("train.precision") where it cannot run.

    fp32 on CUDA also sets whether fp32 matmuls and convolutions may use TF32 (`tf32`, the run
    config's `train.tf32`)."""
    if name not in AUTOCAST_DTYPES:
        raise FieldError("train.precision", f"{name!r} is not one of {', '.join(AUTOCAST_DTYPES)}")
    if name == "fp8":
        check_fp8_supported(device)
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise FieldError(
            "train.precision",
            "bf16 needs an Ampere or newer GPU (compute capability 8.0+); use fp16",
        )
    if name == "fp32" and device.type == "cuda":
        set_tf32(tf32)
    scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
    param_dtype = torch.float64 if name == "fp64" else torch.float32
    return Precision(name, device.type, AUTOCAST_DTYPES[name], scaler, param_dtype)


def set_tf32(enabled: bool) -> None:
    """Allow (or forbid) TF32 for fp32 matmuls and cuDNN convolutions.

    These switches are process-wide in torch (there is no per-module setting), so the run that
    owns the process sets them once, at set-up, both ways: a later run in the same process with
    `tf32: false` gets IEEE fp32 again rather than inheriting an earlier run's choice."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):  # torch >= 2.9's switch
        conv.fp32_precision = "tf32" if enabled else "ieee"
    else:  # older torch; the new one warns that this flag is deprecated
        torch.backends.cudnn.allow_tf32 = enabled


def check_fp8_supported(device: torch.device) -> None:
    """Raise a FieldError saying what is missing when fp8 training cannot run here."""
    if device.type != "cuda":
        raise FieldError(
            "train.precision",
            "fp8 needs an NVIDIA GPU with fp8 tensor cores (Ada, Hopper or newer); this run is "
            f"on {device.type}. Use bf16 (or fp32 on a CPU)",
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise FieldError(
            "train.precision",
            f"fp8 needs compute capability 8.9+ (Ada, Hopper or newer); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. Use bf16",
        )
    if importlib.util.find_spec("torchao") is None:
        raise FieldError(
            "train.precision",
            "fp8 matmuls come from torchao, which is not installed: `pip install torchao` "
            "(a build matching your torch), or use bf16",
        )


FP8_RECIPES = ("tensorwise", "rowwise")


def fp8_targets(model: nn.Module, keep_bf16: Sequence[str] = ()) -> dict[str, nn.Module]:
    """The linears fp8 training converts, by qualified name: every `nn.Linear` inside a
    tower's transformer blocks (the decoder's and the encoders', a hub model's towers' blocks
    too: where the FLOPs are) and the
    frozen base of a LoRA linear there. The output layer, embeddings, stems, pooling heads,
    projections, a VLM's projector and a fusion head stay in bf16 (torchtitan keeps the output
    layer so too), and so does any layer whose dimensions are not multiples of 16 (fp8 matmul
    kernels need them) or whose name contains one of `keep_bf16` (the usual fix when fp8
    diverges)."""
    from mmtrain.train.lora import LoraLinear

    found = {}
    blocks = _hub_block_prefixes(model)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, LoraLinear)):
            continue
        if ".blocks." not in f".{name}" and not name.startswith(blocks):
            continue
        if any(fragment in name for fragment in keep_bf16):
            continue
        if module.in_features % 16 == 0 and module.out_features % 16 == 0:
            found[name] = module
    return found


def _hub_block_prefixes(model: nn.Module) -> tuple[str, ...]:
    """A hub model's blocks by name (`hf.model.language_model.layers.3.`): its towers name
    them by transformers' paths, not mmtrain's `blocks`."""
    towers = getattr(model, "towers", None)
    if towers is None or getattr(model.spec, "hub", None) is None:
        return ()
    names = {id(m): n for n, m in model.named_modules()}
    return tuple(f"{names[id(b)]}." for tower in towers.values() for b in tower.blocks)


def convert_to_fp8(
    model: nn.Module, keep_bf16: Sequence[str] = (), recipe: str = "tensorwise"
) -> dict[str, nn.Module]:
    """Swap the `fp8_targets` for torchao's fp8 training linears in place (a LoRA linear keeps
    its adapters in bf16 and runs its base matmul in fp8); returns the converted modules by
    name. Names and state-dict keys do not change: checkpoints load across bf16 and fp8 runs.
    `recipe`: torchao's "tensorwise" (one scale per tensor) or "rowwise" scaling."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    from mmtrain.train.lora import LoraLinear

    if recipe not in FP8_RECIPES:
        raise FieldError("train.fp8_recipe", f"{recipe!r} is not one of {', '.join(FP8_RECIPES)}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    targets = fp8_targets(model, keep_bf16)
    plain = {name for name, m in targets.items() if not isinstance(m, LoraLinear)}
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: name in plain
    )
    for module in targets.values():
        if isinstance(module, LoraLinear):
            with torch.device("meta"):  # a shell for the base's matmul: no weights of its own
                shell = nn.Linear(module.in_features, module.out_features, module.bias is not None)
            module.use_base_linear(Float8Linear.from_float(shell, config=config))
    return {name: model.get_submodule(name) for name in targets}
