"""CPU offload (`train.offload`: FSDP2's CPUOffloadPolicy) and QLoRA on one GPU, through the
trainer's own parts: a Llama-shaped LM (~1.1B parameters: width 2048, 16 blocks, GQA 16/8
heads, MLP 5632, 32k ids, untied head; rows of 2048 random ids) built by the trainer's set-up
(`model_setup.build_model`: under offload on the meta device, materialised shard by shard in
host memory, FSDP2 over a one-rank NCCL group; without offload the plain model on the GPU, as
`mmtrain train` runs it on one GPU), bf16, one micro-batch of 2 rows, the trainer's AdamW
(`make_optimizer`: fused) and step.

Cases: full fine-tuning without and with offload; LoRA (rank 16, bf16 base) and QLoRA (NF4
base); QLoRA with offload on one rank is refused (FSDP2's one-rank unshard copies one of the
three parts of an NF4 weight), which the line shows. Per case, one part of the line:
- the peak allocated GPU memory of a step (the optimizer's state made by an earlier step);
- the median time of a step (host clock around synchronised steps);
- where the parameters (shards) and the optimizer's moments live (`cpu pinned` expected under offload: the
  host copies then run asynchronously) and, for QLoRA, the NF4 bytes on the GPU.

On a CPU (`dry_run`) the same code on a tiny LM over a one-rank gloo group: it proves the note
runs; its figures mean nothing (no GPU memory, no PCIe).

    from gpu_offload import offload_note; print(offload_note(torch.device("cuda"), False))
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from common import median_seconds, sync

from mmtrain.config import config_from_dict
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.distributed import leave_process_group
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.model_setup import build_model
from mmtrain.train.objectives import LABELS_KEY, NextTokenObjective
from mmtrain.train.optim import make_optimizer, resolve_optimizer_defaults
from mmtrain.train.precision import make_precision
from mmtrain.train.qlora import is_quantised
from mmtrain.train.step import forward_backward, move_batch, optimizer_step

LORA = {"rank": 16, "alpha": 32}
CASES = {  # name: (train.offload, the text tower's LoRA settings or None)
    "full": (False, None),
    "full+offload": (True, None),
    "lora": (False, LORA),
    "qlora": (False, {**LORA, "quantize_base": "nf4"}),
    "qlora+offload": (True, {**LORA, "quantize_base": "nf4"}),
}


def _spec(dry_run: bool) -> ModelSpec:
    if dry_run:
        decoder = DecoderSpec(vocab_size=512, width=256, layers=2, heads=4, kv_heads=2,
                              mlp_hidden=512, max_positions=32, tie_embeddings=False)  # fmt: skip
    else:
        decoder = DecoderSpec(vocab_size=32_000, width=2048, layers=16, heads=16, kv_heads=8,
                              mlp_hidden=5632, max_positions=2048, tie_embeddings=False)  # fmt: skip
    return ModelSpec(name="lm-offload", embed_dim=decoder.width, towers={},
                     objective="next_token", decoder=decoder)  # fmt: skip


def _config(positions: int, offload: bool, lora: dict | None):
    towers = {"text": {"lora": lora}} if lora else {}
    config = config_from_dict({
        "model": "lm-offload", "data": {"train": "unused/", "sequence_length": positions},
        "train": {"steps": 1, "batch_size": 2, "micro_batch": 2, "precision": "bf16",
                  "parallel": "fsdp", "offload": offload, "towers": towers},
    })  # fmt: skip
    config.validate(world_size=1)
    return config


def _where(tensors: list[torch.Tensor]) -> str:
    """Where `tensors` (shards or plain) live: device type, and `pinned` for pinned host memory."""
    locals_ = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    kinds = set()
    for t in locals_:
        pinned = t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()
        kinds.add(f"{t.device.type}{' pinned' if pinned else ''}")
    return "/".join(sorted(kinds)) or "none"


def _case(name: str, spec: ModelSpec, device: torch.device, dry_run: bool) -> str:
    offload, lora = CASES[name]
    positions = spec.decoder.max_positions
    config = _config(positions, offload, lora)
    resolve_optimizer_defaults(config.train, spec)
    precision = make_precision("bf16", device)
    env = parallel.DistributedEnv(device, 0, 1, 0, False, 1)
    model = build_model(config, spec, precision, env, None).model
    optimizer = make_optimizer(model, config.train, device)
    ids = torch.randint(0, spec.decoder.vocab_size, (2, positions),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    batch = {"text": ids, LABELS_KEY: ids}
    objectives = [NextTokenObjective()]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = forward_backward(model, objectives, [move_batch(batch, device)], precision)
        optimizer_step(model, optimizer, precision, 1.0, loss=loss)

    step()  # the optimizer's state exists from here on
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds = median_seconds(step, device, 2 if dry_run else 4, warmup=0)
    peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else "n/a"  # fmt: skip
    params = list(model.parameters())
    moments = [s["exp_avg"] for s in optimizer.state.values() if "exp_avg" in s]
    nf4 = [p for p in params if is_quantised(p)]
    parts = [f"peak {peak}", f"{1000 * seconds:.0f} ms/step",
             f"params {_where(params)}", f"moments {_where(moments)}"]  # fmt: skip
    if nf4:
        held = sum(_nf4_bytes(p) for p in nf4)
        parts.append(f"NF4 {len(nf4)} weights {held / 2**30:.2f} GiB")
    return f"{name}: " + ", ".join(parts)


def _nf4_bytes(param: torch.Tensor) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    parts = ("quantized_data", "quantized_scalers", "quantization_factor")
    return sum(getattr(local, part).nbytes for part in parts)


def offload_note(device: torch.device, dry_run: bool) -> str:
    """One line: peak GPU memory and step time of full fine-tuning, LoRA and QLoRA, with and
    without CPU offload (module docstring)."""
    if device.type == "cuda" and device.index is None:  # NCCL binds the group to one GPU
        device = torch.device("cuda", torch.cuda.current_device())
    spec = _spec(dry_run)
    with tempfile.TemporaryDirectory() as tmp:
        owns = not dist.is_initialized()
        if owns:
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    init_method=f"file://{Path(tmp) / 'group'}", rank=0,
                                    world_size=1, **kwargs)  # fmt: skip
        try:
            parts = []
            for name in CASES:
                try:
                    parts.append(_case(name, spec, device, dry_run))
                except Exception as err:  # noqa: BLE001 - one case failing is a finding
                    parts.append(f"{name}: failed: {type(err).__name__}: {err}")
                if device.type == "cuda":  # the case's model and optimizer are gone
                    torch.cuda.empty_cache()
        finally:
            if owns:
                leave_process_group()
    size = f"{spec.params() / 1e9:.2f}B LM, 2 x {spec.decoder.max_positions}"
    return f"{device.type} offload/QLoRA ({size}, bf16, 1 rank): " + "; ".join(parts)


if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    print(offload_note(torch.device("cuda" if cuda else "cpu"), dry_run=not cuda))
