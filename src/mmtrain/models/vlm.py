"""LanguageModel: a decoder LM (models/decoder.py), alone or with images spliced into its text
as LLaVA does (a vision tower's hidden states, a projector, one placeholder id per image).

Read top to bottom: the projector, where each id lands among the LM's positions (`Layout`),
the model (image features, the spliced embeddings, logits, the chunked next-token loss),
generation.

Batch contract (DESIGN.md section 4): "text" int64 [R, T] holds each image as ONE
`projector.image_token_id`; "image" [N, 3, H, W] holds the batch's images in reading order. In
the LM an image takes `spec.image_tokens()` = P positions, so a row of ids ("placeholder
space") is longer in the LM ("position space"). The splice is a pure index computation: each id
owns a span of positions (P for a placeholder, 1 otherwise), the embeddings of every position
are gathered in one indexing op from [text embeddings; image tokens; a zero row for padding],
and the logits are read back at each id's LAST position, so `logits(batch)` has one row per id
of "text" (at a placeholder: the row of the image's last token, which predicts the next id).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmtrain.models.decoder import Decoder, KVCache, document_positions, next_positions, sample
from mmtrain.models.host_copy import to_device
from mmtrain.models.init_rules import apply_init_rules, init_rules
from mmtrain.models.materialize import initialised_parameters
from mmtrain.models.native_vision import NativeVisionTower
from mmtrain.models.sequence_split import SequenceSplit
from mmtrain.models.splice import (
    PAD_DOCUMENT,
    Layout,
    expand_per_id,
    image_placeholders,
    make_layout,
    position_targets,
    splice,
    valid_ids,
)
from mmtrain.models.token_loss import TOKEN_NLL, chunked_nll_sum, chunked_token_nll
from mmtrain.models.towers import Tower
from mmtrain.models.visual_inputs import IMAGE_SOURCES, splice_visual_inputs
from mmtrain.spec import VISION_TOWER, ModelSpec, ProjectorSpec

TEXT = "text"  # the decoder's name among the towers and the batch key of the token ids
LABELS = "labels"  # the next-token targets, aligned with "text" (train/objectives.py's key)
# (length, right_padded, images) of the splice as host ints (`splice_sizes`), set by whoever
# laid out the rows (the loader's workers): the forward then reads nothing from the device.
SPLICE_SIZES = "splice_sizes"


# ----------------------------------------------------------------------------- projector
class Projector(nn.Module):
    """Vision hidden states [N, P, vision_width] -> LM embeddings [N, P, lm_width]: one linear
    layer ("linear", LLaVA-1) or linear, GELU, linear ("mlp", LLaVA-1.5's mlp2x_gelu)."""

    def __init__(self, spec: ProjectorSpec, vision_width: int, lm_width: int):
        super().__init__()
        self.fc1 = nn.Linear(vision_width, lm_width)
        self.fc2 = nn.Linear(lm_width, lm_width) if spec.kind == "mlp" else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc1(x)
        return x if self.fc2 is None else self.fc2(F.gelu(x))


# ----------------------------------------------------------------------------- the model
class LanguageModel(nn.Module):
    """A decoder LM (`spec.decoder`), with an image tower and a projector when `spec.projector`
    is set (a vision-language model). The decoder is the tower named "text", so per-tower
    training settings, FSDP per block and activation checkpointing find it like any tower.

    `logits(batch)` [R, T, vocab], `forward(batch)` {"logits": ...} (or, when the batch has
    "labels", {"nll_sum": ...} without the logits), `generate(batch, n)` [R, n] new tokens;
    see the module docstring for the batch.
    """

    # Set by train/sequence_parallel.py: `nll_sum` then runs the decoder on this rank's slice
    # of every row's positions, after the images are spliced in (no image is cut).
    sequence_split: SequenceSplit | None = None

    def __init__(self, spec: ModelSpec, loss_chunk_rows: int | None = None):
        super().__init__()
        if spec.decoder is None:
            raise ValueError(f"model {spec.name!r} has no decoder; build a MultimodalModel")
        self.spec = spec
        # Positions per chunk of the loss (None: 2**26 logits, `token_loss.default_chunk_rows`).
        self.loss_chunk_rows = loss_chunk_rows
        self.projector_spec = spec.projector
        towers: dict[str, nn.Module] = {}
        self.projector: Projector | None = None
        if spec.projector is not None:
            name = spec.projector.tower
            if name == TEXT:
                raise ValueError(f"the image tower cannot be named {TEXT!r} (the decoder's name)")
            tower = Tower(spec.towers[name], spec.embed_dim)
            towers[name] = tower
            self.feature_blocks = spec.projector.blocks_used(spec.towers[name])
            self._freeze_unused(tower)
        if spec.vision is not None:  # a native-resolution tower (Qwen2-VL), merger included
            towers[VISION_TOWER] = NativeVisionTower(spec.vision)
        towers[TEXT] = Decoder(spec.decoder)  # after the image tower: named_parameters order
        self.towers = nn.ModuleDict(towers)
        if spec.projector is not None:
            vision_width = spec.towers[spec.projector.tower].width
            self.projector = Projector(spec.projector, vision_width, spec.decoder.width)

    def _freeze_unused(self, tower: Tower) -> None:
        # The blocks after the feature layer, the final norm and any pooling head or output
        # projection never run (checkpoints hold them). They never get a gradient, so they are
        # frozen: DDP would otherwise wait for their gradients (or need find_unused_parameters)
        # and the optimizer would carry them.
        unused = [*tower.blocks[self.feature_blocks :], tower.norm_final, tower.pool, tower.proj]
        for module in unused:
            if module is not None:
                module.requires_grad_(False)

    @property
    def decoder(self) -> Decoder:
        return self.towers[TEXT]

    @property
    def image_tower(self) -> Tower | None:
        return None if self.projector_spec is None else self.towers[self.projector_spec.tower]

    # ------------------------------------------------------------------------- images
    def image_features(self, images: Tensor) -> Tensor:
        """Images [N, C, H, W] -> LM embeddings [N, P, lm_width]: the tower's hidden states at
        the feature layer (no final norm), class token dropped unless `keep_cls`, projected."""
        tower = self.image_tower
        x = tower.stem(images)
        if tower.norm_pre is not None:
            x = tower.norm_pre(x)
        for block in tower.blocks[: self.feature_blocks]:
            x = block(x)
        if tower.spec.has_cls_token() and not self.projector_spec.keep_cls:
            x = x[:, 1:]
        return self.projector(x)

    def _image_embeds(self, batch: Mapping[str, Tensor], placeholders: int) -> Tensor | None:
        """The image tokens [N, P, W] of the batch, checked against the placeholder count;
        None when the batch has no "image" key (a text-only batch)."""
        key = "image" if self.projector_spec is None else self.projector_spec.tower
        images = batch.get(key)
        if images is None:
            if placeholders:
                raise ValueError(
                    f"the text holds {placeholders} image placeholder(s) but the batch has no "
                    f"{key!r} tensor; give the images in reading order"
                )
            return None
        if self.projector_spec is None:
            if images.shape[0]:
                raise ValueError(
                    f"this language model has no image tower; the batch holds "
                    f"{images.shape[0]} image(s)"
                )
            return None
        sources = batch.get(IMAGE_SOURCES)  # samples sharing images: each encoded once
        taken = images.shape[0] if sources is None else len(sources)
        if taken != placeholders:
            raise ValueError(
                f"the batch holds {taken} image(s) but its text has {placeholders} "
                f"placeholder(s) (image_token_id {self.projector_spec.image_token_id}); each "
                "image needs exactly one placeholder, in reading order"
            )
        # Distributed rule: under FSDP2 every rank must all-gather (forward) and reduce-scatter
        # (backward) the same sharded modules in the same order, and DDP waits for a gradient of
        # every trained parameter. A VLM's collate therefore always emits "image", also with no
        # image ([0, C, H, W]): the tower and projector then run on the empty batch (their hooks
        # fire like on any rank with images) and `splice` concatenates the empty result into its
        # sources, so backward reaches them with zero gradients. Only a batch with no "image" key
        # skips the tower; that is for streams that are text-only on every rank.
        features = self.image_features(images)
        if sources is None:
            return features
        index = to_device(torch.tensor(sources, dtype=torch.long), features.device)
        return features.index_select(0, index)

    # ------------------------------------------------------------------------- logits
    def _is_image(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Bool [R, T]: the placeholders that take an image (not those in padding)."""
        image_id = None if self.projector_spec is None else self.projector_spec.image_token_id
        return image_placeholders(
            batch[TEXT], image_id, batch.get("attention_mask"), batch.get("document_ids")
        )

    def _check_text(self, batch: Mapping[str, Tensor]) -> Tensor:
        if TEXT not in batch:
            raise KeyError(
                f"a language model needs the token ids under {TEXT!r}; batch keys: "
                f"{', '.join(map(str, batch)) or 'none'}"
            )
        text = batch[TEXT]
        if text.dim() != 2 or text.shape[1] == 0:
            raise ValueError(
                f"{TEXT!r} must be int64 [rows, ids] with at least one id, got {list(text.shape)}"
            )
        for key in ("document_ids", "position_ids", "attention_mask", LABELS):
            if key in batch and batch[key].shape != text.shape:
                raise ValueError(
                    f"{key!r} must have the shape of {TEXT!r} {list(text.shape)} (one entry "
                    f"per id), got {list(batch[key].shape)}"
                )
        return text

    def _decoder_inputs(
        self, batch: Mapping[str, Tensor], right_align: bool = False
    ) -> tuple[Tensor, Layout, dict[str, Tensor | bool]]:
        """The LM's input embeddings [R, L, W], the layout, and the keyword arguments of
        `Decoder.hidden` (positions, masks) in position space."""
        if self.spec.vision is not None:
            return self._native_decoder_inputs(batch, right_align)
        text = self._check_text(batch)
        is_image = self._is_image(batch)
        p = self.spec.image_tokens()
        layout = make_layout(
            is_image, p, right_align, batch.get("attention_mask"), batch.get(SPLICE_SIZES)
        )
        images = self._image_embeds(batch, layout.images)
        text_embeds = self.decoder.embed(text)
        if images is None:
            images = text_embeds.new_zeros(0, max(p, 1), text_embeds.shape[-1])
        embeds = splice(text_embeds, images, is_image, layout)
        return embeds, layout, self._position_inputs(batch, layout, right_align)

    def _native_decoder_inputs(
        self, batch: Mapping[str, Tensor], right_align: bool
    ) -> tuple[Tensor, Layout, dict[str, Tensor | bool]]:
        """A native-resolution VLM's: each image and clip at its own size, 3-D (M-RoPE)
        positions from the layout (models/visual_inputs.py)."""
        text = self._check_text(batch)
        if "position_ids" in batch:
            raise ValueError(
                "a native-resolution VLM computes its M-RoPE positions from the layout "
                "(restarting at each of 'document_ids'); the batch must not give 'position_ids'"
            )
        valid = valid_ids(text, batch.get("attention_mask"), batch.get("document_ids"))
        visual = splice_visual_inputs(
            self.towers[VISION_TOWER], self.spec.vision_tokens, self.decoder.embed(text), batch,
            valid, right_align=right_align, key_mask=batch.get("attention_mask"),
            sizes=batch.get(SPLICE_SIZES), document_ids=batch.get("document_ids"),
        )  # fmt: skip
        kwargs = self._position_inputs(batch, visual.layout, right_align)
        kwargs["position_ids"] = visual.positions
        return visual.embeds, visual.layout, kwargs

    def _position_inputs(
        self, batch: Mapping[str, Tensor], layout: Layout, right_align: bool
    ) -> dict[str, Tensor | bool]:
        """`position_ids`, `document_ids` and `attention_mask` of the expanded rows, and
        `right_padded`.

        Positions: from "position_ids" (an image's j-th token at its placeholder's position
        + j), else restarting at every document of "document_ids", else counting the unmasked
        positions of "attention_mask" (left padding), else 0, 1, ... Padding added to make rows
        L long is a padding document / a masked key. Right-padded rows (training and eval
        batches; `Layout.right_padded`) tell the decoder so: it then attends causally without
        the mask (models/attention.py)."""
        out: dict[str, Tensor | bool] = {}
        mask = None
        if "attention_mask" in batch:
            mask = expand_per_id(batch["attention_mask"].bool(), layout, False)
            out["right_padded"] = layout.right_padded
        elif right_align and bool(layout.valid[:, 0].logical_not().any()):
            mask = layout.valid  # right-aligned rows: their leading padding must not be seen
        if "document_ids" in batch:
            out["document_ids"] = expand_per_id(batch["document_ids"], layout, PAD_DOCUMENT)
        if "position_ids" in batch:
            first = expand_per_id(batch["position_ids"], layout, 0)
            out["position_ids"] = torch.where(layout.valid, first + layout.offset, 0)
        elif "document_ids" in out:
            out["position_ids"] = document_positions(out["document_ids"])
        elif mask is not None:
            out["position_ids"] = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        if mask is not None:
            out["attention_mask"] = mask
        return out

    def logits(self, batch: Mapping[str, Tensor]) -> Tensor:
        """[R, T, vocab]: one row per id of `batch["text"]`; at a placeholder the row of its
        image's last token (it predicts the id after the image)."""
        embeds, layout, kwargs = self._decoder_inputs(batch)
        hidden = self.decoder.hidden(inputs_embeds=embeds, **kwargs)
        index = layout.ends[..., None].expand(-1, -1, hidden.shape[-1])
        return self.decoder.head(hidden.gather(1, index))

    def nll_sum(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Summed next-token NLL of `batch["labels"]` [R, T] (aligned with "text": id t's row
        scores label t + 1; -100: no target), without the batch's logits: the head and the
        cross-entropy run `loss_chunk_rows` positions at a time (models/token_loss.py)."""
        embeds, layout, kwargs = self._decoder_inputs(batch)
        if self.sequence_split is not None:
            return self._split_nll_sum(embeds, position_targets(batch[LABELS], layout), kwargs)
        scored = self._predicting_rows(embeds, layout, kwargs)
        targets = batch[LABELS][:, 1:].reshape(-1)
        return chunked_nll_sum(scored, self.decoder.head_weight, targets, self.loss_chunk_rows)

    def token_nll(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Each target's NLL [R, T - 1] (aligned with `batch["labels"][:, 1:]`; 0 where there
        is none), chunked as `nll_sum`: the per-sample sums of DPO's log-probs (train/dpo.py)
        without the batch's logits."""
        embeds, layout, kwargs = self._decoder_inputs(batch)
        scored = self._predicting_rows(embeds, layout, kwargs)
        targets = batch[LABELS][:, 1:]
        nll = chunked_token_nll(
            scored, self.decoder.head_weight, targets.reshape(-1), self.loss_chunk_rows
        )
        return nll.view(targets.shape)

    def _predicting_rows(
        self, embeds: Tensor, layout: Layout, kwargs: dict[str, Tensor | bool]
    ) -> Tensor:
        """The decoder's output [R x (T - 1), width] at the rows that predict an id: every id's
        last position but the last id's."""
        hidden = self.decoder.hidden(inputs_embeds=embeds, **kwargs)
        index = layout.ends[:, :-1, None].expand(-1, -1, hidden.shape[-1])
        return hidden.gather(1, index).flatten(0, 1)

    def _split_nll_sum(
        self, embeds: Tensor, targets: Tensor, kwargs: dict[str, Tensor | bool]
    ) -> Tensor:
        """This rank's part of `nll_sum` under sequence parallelism: the NLL of the targets at
        its positions (the parts of a sequence-parallel group sum to the whole rows' NLL). The
        head runs on every local position, an image's too (their targets are -100): the
        positions that predict an id are not evenly spread over the ranks."""
        embeds, kwargs, targets = self.sequence_split.split_rows(embeds, kwargs, targets)
        hidden = self.decoder.hidden(inputs_embeds=embeds, **kwargs)
        return chunked_nll_sum(
            hidden.flatten(0, 1), self.decoder.head_weight, targets.reshape(-1),
            self.loss_chunk_rows,
        )  # fmt: skip

    def forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """{"nll_sum": `nll_sum(batch)`} when the batch has "labels" (training: the loss runs
        inside the forward FSDP2 hooks, where the head weight is gathered), {"token_nll":
        `token_nll(batch)`} when it also asks for them (TOKEN_NLL true), else {"logits":
        `logits(batch)`}."""
        if LABELS in batch and batch.get(TOKEN_NLL):
            return {TOKEN_NLL: self.token_nll(batch)}
        if LABELS in batch:
            return {"nll_sum": self.nll_sum(batch)}
        return {"logits": self.logits(batch)}

    # ------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        batch: Mapping[str, Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        eos_ids: tuple[int, ...] | None = None,
        pad_id: int | None = None,
    ) -> Tensor:
        """Up to `max_new_tokens` new tokens per row [R, n] (the prompt not included), with a KV
        cache: the prompt's spliced embeddings are prefilled, then one token at a time.

        Prompts of different lengths are left-padded ("attention_mask" False); rows are
        right-aligned in position space too (images make rows of equal ids unequal), so every
        row's next token goes to the same cache slot. Sampling is `Decoder.generate`'s:
        greedy at `temperature` 0, else nucleus sampling from `generator`; a row ends at any of
        `eos_ids` (default the spec's), keeps it and is filled with `pad_id` (default the first
        eos id) afterwards; generation stops when every row ended.
        """
        decoder = self.decoder
        eos = tuple(decoder.spec.eos_ids if eos_ids is None else eos_ids)
        pad = pad_id if pad_id is not None else (eos[0] if eos else 0)
        text = self._check_text(batch)
        packed = [key for key in ("document_ids", "position_ids") if key in batch]
        if packed:
            raise ValueError(
                f"generate takes one prompt per row, left-padded (attention_mask); the batch "
                f"has {', '.join(packed)} (packed training rows)"
            )
        embeds, layout, kwargs = self._decoder_inputs(batch, right_align=True)
        rows, length = layout.owner.shape
        cache = KVCache(decoder.spec, rows, length + max_new_tokens, text.device, embeds.dtype)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=text.device).expand(rows, length)
        mask = kwargs.get("attention_mask")
        eos_tensor = torch.tensor(eos, dtype=text.dtype, device=text.device)
        done = torch.zeros(rows, dtype=torch.bool, device=text.device)
        new_tokens: list[Tensor] = []
        hidden = decoder.hidden(
            inputs_embeds=embeds, position_ids=positions, attention_mask=mask, cache=cache
        )
        for step in range(max_new_tokens):
            new = sample(decoder.head(hidden[:, -1]), temperature, top_p, generator)
            new = torch.where(done, torch.full_like(new, pad), new)
            new_tokens.append(new)
            done = done | torch.isin(new, eos_tensor)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            positions = next_positions(positions)  # M-RoPE: past the prompt's furthest
            if mask is not None:
                mask = F.pad(mask, (0, 1), value=True)
            hidden = decoder.hidden(
                new[:, None], position_ids=positions, attention_mask=mask, cache=cache
            )
        if not new_tokens:
            return text.new_zeros(rows, 0)
        return torch.stack(new_tokens, dim=1)

    # ------------------------------------------------------------------------- weights
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Random init for training from scratch, in `named_parameters()` order from
        `generator` (drawn on the CPU in float32: the same weights on any device): the image
        tower and the projector by `models.init_rules.init_rules` (the tower as in a
        MultimodalModel; the projector fan-in, biases 0), the decoder by
        `Decoder.init_weights`."""
        rules = init_rules(self)
        prefix = f"towers.{TEXT}."
        # named_parameters order is: image tower, decoder, projector (registration order).
        before = [(n, p) for n, p in initialised_parameters(self) if n.startswith("towers.")]
        apply_init_rules([(n, p) for n, p in before if not n.startswith(prefix)], rules, generator)
        self.decoder.init_weights(generator)
        if self.projector is not None:
            apply_init_rules(
                [(f"projector.{n}", p) for n, p in self.projector.named_parameters()],
                rules,
                generator,
            )
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute derived (non-persistent) buffers of the submodules that have them."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()
