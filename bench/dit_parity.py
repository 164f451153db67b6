"""Learning parity for generators: does mmtrain's trainer draw emoji as well as diffusers' own
training path, at the same budget, by the same metric?

Three runs on the same shards (the `quickstart --diffusion` emoji: ten classes, 32 px), the
same DiT shape (4 blocks of width 128, 4 heads, 4-pixel patches, class-conditional), batch,
learning rate, warm-up, cosine schedule, gradient clipping and step count, in one command:

- diffusers: its DiT training recipe as its example scripts write it, by hand on its parts:
  `DiTTransformer2DModel` (its own init and class dropout, 0.1), `DDPMScheduler` (1000 linear
  betas, epsilon prediction, `add_noise`), AdamW with the examples' betas (0.95, 0.999),
  weight decay 1e-6 and eps 1e-8, `training_utils.EMAModel` with its warm-up (power 3/4, at
  most the given decay), sampled by `DDIMScheduler` in 25 steps with classifier-free guidance
  as `DiTPipeline` does (the "no class" id, guidance on epsilon). It reads the batches of
  mmtrain's streaming loader (the same decoded, flipped images), so the data is identical.
- mmtrain ddpm: `train(config)` (what `mmtrain train` runs) with `objective: diffusion`,
  epsilon, the same betas: the same objective as diffusers', mmtrain's trainer, sampled by
  DDIM in 25 steps with the same guidance.
- mmtrain flow: the same with `objective: flow_matching` (what `quickstart --diffusion`
  trains), sampled by Euler in 25 steps.

Metric: the Fréchet distance between samples for the classes of the held-out emoji and those
emoji, in the image features of the image-text quickstart's CLIP (`--clip`, default
runs/quickstart: train it first with `mmtrain quickstart`), from each run's EMA; the same real
images and features for all three. At equal steps: every run's last step. At equal wall-clock:
diffusers' run also keeps a copy of its EMA when its own training time (data and steps) reaches
mmtrain flow's, training on past the step count if it has not by then.

Prints a table and appends it to bench/RESULTS.md with the command and the machine. Trains for
minutes: never run in CI.

    python bench/dit_parity.py [--clip runs/quickstart] [--steps 450] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import append_results, load_average

from mmtrain import load_model
from mmtrain.config import DiffusionConfig, config_from_dict
from mmtrain.eval.diffusion import image_features
from mmtrain.eval.frechet import frechet_distance
from mmtrain.eval.sampling import sample
from mmtrain.quickstart.common import Paths, build_shards
from mmtrain.quickstart.diffusion import DiffusionDemoConfig, dit_spec, train_config
from mmtrain.quickstart.emoji_classes import CLASSES, write_class_raw
from mmtrain.quickstart.emoji_data import list_emoji
from mmtrain.quickstart.stage0 import clip_run_folder
from mmtrain.spec import ModelSpec
from mmtrain.train.loop import train


def peer_dit(config: DiffusionDemoConfig):
    import diffusers

    return diffusers.DiTTransformer2DModel(
        num_attention_heads=config.heads, attention_head_dim=config.width // config.heads,
        in_channels=3, out_channels=3, num_layers=config.layers, sample_size=32,
        patch_size=config.patch_size, num_embeds_ada_norm=len(CLASSES),
    )  # fmt: skip


def train_peer(config: DiffusionDemoConfig, train_shards: Path, steps: int, until_s: float):
    """diffusers' recipe (module docstring) for `steps` steps, and on until `until_s` seconds of
    training if it is not there by then. Returns (EMA model at `steps`, EMA model at `until_s`,
    training seconds at `steps`, steps done by `until_s`)."""
    from diffusers import DDPMScheduler
    from diffusers.optimization import get_cosine_schedule_with_warmup
    from diffusers.training_utils import EMAModel

    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.data.stream.denoiser_inputs import DenoiserDecoder
    from mmtrain.data.stream.loader import StreamingLoader

    torch.manual_seed(config.seed)
    model = peer_dit(config).train()
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.95, 0.999),
                                  weight_decay=1e-6, eps=1e-8)  # fmt: skip
    warmup = min(steps, max(1, round(config.warmup_fraction * steps)))
    lr_schedule = get_cosine_schedule_with_warmup(optimizer, warmup, steps)
    ema = EMAModel(model.parameters(), decay=config.ema, use_ema_warmup=True, power=0.75)
    spec = dit_spec(config)
    decoder = DenoiserDecoder(spec, "label", CLASSES, train=True)
    loader = StreamingLoader(ShardSet.open(train_shards), decoder, config.batch_size,
                             seed=config.seed, drop_tail=True)  # fmt: skip
    at_steps = at_time = None
    seconds, step, epoch = 0.0, 0, 0
    while at_steps is None or at_time is None:
        loader.set_epoch(epoch)
        epoch += 1
        started = time.perf_counter()
        for batch in loader:
            x0, y = batch["image"], batch["class"]
            noise = torch.randn_like(x0)
            t = torch.randint(0, 1000, (x0.shape[0],))
            pred = model(scheduler.add_noise(x0, noise, t), timestep=t, class_labels=y).sample
            loss = F.mse_loss(pred, noise)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step < steps:
                lr_schedule.step()
            optimizer.zero_grad(set_to_none=True)
            ema.step(model.parameters())
            step += 1
            now = time.perf_counter()
            seconds, started = seconds + now - started, now
            if step == steps:
                at_steps = (_ema_copy(model, ema), seconds)
            if at_time is None and seconds >= until_s:
                at_time = (_ema_copy(model, ema), step)
            if at_steps is not None and at_time is not None:
                break
    loader.close()
    return at_steps[0], at_time[0], at_steps[1], at_time[1]


def _ema_copy(model, ema):
    averaged = copy.deepcopy(model).eval()
    ema.copy_to(averaged.parameters())
    return averaged


@torch.no_grad()
def peer_samples(model, classes: torch.Tensor, cfg: float, seed: int) -> torch.Tensor:
    """DDIM in 25 steps with guidance on epsilon, as DiTPipeline samples a DiT."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    scheduler.set_timesteps(25)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(classes.shape[0], 3, 32, 32, generator=g)
    null = torch.full_like(classes, len(CLASSES))
    for t in scheduler.timesteps:
        both = model(torch.cat([x, x]), timestep=t.expand(2 * x.shape[0]),
                     class_labels=torch.cat([classes, null])).sample  # fmt: skip
        cond, uncond = both.chunk(2)
        x = scheduler.step(uncond + cfg * (cond - uncond), t, x).prev_sample
    return x.clamp(-1, 1)


def train_mmtrain(config: DiffusionDemoConfig, paths: Paths, objective: str, steps: int):
    """mmtrain's trainer on the spec with `objective`; (EMA model, training seconds)."""
    spec = dit_spec(config).to_dict()
    spec["objective"] = objective
    spec["denoiser"]["prediction"] = "velocity" if objective == "flow_matching" else "epsilon"
    spec_file = paths.out / f"{objective}.yaml"
    ModelSpec.from_dict(spec).save(spec_file)
    run = train_config(config, paths, steps)
    run["model"] = str(spec_file)
    run["out"] = str(paths.out / f"run-{objective}")
    run["data"]["val"] = []
    run["eval"] = {"every_steps": None}
    result = train(config_from_dict(run))
    seconds = sum(row.get("step_s", 0.0) for row in result.history)
    return load_model(Path(run["out"]) / "ema").eval(), seconds


def held_out(val_shards: Path, config: DiffusionDemoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out images in [-1, 1] and their classes, as the evaluator decodes them, each
    once (the loader pads its last batch with samples from the start: dropped by key)."""
    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.data.stream.denoiser_inputs import DenoiserDecoder
    from mmtrain.data.stream.loader import StreamingLoader

    decoder = DenoiserDecoder(dit_spec(config), "label", CLASSES, train=False)
    loader = StreamingLoader(ShardSet.open(val_shards), decoder, 256, shuffle=False,
                             with_keys=True)  # fmt: skip
    loader.set_epoch(0)
    images, classes, seen = [], [], set()
    for batch in loader:
        for i, key in enumerate(batch["__key__"]):
            if key not in seen:
                seen.add(key)
                images.append(batch["image"][i])
                classes.append(batch["class"][i])
    loader.close()
    return torch.stack(images), torch.stack(classes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", type=Path, default=Path("runs/quickstart"))
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    extractor = load_model(clip_run_folder(args.clip)).eval()
    config = DiffusionDemoConfig()
    with tempfile.TemporaryDirectory() as tmp:
        paths = Paths(Path(tmp))
        split = write_class_raw(list_emoji(), paths.raw, config.val_fraction)
        build_shards(split.train_dir, paths.train_shards, 2, modalities="image")
        build_shards(split.val_dir, paths.val_shards, 2, modalities="image")
        real, classes = held_out(paths.val_shards, config)
        real_features = image_features(extractor, real)

        def fd(images: torch.Tensor) -> float:
            return frechet_distance(image_features(extractor, images), real_features)

        runs = {}
        for objective in ("flow_matching", "diffusion"):
            model, seconds = train_mmtrain(config, paths, objective, args.steps)
            images = sample(model, {"class": classes}, classes.shape[0], steps=25, cfg=config.cfg,
                            seed=0, config=DiffusionConfig())  # fmt: skip
            runs[objective] = (args.steps, seconds, fd(images))
        flow_seconds = runs["flow_matching"][1]
        at_steps, at_time, seconds, steps_by_time = train_peer(
            config, paths.train_shards, args.steps, flow_seconds
        )
        peer_fd = fd(peer_samples(at_steps, classes, config.cfg, seed=0))
        peer_fd_time = fd(peer_samples(at_time, classes, config.cfg, seed=0))
    half = real_features.shape[0] // 2
    floor = frechet_distance(real_features[:half], real_features[half:])
    rows = [
        "| trainer | objective | steps | training (s) | FD at equal steps | FD at equal wall-clock |",
        "|---|---|---:|---:|---:|---:|",
        f"| diffusers | DDPM epsilon | {args.steps} | {seconds:.0f} | {peer_fd:.3f} | "
        f"{peer_fd_time:.3f} ({steps_by_time} steps in {flow_seconds:.0f} s) |",
        f"| mmtrain | DDPM epsilon | {args.steps} | {runs['diffusion'][1]:.0f} | "
        f"{runs['diffusion'][2]:.3f} | |",
        f"| mmtrain | flow matching | {args.steps} | {flow_seconds:.0f} | "
        f"{runs['flow_matching'][2]:.3f} | {runs['flow_matching'][2]:.3f} |",
    ]
    print("\n".join(rows))
    notes = [
        f"The quickstart --diffusion emoji ({split.train} train / {split.val} held out, 10 "
        f"classes, 32 px), DiT 4 x 128, batch {config.batch_size}, lr {config.lr:g} "
        f"(warm-up {config.warmup_fraction:.0%}, cosine), EMA {config.ema}, guidance "
        f"{config.cfg:g}, 25 sampling steps, fp32, {args.threads} threads. FD in the features "
        f"of {args.clip} (lower is closer, every FD at n = {real.shape[0]}); the real-vs-real "
        f"floor, two halves of the held-out images (n = {half} each, so biased higher than an "
        f"FD at {real.shape[0]}), is {floor:.3f}. Load average {load_average()}.",
    ]
    if not args.no_append:
        append_results("DiT learning parity: mmtrain vs diffusers' recipe", rows, notes)


if __name__ == "__main__":
    main()
