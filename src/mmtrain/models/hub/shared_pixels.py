"""A preference pair's images through a transformers class's vision encoder once.

A hub model's pair batch (data/stream/preference_batches.py) holds the chosen sides and then
the rejected sides, each side's pixels made by the folder's processor, which is deterministic:
in a padded batch the second half of every per-image tensor (Qwen's patch rows and grids, a
SigLIP's pixel batch and patch masks) repeats the first. The batch says so (`PAIRED_PIXELS`),
and for that forward the encoder (the vision tower's part that holds its blocks) runs on the
first half of each tensor it is given along its first dimension, and each tensor it returns
is repeated along its first dimension (features a patch or token: Qwen; an image: SigLIP),
which is what the class then splits and splices as if every side had been encoded. Backward
adds the two halves' gradients: the encoder's gradient is the one of encoding both sides.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

PAIRED_PIXELS = "paired_pixels"  # a batch's flag (host bool): its images repeat, halves alike


@contextlib.contextmanager
def encoded_once(encoder: nn.Module) -> Iterator[None]:
    """For the forwards inside the block, `encoder` runs on the first half of its inputs and
    returns its outputs twice over (module docstring)."""
    handles = [
        encoder.register_forward_pre_hook(_first_half, with_kwargs=True),
        encoder.register_forward_hook(_repeated),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _first_half(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    tensors = [x for x in (*args, *kwargs.values()) if torch.is_tensor(x) and x.dim()]
    odd = [tuple(x.shape) for x in tensors if x.shape[0] % 2]
    if odd:
        raise ValueError(
            f"{type(module).__name__}: inputs of shape {odd[0]} cannot be a pair batch's "
            "images twice over (the first dimension is odd)"
        )
    return tuple(_half(a) for a in args), {k: _half(v) for k, v in kwargs.items()}


def _half(value: Any) -> Any:
    if torch.is_tensor(value) and value.dim():
        return value[: value.shape[0] // 2]
    return value


def _repeated(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return _twice(output)


def _twice(value: Any) -> Any:
    """Every tensor of `value` (nested in tuples, lists and transformers' ModelOutput)
    repeated along its first dimension."""
    if torch.is_tensor(value):
        return torch.cat([value, value]) if value.dim() else value
    if isinstance(value, Mapping):  # a ModelOutput: an ordered dict of its set fields
        return type(value)(**{k: _twice(v) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        return type(value)(_twice(v) for v in value)
    return value
