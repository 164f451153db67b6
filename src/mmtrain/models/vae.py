"""The image autoencoder of latent diffusion (Rombach et al. 2022): `AutoencoderKL`, laid out
as diffusers lays it out, so a diffusers folder loads by name (models/formats/diffusers.py).

    vae.encode_latent(images)  # [B, 3, H, W] in [-1, 1] -> the latent mean [B, C, H/f, W/f]
    vae.decode_latent(z)       # the latent -> images in [-1, 1] (about: the decoder's range)
    vae.to_diffusion(z)        # (z - shift_factor) * scaling_factor: what a DiT trains on
    vae.from_diffusion(z)      # and back

The encoder: a 3x3 convolution, one down block per entry of `block_out_channels` (residual
blocks, then a stride-2 convolution except after the last), a middle of residual block,
single-head self-attention over the positions and residual block, GroupNorm, SiLU and a 3x3
convolution to the mean and log-variance, then a 1x1 convolution (`quant_conv`). The decoder
mirrors it (nearest-neighbour 2x upsampling, one more residual block per level). The VAE is a
frozen tool here: it encodes a dataset once and decodes samples; mmtrain does not train it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from mmtrain.structured import FieldError

EPS = 1e-6  # every GroupNorm of the autoencoder


@dataclass(frozen=True)
class VaeConfig:
    """The shape of an AutoencoderKL (diffusers' config.json names)."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    mid_block_add_attention: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # kept for writing back

    def downscale(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    def validate(self, path: str = "vae") -> None:
        for c in self.block_out_channels:
            if c % self.norm_num_groups:
                raise FieldError(f"{path}.norm_num_groups",
                                 f"{self.norm_num_groups} groups do not divide {c} channels")  # fmt: skip


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=EPS)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=EPS)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class SpatialAttention(nn.Module):
    """One head of self-attention over the H x W positions, GroupNorm first, residual."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).reshape(b, c, h * w).transpose(1, 2)
        q, k, v = (proj(tokens)[:, None] for proj in (self.to_q, self.to_k, self.to_v))
        y = self.to_out[0](F.scaled_dot_product_attention(q, k, v)[:, 0])
        return x + y.transpose(1, 2).reshape(b, c, h, w)


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool):
        super().__init__()
        self.attentions = nn.ModuleList([SpatialAttention(channels, groups)] if attention else [])
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups) for _ in range(2)])

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        for attention in self.attentions:
            x = attention(x)
        return self.resnets[1](x)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # pad right and bottom, as the LDM encoder


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution of the encoder (`downsamplers`) or the decoder (`upsamplers`)."""

    def __init__(self, cin: int, cout: int, blocks: int, groups: int, resample: type | None):
        super().__init__()
        chans = [cin] + [cout] * blocks
        self.resnets = nn.ModuleList(
            ResnetBlock(a, b, groups) for a, b in zip(chans, chans[1:], strict=False)
        )
        name = "downsamplers" if resample is Downsample else "upsamplers"
        if resample is not None:
            setattr(self, name, nn.ModuleList([resample(cout)]))
        self.resample = name if resample is not None else None

    def forward(self, x: Tensor) -> Tensor:
        for block in self.resnets:
            x = block(x)
        if self.resample is not None:
            x = getattr(self, self.resample)[0](x)
        return x


class Encoder(nn.Module):
    def __init__(self, c: VaeConfig):
        super().__init__()
        chans, g = c.block_out_channels, c.norm_num_groups
        self.conv_in = nn.Conv2d(c.in_channels, chans[0], 3, padding=1)
        ins = [chans[0], *chans[:-1]]
        self.down_blocks = nn.ModuleList(
            _Level(a, b, c.layers_per_block, g, Downsample if i < len(chans) - 1 else None)
            for i, (a, b) in enumerate(zip(ins, chans, strict=True))
        )
        self.mid_block = MidBlock(chans[-1], g, c.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(g, chans[-1], eps=EPS)
        self.conv_out = nn.Conv2d(chans[-1], 2 * c.latent_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for level in self.down_blocks:
            x = level(x)
        return self.conv_out(F.silu(self.conv_norm_out(self.mid_block(x))))


class Decoder(nn.Module):
    def __init__(self, c: VaeConfig):
        super().__init__()
        chans, g = tuple(reversed(c.block_out_channels)), c.norm_num_groups
        self.conv_in = nn.Conv2d(c.latent_channels, chans[0], 3, padding=1)
        self.mid_block = MidBlock(chans[0], g, c.mid_block_add_attention)
        ins = [chans[0], *chans[:-1]]
        self.up_blocks = nn.ModuleList(
            _Level(a, b, c.layers_per_block + 1, g, Upsample if i < len(chans) - 1 else None)
            for i, (a, b) in enumerate(zip(ins, chans, strict=True))
        )
        self.conv_norm_out = nn.GroupNorm(g, chans[-1], eps=EPS)
        self.conv_out = nn.Conv2d(chans[-1], c.out_channels, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        x = self.mid_block(self.conv_in(z))
        for level in self.up_blocks:
            x = level(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class AutoencoderKL(nn.Module):
    def __init__(self, config: VaeConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        z2, z = 2 * config.latent_channels, config.latent_channels
        self.quant_conv = nn.Conv2d(z2, z2, 1) if config.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(z, z, 1) if config.use_post_quant_conv else None

    def encode_latent(self, images: Tensor) -> Tensor:
        """The mean of the latent Gaussian of images [B, C, H, W] in [-1, 1]."""
        moments = self.encoder(images)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return moments[:, : self.config.latent_channels]

    def decode_latent(self, z: Tensor) -> Tensor:
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def to_diffusion(self, z: Tensor) -> Tensor:
        return (z - (self.config.shift_factor or 0.0)) * self.config.scaling_factor

    def from_diffusion(self, z: Tensor) -> Tensor:
        return z / self.config.scaling_factor + (self.config.shift_factor or 0.0)
