"""A diffusers pipeline folder's own text encoders: captions -> what its transformer takes,
computed by the pipeline's own `encode_prompt` (never a re-implementation of its encoders).

`data encode-latents SHARDS --pipeline DIR` encodes images with the folder's `vae/` and
captions with this: the pipeline class `model_index.json` names, loaded from the folder
without its transformer and VAE (`transformer=None, vae=None`), so its text encoders and
tokenizers are exactly the folder's. Per caption it gives the transformer's text inputs, which
the native MMDiT reads as `.text_hidden.npy` and `.text_pooled.npy` (data/ingest/latents.py):

- StableDiffusion3Pipeline: CLIP-L and CLIP-G's penultimate states side by side, padded to
  T5's width, then T5's states ([77 + max_sequence_length, 4096] for SD3), and both CLIPs'
  projected pooled embeddings side by side ([2048]).
- FluxPipeline: T5's states [max_sequence_length, 4096] and CLIP-L's pooled output [768] (its
  `text_ids` are zeros the transformer's positions take, not data, and are not stored).
- WanPipeline: UMT5's states [max_sequence_length, 4096], zero past the caption's tokens as Wan
  pads them; Wan's transformer takes no pooled vector, so none is stored (pooled_width 0).

No family's transformer takes an attention mask over the text (padding is attended as the
pipeline attends it, Wan's zeros included), so no mask is stored. The components are loaded in
float32: the arrays are stored in float32, and the shape is the pipeline's own answer for an
empty caption. `max_sequence_length` defaults to what the pipeline generates with (its
`__call__`'s default: 512 for Wan, whose encode_prompt alone would take 226).

Each component's identity (its folder, class and the sha256 of its config.json; a tokenizer's,
of its files) goes into the latent manifest, so latents and text features name what made them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmtrain.data.ingest.text_features import TextShape

__all__ = [
    "FAMILIES",
    "PipelineFolderError",
    "PipelineTextEncoder",
    "component_identity",
    "load_pipeline_text_encoder",
    "pipeline_identity",
    "read_model_index",
    "refuse_other_components",
]

INDEX_FILE = "model_index.json"
CONFIG_FILE = "config.json"


class PipelineFolderError(ValueError):
    """A folder that cannot serve as a pipeline's encoders; the message names it and why."""


@dataclass(frozen=True)
class PipelineFamily:
    """What mmtrain needs to know of a pipeline class to run its `encode_prompt`."""

    text_encoders: tuple[str, ...]  # model_index.json entries encode_prompt runs, in order
    tokenizers: tuple[str, ...]
    names: str  # the encoders, as a reader knows them
    extra_prompts: int  # the prompt_2 (, prompt_3) arguments: None, the same caption
    hidden: int  # where encode_prompt's result holds the hidden states
    pooled: int | None  # and the pooled vector (None: the family's transformer takes none)
    keywords: tuple[tuple[str, Any], ...] = ()  # its other arguments, fixed
    per_prompt: str = "num_images_per_prompt"  # encode_prompt's name of the copies a caption


FAMILIES = {
    "StableDiffusion3Pipeline": PipelineFamily(
        text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"),
        tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3"),
        names="CLIP-L, CLIP-G and T5",
        extra_prompts=2,
        hidden=0,  # (prompt_embeds, negative_prompt_embeds, pooled, negative_pooled)
        pooled=2,
        keywords=(("do_classifier_free_guidance", False),),
    ),
    "FluxPipeline": PipelineFamily(
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        names="CLIP-L and T5",
        extra_prompts=1,
        hidden=0,  # (prompt_embeds, pooled_prompt_embeds, text_ids)
        pooled=1,
    ),
    "WanPipeline": PipelineFamily(
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        names="UMT5",
        extra_prompts=0,
        hidden=0,  # (prompt_embeds, negative_prompt_embeds)
        pooled=None,
        keywords=(("do_classifier_free_guidance", False),),
        per_prompt="num_videos_per_prompt",
    ),
}


def read_model_index(folder: str | Path) -> tuple[str, dict[str, Any]]:
    """(class name, model_index.json) of a pipeline folder of a supported family;
    PipelineFolderError naming the file or the class (and what is supported) otherwise."""
    folder = Path(folder)
    file = folder / INDEX_FILE
    if not file.is_file():
        raise PipelineFolderError(
            f"{folder}: no {INDEX_FILE}, so not a diffusers pipeline folder; give the folder "
            "`pipeline.save_pretrained` wrote (or a VAE folder with --vae)"
        )
    try:
        index = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PipelineFolderError(f"{file}: not readable JSON ({err})") from None
    name = index.get("_class_name") if isinstance(index, dict) else None
    if name not in FAMILIES:
        raise PipelineFolderError(
            f"{file}: _class_name {name!r} is not a pipeline mmtrain encodes with; supported: "
            f"{', '.join(FAMILIES)}"
        )
    return name, index


def component_identity(folder: str | Path, config: str | None = CONFIG_FILE) -> dict[str, Any]:
    """What a manifest keeps of a component: its folder, class and the sha256 of its config
    file; with `config` None (a tokenizer: its vocabulary is what identifies it), the sha256 of
    its files, name and bytes."""
    folder = Path(folder).resolve()
    file = folder / config if config is not None else None
    if file is not None:
        data = file.read_bytes()
        try:
            parsed = json.loads(data) if config.endswith(".json") else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            parsed = {}
        kind = parsed.get("_class_name") or (parsed.get("architectures") or [None])[0]
        return {"folder": str(folder), "class": kind, "config_sha256": _sha256(data)}
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return {"folder": str(folder), "files_sha256": digest.hexdigest()}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pipeline_identity(folder: str | Path) -> dict[str, Any]:
    """What a manifest keeps of the pipeline itself: its folder, class and the sha256 of its
    model_index.json."""
    folder = Path(folder).resolve()
    class_name, _ = read_model_index(folder)
    data = (folder / INDEX_FILE).read_bytes()
    return {"folder": str(folder), "class": class_name, "model_index_sha256": _sha256(data)}


def refuse_other_components(latent: Mapping[str, Any], pipeline: str | Path, where: str) -> None:
    """Latents (and text features) made by other components than `pipeline`'s are refused:
    PipelineFolderError naming the first component of the manifest's latent section
    (`latent.components`, what `encode-latents` recorded) whose config differs from the one of
    the same name in the pipeline folder. Components the manifest does not name are not
    checked (a plain `--vae` run records only its VAE)."""
    recorded = latent.get("components") if isinstance(latent, Mapping) else None
    for name, identity in (recorded or {}).items():
        if not isinstance(identity, Mapping) or "config_sha256" not in identity:
            continue  # a tokenizer's files: the encoder's config already names its family
        ours = Path(pipeline) / name
        mine = component_identity(ours) if (ours / CONFIG_FILE).is_file() else None
        if mine is None or mine["config_sha256"] != identity["config_sha256"]:
            theirs = f"{identity.get('class')} of {identity.get('folder')}"
            has = "has none" if mine is None else f"holds another ({mine['class']})"
            raise PipelineFolderError(
                f"{where} was encoded by the {name} {theirs} (config sha256 "
                f"{str(identity['config_sha256'])[:12]}), and the pipeline {pipeline} {has}: "
                f"encode the data again with `mmtrain data encode-latents --pipeline {pipeline}`"
            )


class PipelineTextEncoder:
    """A pipeline's own encode_prompt: captions -> (hidden, pooled), float32 on the CPU; the
    same interface as text_features.TextEncoder, so encode_latent_shards takes either."""

    def __init__(self, pipe: Any, family: PipelineFamily, folder: Path, class_name: str,
                 max_sequence_length: int | None, batch_size: int):  # fmt: skip
        self.pipe, self.family, self.folder = pipe, family, folder
        self.class_name, self.batch_size = class_name, batch_size
        self.max_sequence_length = max_sequence_length
        hidden, pooled = self._encode([""])
        self.shape = TextShape(hidden.shape[1], hidden.shape[2], pooled.shape[1])
        self.components = {name: component_identity(folder / name) for name in family.text_encoders}
        for name in family.tokenizers:
            self.components[name] = component_identity(folder / name, config=None)

    def record(self) -> dict[str, Any]:
        """What a latent manifest keeps about the encoder (no `path`: that key names an
        mmtrain model folder `generate --prompt` loads)."""
        return {"pipeline": str(self.folder.resolve()), "class": self.class_name,
                "encoders": self.family.names, "max_sequence_length": self.max_sequence_length,
                "text_tokens": self.shape.text_tokens, "text_width": self.shape.text_width,
                "pooled_width": self.shape.pooled_width}  # fmt: skip

    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 CPU tensors [N, text_tokens, text_width] and [N, pooled_width] for `texts`,
        `batch_size` at a time in order ([N, 0] for a family without a pooled vector)."""
        s = self.shape
        hidden = [torch.zeros(0, s.text_tokens, s.text_width)]
        pooled = [torch.zeros(0, s.pooled_width)]
        for start in range(0, len(texts), self.batch_size):
            h, p = self._encode(list(texts[start : start + self.batch_size]))
            hidden.append(h)
            pooled.append(p)
        return torch.cat(hidden), torch.cat(pooled)

    @torch.no_grad()
    def _encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.family
        keywords = dict(f.keywords)
        if self.max_sequence_length is not None:
            keywords["max_sequence_length"] = self.max_sequence_length
        keywords[f.per_prompt] = 1
        device = next(getattr(self.pipe, f.text_encoders[0]).parameters()).device
        out = self.pipe.encode_prompt(texts, *([None] * f.extra_prompts), device=device,
                                      **keywords)  # fmt: skip
        hidden = out[f.hidden].float().cpu()
        if f.pooled is None:  # Wan: no pooled vector; an empty one keeps the interface
            return hidden, hidden.new_zeros(hidden.shape[0], 0)
        return hidden, out[f.pooled].float().cpu()


def load_pipeline_text_encoder(
    folder: str | Path,
    *,
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    max_sequence_length: int | None = None,
) -> PipelineTextEncoder:
    """The text encoders and tokenizers of the pipeline folder `folder`, run by its own class's
    encode_prompt (float32, on `device`); `max_sequence_length` None: the pipeline's default.
    PipelineFolderError for a folder of no supported pipeline or without an encoder it needs."""
    import diffusers

    folder = Path(folder)
    class_name, index = read_model_index(folder)
    family = FAMILIES[class_name]
    for name in (*family.text_encoders, *family.tokenizers):
        entry = index.get(name)
        if not (isinstance(entry, list) and entry and entry[0]) or not (folder / name).is_dir():
            raise PipelineFolderError(
                f"{folder}: {class_name} encodes captions with {family.names}, and its "
                f"{name} is {'missing' if entry is None else 'null'} in {INDEX_FILE} or has "
                f"no folder; give the whole pipeline folder"
            )
    pipeline_class = getattr(diffusers, class_name)
    default = _default_sequence_length(pipeline_class)
    if max_sequence_length is not None and default is None:
        raise PipelineFolderError(f"{class_name}.encode_prompt takes no max_sequence_length")
    try:
        pipe = pipeline_class.from_pretrained(folder, transformer=None, vae=None,
                                              dtype=torch.float32, local_files_only=True)  # fmt: skip
    except (OSError, ValueError) as err:
        raise PipelineFolderError(f"{folder}: {class_name} does not load ({err})") from None
    pipe.to(device)
    if max_sequence_length is None and default is not None:
        max_sequence_length = default
    return PipelineTextEncoder(pipe, family, folder, class_name, max_sequence_length, batch_size)


def _default_sequence_length(pipeline_class: type) -> int | None:
    """The text length the pipeline generates with: its `__call__`'s max_sequence_length
    default (what its transformer sees at inference), else encode_prompt's; None when it takes
    none. (Wan's encode_prompt defaults to 226 while WanPipeline() encodes 512 tokens.)"""
    for method in (pipeline_class.__call__, pipeline_class.encode_prompt):
        parameter = inspect.signature(method).parameters.get("max_sequence_length")
        if parameter is not None and isinstance(parameter.default, int):
            return parameter.default
    return None
