"""The `--video` quickstart's pipeline: a Wan 2.1 text-to-video pipeline folder at toy sizes,
made offline with diffusers' and transformers' own classes, the way a user's folder holds one.

- tokenizer: a T5 Unigram tokenizer of the captions' words (one piece a word);
- text_encoder: UMT5 (random: its word embeddings tell the captions apart, and stay frozen);
- vae: AutoencoderKLWan at 2x in time and space, 4 latent channels, trained here first on the
  demo's clips (stage 0: reconstruction, a little KL), its per-channel latent mean and standard
  deviation measured on them and stored in its config as Wan's are (`latents_mean`,
  `latents_std`): without a trained VAE a sample would decode to noise and nobody could see
  what the transformer learned;
- transformer: WanTransformer3DModel (patches 1 x 2 x 2), random: the part mmtrain trains;
- scheduler: flow matching (FlowMatchEulerDiscreteScheduler) with `shift`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmtrain.quickstart.motion_clips import COLOURS, DIRECTIONS, clips

LATENT_CHANNELS = 4
TEXT_WIDTH = 32


@dataclass
class TinyWan:
    width: int = 64
    heads: int = 4
    layers: int = 4
    vae_steps: int = 300
    vae_batch: int = 8
    vae_lr: float = 2e-3
    shift: float = 1.0  # Wan's 3.0 is for 480p's 32,760 tokens; these clips have 80
    seed: int = 0


def words() -> list[str]:
    return sorted({"a", "square", "moves", *COLOURS, *DIRECTIONS})


def tokenizer() -> Any:
    import transformers

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + word, -1.0) for word in words()]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0)


def build_pipeline(out: Path, config: TinyWan) -> Path:
    """Write the pipeline folder `out` (its VAE trained first); returns it."""
    import diffusers
    import torch
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        vae = train_vae(config)
        text = transformers.UMT5EncoderModel(transformers.UMT5Config(
            vocab_size=3 + len(words()), d_model=TEXT_WIDTH, d_ff=64, d_kv=8, num_layers=2,
            num_heads=4))  # fmt: skip
        transformer = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=config.heads,
            attention_head_dim=config.width // config.heads, in_channels=LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS, text_dim=TEXT_WIDTH, freq_dim=32,
            ffn_dim=4 * config.width, num_layers=config.layers, rope_max_seq_len=32)  # fmt: skip
    pipe = diffusers.WanPipeline(
        tokenizer=tokenizer(), text_encoder=text, transformer=transformer, vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=config.shift))  # fmt: skip
    pipe.save_pretrained(out)
    return out


def train_vae(config: TinyWan) -> Any:
    """AutoencoderKLWan trained to reconstruct the demo's clips, with Wan's latent statistics
    measured on them."""
    import diffusers
    import torch

    def vae_of(mean: list[float], std: list[float]) -> Any:
        return diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2], num_res_blocks=1,
            temperal_downsample=[True], latents_mean=mean, latents_std=std,
            scale_factor_temporal=2, scale_factor_spatial=2)  # fmt: skip

    vae = vae_of([0.0] * LATENT_CHANNELS, [1.0] * LATENT_CHANNELS)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=config.vae_lr)
    stream = clips(config.vae_steps * config.vae_batch, seed=config.seed + 1)
    for _ in range(config.vae_steps):
        x = torch.from_numpy(np.stack([c for _, _, c in _take(stream, config.vae_batch)]))
        posterior = vae.encode(x).latent_dist
        error = (vae.decode(posterior.sample()).sample - x).square().mean()
        loss = error + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        held = torch.from_numpy(np.stack([c for _, _, c in clips(64, seed=config.seed + 2)]))
        z = vae.encode(held).latent_dist.mean.transpose(0, 1).flatten(1)  # [C, everything]
    trained = vae_of(z.mean(1).tolist(), z.std(1).tolist())
    trained.load_state_dict(vae.state_dict())
    return trained.eval()


def _take(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]
