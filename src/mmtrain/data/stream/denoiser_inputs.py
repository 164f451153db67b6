"""A denoiser's inputs from shard samples: the clean image or latent and its class.

Images are the centred square of the sample at the denoiser's `sample_size` (bicubic), in
[-1, 1] (mean 0.5, std 0.5 per channel), flipped at random in training as DiT trains; a latent
is a `.npy` member holding exactly the denoiser's [C, H, W] (a VAE's encoding made beforehand).
The class comes from `.cls` or the `.json` member's `label_field` (labels.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mmtrain.data.stream.labels import read_class
from mmtrain.data.stream.media import MediaError, decode_latent
from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS, AugmentConfig, ImageTransform
from mmtrain.spec import ModelSpec


class DenoiserDecoder:
    """A shard sample -> a denoiser's clean input and condition: "image" (the centred square at
    `sample_size`, in [-1, 1]; flipped at random in training) or "latent" (a `.npy` member of
    the denoiser's [C, H, W]), and "class" when the denoiser is class-conditional."""

    def __init__(
        self,
        spec: ModelSpec,
        label_field: str = "label",
        class_names: Sequence[str] = (),
        uint8_pixels: bool = False,
        train: bool = True,
    ):
        assert spec.denoiser is not None
        self.denoiser = spec.denoiser
        self.label_field, self.class_names = label_field, list(class_names)
        self.transform = None
        if self.denoiser.input == "image":
            half = (0.5,) * self.denoiser.channels  # (x / 255 - 0.5) / 0.5: [-1, 1]
            augment = AugmentConfig(
                scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=True, mean=half, std=half
            )
            # train=True with a full-area crop: the centred square (non-square images) and the
            # flip; eval: the same square, never flipped.
            self.transform = ImageTransform(
                self.denoiser.sample_size, True, self.denoiser.channels, augment, uint8_pixels
            )

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        d = self.denoiser
        if self.transform is not None:
            ext = next((e for e in MODALITY_EXTENSIONS["image"] if e in sample), None)
            if ext is None:
                raise MediaError(
                    f"no image member (expected one of {', '.join(MODALITY_EXTENSIONS['image'])})"
                )
            out = {"image": self.transform.decode(sample[ext], rng)}
        else:
            if "npy" not in sample:
                raise MediaError("no .npy latent member (the denoiser's input is `latent`)")
            shape = (d.channels, d.sample_size, d.sample_size)
            out = {"latent": torch.from_numpy(decode_latent(sample["npy"], shape))}
        if d.num_classes:
            out["class"] = read_class(sample, d.num_classes, self.label_field, self.class_names)
        return out
