"""A tiny Wan 2.1 text-to-video pipeline diffusers builds from configs, and captioned clips of
a moving bar, shared by the Wan tests (offline: no weights, no sentencepiece).

The layout is Wan 2.1's at toy sizes: UMT5 (24 wide) with a T5 Unigram tokenizer of letters,
AutoencoderKLWan (4 latent channels, 2x down in time and space: `scale_factor_temporal` and
`scale_factor_spatial` say so, as WanPipeline reads them), WanTransformer3DModel (patches of
1 x 2 x 2, 2 blocks of width 16), and the flow-matching scheduler with Wan's shift.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from mmtrain.data.storage.shard_writer import ShardWriter
from test_pipeline_latents import LETTERS, t5_tokenizer

TEXT_TOKENS = 6  # --max-sequence-length of the tiny pipeline's captions
TEXT_WIDTH = 24
LATENT_CHANNELS = 4
TIME_FACTOR, SPACE_FACTOR = 2, 2  # the tiny VAE's down-sampling
SHIFT = 3.0  # Wan 2.1's flow shift at 480p
SIDE = 16  # pixels of the clips
FRAMES = 9  # frames of a clip: 1 + 4 x TIME_FACTOR, so 5 latent frames


def wan_vae():
    import diffusers

    return diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2], num_res_blocks=1,
        temperal_downsample=[True], latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 2.0, 0.8, 1.2], scale_factor_temporal=TIME_FACTOR,
        scale_factor_spatial=SPACE_FACTOR)  # fmt: skip


def umt5_encoder():
    import transformers

    config = transformers.UMT5Config(vocab_size=3 + 2 * len(LETTERS), d_model=TEXT_WIDTH, d_ff=32,
                                     d_kv=8, num_layers=2, num_heads=2)  # fmt: skip
    return transformers.UMT5EncoderModel(config)


def wan_transformer():
    import diffusers

    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_WIDTH,
        freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)  # fmt: skip


def wan_pipeline(folder: Path, seed: int = 2) -> Path:
    """Save the tiny WanPipeline into `folder` (its model_index.json and components)."""
    import diffusers

    torch.manual_seed(seed)
    pipe = diffusers.WanPipeline(
        tokenizer=t5_tokenizer(), text_encoder=umt5_encoder(), transformer=wan_transformer(),
        vae=wan_vae(), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=SHIFT))  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


def moving_bar_clip(direction: int, colour: int, frames: int = FRAMES, fps: int = 8) -> bytes:
    """An MP4 of a bright bar crossing a dark SIDE x SIDE frame, left to right (direction 1) or
    right to left (-1), in colour channel `colour`."""
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = SIDE, SIDE, "yuv420p"
        for f in range(frames):
            step = f if direction > 0 else frames - 1 - f
            left = round(step * (SIDE - 4) / max(frames - 1, 1))
            pixels = np.full((SIDE, SIDE, 3), 20, np.uint8)
            pixels[:, left : left + 4, colour] = 230
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def captioned_clips(folder: Path, n: int = 6, frames: int = FRAMES) -> str:
    """Shards of `n` clips with captions ("a bar moves right" / "left"), alternating."""
    with ShardWriter(folder, max_samples=4) as writer:
        for i in range(n):
            direction = 1 if i % 2 == 0 else -1
            caption = "a bar moves " + ("right" if direction > 0 else "left")
            writer.write({"__key__": f"clip{i:03d}", "mp4": moving_bar_clip(direction, i % 3, frames),
                          "txt": caption.encode()})  # fmt: skip
    return str(folder)
