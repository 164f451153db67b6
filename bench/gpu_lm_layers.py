"""GPU check (d) of issue 41: eight full-size Qwen2.5-7B decoder layers with the real 152k
head, bf16, activation checkpointing per block, on packed and on padded rows of 4,096
positions, eager and compiled per block: MFU (the trainer's definition), the compiled graphs
and frames (recompiles), and the chunked loss's share of the step (the head's matmuls and the
log-softmax, timed alone on the same hidden states).

    lm_layers_note(torch.device("cuda"), dry_run=False)   # from bench/gpu_bench.py
"""

from __future__ import annotations

import gc

import torch
from common import median_seconds

from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models.token_loss import chunked_nll_sum
from mmtrain.spec import ModelSpec
from mmtrain.train.metrics import compile_counts, detect_peak_flops
from mmtrain.train.objectives import LABELS_KEY
from mmtrain.train.parallel import apply_compile

# Qwen2.5-7B's decoder (config.json of Qwen/Qwen2.5-7B): 3584 wide, 28 heads over 4 key/value
# heads, MLP 18944, 152,064 ids, untied head; eight of its 28 layers keep the step on one GPU.
QWEN_7B = dict(vocab_size=152_064, width=3584, layers=8, heads=28, kv_heads=4, mlp_hidden=18_944,
               tie_embeddings=False)  # fmt: skip
TINY = dict(vocab_size=512, width=64, layers=2, heads=4, kv_heads=2, mlp_hidden=160,
            tie_embeddings=False)  # fmt: skip


def _rows(vocab: int, rows: int, positions: int, packed: bool) -> dict[str, torch.Tensor]:
    """Random ids; packed: four documents a row; padded: the last quarter of every row padding."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, positions), generator=g)
    batch = {"text": ids, LABELS_KEY: ids.clone()}
    if packed:
        batch["document_ids"] = torch.arange(positions).div(positions // 4, rounding_mode="floor")
        batch["document_ids"] = batch["document_ids"].expand(rows, -1).contiguous()
    else:
        mask = torch.ones(rows, positions, dtype=torch.bool)
        mask[:, -positions // 4 :] = False
        batch["attention_mask"] = mask
        batch[LABELS_KEY][~mask] = -100
    return batch


def _loss_seconds(spec: ModelSpec, rows: int, positions: int, device) -> float:
    """The chunked next-token loss alone (forward and backward through the head) on hidden
    states of the step's shape, bf16 under autocast."""
    d = spec.decoder
    hidden = torch.randn(rows * positions, d.width, device=device, requires_grad=True)
    weight = torch.randn(d.vocab_size, d.width, device=device, requires_grad=True)
    targets = torch.randint(0, d.vocab_size, (rows * positions,), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            chunked_nll_sum(hidden, weight, targets).backward()

    return median_seconds(step, device, 3, 1)


def lm_layers_note(device: torch.device, dry_run: bool) -> str:
    from gpu_bench import _next_token_step  # the shared bf16 step

    positions, rows = (64, 2) if dry_run else (4096, 1)
    decoder = DecoderSpec(max_positions=positions, **(TINY if dry_run else QWEN_7B))
    spec = ModelSpec(name="qwen2.5-7b x 8 layers", embed_dim=decoder.width, towers={},
                     objective="next_token", decoder=decoder)  # fmt: skip
    peak = detect_peak_flops(device, "bf16")
    flops = spec.train_flops(spec.sequence_flops_by_part([positions] * rows, 0))
    parts = []
    for packed in (True, False):  # one model per layout: timed eager, then compiled in place
        step = _next_token_step(spec, _rows(decoder.vocab_size, rows, positions, packed),
                                device, lr=1e-5)  # fmt: skip
        layout = "packed" if packed else "padded"
        for compiled in (False, True):
            before = compile_counts().get("compiled_graphs", 0)  # the process's so far
            if compiled:
                apply_compile(step.model)
            seconds = median_seconds(step, device, 2 if dry_run else 5, 2)
            mfu = f"MFU {100 * flops / seconds / peak:.1f}%" if peak else "MFU n/a"
            graphs = compile_counts().get("compiled_graphs", 0) - before
            graphs = f", {graphs} graphs" if compiled else ""
            parts.append(f"{layout} {'compiled' if compiled else 'eager'} "
                         f"{1e3 * seconds:.0f} ms, {mfu}{graphs}")  # fmt: skip
            if not compiled:
                loss_s = _loss_seconds(spec, rows, positions, device)
                parts[-1] += f", loss {100 * loss_s / seconds:.0f}% of the step"
        del step  # its model and AdamW state before the next layout's are built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return (f"{spec.name} on {device.type} ({rows} x {positions} positions, bf16, AC per block): "
            + "; ".join(parts))  # fmt: skip
