"""An independent, functional version of OpenCLIP's ViT `CLIP` forward pass, for tests.

It reads a state dict under OpenCLIP's own key names and computes `encode_image` / `encode_text`
the way OpenCLIP's VisionTransformer and TextTransformer do (nn.MultiheadAttention's math written
out as matmuls), so the converter can be checked without installing open_clip. It shares no code
with mmtrain's model or converter: an error in either shows up as a disagreement here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class ClipShape:
    """The numbers of an OpenCLIP ViT CLIP model config (model_configs/*.json)."""

    embed_dim: int
    image_size: int
    patch_size: int
    vision_width: int
    vision_layers: int
    vision_heads: int
    context_length: int
    vocab_size: int
    text_width: int
    text_layers: int
    text_heads: int
    mlp_ratio: float = 4.0
    quick_gelu: bool = False
    text_proj_bias: bool = False  # text_projection becomes an nn.Linear (weight [E, w], bias)
    logit_bias: bool = False  # SigLIP-style training adds a learned logit bias

    def spec_dict(self, name: str = "openclip-like") -> dict:
        """The mmtrain spec (as a dict) of the same model."""
        act = "quick_gelu" if self.quick_gelu else "gelu"
        return {
            "name": name,
            "embed_dim": self.embed_dim,
            "pairs": [["image", "text"]],
            "logit_bias_init": -10.0 if self.logit_bias else None,
            "towers": {
                "image": {
                    "modality": "image",
                    "stem": {"image_size": self.image_size, "patch_size": self.patch_size},
                    "width": self.vision_width,
                    "layers": self.vision_layers,
                    "heads": self.vision_heads,
                    "mlp_ratio": self.mlp_ratio,
                    "activation": act,
                    "pooling": "cls",
                },
                "text": {
                    "modality": "text",
                    "stem": {
                        "vocab_size": self.vocab_size,
                        "context_length": self.context_length,
                        "causal": True,
                    },
                    "width": self.text_width,
                    "layers": self.text_layers,
                    "heads": self.text_heads,
                    "mlp_ratio": self.mlp_ratio,
                    "activation": act,
                    "pooling": "eot",
                    "proj_bias": self.text_proj_bias,
                },
            },
        }


VIT_B_32 = ClipShape(
    embed_dim=512,
    image_size=224,
    patch_size=32,
    vision_width=768,
    vision_layers=12,
    vision_heads=12,
    context_length=77,
    vocab_size=49408,
    text_width=512,
    text_layers=12,
    text_heads=8,
)


# ----------------------------------------------------------------------------- random weights
def random_openclip_state_dict(shape: ClipShape, generator: torch.Generator) -> dict[str, Tensor]:
    """A state dict with OpenCLIP's key names and shapes, filled with random values of sensible
    scale (norm weights away from 1, biases away from 0, so a mix-up cannot hide)."""

    def rand(*size: int, std: float, mean: float = 0.0) -> Tensor:
        return mean + std * torch.randn(size, generator=generator)

    def norm(prefix: str, width: int) -> dict[str, Tensor]:
        return {
            f"{prefix}.weight": rand(width, std=0.1, mean=1.0),
            f"{prefix}.bias": rand(width, std=0.1),
        }

    def blocks(prefix: str, width: int, layers: int) -> dict[str, Tensor]:
        hidden = int(width * shape.mlp_ratio)
        out: dict[str, Tensor] = {}
        for i in range(layers):
            b = f"{prefix}.{i}"
            out |= norm(f"{b}.ln_1", width)
            out[f"{b}.attn.in_proj_weight"] = rand(3 * width, width, std=width**-0.5)
            out[f"{b}.attn.in_proj_bias"] = rand(3 * width, std=0.02)
            out[f"{b}.attn.out_proj.weight"] = rand(width, width, std=width**-0.5)
            out[f"{b}.attn.out_proj.bias"] = rand(width, std=0.02)
            out |= norm(f"{b}.ln_2", width)
            out[f"{b}.mlp.c_fc.weight"] = rand(hidden, width, std=width**-0.5)
            out[f"{b}.mlp.c_fc.bias"] = rand(hidden, std=0.02)
            out[f"{b}.mlp.c_proj.weight"] = rand(width, hidden, std=hidden**-0.5)
            out[f"{b}.mlp.c_proj.bias"] = rand(width, std=0.02)
        return out

    vw, tw, p = shape.vision_width, shape.text_width, shape.patch_size
    grid = shape.image_size // p
    sd = {
        "positional_embedding": rand(shape.context_length, tw, std=0.01),
        "logit_scale": torch.tensor(math.log(1 / 0.07)) + rand(std=0.1),
        "visual.class_embedding": rand(vw, std=vw**-0.5),
        "visual.positional_embedding": rand(grid * grid + 1, vw, std=vw**-0.5),
        "visual.proj": rand(vw, shape.embed_dim, std=vw**-0.5),
        "visual.conv1.weight": rand(vw, 3, p, p, std=(3 * p * p) ** -0.5),
    }
    sd |= norm("visual.ln_pre", vw)
    sd |= blocks("visual.transformer.resblocks", vw, shape.vision_layers)
    sd |= norm("visual.ln_post", vw)
    sd["token_embedding.weight"] = rand(shape.vocab_size, tw, std=0.02)
    sd |= blocks("transformer.resblocks", tw, shape.text_layers)
    sd |= norm("ln_final", tw)
    if shape.text_proj_bias:
        sd["text_projection.weight"] = rand(shape.embed_dim, tw, std=tw**-0.5)
        sd["text_projection.bias"] = rand(shape.embed_dim, std=0.1)
    else:
        sd["text_projection"] = rand(tw, shape.embed_dim, std=tw**-0.5)
    if shape.logit_bias:
        sd["logit_bias"] = torch.tensor(-10.0) + rand(std=0.1)
    return sd


# ----------------------------------------------------------------------------- forward math
def _layer_norm(x: Tensor, sd: dict[str, Tensor], prefix: str) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], sd[f"{prefix}.weight"], sd[f"{prefix}.bias"], eps=1e-5)


def _attention(
    x: Tensor, sd: dict[str, Tensor], prefix: str, heads: int, mask: Tensor | None
) -> Tensor:
    """nn.MultiheadAttention(x, x, x) with packed in_proj (rows q, k, v), written out."""
    batch, length, width = x.shape
    head_dim = width // heads
    qkv = x @ sd[f"{prefix}.in_proj_weight"].T + sd[f"{prefix}.in_proj_bias"]
    q, k, v = (
        t.reshape(batch, length, heads, head_dim).transpose(1, 2) for t in qkv.split(width, dim=-1)
    )
    scores = (q / math.sqrt(head_dim)) @ k.transpose(-1, -2)
    if mask is not None:
        scores = scores + mask
    out = scores.softmax(dim=-1) @ v
    out = out.transpose(1, 2).reshape(batch, length, width)
    return out @ sd[f"{prefix}.out_proj.weight"].T + sd[f"{prefix}.out_proj.bias"]


def _activation(x: Tensor, quick_gelu: bool) -> Tensor:
    return x * torch.sigmoid(1.702 * x) if quick_gelu else F.gelu(x)


def _resblocks(
    x: Tensor,
    sd: dict[str, Tensor],
    prefix: str,
    layers: int,
    heads: int,
    shape: ClipShape,
    mask: Tensor | None,
) -> Tensor:
    for i in range(layers):
        b = f"{prefix}.{i}"
        x = x + _attention(_layer_norm(x, sd, f"{b}.ln_1"), sd, f"{b}.attn", heads, mask)
        h = (
            _layer_norm(x, sd, f"{b}.ln_2") @ sd[f"{b}.mlp.c_fc.weight"].T
            + sd[f"{b}.mlp.c_fc.bias"]
        )
        h = _activation(h, shape.quick_gelu)
        x = x + h @ sd[f"{b}.mlp.c_proj.weight"].T + sd[f"{b}.mlp.c_proj.bias"]
    return x


def encode_image(sd: dict[str, Tensor], images: Tensor, shape: ClipShape) -> Tensor:
    """OpenCLIP's `encode_image(images, normalize=True)` for a ViT with token (class) pooling."""
    p = shape.patch_size
    x = F.conv2d(images, sd["visual.conv1.weight"], stride=p)  # [B, width, grid, grid]
    x = x.flatten(2).transpose(1, 2)  # [B, grid * grid, width], row-major over the grid
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], dim=1) + sd["visual.positional_embedding"]
    x = _layer_norm(x, sd, "visual.ln_pre")
    x = _resblocks(
        x, sd, "visual.transformer.resblocks", shape.vision_layers, shape.vision_heads, shape, None
    )
    pooled = _layer_norm(x[:, 0], sd, "visual.ln_post")
    return F.normalize(pooled @ sd["visual.proj"], dim=-1)


def encode_text(sd: dict[str, Tensor], text: Tensor, shape: ClipShape) -> Tensor:
    """OpenCLIP's `encode_text(text, normalize=True)`: causal mask, features at the argmax id (EOT
    is the highest id in CLIP's vocabulary)."""
    length = text.shape[1]
    x = sd["token_embedding.weight"][text] + sd["positional_embedding"][:length]
    causal = torch.full((length, length), float("-inf")).triu(1)
    x = _resblocks(
        x, sd, "transformer.resblocks", shape.text_layers, shape.text_heads, shape, causal
    )
    x = _layer_norm(x, sd, "ln_final")
    pooled = x[torch.arange(x.shape[0]), text.argmax(dim=-1)]
    if "text_projection.weight" in sd:  # the nn.Linear variant (text proj_bias)
        return F.normalize(
            F.linear(pooled, sd["text_projection.weight"], sd["text_projection.bias"]), dim=-1
        )
    return F.normalize(pooled @ sd["text_projection"], dim=-1)


def clip_token_ids(lengths: list[int], shape: ClipShape, generator: torch.Generator) -> Tensor:
    """Token ids as CLIP's tokenizer lays them out: SOT, `n` ordinary ids, EOT, zero padding.
    SOT and EOT are the two highest ids (49406, 49407 in CLIP's vocabulary)."""
    sot, eot = shape.vocab_size - 2, shape.vocab_size - 1
    rows = torch.zeros(len(lengths), shape.context_length, dtype=torch.long)
    for row, n in zip(rows, lengths, strict=True):
        assert n + 2 <= shape.context_length
        row[0] = sot
        row[1 : n + 1] = torch.randint(1, sot, (n,), generator=generator)
        row[n + 1] = eot
    return rows
