"""`init` of a hub model: the folder's weights, read by transformers' own `from_pretrained`
(which knows each class's checkpoint layouts and renamings), copied into the run's model.

`init_strict` (default) refuses a folder whose weights leave any parameter of the class at
random init or hold tensors the class has no place for; `init_strict: false` loads what fits
and reports the rest.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from mmtrain.atomic import sha256_file
from mmtrain.models.hub.source import model_class, resolve_folder
from mmtrain.train.init import InitError, InitReport

log = logging.getLogger(__name__)
WEIGHT_SUFFIX = ".safetensors"


def load_init_hub(model: nn.Module, init: str, strict: bool = True) -> InitReport:
    """Fill `model.hf` (a HubModel's transformers module) from the folder or hub name `init`;
    a hub denoiser's diffusers module from its pipeline folder (train/init_hub_denoiser.py)."""
    if model.spec.denoiser is not None:
        from mmtrain.train.init_hub_denoiser import load_init_hub_denoiser

        return load_init_hub_denoiser(model, init, strict)
    if not isinstance(init, str):
        raise InitError("init", "a hub model starts from one folder or hub name, not per tower")
    folder = resolve_folder(init, "init")
    cls = model_class(folder)
    if cls is not type(model.hf):
        raise InitError(
            "init",
            f"{folder} holds a {cls.__name__}; the run's model is a {type(model.hf).__name__}",
        )
    source, info = cls.from_pretrained(
        str(folder), dtype=_dtype_of(model.hf), output_loading_info=True
    )
    return copy_loaded(model.hf, source, info, folder, strict)


def copy_loaded(
    target: nn.Module, source: nn.Module, info: dict, folder: Path, strict: bool
) -> InitReport:
    """`source` (the class's own `from_pretrained` of `folder`, with its loading info) copied
    into `target`; `strict` refuses weights that leave a parameter at random init or that
    nothing takes. The report has the sha256 of the folder's weight files."""
    name = type(source).__name__
    missing, unexpected = list(info["missing_keys"]), list(info["unexpected_keys"])
    if strict and (missing or unexpected):
        raise InitError(
            "init",
            f"{folder}: {len(missing)} parameter(s) of {name} not in the weights "
            f"({', '.join(missing[:3])}) and {len(unexpected)} unused "
            f"({', '.join(unexpected[:3])}); init_strict: false loads what fits",
        )
    state = source.state_dict()
    with torch.no_grad():
        for key, tensor in target.state_dict().items():
            tensor.copy_(state[key])
    report = InitReport(loaded=len(state), random=missing, ignored=unexpected)
    for file in sorted(folder.glob(f"*{WEIGHT_SUFFIX}")):
        report.sha256[str(file)] = sha256_file(file)
    log.info("init: %s (%s, %d tensors)", folder, name, len(state))
    return report


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
