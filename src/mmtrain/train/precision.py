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


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x` in fp32 for losses and metrics (they need its range), float64 kept as it is (fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def make_precision(name: str, device: torch.device) -> Precision:
    """The Precision for `name` on `device`; raises FieldError("train.precision") where it cannot run."""
    if name not in AUTOCAST_DTYPES:
        raise FieldError("train.precision", f"{name!r} is not one of {', '.join(AUTOCAST_DTYPES)}")
    if name == "fp8":
        check_fp8_supported(device)
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise FieldError(
            "train.precision",
            "bf16 needs an Ampere or newer GPU (compute capability 8.0+); use fp16",
        )
    scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
    param_dtype = torch.float64 if name == "fp64" else torch.float32
    return Precision(name, device.type, AUTOCAST_DTYPES[name], scaler, param_dtype)


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


def convert_to_fp8(model: nn.Module, keep_bf16: Sequence[str] = ()) -> nn.Module:
    """Swap the towers' Linear layers for torchao's fp8 training linears, in place.

    Layers whose qualified name contains one of `keep_bf16` (e.g. "proj", "towers.text") stay
    in bf16 autocast, the usual fix when fp8 diverges; so do layers whose dimensions are not
    multiples of 16, which fp8 matmul kernels require.
    """
    from torchao.float8 import convert_to_float8_training

    def wanted(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(fragment in name for fragment in keep_bf16):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, module_filter_fn=wanted)
    return model
