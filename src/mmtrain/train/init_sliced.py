"""`init` read slice by slice, for a model sharded before it has weights (FSDP2 on several
ranks, train/model_setup.py): each rank reads from the baseline's safetensors files only the
rows of dim 0 it owns (`safe_open(...).get_slice`), one file open at a time, so no rank ever
holds the whole model or maps every shard file at once.

Sources read this way:
- an mmtrain model or run folder (`model.safetensors` + `spec.yaml`, or its shards and index):
  our own names, `init: PATH` for the whole model;
- a Hugging Face Llama / Qwen2 folder (one file or shards with an index) as the decoder of an
  LM (`init: PATH`) or of a VLM (`init: {text: PATH}`); its key map (models/formats/hf_llama.py)
  concatenates q, k, v and gate, up along dim 0, so a row range of ours is row ranges of
  theirs.

The plan is made from the files' headers alone (names and shapes). It is taken only when it
fits exactly: every tensor it names exists in the model with the same shape (a decoder's
vocabulary may grow: new rows are the mean of the source's rows, as in init_lm.py) and every
tensor of the model it leaves out is one a baseline never has (LoRA adapters; a VLM's image
tower and projector when only `text` is named). Otherwise `plan_sliced_init` returns None and
the set-up reads the baseline whole (init.py), with its precise errors and its other formats.
QLoRA's NF4 weights are the exception to reading rows: each rank reads the whole of such a
tensor (one at a time), quantises it and keeps its rows, so all ranks share its scales.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from mmtrain.atomic import sha256_file
from mmtrain.folders import INDEX_FILE, WEIGHTS_FILE
from mmtrain.models.materialize import copy_rows_, local_rows
from mmtrain.spec import ModelSpec
from mmtrain.train.init_lm import DECODER, VOCAB_ROWS, grow_rows
from mmtrain.train.lora import is_adapter
from mmtrain.train.qlora import copy_full_nf4_, is_quantised

log = logging.getLogger(__name__)

HF_DECODERS = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class Part:
    """Rows of one of our tensors held by one source tensor (parts concatenate on dim 0)."""

    file: Path
    key: str
    rows: int


@dataclass
class SlicedInit:
    parts: dict[str, list[Part]]  # our full name -> its parts, in order
    grown: dict[str, int] = field(default_factory=dict)  # our name -> rows the source has
    files: list[Path] = field(default_factory=list)


def plan_sliced_init(model: nn.Module, init: str | Mapping[str, str]) -> SlicedInit | None:
    """The sliced plan of `init` for `model` (built on the meta device), or None when some
    source or tensor needs the whole-model path."""
    spec: ModelSpec = model.spec
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if isinstance(init, str):
        sources = {"": Path(init)}
    elif set(init) == {DECODER} and spec.decoder is not None:
        sources = {f"towers.{DECODER}.": Path(init[DECODER])}
    else:
        return None
    plan = SlicedInit(parts={})
    for prefix, path in sources.items():
        found = _source_parts(path, spec, prefix)
        if found is None:
            return None
        parts, files = found
        plan.parts.update(parts)
        plan.files += files
    for name, parts in plan.parts.items():
        rows = sum(part.rows for part in parts)
        if name not in shapes or not _fits(name, rows, shapes[name]):
            return None
        if rows != shapes[name][0]:
            plan.grown[name] = rows
    left = [n for n in shapes if n not in plan.parts and not is_adapter(n)]
    if any(name.startswith(prefix) for name in left for prefix in sources):
        return None  # the baseline lacks tensors of the part it is to fill
    return plan


def _fits(name: str, rows: int, shape: tuple[int, ...]) -> bool:
    """Rows of the source fit the model's tensor: equal, or fewer for a growing vocabulary."""
    grows = name in VOCAB_ROWS and rows < shape[0]
    return rows == shape[0] or grows


def _source_parts(
    path: Path, spec: ModelSpec, prefix: str
) -> tuple[dict[str, list[Part]], list[Path]] | None:
    """Our names -> parts of the baseline at `path` (None: not a format read in slices)."""
    files = _weight_files(path)
    if files is None:
        return None
    headers = _headers(files)
    if (path / "spec.yaml").is_file():
        if prefix or not _same_architecture(ModelSpec.load(path / "spec.yaml"), spec):
            return None  # the whole-model path matches towers and says what differs
        return {key: [Part(file, key, shape[0] if shape else 1)] for key, (file, shape) in
                headers.items()}, files  # fmt: skip
    return _hf_decoder_parts(path, spec, prefix, headers, files)


def _same_architecture(source: ModelSpec, spec: ModelSpec) -> bool:
    ours, theirs = spec.to_dict(), source.to_dict()
    ours.pop("name", None), theirs.pop("name", None)
    return ours == theirs


def _hf_decoder_parts(path, spec, prefix, headers, files):
    config_file = path / "config.json"
    if not config_file.is_file() or spec.decoder is None:
        return None
    config = json.loads(config_file.read_text())
    if not set(config.get("architectures") or []) & set(HF_DECODERS):
        return None
    if prefix == "" and spec.projector is not None:
        return None  # a whole VLM from an LM folder: the whole-model path says what is missing
    from mmtrain.models.formats.hf_llama import key_map, spec_from_config

    source_spec = spec_from_config(config, config_file)
    if source_spec.tie_embeddings and "lm_head.weight" in headers:
        return None  # init_lm checks such a repeated head equals the embedding: read whole
    prefix = prefix or f"towers.{DECODER}."
    parts: dict[str, list[Part]] = {}
    for pair in key_map(source_spec):
        if any(theirs not in headers for theirs, _ in pair.theirs):
            return None
        parts[prefix + pair.ours] = [
            Part(headers[theirs][0], theirs, shape[0]) for theirs, shape in pair.theirs
        ]
    return parts, files


def _weight_files(folder: Path) -> list[Path] | None:
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text()).get("weight_map", {})
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    return None


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor's file and shape, from the headers only (no tensor is read)."""
    found = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                found[key] = (file, tuple(f.get_slice(key).get_shape()))
    return found


# ----------------------------------------------------------------------------- loading
@torch.no_grad()
def load_sliced_init(model: nn.Module, plan: SlicedInit) -> dict[str, str]:
    """Copy this rank's rows of every planned tensor into `model` (materialised, sharded or
    not); returns {file: sha256} of the files read, for the run's resolved config."""
    params = dict(model.named_parameters())
    for name, parts in plan.parts.items():
        param = params[name]
        if param.dim() == 0:  # a logit scale or bias: whole on every rank (never sharded)
            with safe_open(str(parts[0].file), framework="pt") as f:
                param.copy_(f.get_tensor(parts[0].key))
            continue
        if is_quantised(param):  # QLoRA's NF4: the whole tensor quantised, this rank's rows kept
            full = _read_rows(parts, 0, param.shape[0])
            copy_full_nf4_(param, full.reshape(param.shape))
            continue
        start, end = local_rows(param)
        if name in plan.grown:
            full = grow_rows(_read_rows(parts, 0, plan.grown[name]), param.shape[0], param.dtype)
            rows = full[start:end]
        else:
            rows = _read_rows(parts, start, end)
        copy_rows_(param, rows.reshape(end - start, *param.shape[1:]))
    random = [n for n in params if n not in plan.parts]
    log.info("init: %d tensors read in slices of dim 0 from %d files", len(plan.parts),
             len(plan.files))  # fmt: skip
    if random:
        log.info("init: %d tensors keep their random init: %s", len(random), random[0])
    return {str(file): sha256_file(file) for file in plan.files}


def _read_rows(parts: list[Part], start: int, end: int) -> Tensor:
    """Rows [start, end) of the concatenation of `parts` along dim 0, reading only those."""
    pieces, offset = [], 0
    for part in parts:
        lo, hi = max(start, offset), min(end, offset + part.rows)
        if lo < hi:
            with safe_open(str(part.file), framework="pt") as f:
                pieces.append(f.get_slice(part.key)[lo - offset : hi - offset])
        offset += part.rows
    if not pieces:  # this rank holds no row of the tensor (more ranks than rows)
        with safe_open(str(parts[0].file), framework="pt") as f:
            return f.get_slice(parts[0].key)[0:0]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
