"""Wan 2.x's WanTransformer3DModel as a hub denoiser: what WanPipeline does around it.

WanPipeline hands the transformer the latent video as it is, [B, C, T, H, W] (the transformer
patches it 1 x 2 x 2 and places its own rotary positions), the timestep on the scheduler's
0-1000 scale (mmtrain's objective feeds 1000 t, the same), and UMT5's hidden states
[B, L, text_dim], zero past each caption, which every block cross-attends; it takes no pooled
text and no mask. The prediction is the velocity in the latent's layout.

One tower, `denoiser`: the blocks (`blocks`, the class's `_no_split_modules`) with the patch,
timestep and text embedders, the output norm and projection. LoRA's `attn` target is every
linear of the self-attention (`attn1`) and the cross-attention (`attn2`), `mlp` the feed-forward
(`ffn`): the generic tower's rule finds them by these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from mmtrain.hub_spec import DENOISER_TOWERS
from mmtrain.models.dit import TEXT_HIDDEN, TIMESTEP
from mmtrain.models.hub.towers import HubTower

LATENT = "latent"


def wan_towers(hf: nn.Module, prefix: str = "hf.") -> dict[str, HubTower]:
    """{"denoiser": every part of the WanTransformer3DModel, its own output modulation table
    (a parameter of the model itself) included}."""
    no_split = set(getattr(hf, "_no_split_modules", None) or ())
    name = DENOISER_TOWERS[0]
    return {name: HubTower(name, dict(hf.named_children()), no_split, prefix, owner=hf)}


def wan_predict(hf: nn.Module, batch: Mapping[str, Tensor], guidance: bool) -> Tensor:
    """The velocity [B, C, T, H, W] at the noisy `latent`, `timestep` (1000 t) and the text's
    `text_hidden` [B, L, D]. Wan embeds no guidance scale (`guidance` is False)."""
    return hf(
        hidden_states=batch[LATENT],
        timestep=batch[TIMESTEP],
        encoder_hidden_states=batch[TEXT_HIDDEN],
        return_dict=False,
    )[0]


def wan_denoiser_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The DenoiserSpec fields of a WanTransformer3DModel config: a cross-attention DiT over
    1 x p x p tubes of the latent video, UMT5's hidden states text_dim wide."""
    if config.get("image_dim") or config.get("added_kv_proj_dim"):
        raise ValueError(
            "an image-to-video transformer (image_dim): mmtrain trains Wan's "
            "text-to-video transformer (WanPipeline) from its folder"
        )
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    temporal, patch, patch_w = (int(v) for v in config.get("patch_size", (1, 2, 2)))
    if patch != patch_w:
        raise ValueError(f"patch_size {config['patch_size']}: mmtrain takes square patches")
    return dict(
        channels=int(config["in_channels"]),
        patch_size=patch,
        temporal_patch=temporal,
        width=heads * head_dim,
        layers=int(config["num_layers"]),
        heads=heads,
        mlp_ratio=int(config["ffn_dim"]) / (heads * head_dim),
        architecture="cross_attention",
        text_width=int(config["text_dim"]),
    )


def wan_prompt(pipe: Any, prompt: str, text_tokens: int | None, cfg: float) -> dict[str, Any]:
    """WanPipeline's text keywords for `prompt`, at `text_tokens` (None: the pipeline's
    default) and, with guidance (`cfg` > 1), the zero text as the unconditional branch: what
    mmtrain's caption dropout trains (the pipeline's own negative prompt is the encoding of
    another text, which a run of mmtrain never saw as "no caption")."""
    import torch

    tokens = {} if text_tokens is None else {"max_sequence_length": text_tokens}
    if cfg <= 1:
        return {"prompt": prompt, **tokens}
    embeds = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, **tokens)[0]
    return {"prompt_embeds": embeds, "negative_prompt_embeds": torch.zeros_like(embeds)}
