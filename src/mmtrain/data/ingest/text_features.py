"""A frozen text encoder mmtrain has: the text tower of a model folder (a CLIP trained with
mmtrain, such as the image-text quickstart's `run/`, or `mmtrain convert --from openclip`'s
output) turns captions into what an MMDiT is conditioned on (models/mmdit.py).

Per caption it gives the tower's final hidden states [text_tokens, text_width] (after its final
norm, before pooling; every position, the padding included as the tower computes it, so each
caption has the same `text_tokens` = the stem's context length, as SD3's cached CLIP states
have 77) and its pooled embedding [pooled_width]: the text embedding zero-shot compares,
*before* normalisation. SD3 feeds its CLIPs' projected `text_embeds` unnormalised too, the
MMDiT's pooled MLP learns its own scale, and `F.normalize(pooled)` is the zero-shot embedding
exactly, so nothing the tower computes is thrown away.

Captions are tokenized as the model was trained: its tokenizer (`tokenizer_of`) at its stem's
context length. Float32, in eval mode under `torch.no_grad`, a fixed batch order: the same
captions give the same arrays. It tokenizes, so it lives in data/ (models do not import data):
`mmtrain data encode-latents --text-encoder` caches its outputs beside each latent
(data/ingest/latents.py) and `mmtrain generate --prompt` runs it on prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from mmtrain.data.stream.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer
from mmtrain.models.build import load_model
from mmtrain.structured import FieldError

__all__ = ["TextEncoder", "TextEncoderError", "TextShape", "load_text_encoder", "tokenizer_of"]

# Files beside the weights that say how a converted folder tokenizes (OpenCLIP's merges file).
TOKENIZER_FILES = ("tokenizer.json", "bpe_simple_vocab_16e6.txt.gz", "bpe_simple_vocab_16e6.txt")


class TextEncoderError(ValueError):
    """A folder that cannot serve as a text encoder; the message names it and what to do."""


@dataclass(frozen=True)
class TextShape:
    """What the encoder gives per caption: the three numbers of an MMDiT's denoiser section."""

    text_tokens: int
    text_width: int
    pooled_width: int

    def __str__(self) -> str:
        return ", ".join(f"{name} {value}" for name, value in asdict(self).items())


class TextEncoder:
    """A model's text tower with its tokenizer: captions -> (hidden, pooled), float32 on the CPU."""

    def __init__(
        self,
        tower: torch.nn.Module,
        tokenizer: Tokenizer,
        shape: TextShape,
        *,
        path: str,
        tower_name: str,
        tokenizer_name: str,
        batch_size: int = 64,
    ):
        self.tower = tower.eval()
        self.tokenizer = tokenizer
        self.shape = shape
        self.path = path
        self.tower_name = tower_name
        self.tokenizer_name = tokenizer_name
        self.batch_size = batch_size

    def record(self) -> dict[str, Any]:
        """What a latent manifest keeps about the encoder (`mmtrain generate` reads it back)."""
        return {"path": self.path, "tower": self.tower_name, "tokenizer": self.tokenizer_name,
                **asdict(self.shape)}  # fmt: skip

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 CPU tensors [N, text_tokens, text_width] and [N, pooled_width] for `texts`,
        `batch_size` at a time in order."""
        s = self.shape
        hidden = [torch.zeros(0, s.text_tokens, s.text_width)]
        pooled = [torch.zeros(0, s.pooled_width)]
        device = next(self.tower.parameters()).device
        for start in range(0, len(texts), self.batch_size):
            ids = self.tokenizer(list(texts[start : start + self.batch_size]), s.text_tokens)
            ids = ids.to(device)
            tokens = self.tower.forward_tokens(ids)
            hidden.append(tokens.float().cpu())
            pooled.append(self.tower.pool_and_project(tokens, ids).float().cpu())
        return torch.cat(hidden), torch.cat(pooled)


def load_text_encoder(
    folder: str | Path, *, device: str | torch.device = "cpu", batch_size: int = 64
) -> TextEncoder:
    """The text tower of the model folder `folder` (its first, if it has several), in float32 on
    `device`. FileNotFoundError / FieldError for a folder that is no model folder,
    TextEncoderError for a model without a text tower or without a tokenizer to know."""
    folder = Path(folder)
    model = load_model(folder, device=device, dtype=torch.float32)
    spec = model.spec
    towers = {n: t for n, t in spec.towers.items() if t.modality == "text"}
    if spec.decoder is not None or spec.denoiser is not None or not towers:
        kind = "a denoiser" if spec.denoiser else "a language model" if spec.decoder else ""
        has = kind or "towers: " + ", ".join(spec.towers)
        raise TextEncoderError(
            f"{folder}: {spec.name} has no text tower to encode with ({has}); give a model "
            "folder with one, e.g. a CLIP trained with mmtrain or converted by `mmtrain "
            "convert --from openclip`"
        )
    name, tower = next(iter(towers.items()))
    tokenizer, tokenizer_name = tokenizer_of(folder, tower.stem)
    pooled = spec.embed_dim if tower.output_proj else tower.width
    shape = TextShape(tower.stem.context_length, tower.width, pooled)
    return TextEncoder(model.towers[name], tokenizer, shape, path=str(folder.resolve()),
                       tower_name=name, tokenizer_name=tokenizer_name, batch_size=batch_size)  # fmt: skip


def tokenizer_of(folder: Path, stem: Any) -> tuple[Tokenizer, str]:
    """The tokenizer the text tower of `folder` was trained with, and its name: a run's
    config.yaml `data.tokenizer` (a relative path found in the run folder when it is there),
    else a tokenizer file beside the weights (TOKENIZER_FILES), else mmtrain's byte-level one,
    but only for a byte-sized vocabulary: ids of another tokenizer would be silently wrong."""
    name = _run_tokenizer(folder) or next(
        (str(folder / f) for f in TOKENIZER_FILES if (folder / f).is_file()), None
    )
    if name is None:
        if stem.vocab_size != ByteTokenizer.vocab_size:
            raise TextEncoderError(
                f"{folder}: no config.yaml naming data.tokenizer and no tokenizer file beside "
                f"the weights, and its text tower's {stem.vocab_size} ids are not mmtrain's "
                f"byte-level {ByteTokenizer.vocab_size}: put its tokenizer in the folder "
                f"({' or '.join(TOKENIZER_FILES[:2])})"
            )
        name = "byte"
    try:
        tokenizer = get_tokenizer(name)
    except FieldError as err:
        raise TextEncoderError(f"{folder}: its tokenizer {err.message}") from None
    if tokenizer.vocab_size > stem.vocab_size:
        raise TextEncoderError(
            f"{folder}: its tokenizer {name} has {tokenizer.vocab_size} ids, more than the text "
            f"tower's {stem.vocab_size}: not the tokenizer it was trained with"
        )
    return tokenizer, name


def _run_tokenizer(folder: Path) -> str | None:
    """`data.tokenizer` of a run folder's config.yaml ('byte', the default, when a run config
    names none); None without a run config."""
    config = folder / "config.yaml"
    try:
        data = yaml.safe_load(config.read_text()) if config.is_file() else None
    except (OSError, yaml.YAMLError) as err:
        raise TextEncoderError(f"{config}: not a readable run config ({err})") from None
    section = data.get("data") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        return None
    value = section.get("tokenizer", "byte")
    if not isinstance(value, str):
        raise TextEncoderError(f"{config}: data.tokenizer must be a name or a path, got {value!r}")
    if value != "byte" and not Path(value).is_absolute() and (folder / value).exists():
        return str(folder / value)
    return value
