"""DPO's step on one GPU (issue 44), its three references side by side, against the plan the
trainer records for the run (`planned_memory`).

A Llama-shaped LM of ~1.1B parameters (width 2048, 16 blocks, GQA 16/8 heads, MLP 8192, 32k
ids, untied head), random init, bf16 autocast over fp32 weights, built by the trainer's own
functions (`build_model`, `build_reference`, `objectives_for`, `make_optimizer`), trained by
its `forward_backward` + `optimizer_step` with the real `DpoObjective` on micro-batches of 4
pairs (8 rows of up to 1,024 positions: a shared prompt, each side's answer the labels,
right-padded by the loader's own `conversation_batch`):
- LoRA (rank 16 on attention and MLP) with the adapters disabled as the reference;
- a full fine-tune with the cached reference: a `ReferencePass` scores every pair first (the
  trainer's pass, files and all, in a temporary folder), and each step looks its pairs up by
  `pair_index` (a pinned host->device copy);
- the same full fine-tune with a frozen copy (`build_reference`) as the reference.
Each: ms a step (CUDA events, after warm-up, median), the peak allocated memory of the timed
steps against `planned_memory`'s `predicted_allocated_bytes` for the same config, and the
device syncs of a step under `torch.cuda.set_sync_debug_mode("warn")` (common.count_syncs),
with `prepare`'s share (the reference's work: its forward, or the lookup) and, for the cache,
the lookup's alone, which should be 0. Also the reference pass: pairs/s of `reference_logps`
over micro-batches already on the device (CUDA events) and of the whole `ReferencePass.run`
(host batches moved, log-probs read back, parts written).

On a CPU (`dry_run`) the same code on a tiny LM: it proves the note runs (no peak, no syncs).

    from gpu_dpo import dpo_note; print(dpo_note(torch.device("cuda"), dry_run=False))
    PYTHONPATH=src:bench python bench/gpu_dpo.py [--dry-run]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import count_syncs, median_seconds

from mmtrain.config import config_from_dict
from mmtrain.data.stream.chat_templates import IGNORE_INDEX
from mmtrain.data.stream.conversation_batches import (
    NO_IMAGE_ID,
    ConversationSample,
    conversation_batch,
)
from mmtrain.data.stream.preference_batches import PAIR_INDEX, PAIRS
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models import create_model
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.dpo import reference_logps, reference_mode
from mmtrain.train.metrics import planned_memory
from mmtrain.train.model_setup import build_model, build_reference
from mmtrain.train.objectives import objectives_for
from mmtrain.train.optim import make_optimizer, resolve_optimizer_defaults
from mmtrain.train.precision import make_precision
from mmtrain.train.reference_cache import ReferenceLogps, ReferencePass, identity_of
from mmtrain.train.step import forward_backward, move_batch, optimizer_step

GIB = 2**30
PAIRS_A_BATCH = 4
SCORED_BATCHES = 8  # micro-batches the reference pass scores (32 pairs)
LM_1B = dict(vocab_size=32_000, width=2048, layers=16, heads=16, kv_heads=8, mlp_hidden=8192,
             tie_embeddings=False)  # fmt: skip
TINY = dict(vocab_size=512, width=64, layers=2, heads=4, kv_heads=2, mlp_hidden=160,
            tie_embeddings=False)  # fmt: skip


def _spec(dry_run: bool, positions: int) -> ModelSpec:
    decoder = DecoderSpec(max_positions=positions, **(TINY if dry_run else LM_1B))
    return ModelSpec(name="lm-dpo", embed_dim=decoder.width, towers={},
                     objective="next_token", decoder=decoder)  # fmt: skip


def _config(folder: Path, positions: int, reference: str, lora: bool):
    """The run's config: dpo with `reference`, LoRA on the text tower or a full fine-tune."""
    towers = {"text": {"lora": {"rank": 16}}} if lora else {}
    config = config_from_dict({
        "model": str(folder / "spec.json"),
        "data": {"train": str(folder), "sequence_length": positions},
        "train": {"steps": 1, "batch_size": PAIRS_A_BATCH, "micro_batch": PAIRS_A_BATCH,
                  "precision": "bf16", "objective": "dpo", "dpo": {"reference": reference},
                  "towers": towers},
        "out": str(folder / "run"),
    })  # fmt: skip
    config.validate(world_size=1)
    return config


def pair_batches(vocab: int, positions: int, count: int, seed: int) -> list[dict]:
    """`count` host micro-batches of PAIRS_A_BATCH pairs as the loader lays them out: each
    pair a prompt of a quarter to half a row and two answers (labels on the answer only),
    chosen rows first; the first chosen answer fills its row, so every batch is `positions`
    wide. `__index__`: each pair's sample id, as the loader's batches carry it."""
    rng = random.Random(seed)

    def ids(length: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(length)]  # 0-2: padding's ids

    batches = []
    for number in range(count):
        chosen, rejected = [], []
        for pair in range(PAIRS_A_BATCH):
            prompt = ids(rng.randrange(positions // 4, positions // 2))
            room = positions - len(prompt)
            for side, fills in ((chosen, pair == 0), (rejected, False)):
                answer = ids(room if fills else rng.randrange(room // 2, room + 1))
                labels = [IGNORE_INDEX] * len(prompt) + answer
                side.append(ConversationSample(prompt + answer, labels))
        batch = conversation_batch(chosen + rejected, pack=False, row_length=positions,
                                   image_token_id=NO_IMAGE_ID, image_tokens=0)  # fmt: skip
        batch[PAIRS] = PAIRS_A_BATCH
        batch["__index__"] = list(range(number * PAIRS_A_BATCH, (number + 1) * PAIRS_A_BATCH))
        batches.append(batch)
    return batches


def _pinned(batch: dict) -> dict:
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def step_ms(step, device: torch.device, steps: int, warmup: int) -> float:
    """Median ms of `step()` after `warmup` untimed calls: CUDA events around each call on a
    GPU (read after the last), the host clock elsewhere."""
    if device.type != "cuda":
        return 1e3 * median_seconds(step, device, steps, warmup)
    for _ in range(warmup):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]  # fmt: skip
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


class _Run:
    """A built model with its optimizer, precision and config: a DPO step as the trainer
    takes it (`step`), for whichever reference `use` sets up."""

    def __init__(self, config, spec: ModelSpec, device: torch.device):
        resolve_optimizer_defaults(config.train, spec)
        self.spec, self.device = spec, device
        self.precision = make_precision("bf16", device)
        self.env = parallel.DistributedEnv(device, 0, 1, 0, False, 1)
        self.built = build_model(config, spec, self.precision, self.env, None)
        self.config = self.built.config
        self.optimizer = make_optimizer(self.built.model, self.config.train, device)

    def use(self, config, reference=None, cached: ReferenceLogps | None = None) -> str:
        """The objective of `config`'s train.dpo (resolved as the trainer resolves it)."""
        self.config = config
        mode = reference_mode(self.built.model, config.train.dpo)
        self.objectives = objectives_for(self.built.model, self.spec, objective="dpo",
                                         dpo=config.train.dpo, reference=reference,
                                         cached=cached)  # fmt: skip
        return mode

    def step(self, batch: dict) -> torch.Tensor:
        """One optimizer step; its loss, on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        loss, _ = forward_backward(self.built.trained, self.objectives, [batch], self.precision, 1)
        optimizer_step(self.built.model, self.optimizer, self.precision,
                       self.config.train.grad_clip, loss=loss)  # fmt: skip
        return loss

    def prepare(self, batch: dict) -> None:
        for objective in self.objectives:
            objective.prepare(self.built.trained, [batch], self.precision)


def measure(run: _Run, mode: str, batch: dict, dry_run: bool) -> str:
    """One reference's figures: ms a step, peak vs plan, syncs (module docstring)."""
    device = run.device
    cuda = device.type == "cuda"
    steps, warmup = (2, 1) if dry_run else (5, 2)
    # ln 2 where the policy is the reference (adapters, and the cache scored by this very
    # model): a lookup that read another pair's values would show here.
    first_loss = float(run.step(batch))
    for _ in range(warmup - 1):  # the optimizer's state exists from the first step on
        run.step(batch)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    ms = step_ms(lambda: run.step(batch), device, steps, 0)
    plan = planned_memory(run.spec, run.config, world_size=1, recompute=run.built.recompute,
                          device=device, dpo_reference=mode)["predicted_allocated_bytes"]  # fmt: skip
    label = "LoRA + adapters" if mode == "adapters" else f"full + {mode}"
    label += f" (first loss {first_loss:.4f})"
    if not cuda:
        return (
            f"{label}: {ms:.0f} ms/step, plan {plan / GIB:.3f} GiB (no peak or syncs on "
            f"{device.type})"
        )
    peak = torch.cuda.max_memory_allocated(device)
    syncs = count_syncs(lambda: run.step(batch), device)
    prepared = count_syncs(lambda: run.prepare(batch), device)
    text = (f"{label}: {ms:.1f} ms/step, peak {peak / GIB:.2f} GiB vs plan {plan / GIB:.2f} GiB "
            f"({100 * (peak / plan - 1):+.1f}%), syncs {syncs}/step ({prepared} in prepare")  # fmt: skip
    if mode == "cache":
        cached = run.objectives[0].cached
        lookup = count_syncs(lambda: cached.lookup(batch[PAIR_INDEX], device), device)
        text += f", {lookup} in the lookup"
    return text + ")"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def scoring(run: _Run, host: list[dict], folder: Path, dry_run: bool
            ) -> tuple[ReferenceLogps, str]:  # fmt: skip
    """The cached reference: `reference_logps` alone over micro-batches on the device (CUDA
    events), then the trainer's whole ReferencePass over the host batches; its values and
    the pass's pairs/s."""
    device, precision, model = run.device, run.precision, run.built.trained
    moved = [move_batch({k: v for k, v in b.items() if k != "__index__"}, device,
                        precision.param_dtype) for b in host]  # fmt: skip
    pairs = PAIRS_A_BATCH * len(host)

    def forwards() -> None:
        for batch in moved:
            reference_logps(model, batch, precision)

    forward_ms = step_ms(forwards, device, 1 if dry_run else 3, 1)
    identity = identity_of(run.config, ["gpu_dpo bench pairs"])
    store = ReferencePass(folder, identity, pairs, rank=0, barrier=lambda: None)

    def score(batch: dict) -> torch.Tensor:
        return reference_logps(model, move_batch(batch, device, precision.param_dtype), precision)

    start = time.perf_counter()
    cached = store.run(({**b} for b in host), score)  # run() pops each batch's __index__
    pass_s = time.perf_counter() - start
    return cached, (f"reference pass over {pairs} pairs: {pairs / forward_ms * 1e3:.0f} pairs/s "
                    f"(reference_logps on the device), {pairs / pass_s:.0f} pairs/s "
                    "(ReferencePass.run: moved, read back, written)")  # fmt: skip


def dpo_note(device: torch.device, dry_run: bool) -> str:
    began = time.perf_counter()
    positions = 64 if dry_run else 1024
    spec = _spec(dry_run, positions)
    cuda = device.type == "cuda"
    host = pair_batches(spec.decoder.vocab_size, positions, 2 if dry_run else SCORED_BATCHES, 0)
    if cuda:
        host = [_pinned(b) for b in host]  # as the loader hands them over on a GPU
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "spec.json").write_text(json.dumps(spec.to_dict()))
        batch = move_batch(host[0], device)  # the timed steps' micro-batch, on the device
        batch[PAIR_INDEX] = batch.pop("__index__")  # as TrainData.next_batch names it

        config = _config(folder, positions, "adapters", lora=True)
        run = _Run(config, spec, device)
        parts.append(measure(run, run.use(config), batch, dry_run))
        del run
        _free(device)

        config = _config(folder, positions, "cache", lora=False)
        run = _Run(config, spec, device)
        cached, pass_note = scoring(run, host, folder / "run", dry_run)
        parts.append(measure(run, run.use(config, cached=cached), batch, dry_run))
        config = _config(folder, positions, "copy", lora=False)
        copy = build_reference(config, spec, run.precision, run.env)
        parts.append(measure(run, run.use(config, reference=copy), batch, dry_run))
        parts.append(pass_note)
        del run, copy
        _free(device)
    name = torch.cuda.get_device_name(device) if cuda else device.type
    params = sum(p.numel() for p in create_model(spec, device="meta").parameters())
    head = (f"DPO step on {name} ({params / 1e6:,.1f}M-parameter LM, {PAIRS_A_BATCH} pairs x "
            f"{positions} positions a micro-batch, bf16; first loss ln 2 = 0.6931 where the "
            "policy is the reference; optimizer_step's flag read is 1 sync)")  # fmt: skip
    return f"{head}: {'; '.join(parts)}; note {time.perf_counter() - began:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    print(dpo_note(torch.device("cuda" if cuda else "cpu"), dry_run=not cuda))


if __name__ == "__main__":
    main()
