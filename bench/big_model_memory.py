"""Peak resident memory per rank of a model larger than one rank's share: FSDP2 on 2 gloo ranks,
`init:` from a HF Llama folder that transformers itself wrote (sharded safetensors), LoRA on
the LM, a few steps, the final checkpoint and the export. Measured, on the CPU.

Variants, each a fresh 2-rank run (its own processes):
- sharded: the trainer's path under FSDP (meta-device build, shards materialised per rank,
  `init` read in slices of dim 0, export gathered one parameter at a time);
- whole: the same run through the set-up every rank used before (the whole model built and
  loaded in each rank, then sharded), which remains the fallback for baselines not read in
  slices.
Each under three heaps (`--heaps`): `glibc` (glibc's dynamic mmap threshold, which grows past
the size of freed all-gather buffers, so the heap keeps them: the trainer's rank start is kept
from fixing it), `rank-start` (what the trainer does: `distributed.fix_malloc_mmap_threshold`
sets 1 MB through mallopt when a rank starts) and `env` (`MALLOC_MMAP_THRESHOLD_=1000000` set
by the launcher, which the rank start then leaves alone).

Peak RSS = `VmHWM` of /proc/self/status of each rank at the end of its run (set-up, training,
checkpoint and export included). Not getrusage's ru_maxrss: Linux carries that over from the
parent process a rank was forked from, whose RSS at fork time then floors every figure. The bound the issue sets: 0.6 x the model's
fp32 bytes + 1 GiB of runtime. Also checks that the exported weights of the run at lr 0 equal
the source bitwise (merged LoRA adapters at zero change nothing).

    python bench/big_model_memory.py [--layers 20] [--steps 2] [--variants sharded,whole]
        [--heaps glibc,rank-start,env]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import append_results, load_average

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from dist_helpers import run_distributed  # noqa: E402

GIB = 2**30
THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "1000000"}
HEAPS = ("glibc", "rank-start", "env")
HEAP_LABELS = {
    "glibc": "glibc's dynamic",
    "rank-start": "1 MB by mallopt at rank start",
    "env": "MALLOC_MMAP_THRESHOLD_=1000000",
}


def make_baseline(folder: Path, layers: int) -> int:
    """A random Llama of `layers` blocks (width 1536, 32000 ids) saved by transformers in
    1 GB shards; returns its fp32 bytes."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=layers,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256,
        tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="1GB")
    return sum(p.numel() * 4 for p in model.parameters())


def make_run(root: Path, baseline: Path, steps: int) -> dict:
    """Text conversations in shards, a byte-level BPE, and the run's config (lr 0)."""
    from mmtrain.data.storage.manifest import write_manifest
    from mmtrain.data.storage.shard_writer import ShardWriter
    from mmtrain.data.stream.tokenizer import train_bpe
    from mmtrain.models.formats.hf import language_model_spec
    from mmtrain.models.formats.hf_llama import spec_from_config

    shards = root / "shards"
    words = ["the quick brown fox jumps over the lazy dog"] * 8
    train_bpe(words, vocab_size=300, out_path=shards / "tokenizer.json")
    with ShardWriter(shards, max_samples=8) as writer:
        for i in range(16):
            messages = [
                {"role": "user", "content": f"count {i}"},
                {"role": "assistant", "content": "the quick brown fox " * (1 + i % 3)},
            ]
            writer.write({"__key__": f"{i:09d}", "json": json.dumps({"id": str(i), "messages": messages})})  # fmt: skip
    write_manifest(shards, writer.shards, modalities=["text"])
    config_file = baseline / "config.json"
    decoder = spec_from_config(json.loads(config_file.read_text()), config_file)
    spec = language_model_spec(decoder, "bench-llama")
    (root / "spec.json").write_text(json.dumps(spec.to_dict()))
    return {
        "model": str(root / "spec.json"),
        "init": str(baseline),
        "data": {"train": str(shards), "tokenizer": str(shards / "tokenizer.json"),
                 "chat_template": "plain", "sequence_length": 64},
        "train": {"steps": steps, "batch_size": 2, "micro_batch": 1, "lr": 0.0,
                  "warmup_steps": 0, "parallel": "fsdp",
                  "towers": {"text": {"lora": {"rank": 8}}}},
        "checkpoint": {"every_steps": 1000, "keep": 1},
        "metrics": {"tensorboard": False},
    }  # fmt: skip


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM, kept per address space: fresh after exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rank(rank: int, world: int, config: dict, variant: str, heap: str) -> dict:
    from mmtrain.config import config_from_dict
    from mmtrain.train import model_setup, parallel
    from mmtrain.train.loop import train

    if variant == "whole":
        model_setup._sliced_plan = lambda *args: model_setup._WHOLE
    if heap == "glibc":  # the rank start leaves glibc's dynamic threshold as it is
        parallel.fix_malloc_mmap_threshold = lambda *args: False
    after_imports = peak_rss_bytes()
    started = time.perf_counter()
    train(config_from_dict(config))
    return {
        "after_imports": after_imports,
        "peak": peak_rss_bytes(),
        "seconds": time.perf_counter() - started,
    }


def run(config: dict, out: Path, variant: str, heap: str) -> list[dict]:
    saved = dict(os.environ)
    for name in THRESHOLD:
        os.environ.pop(name, None)
    if heap == "env":
        os.environ.update(THRESHOLD)
    try:
        config = {**config, "out": str(out)}
        return run_distributed(_rank, world_size=2, args=(config, variant, heap), timeout_s=1800)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def exported_equals_source(out: Path, baseline: Path) -> bool:
    from mmtrain.models.formats.hf_llama import hf_to_mmtrain, spec_from_config
    from mmtrain.models.safetensors_files import read_weights

    config_file = baseline / "config.json"
    spec = spec_from_config(json.loads(config_file.read_text()), config_file)
    source = hf_to_mmtrain(read_weights(baseline), spec)
    exported = read_weights(out)
    return set(exported) == {f"towers.text.{k}" for k in source} and all(
        torch.equal(exported[f"towers.text.{k}"], v) for k, v in source.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", default="sharded,whole")
    parser.add_argument("--heaps", default=",".join(HEAPS))
    args = parser.parse_args()
    load = load_average()
    root = Path(tempfile.mkdtemp(prefix="mmtrain-bigmem-"))
    fp32_bytes = make_baseline(root / "hf", args.layers)
    config = make_run(root, root / "hf", args.steps)
    bound = 0.6 * fp32_bytes + GIB
    rows = ["| variant | heap (mmap threshold) | rank 0 peak GiB | rank 1 peak GiB | after imports GiB | bound GiB | within | run s | export == source |",
            "|---|---|---:|---:|---:|---:|---|---:|---|"]  # fmt: skip
    for variant in args.variants.split(","):
        for heap in args.heaps.split(","):
            out = root / f"run-{variant}-{heap}"
            ranks = run(config, out, variant, heap)
            peaks = [r["peak"] for r in ranks]
            same = exported_equals_source(out, root / "hf")
            rows.append(
                f"| {variant} | {HEAP_LABELS[heap]} | {peaks[0] / GIB:.2f} | "
                f"{peaks[1] / GIB:.2f} | {ranks[0]['after_imports'] / GIB:.2f} | "
                f"{bound / GIB:.2f} | {'yes' if max(peaks) <= bound else 'no'} | "
                f"{max(r['seconds'] for r in ranks):.0f} | {same} |"
            )
            print(rows[-1], flush=True)
    notes = [
        f"Llama from transformers (LlamaForCausalLM, width 1536, {args.layers} blocks, 12 heads /"
        f" 4 kv heads, MLP 4096, 32000 ids, untied head): {fp32_bytes / GIB:.2f} GiB of fp32 "
        "weights, saved by save_pretrained in 1 GB shards; `init:` that folder, LoRA rank 8 on "
        f"the LM, FSDP2 on 2 gloo ranks (1 thread each), {args.steps} steps of 2 x 64 positions"
        " at lr 0, the final (sharded) checkpoint and the export. Peak RSS per rank: VmHWM at "
        "the end of the run. Bound: 0.6 x fp32 bytes + 1 GiB.",
        f"Load average before: {load}.",
    ]
    print("\n".join(rows))
    append_results("big_model_memory", rows, notes)


if __name__ == "__main__":
    main()
