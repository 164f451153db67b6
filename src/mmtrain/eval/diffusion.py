"""Evaluating a denoiser on held-out images: its loss at fixed timesteps and, given a feature
extractor, the Fréchet distance between its samples and those images.

- Loss at fixed timesteps: every held-out image noised at each of `TIMES` (flow matching: t;
  DDPM: the step at that fraction of the schedule) with noise drawn from (seed, batch, rank,
  time) alone, the prediction's mean squared error per time and their mean. Deterministic, so
  two checkpoints compare on the same noise; unweighted (min-SNR is a training choice).
- FD (eval/frechet.py): `samples` images generated for the conditions of the first held-out
  images, their classes or (an MMDiT) their cached text (eval/sampling.py: `steps`, `cfg`;
  guided from the "no class" id or the zeroed text), both sets through the extractor's image tower at
  its own input size; `fd_real_floor` is the FD between two halves of the real set, what
  sampling noise alone costs at half this n, and `fd_half` the samples' first half against the
  real set's second: FD's estimate is biased upwards the more the fewer the images, so the
  floor compares with `fd_half` (the same n), not with `fd`. The extractor is any mmtrain model with an image tower
  (e.g. a CLIP trained on the same domain): nothing is downloaded. A latent denoiser's samples
  and held-out latents are decoded to pixels by the VAE that encoded them (`vae`) first.
- With class names and an extractor that has a text tower (a CLIP), also the conditional
  accuracy (zero-shot, eval/zeroshot.py: is a sample of class k nearest to class k's prompts?)
  beside the real images' (the ceiling this extractor allows), and the CLIP score of each
  sample against its class's prompts (models/clip_score.py). The extractor is not the
  denoiser's conditioning (a class DiT has none), so it does not grade its own homework.
  An MMDiT's loss is its prediction's error given each held-out image's own text.

Each held-out image counts once (the loader pads the epoch's last step with samples from its
start; those repeats are dropped by key). Every rank evaluates its share of the images; the sums and the features are gathered, so the
report is the same on every rank (a collective: call it on all of them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmtrain import distributed
from mmtrain.config import DiffusionConfig
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.denoiser_inputs import TEXT_MEMBERS, DenoiserDecoder, _cached_text
from mmtrain.data.stream.loader import StreamingLoader
from mmtrain.data.stream.media import MediaError
from mmtrain.data.stream.transforms import ImageTransform
from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.eval.frechet import frechet_distance
from mmtrain.eval.sampling import Condition, condition_of, image_grid, sample, to_uint8
from mmtrain.models.dit import CLASS, PREDICTION, TEXT_HIDDEN, TEXT_POOLED, TIMESTEP
from mmtrain.models.schedules import (
    FLOW_TIMESTEP_SCALE,
    ddpm_alphas_cumprod,
    ddpm_pair,
    draw_generator,
    flow_pair,
)
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

TIMES = (0.1, 0.3, 0.5, 0.7, 0.9)


class DenoiserEvaluator:
    """The held-out set of a denoiser, loaded once and replayed at every `report`."""

    def __init__(
        self,
        spec: ModelSpec,
        data: str | Path | Sequence[str | Path],
        *,
        batch_size: int,
        config: DiffusionConfig | None = None,
        label_field: str = "label",
        class_names: Sequence[str] = (),
        seed: int = 0,
        extractor: nn.Module | None = None,
        samples: int = 256,
        steps: int = 25,
        cfg: float = 1.0,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        extractor_tokenizer: str = "byte",
        video_stride: int | None = None,  # the run's data.video_stride: its middle window
        vae: nn.Module | None = None,  # a latent denoiser's: its samples and images to pixels
    ):
        if spec.denoiser is None:
            raise FieldError("model", f"{spec.name} is not a denoiser")
        if extractor is not None and spec.denoiser.input == "latent" and vae is None:
            raise FieldError(
                "extractor",
                f"{spec.name} denoises latents: its samples and the held-out latents are seen "
                "through the VAE that encoded them; give it (a diffusers AutoencoderKL "
                "folder: eval.vae in a run config, --vae with mmtrain eval)",
            )
        try:
            shards = ShardSet.open(data)
        except (FileNotFoundError, ValueError) as err:
            raise FieldError("data", f"{data!r}: {err}") from None
        self.spec, self.config = spec, config or DiffusionConfig()
        self.seed, self.samples, self.steps, self.cfg = seed, samples, steps, cfg
        self.extractor, self.vae = extractor, vae
        self.class_names = list(class_names)
        self.extractor_tokenizer = extractor_tokenizer
        self.rank = distributed.rank() if rank is None else rank
        self.shards = shards  # the grid's texts are read from it directly, the same on every rank
        decoder = DenoiserDecoder(spec, label_field, class_names, train=False,
                                  video_stride=video_stride)  # fmt: skip
        self.loader = StreamingLoader(
            shards, decoder, batch_size, rank=self.rank,
            world_size=distributed.world_size() if world_size is None else world_size,
            shuffle=False, drop_tail=False, num_workers=num_workers, with_keys=True,
            max_consecutive_corrupt=len(shards),
        )  # fmt: skip

    @torch.no_grad()
    def report(self, model: nn.Module) -> dict[str, Any]:
        """{"diffusion": {"loss", "loss_at": {t: loss}, "n", and with an extractor "fd",
        "fd_real_floor", "fd_half", "fd_n", "extractor"}}."""
        self.loader.set_epoch(0)
        param = next(model.parameters())
        key = self.spec.denoiser.input
        errors, keys, real, conditions, elements = [], [], [], [], 0
        for number, batch in enumerate(self.loader):
            x0 = batch[key].to(param.device, param.dtype)
            condition = _on(condition_of(self.spec.denoiser, batch), param)
            errors.append(torch.stack([self._error(model, x0, condition, t, draw_generator(
                self.seed, number, self.rank, i, device=param.device))
                for i, t in enumerate(TIMES)], dim=1))  # fmt: skip
            keys.append(list(batch["__key__"]))
            elements = x0[0].numel()
            # Enough for `samples` images once the tail's repeats are dropped (at most a batch).
            if self.extractor is not None and sum(len(r) for r in real) < self.samples + len(x0):
                real.append(x0.cpu())
                conditions.append({k: v.cpu() for k, v in condition.items()})
        kept = _first_occurrences(keys, self.rank)
        mask = torch.cat(kept).to(param.device) if kept else torch.zeros(0, dtype=torch.bool)
        mine = torch.cat(errors)[mask].sum(0) if errors else torch.zeros(len(TIMES))
        *sums, images = distributed.sum_over_ranks([*mine.tolist(), int(mask.sum())])
        losses = {f"{t:g}": s / max(images * elements, 1) for t, s in zip(TIMES, sums, strict=True)}
        out: dict[str, Any] = {"loss": float(np.mean(list(losses.values()))), "loss_at": losses,
                               "n": int(images)}  # fmt: skip
        if self.extractor is not None:
            real = [x[m] for x, m in zip(real, kept, strict=False)]
            conditions = [
                {k: v[m] for k, v in c.items()} for c, m in zip(conditions, kept, strict=False)
            ]
            out.update(self._frechet(model, real, conditions))
        return {"diffusion": out}

    @torch.no_grad()
    def sample_grid(self, model: nn.Module, per_class: int = 4, rows: int = 8) -> np.ndarray | None:
        """uint8 [H, W, 3] grid of samples from a fixed seed: a row per class (the first
        `rows`) or, for an MMDiT, per held-out text (the set's first `rows` samples'),
        `per_class` columns (one row when unconditional); a video's first frames.
        A latent denoiser's samples are decoded by its VAE (`vae`); None without one. Every
        rank calls it (the model's forward is a collective under FSDP); all get the same
        grid."""
        d = self.spec.denoiser
        if d.input == "latent" and self.vae is None:
            return None
        condition: dict[str, Tensor] = {}
        n_rows = 1
        if d.takes_text():
            texts = first_texts(self.shards, d, rows)
            n_rows = texts[TEXT_HIDDEN].shape[0]
            condition = {k: v.repeat_interleave(per_class, 0) for k, v in texts.items()}
        elif d.num_classes:
            n_rows = min(rows, d.num_classes)
            condition = {CLASS: torch.arange(n_rows).repeat_interleave(per_class)}
        images = sample(model, condition, n_rows * per_class, steps=self.steps, cfg=self.cfg,
                        seed=self.seed, config=self.config)  # fmt: skip
        if d.is_video():
            images = images[:, :, 0]  # [N, C, T, H, W] -> the first frames
        return image_grid(to_uint8(self._pixels(images)).numpy(), n_rows)

    def _error(self, model: nn.Module, x0: Tensor, condition: Condition, t: float, g) -> Tensor:
        """Squared error [n] of each sample's prediction at time t (its channels only)."""
        d = self.spec.denoiser
        noise = torch.randn(x0.shape, generator=g, device=x0.device, dtype=x0.dtype)
        n = x0.shape[0]
        if self.spec.objective == "flow_matching":
            noisy, target = flow_pair(
                x0, noise, torch.full((n,), t, dtype=x0.dtype, device=x0.device)
            )
            timestep = torch.full((n,), t * FLOW_TIMESTEP_SCALE, dtype=x0.dtype, device=x0.device)
        else:
            step = round(t * (self.config.ddpm_steps - 1))
            abar = ddpm_alphas_cumprod(self.config)[step].to(x0.device, x0.dtype).expand(n)
            noisy, target = ddpm_pair(x0, noise, abar, d.prediction)
            timestep = torch.full((n,), float(step), dtype=x0.dtype, device=x0.device)
        batch = {d.input: noisy, TIMESTEP: timestep, **condition}
        prediction = model(batch)[PREDICTION][:, : d.channels]  # through wrappers' hooks
        return (prediction.double() - target.double()).square().flatten(1).sum(1)

    def _frechet(
        self, model: nn.Module, real: list[Tensor], conditions: list[dict[str, Tensor]]
    ) -> dict[str, Any]:
        real_images = torch.cat(real)[: self.samples] if real else torch.zeros(0)
        condition = {k: torch.cat([c[k] for c in conditions])[: self.samples]
                     for k in (conditions[0] if conditions else {})}  # fmt: skip
        labels = condition.get(CLASS)
        mine = real_images.shape[0]
        fake = torch.zeros(0)
        if mine:
            fake = sample(model, condition, mine,
                          # other noise on every rank, or the ranks' samples would repeat
                          steps=self.steps, cfg=self.cfg, seed=self.seed + 7919 * self.rank,
                          config=self.config).cpu()  # fmt: skip
        real_features = _gathered(image_features(self.extractor, self._pixels(real_images)))
        fake_features = _gathered(image_features(self.extractor, self._pixels(fake)))
        half = real_features.shape[0] // 2
        out = {
            "fd": frechet_distance(fake_features, real_features),
            "fd_real_floor": frechet_distance(real_features[:half], real_features[half:]),
            # FD's bias grows as n falls, so the floor (halves) is set beside the samples' FD
            # at the same n against the same half: the comparison free of that bias.
            "fd_half": frechet_distance(fake_features[:half], real_features[half:]),
            "fd_n": int(real_features.shape[0]),
            "extractor": getattr(self.extractor.spec, "name", "extractor"),
        }
        if labels is not None and self.class_names and _text_tower(self.extractor) is not None:
            all_labels = _gathered(labels.double()).long()
            out.update(self._conditional(fake_features, real_features, all_labels))
        return out

    @torch.no_grad()
    def _pixels(self, x: Tensor) -> Tensor:
        """Images in [-1, 1]: `x` itself, or a latent denoiser's latents through its VAE
        (the denoiser's scaling undone first), a batch at a time."""
        if self.spec.denoiser.input != "latent" or x.shape[0] == 0:
            return x
        param = next(self.vae.parameters())
        decoded = [
            self.vae.decode_latent(self.vae.from_diffusion(chunk.to(param.device, param.dtype)))
            for chunk in x.split(16)
        ]
        return torch.cat(decoded).clamp(-1, 1).cpu()

    def _conditional(self, fake: Tensor, real: Tensor, labels: Tensor) -> dict[str, float]:
        """Zero-shot accuracy of samples (and of the real images) for their class, and the
        samples' CLIP score against their class's prompts."""
        from mmtrain.data.stream.tokenizer import get_tokenizer
        from mmtrain.eval.zeroshot import class_embeddings
        from mmtrain.models.clip_score import clip_score

        tower = _text_tower(self.extractor)
        tokenizer = get_tokenizer(self.extractor_tokenizer)
        context = self.extractor.spec.towers[tower].stem.context_length
        param = next(self.extractor.parameters())

        def embed(texts: list[str]) -> Tensor:
            ids = tokenizer(texts, context).to(param.device)
            return self.extractor.encode({tower: ids})[tower].double().cpu()

        with torch.no_grad():
            classes = class_embeddings(embed, self.class_names).double()
        return {
            "cond_accuracy": float(((fake @ classes.T).argmax(1) == labels).double().mean()),
            "real_accuracy": float(((real @ classes.T).argmax(1) == labels).double().mean()),
            "clip_score": float(clip_score(fake, classes[labels]).mean()),
        }

    def close(self) -> None:
        self.loader.close()
        for source in self.loader.plan.sources:
            source.close()


@torch.no_grad()
def image_features(extractor: nn.Module, images: Tensor, batch: int = 64) -> Tensor:
    """Embeddings [N, D] (float64, CPU) of images in [-1, 1] by the extractor's image tower,
    each image resized to the tower's input as its eval transform does (bicubic)."""
    spec = extractor.spec
    tower = next((n for n, t in spec.towers.items() if t.modality == "image"), None)
    if tower is None:
        raise FieldError("extractor", f"{spec.name} has no image tower to take features with")
    if images.shape[0] == 0:
        return torch.zeros(0, spec.embed_dim, dtype=torch.float64)
    transform = ImageTransform.from_stem(spec.towers[tower].stem, train=False)
    param = next(extractor.parameters())
    pixels = to_uint8(images).numpy()
    out = []
    for start in range(0, len(pixels), batch):
        chunk = [_resized(transform, p) for p in pixels[start : start + batch]]
        x = torch.stack(chunk).to(param.device, param.dtype)
        out.append(extractor.encode({tower: x})[tower].double().cpu())
    return torch.cat(out)


def first_texts(shards: ShardSet, denoiser: DenoiserSpec, n: int) -> dict[str, Tensor]:
    """The cached text ({"text_hidden": [k, L, W], and "text_pooled": [k, P] where the
    denoiser takes it}, float32) of the first k <= n samples of `shards` that hold a readable
    one, in order."""
    found: list[tuple[Tensor, ...]] = []
    for index in range(len(shards)):
        if len(found) == n:
            break
        try:
            found.append(cached_text(shards, index, denoiser))
        except MediaError:  # a corrupt sample, skipped as the loader skips it
            continue
    keys = denoiser.text_members()
    if not found:
        raise FieldError("data", f"no sample holds a readable .{TEXT_MEMBERS[keys[-1]]}")
    return {key: torch.stack([texts[i] for texts in found]) for i, key in enumerate(keys)}


def cached_text(shards: ShardSet, index: int, denoiser: DenoiserSpec) -> tuple[Tensor, ...]:
    """Sample `index`'s text encoders' outputs, [text_tokens, text_width] (and [pooled_width]
    where the denoiser takes a pooled vector), read and checked as training reads them
    (data/stream/denoiser_inputs.py); MediaError when the sample has none or they do not fit."""
    sample = shards.read(index)
    shapes = {TEXT_HIDDEN: (denoiser.text_tokens, denoiser.text_width),
              TEXT_POOLED: (denoiser.pooled_width,)}  # fmt: skip
    return tuple(
        torch.from_numpy(_cached_text(sample, TEXT_MEMBERS[key], shapes[key]))
        for key in denoiser.text_members()
    )


def _on(condition: dict[str, Tensor], param: Tensor) -> dict[str, Tensor]:
    """A loader's condition on the model's device, its text in the model's dtype."""
    return {k: v.to(param.device, param.dtype if v.is_floating_point() else v.dtype)
            for k, v in condition.items()}  # fmt: skip


def _text_tower(model: nn.Module) -> str | None:
    return next((n for n, t in model.spec.towers.items() if t.modality == "text"), None)


def _resized(transform: ImageTransform, pixels: np.ndarray) -> Tensor:
    if pixels.shape[-1] == 1:
        pixels = np.repeat(pixels, 3, axis=-1)
    h, w = pixels.shape[:2]
    return transform.apply(pixels, (0, 0, w, h), False)


def _first_occurrences(keys: list[list[str]], rank: int) -> list[Tensor]:
    """Per batch, a bool mask of the samples counted: the loader pads the epoch's last step
    with samples from its start so that every rank takes the same steps, and those repeats
    (the same key again, on this rank or another) are counted once, at their first place in
    rank order. A collective: every rank calls it with its own batches' keys."""
    everyone: list[Any] = [keys]
    if distributed.world_size() > 1:
        everyone = [None] * distributed.world_size()
        torch.distributed.all_gather_object(everyone, keys)
    seen: set[str] = set()
    masks: list[Tensor] = []
    for other, batches in enumerate(everyone):
        for batch in batches:
            first = []
            for k in batch:  # one by one: a small set repeats inside one batch too
                first.append(k not in seen)
                seen.add(k)
            if other == rank:
                masks.append(torch.tensor(first, dtype=torch.bool))
    return masks


def _gathered(features: Tensor) -> Tensor:
    """Every rank's features, in rank order (shares may differ in size)."""
    if distributed.world_size() == 1:
        return features
    parts: list[Any] = [None] * distributed.world_size()
    torch.distributed.all_gather_object(parts, features)
    return torch.cat(parts)
