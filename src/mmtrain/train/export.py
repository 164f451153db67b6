"""The run's final weights, written one tensor at a time: OUT/model.safetensors (shards and an
index past 5 GB) + OUT/spec.yaml, LoRA adapters merged, and the adapters alone in
OUT/lora.safetensors and OUT/adapter/. `copy_processor_files` puts beside them, at the start of a run, the
tokenizer, chat template, processor and generation files of where the run starts, so that
`convert --to hf OUT` needs nothing outside the run folder.

Under FSDP every rank gathers one parameter at a time (`DTensor.full_tensor()`, a collective)
and rank 0 writes it before the next is gathered, so no rank ever holds the whole model; the
LoRA adapters (small) are gathered first, to merge each weight as it passes. Without FSDP rank
0 copies one tensor at a time to the CPU. Non-finite weights are refused before anything is
written (all ranks agree), so a diverged run never replaces a good export.

A merged LoRA weight is written in the adapters' dtype (fp32) when its base is held in a
narrower one (bf16, or QLoRA's NF4, dequantised first): W + scale B A is summed in float64 and
rounded once (train/lora.py `merged`). QLoRA's other NF4 weights are written dequantised, in
the dtype the forward used them in; the model folder holds no 4-bit tensor.

A LoRA run's adapters are also written as OUT/adapter/ in PEFT's layout, named after the
transformers model `convert --to hf` writes (models/formats/peft_adapter.py); where the spec
has no transformers class, the log says so and the run ends as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from mmtrain.config import LoraConfig, RunConfig
from mmtrain.models import create_model
from mmtrain.models.build import write_model_folder
from mmtrain.models.formats.hf_common import NoHFCounterpart
from mmtrain.models.formats.hf_processor_files import (
    TOKENIZER_FILES,
    ProcessorFilesError,
    find_processor_files,
)
from mmtrain.models.formats.peft_adapter import ADAPTER_DIR, write_peft_adapter
from mmtrain.models.materialize import full_on_cpu
from mmtrain.models.safetensors_files import TensorEntry
from mmtrain.train import parallel
from mmtrain.train.checkpointer import check_finite_weights
from mmtrain.train.lora import LORA_FILE, is_adapter, merged, write_lora_file
from mmtrain.train.qlora import full_dequantised_weight, is_quantised

log = logging.getLogger(__name__)


def export_model(
    model: nn.Module,
    out: Path,
    rank: int,
    lora_scale: Mapping[str, float],
    loras: Mapping[str, LoraConfig],
    *,
    base_name: str | None = None,
) -> None:
    """Every rank calls it (a collective under FSDP); rank 0 writes. A LoRA run also gets
    OUT/adapter/ in PEFT's layout, `base_name` (`peft_base_name(config.init)`) recorded as
    the model it applies to."""
    sharded = parallel.is_fsdp(model)
    if not sharded and rank != 0:
        return
    state = model.state_dict()  # QLoRA's NF4 weights are not in it (train/qlora.py)
    check_finite_weights(state, sharded=sharded)
    adapters = {name: full_on_cpu(v) for name, v in state.items() if is_adapter(name)}
    sources = plain_sources(model, state)
    layout = [_entry(name, v, adapters, lora_scale) for name, v in sources.items()]
    _check_layout(model, layout)
    tensors = merged_tensors(sources, adapters, lora_scale)
    if rank != 0:
        for _ in tensors:  # take part in every gather
            pass
        return
    if adapters:
        write_lora_file(adapters, loras, out / LORA_FILE)
        _write_peft_adapter(model, adapters, loras, out, base_name)
    write_model_folder(out, model.spec, layout, tensors)


def _write_peft_adapter(
    model: nn.Module,
    adapters: Mapping[str, torch.Tensor],
    loras: Mapping[str, LoraConfig],
    out: Path,
    base_name: str | None,
) -> None:
    """OUT/adapter/ (models/formats/peft_adapter.py), where the spec has a transformers class;
    otherwise logged, never a reason to fail a finished run. The base is `base_name` only
    when the run trained nothing but the adapters: then the folder it started from is
    exactly the model the adapters apply to."""
    trained = [n for n, p in model.named_parameters() if p.requires_grad and not is_adapter(n)]
    if trained and base_name is not None:
        log.info(
            "the PEFT adapter records no base model: the run also trained %d other weights "
            "(%s, ...), so %s is not the model its adapters apply to",
            len(trained), trained[0], base_name,
        )  # fmt: skip
        base_name = None
    try:
        write_peft_adapter(model.spec, adapters, loras, out / ADAPTER_DIR, base_name)
    except NoHFCounterpart as err:
        log.info("no PEFT adapter (%s/): the model has no transformers counterpart: %s",
                 ADAPTER_DIR, err)  # fmt: skip


def copy_processor_files(config: RunConfig, out: Path) -> list[str]:
    """Copy into the run folder `out` the tokenizer (with its chat template), processor and
    generation files of `config.init`'s folder (a {tower: path} init: the text tower's
    first), else of `data.tokenizer`'s, and the chat template `data.chat_template` names
    (models/formats/hf_processor_files.py); returns their names. Rank 0 calls it once `out`
    exists, before the first step. A resumed run keeps the files it started with; files that
    cannot be found are logged, never a reason to stop training."""
    if any((out / name).is_file() for name in TOKENIZER_FILES):
        return []
    try:
        found = find_processor_files(
            None, config.init, config.data.tokenizer, config.data.chat_template, _existing
        )
    except ProcessorFilesError as err:
        log.warning("the run folder gets no tokenizer or processor files: %s", err)
        return []
    for note in found.notes:
        log.info("%s", note)
    names = found.write(out)
    if names:
        log.info("copied %s into %s", ", ".join(names), out)
    return names


def _existing(value: str, key: str) -> Path:
    """A path of the run config (resolved when the config was loaded), where it is."""
    path = Path(value).expanduser()
    if not path.exists():
        raise ProcessorFilesError(key, f"{value!r} is not found")
    return path.resolve()


def plain_sources(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's tensors, by name, in its order: the state dict's (adapters left out)
    and the NF4 parameters it leaves out."""
    quantised = {name: p for name, p in model.named_parameters() if is_quantised(p)}
    sources = {name: v for name, v in state.items() if not is_adapter(name)}
    if not quantised:
        return sources
    sources.update(quantised)
    order = create_model(model.spec, device="meta").state_dict()
    return {name: sources[name] for name in order if name in sources}


def _merge_prefix(name: str, lora_scale: Mapping[str, float]) -> str | None:
    """The LoRA linear whose weight `name` is, or None."""
    prefix = name.removesuffix(".weight")
    return prefix if name.endswith(".weight") and prefix in lora_scale else None


def _entry(
    name: str,
    value: torch.Tensor,
    adapters: Mapping[str, torch.Tensor],
    lora_scale: Mapping[str, float],
) -> TensorEntry:
    """The written tensor's entry: a merged weight in the wider of its base's and its
    adapters' dtypes (`merged`), any other in its own (NF4: the dtype it dequantises to)."""
    entry = TensorEntry.of(name, value)
    prefix = _merge_prefix(name, lora_scale)
    if prefix is not None:
        dtype = torch.promote_types(value.dtype, adapters[f"{prefix}.lora_a"].dtype)
        entry = TensorEntry(name, dtype, entry.shape)
    return entry


def merged_tensors(
    sources: Mapping[str, torch.Tensor],
    adapters: Mapping[str, torch.Tensor],
    lora_scale: Mapping[str, float],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on the CPU) of the plain model, one at a time, NF4 weights
    dequantised, adapters merged."""
    for name, value in sources.items():
        full = full_dequantised_weight(value) if is_quantised(value) else full_on_cpu(value)
        prefix = _merge_prefix(name, lora_scale)
        if prefix is not None:
            a, b = adapters[f"{prefix}.lora_a"], adapters[f"{prefix}.lora_b"]
            full = merged(full, a, b, lora_scale[prefix])
        yield name, full
        del full


def _check_layout(model: nn.Module, layout: list[TensorEntry]) -> None:
    """The exported names and shapes are those of the plain model of the spec (wrappers such
    as LoRA, compile and FSDP keep names; a mismatch here is a bug, not bad input)."""
    plain = create_model(model.spec, device="meta").state_dict()
    got = {entry.name: tuple(entry.shape) for entry in layout}
    want = {name: tuple(t.shape) for name, t in plain.items()}
    if got != want:
        differ = sorted(set(got) ^ set(want)) or [n for n in got if got[n] != want[n]]
        raise RuntimeError(f"the exported weights do not match the spec: {differ[:5]}")
