"""`train` on a vision-language model (presets/tiny-vlm.yaml): the loop's machinery for the
next-token objective — stages through `init` and frozen towers, exact resume with packing,
LoRA and frozen decoder blocks, and 2 ranks (FSDP2 + activation checkpointing) against 1.

Real parts: JPEG images, tar shards of conversations, the streaming loader, the byte tokenizer
with the "plain" template, real gloo processes. Exact comparisons run in float64
(`train.precision: fp64`): ~1e4 roundings of ~1e-16 per value and step keep differences below
~1e-11, so rtol 1e-9 holds on any CPU while a lost micro-batch or a wrong normalisation shows
at ~1e-3.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import statistics
from pathlib import Path

import pytest
import safetensors.torch
import torch
from PIL import Image

from dist_helpers import run_distributed
from micro import matmul_tflops
from mmtrain.config import config_from_dict
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.tokenizer import train_bpe
from mmtrain.models import LanguageModel
from mmtrain.report.doctor import diagnose
from mmtrain.report.rundata import load_run
from mmtrain.spec import load_spec
from mmtrain.train.loop import train
from mmtrain.train.metrics import padding_fraction

EXACT = {"rtol": 1e-9, "atol": 1e-12}
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 220), "black": (0, 0, 0)}


def _jpeg(rgb: tuple[int, int, int], seed: int) -> bytes:
    image = Image.new("RGB", (72, 72), rgb)
    image.putpixel((seed % 72, (7 * seed) % 72), (255, 255, 255))  # no two files alike
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _record(i: int) -> tuple[dict, list[bytes]]:
    """A caption per image ("<image>" then its colour), every fourth one text-only."""
    name = list(COLOURS)[i % len(COLOURS)]
    if i % 4 == 3:
        messages = [
            {"role": "user", "content": f"Say {name}."},
            {"role": "assistant", "content": f"{name} " * (1 + i % 3)},
        ]
        return {"id": str(i), "messages": messages, "images": []}, []
    messages = [
        {"role": "user", "content": "<image>"},
        {"role": "assistant", "content": f"a {name} square"},
    ]
    return {"id": str(i), "messages": messages, "images": ["0.jpg"]}, [_jpeg(COLOURS[name], i)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The shards, beside them a byte-level BPE of their words and a smaller tiny-vlm with that
    vocabulary plus one id for the image placeholder."""
    folder = tmp_path_factory.mktemp("vlm-shards")
    words = [f"Say {name}. a {name} square {name}" for name in COLOURS] * 4
    image_id = train_bpe(words, vocab_size=280, out_path=folder / "tokenizer.json").vocab_size
    spec = load_spec("tiny-vlm").to_dict()  # smaller still: 16 image tokens, width 64
    spec.update(embed_dim=64)
    spec["towers"]["image"].update(stem={"image_size": 32, "patch_size": 8}, width=64, layers=3)
    spec["decoder"].update(
        vocab_size=image_id + 1, width=64, mlp_hidden=160, bos_id=None, eos_ids=[]
    )
    spec["projector"]["image_token_id"] = image_id
    (folder / "spec.json").write_text(json.dumps(spec))
    with ShardWriter(folder, max_samples=8) as writer:
        for i in range(24):
            record, images = _record(i)
            sample = {"__key__": f"{i:09d}", "json": json.dumps(record)}
            sample |= {f"{n}.jpg": data for n, data in enumerate(images)}
            writer.write(sample)
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return folder


def _config(out: Path, shards: Path, *, data=None, train=None, **top):
    return config_from_dict(
        {
            "model": str(shards / "spec.json"),
            "data": {
                "train": str(shards),
                "tokenizer": str(shards / "tokenizer.json"),
                "chat_template": "plain",
                "sequence_length": 96,
                **(data or {}),
            },
            "train": {
                "steps": 4,
                "batch_size": 4,
                "micro_batch": 2,
                "precision": "fp64",
                "lr": 1e-3,
                "warmup_steps": 0,
                **(train or {}),
            },
            "checkpoint": {"every_steps": 2, "keep": 3},
            "metrics": {"tensorboard": False},
            "out": str(out),
            **top,
        }
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(folder / "model.safetensors"))


def _changed(before: dict, after: dict, prefix: str) -> bool:
    names = [n for n in before if n.startswith(prefix)]
    assert names, prefix
    return any(not torch.equal(before[n], after[n]) for n in names)


def test_stage_one_then_stage_two(tmp_path, shards):
    """Stage 1 trains the projector only; stage 2 starts from stage 1's run folder through
    `init` and trains the projector and the LM, the vision tower still frozen."""
    frozen = {"image": {"freeze": True}, "text": {"freeze": True}}
    one = train(_config(tmp_path / "one", shards, train={"towers": frozen}))
    assert one.step == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in one.history)
    assert all(r["target_tokens"] > 0 for r in one.history)
    start = train(_config(tmp_path / "zero", shards, train={"steps": 1, "lr": 0.0}))
    before, after = _weights(tmp_path / "zero"), _weights(tmp_path / "one")
    assert not _changed(before, after, "towers.image.")
    assert not _changed(before, after, "towers.text.")
    assert _changed(before, after, "projector.")
    del start

    two_towers = {"image": {"freeze": True}}
    two = train(
        _config(
            tmp_path / "two",
            shards,
            data={"val": str(shards)},
            train={"towers": two_towers},
            init=str(tmp_path / "one"),
        )
    )
    assert two.step == 4
    # validation: perplexity and generated answers, in the rows and in eval.json
    assert math.isfinite(two.history[-1]["val/perplexity"])
    report = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert report["generation"]["n"] > 0 and 0.0 <= report["generation"]["token_f1"] <= 1.0
    final = _weights(tmp_path / "two")
    assert not _changed(after, final, "towers.image.")
    assert _changed(after, final, "towers.text.blocks.")
    assert _changed(after, final, "projector.")


@pytest.mark.parametrize("pack", [False, True], ids=["padded-crash", "packed-sigterm"])
def test_resume_is_exact(tmp_path, shards, pack, monkeypatch):
    """Stopped, then rerun: the same weights as a run never stopped. Padded rows stop dead
    after step 3 (a crash: the checkpoint of step 2 resumes); packed rows get a SIGTERM during
    step 4's forward, a step after the step-2 checkpoint (the step finishes, its checkpoint is
    written, the run exits)."""
    whole = train(_config(tmp_path / "whole", shards, data={"pack": pack}, train={"steps": 6}))
    # The stopped run's packed images travel as uint8 and are normalised on the device (as on
    # CUDA): the same float32 arithmetic as the workers', so the same weights still.
    data = {"pack": pack, "normalise_on_device": pack}
    config = _config(tmp_path / "stopped", shards, data=data, train={"steps": 6})
    if pack:
        forward, calls = LanguageModel.forward, []

        def forward_then_signal(self, batch):
            calls.append(1)
            if len(calls) == 7:  # step 4's first micro-batch (2 per step)
                os.kill(os.getpid(), signal.SIGTERM)
            return forward(self, batch)

        monkeypatch.setattr(LanguageModel, "forward", forward_then_signal)
        assert train(config).stopped_by_signal
        monkeypatch.undo()
    else:
        train(config, halt_after_step=3)
    resumed = train(config)
    assert resumed.resumed_from == (4 if pack else 2)
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "stopped")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    done = resumed.resumed_from
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history[done:]]


def test_lora_and_frozen_decoder_blocks(tmp_path, shards):
    """LoRA on the LM leaves its base weights alone and writes the adapters; freeze_blocks
    keeps the embedding and the first decoder block as they were."""
    base = train(_config(tmp_path / "base", shards, train={"steps": 1, "lr": 0.0}))
    del base
    start = _weights(tmp_path / "base")
    lora = {"image": {"freeze": True}, "text": {"lora": {"rank": 4, "targets": ["attn", "mlp"]}}}
    train(_config(tmp_path / "lora", shards, train={"towers": lora}, init=str(tmp_path / "base")))
    adapters = safetensors.torch.load_file(str(tmp_path / "lora" / "lora.safetensors"))
    assert adapters and all(name.startswith("towers.text.") for name in adapters)
    merged = _weights(tmp_path / "lora")
    assert _changed(start, merged, "towers.text.blocks.")  # the adapters, merged
    assert not _changed(start, merged, "towers.text.embed.")

    blocks = {"image": {"freeze": True}, "text": {"freeze_blocks": 1}}
    train(_config(tmp_path / "fb", shards, train={"towers": blocks}, init=str(tmp_path / "base")))
    after = _weights(tmp_path / "fb")
    assert not _changed(start, after, "towers.text.embed.")
    assert not _changed(start, after, "towers.text.blocks.0.")
    assert _changed(start, after, "towers.text.blocks.1.")


def _assert_follows(runs: list[list[float]], rows, folder: Path, other: Path) -> None:
    """Each of `runs` has the losses of `rows` (a result or its history), and the weights in
    `other` are those in `folder`, up to float64 rounding."""
    expected = torch.tensor([r["loss"] for r in getattr(rows, "history", rows)])
    for got in runs:
        torch.testing.assert_close(torch.tensor(got), expected, **EXACT)
    a, b = _weights(folder), _weights(other)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], **EXACT, msg=name)


def _train_rank(rank: int, world: int, config) -> list[float]:
    return [row["loss"] for row in train(config).history]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_with_checkpointing_follow_one(tmp_path, shards, parallel):
    """2 ranks (DDP or FSDP2, activation checkpointing per decoder block) and 1 rank, same
    global batch: the same losses and final weights (text-only and image rows mixed)."""
    towers = {"text": {"activation_checkpointing": True}}
    one = train(_config(tmp_path / "one", shards, train={"towers": towers}))
    config = _config(tmp_path / "two", shards, train={"towers": towers, "parallel": parallel})
    losses = run_distributed(_train_rank, world_size=2, args=(config,))
    _assert_follows(losses, one, tmp_path / "one", tmp_path / "two")


def test_bf16_and_a_rollback(tmp_path, shards):
    """bf16 autocast trains the VLM; two NaN steps in a row (NaN images) roll back to the
    last checkpoint and the run ends with finite weights."""
    config = _config(
        tmp_path / "bf16",
        shards,
        train={"precision": "bf16", "steps": 6},
        guards={"inject_nan_steps": [3, 4], "max_nonfinite_in_a_row": 2},
    )
    result = train(config)
    assert result.step == 6 and result.rollbacks == 1 and result.skipped_steps == 2
    weights = _weights(tmp_path / "bf16")
    assert all(torch.isfinite(w).all() for w in weights.values())


def _train_rank_halting(rank: int, world: int, config, halt: int) -> int | None:
    return train(config, halt_after_step=halt).resumed_from


def _sequence_parallel(attention: str, size: int) -> dict:
    return {"sequence_parallel": size, "sequence_parallel_attention": attention}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("attention", "pack"),
    [("ring", True), ("all_to_all", False)],
    ids=["ring-packed", "a2a-padded"],
)
def test_sequence_parallel_follows_one_rank(tmp_path, shards, attention, pack):
    """2 ranks splitting every row's sequence (one data rank) and 1 rank: the same losses and
    weights in float64, packed rows (documents and images) and right-padded rows."""
    data = {"pack": pack}
    one = train(_config(tmp_path / "one", shards, data=data))
    config = _config(tmp_path / "sp", shards, data=data, train=_sequence_parallel(attention, 2))
    losses = run_distributed(_train_rank, world_size=2, args=(config,))
    _assert_follows(losses, one, tmp_path / "one", tmp_path / "sp")
    # both ranks on one node (run_distributed says so as torchrun does): no group crosses one
    assert load_run(tmp_path / "sp").events["layout"][-1]["ranks_per_node"] == 2
    assert not [f for f in diagnose(load_run(tmp_path / "sp")) if f.kind == "communication"]


@pytest.mark.slow
def test_resume_across_sequence_parallel_sizes(tmp_path, shards):
    """Checkpoints written by 4 ranks splitting each row four ways resume on 2 ranks splitting
    it two ways, whose checkpoint resumes on 1 rank: the losses and weights of a run never
    stopped (the data world is 1 throughout, so the loader replays the same rows). Each run
    stops dead after a step, as a crash would, so it resumes from the step before."""
    data, every_step = {"pack": True}, {"every_steps": 1, "keep": 2}

    def run(out: Path, **sequence_parallel):
        steps = {"steps": 6, **sequence_parallel}
        return _config(out, shards, data=data, train=steps, checkpoint=every_step)

    whole = train(run(tmp_path / "whole"))
    out = tmp_path / "moved"
    four = run(out, **_sequence_parallel("all_to_all", 4))
    assert run_distributed(_train_rank_halting, world_size=4, args=(four, 2)) == [None] * 4
    two = run(out, **_sequence_parallel("ring", 2))
    assert run_distributed(_train_rank_halting, world_size=2, args=(two, 4)) == [1, 1]
    resumed = train(run(out))
    assert resumed.resumed_from == 3
    resumed_losses = [r["loss"] for r in resumed.history]
    _assert_follows([resumed_losses], whole.history[3:], tmp_path / "whole", out)


def _train_with_slow_all_to_all(rank: int, world: int, config) -> tuple[list[dict], list[str]]:
    """Train with every all-to-all 50 ms late (a slow link) on two nodes of one rank each (as
    torchrun --nnodes 2 --nproc-per-node 1 tells each rank); the rows and the run's warnings."""
    import logging
    import os
    import time

    import torch.distributed as dist

    all_to_all = dist.all_to_all_single

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return all_to_all(*args, **kwargs)

    dist.all_to_all_single = slow
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("mmtrain").addHandler(handler)
    return train(config).history, warnings


@pytest.mark.slow
def test_sequence_parallel_steps_report_their_communication_and_warn_once(tmp_path, shards):
    """With metrics.comm_timing, each step's all-to-alls count in comm_s and, waited for, in
    comm_exposed_s; past 20% of the step the run says so once, on rank 0, with the numbers."""
    config = _config(tmp_path / "sp", shards, train=_sequence_parallel("all_to_all", 2))
    config.metrics.comm_timing = True
    (rows, warned), (other_rows, other_warned) = run_distributed(
        _train_with_slow_all_to_all, world_size=2, args=(config,)
    )
    # 2 layers x (q, k, v there and the output back) x 2 micro-batches, forward and backward
    least = 2 * 4 * 2 * 2 * 0.05
    for row in rows:
        assert least <= row["comm_exposed_s"] <= row["comm_s"] <= row["step_s"]
        assert row["comm_exposed_fraction"] == pytest.approx(row["comm_exposed_s"] / row["step_s"])
    assert len(warned) == 1 and "waited for communication" in warned[0]
    step = rows[int(warned[0].split()[1]) - 1]  # "step N waited for communication P% ..."
    assert f"{100 * step['comm_exposed_fraction']:.0f}% of its {step['step_s']:.3f} s" in warned[0]
    assert other_warned == [] and len(other_rows) == len(rows)
    # `mmtrain doctor` names it from the run folder, with the steps and the command to run,
    # and that the group of 2 reaches past its node of 1 rank: its exchanges cross the network
    waited, across = [f for f in diagnose(load_run(tmp_path / "sp")) if f.kind == "communication"]
    if "groups_across_nodes" in waited.evidence:
        waited, across = across, waited
    assert across.evidence["groups_across_nodes"] == 1 and across.evidence["ranks_per_node"] == 1
    assert "train.sequence_parallel=1 (now 2)" in across.advice
    assert "--gpus-per-node 1 --sequence-parallel 1" in across.advice
    assert across.cost_s == pytest.approx(sum(r["comm_exposed_s/all_to_all"] for r in rows))
    finding = waited
    assert finding.steps == [r["step"] for r in rows[1:]]  # after the warm-up step
    assert finding.evidence["comm_exposed_fraction_mean"] > 0.2
    assert finding.evidence["train.sequence_parallel"] == 2
    assert next(iter(finding.evidence["comm_exposed_s_by_collective"])) == "all_to_all"
    assert "a smaller train.sequence_parallel" in finding.advice
    assert "mmtrain plan" in finding.advice and "--gpus 2 --recommend" in finding.advice


def _uneven_shards(folder: Path) -> Path:
    """Text-only conversations of the shards' words, answers of 1 or 30 words alternately: a
    padded micro-batch of a long and a short one is ~40% padding, of two alike none (over 7
    steps of this seed's order, ~27%)."""
    with ShardWriter(folder, max_samples=8) as writer:
        for i in range(24):
            name = list(COLOURS)[i % len(COLOURS)]
            messages = [{"role": "user", "content": f"Say {name}."},
                        {"role": "assistant", "content": f"{name} " * (1 if i % 2 else 30)}]  # fmt: skip
            record = {"id": str(i), "messages": messages, "images": []}
            writer.write({"__key__": f"{i:09d}", "json": json.dumps(record)})
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return folder


def test_padded_rows_are_named_in_the_mfu_finding(tmp_path, shards):
    """Rows padded to their micro-batch's longest: the loop records each step's padding share of
    the id positions, and doctor's MFU finding (the tiny model at ~2% of this CPU's matmul peak
    against the planner's ~35%) reads the useful part and asks for data.pack; packed, the same
    samples fill their rows and the advice does not."""
    data = {"train": str(_uneven_shards(tmp_path / "uneven"))}
    metrics = {"tensorboard": False, "peak_tflops": matmul_tflops()}
    findings = {}
    for pack in (False, True):
        out = tmp_path / f"pack-{pack}"
        train(_config(out, shards, data={**data, "pack": pack}, train={"precision": "fp32", "steps": 8},
                      metrics=metrics))  # fmt: skip
        run = load_run(out)
        (findings[pack],) = [f for f in diagnose(run) if f.kind == "mfu"]
        rows = run.train_rows[1:]
        useful = [r["mfu"] * (1 - r["padding_fraction"]) for r in rows]
        assert [r["mfu_useful"] for r in rows] == useful  # the row says it beside the mfu
        assert findings[pack].evidence["useful_mfu_median"] == round(statistics.median(useful), 4)
    padded, packed = findings[False].evidence, findings[True].evidence
    assert padded["padding_fraction_mean"] > 0.2 > packed["padding_fraction_mean"]
    assert "data.pack=true" in findings[False].advice
    assert "data.pack" not in findings[True].advice


def test_the_padding_share_counts_masked_ids_and_the_padding_document():
    ids = torch.zeros(2, 4, dtype=torch.long)
    masked = {"text": ids, "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    packed = {"text": ids[:1], "document_ids": torch.tensor([[0, 0, 1, -1]])}
    assert padding_fraction([masked]) == 3 / 8
    assert padding_fraction([masked, packed]) == 4 / 12
    assert padding_fraction([{"text": ids, "image": torch.zeros(2, 3, 8, 8)}]) is None
