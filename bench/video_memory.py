"""Peak memory of a video DiT's training step as the clip grows: attention through SDPA's fused
kernel (what mmtrain runs) against attention with its score matrix held whole, and with
activation checkpointing per block.

mmtrain's attention is `F.scaled_dot_product_attention`. Its flash kernels (CPU and CUDA) are
chunked attention: they walk the keys in tiles with an online softmax and keep only the
output and one log-sum-exp per query for backward, never the T x T scores. The "scores held"
rows force SDPA's math backend (`sdpa_kernel(SDPBackend.MATH)`), which materialises softmax(QK^T)
per head and saves it for backward: what attention costs without a memory-bounded kernel.
Outputs of the two are checked equal (float64) before measuring.

Each cell runs in a fresh process (one forward, loss, backward of one clip at batch 1, fp32, one
thread) and reports the rise of its peak RSS over the process's RSS after building the model
and the batch: the step's own activations, gradients and transients.

Prints a table and appends it to bench/RESULTS.md with the command and the machine.

    python bench/video_memory.py [--frames 16,32,64] [--size 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
from common import append_results, load_average

from mmtrain.spec import ModelSpec


def video_spec(frames: int, size: int) -> ModelSpec:
    """A video DiT of width 256, 4 blocks, 4 heads, full attention over 2 x 4 x 4 tubes."""
    return ModelSpec.from_dict({
        "name": f"video-dit-{frames}f", "objective": "flow_matching",
        "denoiser": {"sample_size": size, "channels": 4, "patch_size": 4, "width": 256,
                     "layers": 4, "heads": 4, "frames": frames, "temporal_patch": 2,
                     "input": "latent"},
    })  # fmt: skip


def one_step(frames: int, size: int, attention: str, ac: str) -> dict:
    """Runs in the child process: peak RSS rise (MiB) of one training step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mmtrain.models import create_model
    from mmtrain.train.parallel import apply_activation_checkpointing

    torch.set_num_threads(1)
    spec = video_spec(frames, size)
    model = create_model(spec, seed=0)
    apply_activation_checkpointing(model, ac)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, *spec.denoiser.sample_shape(), generator=g)
    t = torch.tensor([500.0])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    backends = [SDPBackend.MATH] if attention == "scores held" else [SDPBackend.FLASH_ATTENTION]
    with sdpa_kernel(backends):
        loss = model({"latent": x, "timestep": t})["prediction"].square().mean()
        loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens": spec.denoiser.tokens(), "mib": (peak - base) / 1024}


def outputs_agree(size: int) -> bool:
    """SDPA's fused kernel and the math backend give the same output (float64, 1e-10)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mmtrain.models import create_model

    spec = video_spec(8, size)
    model = create_model(spec, seed=0).double()
    model.denoiser.blocks[0].modulation.weight.data.normal_(0, 0.02)  # not the identity
    x = torch.randn(1, *spec.denoiser.sample_shape(), dtype=torch.float64)
    t = torch.tensor([500.0], dtype=torch.float64)
    with torch.no_grad():
        with sdpa_kernel([SDPBackend.MATH]):
            held = model({"latent": x, "timestep": t})["prediction"]
        fused = model({"latent": x, "timestep": t})["prediction"]
    return torch.allclose(held, fused, rtol=0, atol=1e-10)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        frames, size, attention, ac = json.loads(sys.argv[2])
        print(json.dumps(one_step(frames, size, attention, ac)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", default="16,32,64")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    same = outputs_agree(args.size)
    cells = [("SDPA (fused)", "none"), ("scores held", "none"), ("SDPA (fused)", "full")]
    rows = [
        "| frames | tokens | attention | checkpointing | peak rise (MiB) | vs scores held |",
        "|---:|---:|---|---|---:|---:|",
    ]
    for frames in map(int, args.frames.split(",")):
        measured = {}
        for attention, ac in cells:
            child = [
                sys.executable,
                __file__,
                "--child",
                json.dumps([frames, args.size, attention, ac]),
            ]
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            measured[(attention, ac)] = json.loads(out.strip().splitlines()[-1])
        held = measured[("scores held", "none")]["mib"]
        for (attention, ac), m in measured.items():
            rows.append(f"| {frames} | {m['tokens']} | {attention} | {ac} | {m['mib']:.0f} | "
                        f"{m['mib'] / held:.2f}x |")  # fmt: skip
    print("\n".join(rows))
    notes = [
        f"Video DiT width 256, 4 blocks, 4 heads, tubes 2 x 4 x 4 over {args.size} x "
        f"{args.size} x 4 latents, batch 1, fp32, 1 thread; one forward + backward per fresh "
        f"process; outputs of fused and math attention equal (float64, 1e-10): {same}; load "
        f"average {load_average()}.",
    ]
    if not args.no_append:
        append_results("Video DiT: peak memory of long clips", rows, notes)


if __name__ == "__main__":
    main()
