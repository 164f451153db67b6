"""`init` for a denoiser (a DiffusionModel): the whole network from one source.

    init: PATH      # a diffusers DiT or SD3 folder, an mmtrain model or run folder, a checkpoint

The source's denoiser must have the shape of the model's (width, layers, heads, patches, input
channels); what may differ is what fine-tuning changes on purpose: the class table (a new set
of classes: it keeps its random init, logged) and the learned-sigma half of the output layer
(a flow model started from DiT's DDPM checkpoint: the prediction's channels are copied, the
rest are dropped). Anything else that does not fit raises InitMismatch naming the field; with
`init_strict: false` what fits is loaded and the rest is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import Tensor, nn

from mmtrain.train.init import (
    InitError,
    InitMismatch,
    InitReport,
    Match,
    apply_matches,
    read_source,
)

log = logging.getLogger(__name__)

SHAPE_FIELDS = (
    "architecture",
    "sample_size",
    "channels",
    "patch_size",
    "width",
    "layers",
    "heads",
    "mlp_ratio",
    "text_width",
    "pooled_width",
    "qk_norm",
)
# An MMDiT's text length and position table size are no weights: a run may change them.
OUTPUT_LAYER = ("towers.denoiser.out.weight", "towers.denoiser.out.bias")
CLASS_TABLE = "towers.denoiser.classes.weight"


def load_init_denoiser(
    model: nn.Module, init: str | Mapping[str, str], strict: bool = True
) -> InitReport:
    """`init_start.load_init` for a DiffusionModel (before any wrapping)."""
    if not isinstance(init, str):
        raise InitError("init", "a denoiser is one network: give init: PATH, not per tower")
    source = read_source(init, "init")
    ours, theirs = model.spec.denoiser, source.spec.denoiser
    if theirs is None:
        raise InitMismatch("init", f"{init} holds {source.spec.name}, which has no denoiser")
    differs = [f"{f}: {getattr(theirs, f)} here {getattr(ours, f)}" for f in SHAPE_FIELDS
               if getattr(theirs, f) != getattr(ours, f)]  # fmt: skip
    if differs:
        raise InitMismatch("init", f"{init}: the denoisers differ in shape ({'; '.join(differs)})")
    state = model.state_dict()
    match = Match(field="init", source=source)
    for name, value in source.state.items():
        if name not in state:
            match.unexpected.append(name)
        elif value.shape == state[name].shape:
            match.loaded[name] = value
        elif name in OUTPUT_LAYER and theirs.learn_sigma and not ours.learn_sigma:
            match.loaded[name] = _prediction_rows(value, state[name], ours, theirs)
            match.notes.append(f"{name}: the prediction's rows only (learned sigma dropped)")
        elif name == CLASS_TABLE:
            match.notes.append(f"{name}: {theirs.num_classes} classes there, {ours.num_classes} "
                               "here; it keeps its random init")  # fmt: skip
        else:
            match.mis_shaped.append(
                f"{name} {list(value.shape)} (model: {list(state[name].shape)})"
            )
    match.missing = [n for n in state if n not in source.state]
    return apply_matches(state, [match], [source], init, strict)


def _prediction_rows(value: Tensor, target: Tensor, ours, theirs) -> Tensor:
    """The output layer's rows of the prediction alone (DiT's learned-sigma rows dropped):
    rows are (patch pixel, channel) with channel fastest."""
    patch = ours.patch_size**2
    kept = value.reshape(patch, theirs.out_channels(), *value.shape[1:])[:, : ours.out_channels()]
    return kept.reshape(target.shape).to(target.dtype)
