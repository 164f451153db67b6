"""The entry points of `init` (train/init.py): `load_init` fills a model from its sources,
through train/init.py for a MultimodalModel and train/init_lm.py for a language model, and
`start_from_init` is the trainer's one call (load on a fresh run, keep the recorded `init` on a
resume). Both those modules sit below this one, so neither needs to know the other's model kind.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from mmtrain.config import RunConfig
from mmtrain.train.init import InitError, InitReport, load_init_towers
from mmtrain.train.init_denoiser import load_init_denoiser
from mmtrain.train.init_hub import load_init_hub
from mmtrain.train.init_lm import load_init_lm

log = logging.getLogger(__name__)


def load_init(model: nn.Module, init: str | Mapping[str, str], strict: bool = True) -> InitReport:
    """Copy the weights of `init` into `model` (a MultimodalModel or LanguageModel, before any
    wrapping).

    Raises InitError/InitMismatch; with `strict=False` loads what fits and reports the rest.
    """
    if model.spec.hub is not None:  # a HubModel: transformers' own class
        return load_init_hub(model, init, strict)
    if model.spec.decoder is not None:  # a LanguageModel: its decoder is a tower spec.towers lacks
        return load_init_lm(model, init, strict)
    if model.spec.denoiser is not None:  # a DiffusionModel: one network
        return load_init_denoiser(model, init, strict)
    return load_init_towers(model, init, strict)


def start_from_init(
    model: nn.Module, config: RunConfig, resumed_meta: Mapping[str, Any] | None
) -> RunConfig:
    """The training loop's one call, right after building the model: on a fresh run load
    `config.init` and return the config with `init_sha256` recorded; on a resume (`resumed_meta`:
    the checkpoint's meta) load nothing and return the config with the `init` the run started
    from, so its resolved config keeps telling the truth."""
    if resumed_meta is not None:
        started = resumed_meta.get("config", {})
        before, hashes = started.get("init"), started.get("init_sha256", {})
        if config.init is not None and config.init != before:
            log.info(
                "init %s ignored: the run resumes from its checkpoint (it started from %s)",
                config.init, before or "a random init",
            )  # fmt: skip
        return dataclasses.replace(config, init=before, init_sha256=dict(hashes))
    if config.init is None:
        return config
    report = load_init(model, config.init, strict=config.init_strict)
    return record_init_hashes(config, report.sha256)


def record_init_hashes(config: RunConfig, sha256: Mapping[str, str]) -> RunConfig:
    """The config with the sha256 of every file `init` read; InitError when a file the config
    pinned (`init_sha256`) has another hash now."""
    for file, digest in sha256.items():
        pinned = config.init_sha256.get(file)
        if pinned is not None and pinned != digest:
            raise InitError(
                f"init_sha256.{file}",
                f"the file's sha256 is {digest}, the config expects {pinned}: the baseline "
                "changed since the config was written",
            )
    return dataclasses.replace(config, init_sha256=dict(sha256))
