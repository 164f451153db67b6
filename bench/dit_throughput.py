"""mmtrain's DiT and diffusers' `DiTTransformer2DModel` of the same shape and weights, one
training step each on the same batch, side by side in one process.

The shape is DiT-S/2 on 32 x 32 x 4 latents (256 px images through SD's VAE; Peebles & Xie's
smallest model: 12 layers, width 384, 6 heads), class-conditional, learned sigma. diffusers'
model is built from its config, its weights copied into mmtrain's through the converter
(models/formats/diffusers.py), and both outputs are checked equal before timing. A step is the
forward, the mean squared error against a fixed target, the backward and an AdamW step, in
fp32. Rounds alternate which model goes first, so a busy machine slows both alike; the best
round of each is kept.

Prints a table and appends it to bench/RESULTS.md with the command and the machine.

    python bench/dit_throughput.py [--batch 16] [--rounds 5] [--steps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import append_results, load_average

from mmtrain.models.build import model_with_weights
from mmtrain.models.formats.diffusers import read_diffusers_dit

DIT_S_2 = dict(num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=8,
               num_layers=12, sample_size=32, patch_size=2, num_embeds_ada_norm=1000)  # fmt: skip


def step_seconds(forward, params, batch, target, steps: int) -> float:
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    start = time.perf_counter()
    for _ in range(steps):
        loss = F.mse_loss(forward(*batch), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import diffusers

    torch.manual_seed(0)
    peer = diffusers.DiTTransformer2DModel(**DIT_S_2)
    emb = peer.transformer_blocks[0].norm1.emb.state_dict()  # DiT has one embedder (checkpoints
    for block in peer.transformer_blocks[1:]:  # repeat it per block; a fresh init does not)
        block.norm1.emb.load_state_dict(emb)
    with tempfile.TemporaryDirectory() as tmp:
        peer.save_pretrained(Path(tmp) / "dit")
        spec, state = read_diffusers_dit(Path(tmp) / "dit")
    ours = model_with_weights(spec, {k: v.clone() for k, v in state.items()})
    # eval mode for both: diffusers' class table drops labels at random in train mode (its
    # guidance dropout; mmtrain's lives in the objective), which would make the outputs differ.
    peer.eval(), ours.eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 4, 32, 32, generator=g)
    t = torch.randint(0, 1000, (args.batch,), generator=g).float()
    y = torch.randint(0, 1000, (args.batch,), generator=g)
    target = torch.randn(args.batch, 8, 32, 32, generator=g)
    with torch.no_grad():
        same = torch.allclose(peer(x, timestep=t, class_labels=y).sample,
                              ours.predict({"latent": x, "timestep": t, "class": y}), atol=1e-4)  # fmt: skip
    runs = {
        "diffusers": (lambda a, b, c: peer(a, timestep=b, class_labels=c).sample, peer),
        "mmtrain": (lambda a, b, c: ours.predict({"latent": a, "timestep": b, "class": c}), ours),
    }
    best = {name: float("inf") for name in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            forward, model = runs[name]
            seconds = step_seconds(forward, model.parameters(), (x, t, y), target, args.steps)
            best[name] = min(best[name], seconds)
    rows = [
        "| implementation | step (s) | images/s | vs diffusers |",
        "|---|---:|---:|---:|",
    ]
    for name in runs:
        ratio = best["diffusers"] / best[name]
        rows.append(f"| {name} | {best[name]:.3f} | {args.batch / best[name]:.1f} | {ratio:.2f}x |")
    print("\n".join(rows))
    notes = [
        f"DiT-S/2 (12 layers, width 384) on 32x32x4 latents, batch {args.batch}, fp32, "
        f"{args.threads} threads, best of {args.rounds} rounds of {args.steps} steps; outputs "
        f"equal before timing: {same}; load average {load_average()}.",
    ]
    if not args.no_append:
        append_results("DiT step: mmtrain vs diffusers", rows, notes)


if __name__ == "__main__":
    main()
