"""`init` of a hub denoiser: the pipeline folder's transformer weights, read by diffusers' own
`from_pretrained` of the class (which knows its checkpoint layouts), copied into the run's
model. `init_strict` (default) refuses weights that leave a parameter at random init."""

from __future__ import annotations

import logging

from torch import nn

from mmtrain.models.hub.pipeline import TRANSFORMER_DIR, resolve_pipeline, transformer_class
from mmtrain.train.init import InitError, InitReport
from mmtrain.train.init_hub import copy_loaded

log = logging.getLogger(__name__)


def load_init_hub_denoiser(model: nn.Module, init: str, strict: bool = True) -> InitReport:
    """Fill `model.hf` (a HubDenoiser's diffusers module) from the pipeline folder `init` (or
    the hub name of one in the Hugging Face cache)."""
    folder = resolve_pipeline(init) if isinstance(init, str) else None
    if folder is None:
        raise InitError("init", f"{init!r}: a hub denoiser starts from its pipeline folder")
    name = transformer_class(folder)
    if name != type(model.hf).__name__:
        raise InitError(
            "init", f"{folder} holds a {name}; the run's model is a {type(model.hf).__name__}"
        )
    dtype = next(model.hf.parameters()).dtype
    source, info = type(model.hf).from_pretrained(
        str(folder), subfolder=TRANSFORMER_DIR, torch_dtype=dtype, output_loading_info=True
    )
    return copy_loaded(model.hf, source, info, folder / TRANSFORMER_DIR, strict)
