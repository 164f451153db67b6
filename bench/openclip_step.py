"""mmtrain's and OpenCLIP's training steps on the same tiny CLIP, side by side in one process.

Runs inside the benchmark's own virtual environment (bench/.venv-openclip, made by
train_throughput.py), which sees the project's torch and mmtrain and adds open_clip_torch. Both
models start from the same weights (mmtrain's init, converted with `mmtrain_to_openclip`), see
the same batches in the same order, and train with AdamW (the same groups and hyper-parameters),
fp32, gradient clipping at 1.0. Each implementation's step is forward + contrastive loss +
backward + clip + optimizer step, as its own trainer does it. The two are interleaved in rounds
(alternating which goes first) so that a noisy, shared machine slows both alike.

Prints one JSON object: per-step times and losses of both implementations.

    bench/.venv-openclip/bin/python bench/openclip_step.py --threads 1 --batch 64 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import types
from pathlib import Path

# The PyPI torchvision wheel is built against CUDA torch, so its C++ operators (nms, roi_align,
# ...) cannot load beside the project's CPU torch, and registering their meta kernels at import
# fails. OpenCLIP only needs torchvision's Python parts (transforms, FrozenBatchNorm2d), so that
# one registration module is skipped; nothing the benchmark runs touches those operators.
sys.modules.setdefault(
    "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
)

import open_clip  # noqa: E402
import torch  # noqa: E402
from open_clip.loss import ClipLoss  # noqa: E402

import mmtrain  # noqa: E402
from mmtrain.config import load_config  # noqa: E402
from mmtrain.losses import ContrastiveLoss  # noqa: E402
from mmtrain.models.formats.openclip import key_map, mmtrain_to_openclip  # noqa: E402
from mmtrain.spec import ModelSpec, load_spec  # noqa: E402
from mmtrain.train.loop import forward_backward, optimizer_step  # noqa: E402
from mmtrain.train.objectives import ContrastiveObjective  # noqa: E402
from mmtrain.train.optim import make_optimizer  # noqa: E402
from mmtrain.train.precision import make_precision  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BOS, EOT = 256, 257  # the byte tokenizer's special ids; EOT is the largest id (OpenCLIP's argmax)


def openclip_config(spec: ModelSpec) -> dict:
    """OpenCLIP's model config for an mmtrain ViT CLIP spec (cls pooling, causal eot text)."""
    image, text = spec.towers["image"], spec.towers["text"]
    return {
        "embed_dim": spec.embed_dim,
        "quick_gelu": image.activation == "quick_gelu",
        "vision_cfg": {
            "image_size": image.stem.image_size,
            "patch_size": image.stem.patch_size,
            "width": image.width,
            "layers": image.layers,
            "head_width": image.width // image.heads,
            "mlp_ratio": image.mlp_ratio,
        },
        "text_cfg": {
            "context_length": text.stem.context_length,
            "vocab_size": text.stem.vocab_size,
            "width": text.width,
            "heads": text.heads,
            "layers": text.layers,
            "mlp_ratio": text.mlp_ratio,
        },
    }


def make_batches(spec: ModelSpec, batch: int, count: int, seed: int) -> list[dict]:
    """`count` batches of random images and byte-tokenised texts (BOS ... EOT, zero padding)."""
    g = torch.Generator().manual_seed(seed)
    image, text = spec.towers["image"].stem, spec.towers["text"].stem
    out = []
    for _ in range(count):
        ids = torch.randint(1, 256, (batch, text.context_length), generator=g)
        lengths = torch.randint(3, text.context_length + 1, (batch, 1), generator=g)
        positions = torch.arange(text.context_length)[None]
        ids = torch.where(positions == 0, BOS, ids)
        ids = torch.where(positions == lengths - 1, EOT, ids)
        ids = ids * (positions < lengths)
        pixels = torch.randn(batch, 3, image.image_size, image.image_size, generator=g)
        out.append({"image": pixels, "text": ids})
    return out


class MmtrainStep:
    """The trainer's own step: `forward_backward` + `optimizer_step` (train/loop.py)."""

    def __init__(self, spec: ModelSpec, train_config) -> None:
        self.model = mmtrain.create_model(spec, seed=0)
        self.optimizer = make_optimizer(self.model, train_config, torch.device("cpu"))
        self.objectives = [
            ContrastiveObjective(self.model, ContrastiveLoss.from_spec(spec, distributed=False))
        ]
        self.precision = make_precision("fp32", torch.device("cpu"))
        self.grad_clip = train_config.grad_clip

    def no_decay_names(self) -> set[str]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {
            names[id(p)]
            for group in self.optimizer.param_groups
            if group["weight_decay"] == 0.0
            for p in group["params"]
        }

    def __call__(self, batch: dict) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss, _ = forward_backward(self.model, self.objectives, [batch], self.precision)
        optimizer_step(self.model, self.optimizer, self.precision, self.grad_clip)
        return float(loss.detach())


class OpenClipStep:
    """OpenCLIP's training step as its trainer does it: model -> ClipLoss -> backward -> clip
    -> AdamW -> clamp the logit scale at ln(100)."""

    def __init__(self, spec: ModelSpec, train_config, weights: dict, no_decay: set[str]) -> None:
        name = f"mmtrain-bench-{spec.name}"
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"{name}.json"
            path.write_text(json.dumps(openclip_config(spec)))
            open_clip.add_model_config(path)
        self.model = open_clip.create_model(name, pretrained=None, output_dict=True)
        self.model.load_state_dict(weights, strict=True)
        self.model.train()
        decay_group = {"params": [], "weight_decay": train_config.weight_decay}
        plain_group = {"params": [], "weight_decay": 0.0}
        for param_name, param in self.model.named_parameters():
            (plain_group if param_name in no_decay else decay_group)["params"].append(param)
        self.optimizer = torch.optim.AdamW(
            [decay_group, plain_group],
            lr=train_config.lr,
            betas=train_config.betas,
            eps=train_config.eps,
        )
        self.loss_fn = ClipLoss()
        self.grad_clip = train_config.grad_clip

    def __call__(self, batch: dict) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(batch["image"], batch["text"])
        loss = self.loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(100))
        return float(loss.detach())


def build(spec_name: str, batch: int) -> tuple[dict, list[dict]]:
    """Both steps from the same initial weights, and the batches they share."""
    spec = load_spec(spec_name)
    train_config = load_config(ROOT / "configs" / f"{spec_name}.yaml").train
    ours = MmtrainStep(spec, train_config)
    # OpenCLIP's names of the parameters mmtrain does not decay, so the two optimisers agree.
    theirs_of = {p.ours: p.theirs for p in key_map(spec)}
    no_decay = {theirs_of[n] for n in ours.no_decay_names()}
    weights = mmtrain_to_openclip(ours.model.state_dict(), spec)
    theirs = OpenClipStep(spec, train_config, weights, no_decay)
    return {"mmtrain": ours, "openclip": theirs}, make_batches(spec, batch, count=4, seed=0)


def run(steps: dict, batches: list[dict], warmup: int, rounds: int, per_round: int) -> dict:
    """Interleaved timing: each round runs `per_round` steps of each, alternating who goes first.

    Both see batch i % len(batches) at their i-th step, so their loss curves line up.
    """
    names = list(steps)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    counter = dict.fromkeys(names, 0)

    def one(name: str) -> float:
        batch = batches[counter[name] % len(batches)]
        counter[name] += 1
        start = time.perf_counter()
        losses[name].append(steps[name](batch))
        return time.perf_counter() - start

    for name in names:
        for _ in range(warmup):
            one(name)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            for _ in range(per_round):
                times[name].append(one(name))
    return {"times": times, "losses": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-clip", help="an mmtrain preset with a config")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="add a per-op CPU profile of both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps, batches = build(args.model, args.batch)
    result = run(steps, batches, args.warmup, args.rounds, args.per_round)
    result.update(
        threads=torch.get_num_threads(),
        batch=args.batch,
        open_clip=open_clip.__version__,
        torch=torch.__version__,
    )
    if args.profile:
        result["profile"] = {name: profile(step, batches[0]) for name, step in steps.items()}
    print(json.dumps(result))
    return 0


def profile(step, batch: dict, row_limit: int = 12) -> str:
    """torch.profiler's table of the most expensive CPU ops over 3 steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step(batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


if __name__ == "__main__":
    sys.exit(main())
