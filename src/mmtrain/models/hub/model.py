"""A transformers model trained as it is, behind the protocol the loop talks to.

`HubModel` holds transformers' own module (`hf`, built from a folder's config) and gives the
loop what a native model gives it: `spec`, `towers` (train/optim.py's freezing and per-tower
learning rates, LoRA, activation checkpointing, compile and FSDP2 per block), and
`forward(batch) -> {"nll_sum"}`, the next-token loss summed over the batch's targets, or
{"token_nll"}, each target's NLL, when the batch asks (TOKEN_NLL: DPO's per-sample log-probs);
a preference pair batch's images go through the vision encoder once (PAIRED_PIXELS,
models/hub/shared_pixels.py).

The loss is mmtrain's: the inner model's final hidden state goes through the head a chunk of
positions at a time (models/token_loss.py), never the batch's full logits, normalised by the
step's targets in train/objectives.py. Where the class transforms its logits beyond the head
(a soft cap, a logit scale), the model's own forward computes them and the loss takes them
whole (`out["logits"]`), so the loss is still the class's.

The state dict is the transformers model's (`hf.` prefix stripped by `export`), so an export
is `save_pretrained` of the same class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from mmtrain.hub_spec import HubSpec
from mmtrain.models.hub.shared_pixels import PAIRED_PIXELS, encoded_once
from mmtrain.models.hub.source import model_class, read_config, resolve_folder
from mmtrain.models.hub.towers import HubTower, find_towers
from mmtrain.models.token_loss import TOKEN_NLL, chunked_nll_sum, chunked_token_nll
from mmtrain.spec import ModelSpec

LABELS_KEY = "labels"
GENERATION_FILE = "generation_config.json"
DOCUMENTS_KEY = "document_ids"  # packed rows: the sample of each position (-1: padding)
# Text-config fields that change logits after the head: the loss then takes the class's logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class HubModel(nn.Module):
    def __init__(self, spec: ModelSpec, hf: nn.Module, loss_chunk_rows: int | None = None):
        super().__init__()
        assert spec.hub is not None
        self.spec = spec
        self.hf = hf
        self.loss_chunk_rows = loss_chunk_rows
        self._towers = find_towers(hf, prefix="hf.")
        section = hf.config.get_text_config()
        self.own_logits = any(getattr(section, f, None) for f in LOGIT_TRANSFORMS)

    @property
    def towers(self) -> dict[str, HubTower]:
        return self._towers

    def inner(self) -> nn.Module:
        """The class's model without its head (`XForConditionalGeneration.model`)."""
        return getattr(self.hf, self.hf.base_model_prefix, self.hf.model)

    def forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        paired = bool(batch.get(PAIRED_PIXELS, False))
        encoder = self._towers["vision"].encoder() if paired and "vision" in self._towers else None
        with contextlib.nullcontext() if encoder is None else encoded_once(encoder):
            return self._forward({k: v for k, v in batch.items() if k != PAIRED_PIXELS})

    def _forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        inputs = {k: v for k, v in batch.items() if k != LABELS_KEY}
        labels = batch.get(LABELS_KEY)
        if DOCUMENTS_KEY in inputs:  # packed rows: positions restart per sample
            inputs["position_ids"] = packed_positions(self.inner(), inputs)
        by_token = bool(inputs.pop(TOKEN_NLL, False))
        if labels is None or self.own_logits:
            logits = self.hf(**inputs, use_cache=False).logits
            return {"logits": logits}
        hidden = self.inner()(**inputs, use_cache=False).last_hidden_state
        # The target of position t is labels[t + 1]: the last position predicts nothing.
        rows = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        targets = labels[:, 1:]
        head = self.hf.get_output_embeddings().weight
        if by_token:  # each target's NLL [R, T - 1] (DPO's per-sample log-probs)
            nll = chunked_token_nll(rows, head, targets.reshape(-1), self.loss_chunk_rows)
            return {TOKEN_NLL: nll.view(targets.shape)}
        return {"nll_sum": chunked_nll_sum(rows, head, targets.reshape(-1), self.loss_chunk_rows)}

    def logits(self, batch: Mapping[str, Tensor]) -> Tensor:
        inputs = {k: v for k, v in batch.items() if k != LABELS_KEY}
        if DOCUMENTS_KEY in inputs:
            inputs["position_ids"] = packed_positions(self.inner(), inputs)
        return self.hf(**inputs, use_cache=False).logits


def packed_positions(inner: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """Position ids of packed rows (and "document_ids" taken out of `inputs`): each sample's
    own positions, as if it were alone in its row. With no attention mask, transformers reads
    the restarts as sample boundaries and keeps attention inside each sample.

    A class with 3-D rotary positions (`get_rope_index`: Qwen3-VL) gets them per sample from
    the class itself, over that sample's ids and image grids, under the text positions its
    forward takes first ([4, rows, T]); others get [rows, T]."""
    documents = inputs.pop(DOCUMENTS_KEY)
    text = _restarting(documents)
    rope = getattr(inner, "get_rope_index", None)
    if rope is None or "image_grid_thw" not in inputs:
        return text
    ids, kinds = inputs["input_ids"], inputs["mm_token_type_ids"]
    grids = inputs["image_grid_thw"]
    spatial = torch.zeros((3, *ids.shape), dtype=torch.long, device=ids.device)
    used = 0
    for row in range(ids.shape[0]):
        for document in documents[row].unique().tolist():
            where = (documents[row] == document).nonzero().flatten()
            span = slice(int(where[0]), int(where[-1]) + 1)
            images = _image_runs(kinds[row, span]) if document >= 0 else 0
            if images == 0:
                spatial[:, row, span] = text[row, span]
                continue
            positions, _ = rope(
                ids[row : row + 1, span],
                mm_token_type_ids=kinds[row : row + 1, span],
                image_grid_thw=grids[used : used + images],
            )
            spatial[:, row, span] = positions[:, 0]
            used += images
    return torch.cat([text[None], spatial])


def _restarting(documents: Tensor) -> Tensor:
    """0, 1, 2, ... within each run of equal document ids (padding, -1, is a run too)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    start = torch.ones_like(documents, dtype=torch.bool)
    start[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(start, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def _image_runs(kinds: Tensor) -> int:
    """Images in a sample: runs of image tokens (mm_token_type_ids == 1)."""
    image = (kinds == 1).long()
    return int((image[1:] > image[:-1]).sum() + image[0])


def hub_spec_of(folder: Path, source: str, hf: nn.Module | None = None) -> ModelSpec:
    """The spec of the transformers model `folder` holds: its class, and each tower's parameters
    counted on a meta-device build (no memory, no weights read; `hf`: that build, if made)."""
    if hf is None:
        hf = build_hub_module(folder, device="meta")
    config = read_config(folder)
    towers = find_towers(hf)
    section = hf.config.get_text_config()
    hub = HubSpec(
        source=source,
        architecture=type(hf).__name__,
        model_type=str(config.get("model_type", "")),
        tower_params={name: sum(p.numel() for p in t.parameters()) for name, t in towers.items()},
        text_width=int(section.hidden_size),
        text_layers=int(section.num_hidden_layers),
        vocab_size=int(section.vocab_size),
        tied_embeddings=tied(hf),
    )
    return ModelSpec(
        name=Path(source).name or source,
        embed_dim=hub.text_width,
        towers={},
        objective="next_token",
        hub=hub,
    )


def create_hub_model(
    spec: ModelSpec,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> HubModel:
    """The HubModel of `spec`: its class built from the source's config, randomly initialised
    by the class's own init from `seed` (the global RNG is forked, so a caller's draws are
    untouched), on `device` ("meta": no memory, no init)."""
    folder = resolve_folder(spec.hub.source, "model")
    if device.type == "meta":
        return HubModel(spec, build_hub_module(folder, device=device, dtype=dtype))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = build_hub_module(folder, device="cpu", dtype=dtype)
    return HubModel(spec, hf.to(device))


def build_hub_module(
    folder: Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    require_processor: bool = True,
) -> nn.Module:
    """The folder's transformers model built from its config (random init; on "meta": no
    memory), in `dtype` (default: the class's float32); `require_processor`: see
    `model_class`."""
    import transformers

    cls = model_class(folder, require_processor=require_processor)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with torch.device(device):
        hf = cls._from_config(config, dtype=dtype or torch.float32)
    if (folder / GENERATION_FILE).is_file():  # kept by save_pretrained: the export's too
        hf.generation_config = transformers.GenerationConfig.from_pretrained(str(folder))
    return hf


def tied(hf: nn.Module) -> bool:
    head, embed = hf.get_output_embeddings(), hf.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight
