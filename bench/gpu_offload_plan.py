"""FSDP2's CPU offload on one GPU against the planner's offload figures (plan/offload.py,
plan/memory.py): what only a GPU can show, since pinned memory needs CUDA.

A Qwen2.5-7B-shaped LM cut to 4 blocks (width 3584, GQA 28/4 heads, MLP 18944, 152,064 ids,
untied head; ~2.0B parameters) wrapped as train/parallel.py's apply_fsdp wraps a model (each
block, the untied embedding, the root) with `CPUOffloadPolicy()` over a one-rank NCCL group,
bf16 parameters and fp32 gradient reduction under bf16 autocast, AdamW, one row of 2,048 ids a
step. One line of figures:
- the step's peak allocated CUDA memory (the second step: the optimizer's states made) beside the
  plan's GPU total less the CUDA context and fragmentation (what `max_memory_allocated` sees);
- the pinned host memory the CachingHostAllocator holds after the step
  (`torch.cuda.host_memory_stats`) beside the plan's pinned bytes (each shard rounded up to a
  power of two) and their sum unrounded;
- the step's seconds beside the plan's (whose host optimizer step is not timed).

On a CPU (`dry_run`) a tiny LM under FSDP2 over a one-rank gloo group without offload (pinned
memory needs CUDA): it proves the note runs and prints the plan's figures, measuring nothing.

    from gpu_offload_plan import offload_plan_note; print(offload_plan_note(torch.device("cuda"), False))
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mmtrain
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.hardware import GIB, default_catalog
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.model import Rows, from_spec
from mmtrain.spec import ModelSpec

ROW = 2048  # ids a row, one row a step


def _spec(dry_run: bool) -> ModelSpec:
    if dry_run:
        decoder = DecoderSpec(vocab_size=512, width=64, layers=2, heads=4, kv_heads=2,
                              mlp_hidden=160, max_positions=ROW, tie_embeddings=False)  # fmt: skip
    else:
        decoder = DecoderSpec(vocab_size=152_064, width=3584, layers=4, heads=28, kv_heads=4,
                              mlp_hidden=18_944, max_positions=ROW, qkv_bias=True,
                              tie_embeddings=False)  # fmt: skip
    return ModelSpec(name="lm-offload", embed_dim=decoder.width, towers={},
                     objective="next_token", decoder=decoder)  # fmt: skip


def _shard(model: torch.nn.Module, device: torch.device) -> None:
    """apply_fsdp's units (blocks, the untied embedding, the root), offloaded on CUDA."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    cuda = device.type == "cuda"
    mesh = init_device_mesh(device.type, (1,))
    kw = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32
        ),
        "offload_policy": CPUOffloadPolicy() if cuda else OffloadPolicy(),
    }
    text = model.towers["text"]
    for block in text.blocks:
        fully_shard(block, **kw)
    fully_shard(text.embed, **kw)
    fully_shard(model, **kw)
    register_fsdp_forward_method(model, "logits")


def _step(model, optimizer, ids: torch.Tensor, device: torch.device) -> float:
    start = time.perf_counter()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        logits = model.logits({"text": ids})
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _pinned_now() -> int | None:
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "allocation.current"):
        if key in stats:
            return int(stats[key])
    return None


def offload_plan_note(device: torch.device, dry_run: bool) -> str:
    spec = _spec(dry_run)
    cuda = device.type == "cuda"
    catalog = default_catalog()
    gpu = catalog.resolve_device(torch.cuda.get_device_name(device))[0].key if cuda else "h100"
    cfg = PlanConfig(gpu=gpu, gpus=1, zero=3, offload=True, micro_batch=1, global_batch=1)
    plan = make_plan(from_spec(spec, Rows(positions=ROW)), cfg, catalog)
    m, h = plan.memory, plan.host
    planned = m.total_bytes - m.cuda_context_bytes - m.fragmentation_bytes
    figures = (
        f"plan: GPU {planned / GIB:.2f} GiB allocated, pinned {h.pinned_bytes / GIB:.2f} GiB "
        f"(unrounded {(h.params_bytes + h.grads_bytes) / GIB:.2f}), step {plan.time.step_time_s:.3g} s"
    )
    store = dist.HashStore()
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    try:
        model = mmtrain.create_model(spec)  # fp32 on the host; FSDP2 moves what it computes with
        _shard(model, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, spec.decoder.vocab_size, (1, ROW), generator=g).to(device)
        _step(model, optimizer, ids, device)  # makes the optimizer's states
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        seconds = _step(model, optimizer, ids, device)
        if not cuda:
            return f"offload plan (dry run, no CUDA: nothing measured): {figures}; CPU step {seconds:.3g} s"
        peak = torch.cuda.max_memory_allocated(device)
        pinned = _pinned_now()
        held = (
            "n/a"
            if pinned is None
            else f"{pinned / GIB:.2f} GiB ({pinned / h.pinned_bytes - 1:+.1%})"
        )
        return (
            f"offload on 1 x {gpu}: GPU peak {peak / GIB:.2f} GiB ({peak / planned - 1:+.1%} vs "
            f"plan), pinned host {held}, step {seconds:.3g} s; {figures}"
        )
    finally:
        dist.destroy_process_group()
