"""`mmtrain plan --objective dpo` (plan/preference.py): a sample of the plan is a preference
pair, two rows of the micro-batch.

The planner's own relations: a DPO plan's activations are the SFT plan's at twice the rows with
the whole logits in place of the chunked loss's targets, its FLOPs the SFT plan's at twice the
rows plus the reference's forward over both, and a full fine-tune holds the reference's frozen
copy. Then the real thing, on the CPU in fp32: one DPO step of mmtrain's trainer
(`train.step.forward_backward` with `DpoObjective`) on real pairs (built by `data build`,
decoded and collated by the trainer's pair path) of a tiny Qwen2 LM, as tests/test_dpo.py's
fixture makes it, computes exactly the FLOPs the plan counts (torch's FlopCounterMode, the math
attention kernel, whose matmuls it sees), and what it keeps beyond a next-token step on the
same rows (autograd's saved tensors, as train/measure_step.py counts them, and the logits the
step's output holds) is exactly what the plan adds. `train/measure_step.py` has no DPO step,
so the measurement helper is here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mmtrain.cli import main
from mmtrain.config import DataConfig, DpoConfig, LoraConfig, TowerTrainConfig, TrainConfig
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.conversation_batches import ConversationBatcher
from mmtrain.data.stream.preference_batches import PairDecoder, collate_pairs
from mmtrain.hardware import default_catalog
from mmtrain.models.build import create_model
from mmtrain.models.formats.hf import read_hf_model
from mmtrain.plan import preference as pref
from mmtrain.plan.activations import (
    _loss_bytes,
    activation_options,
    loss_chunk_bytes,
    stack_activations,
)
from mmtrain.plan.compute import flops_per_sample
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.memory import training_memory
from mmtrain.plan.workloads import load_model
from mmtrain.spec import load_spec
from mmtrain.train.dpo import DpoObjective
from mmtrain.train.lora import apply_lora
from mmtrain.train.measure_step import language_batch, next_token_loss
from mmtrain.train.optim import freeze_parameters
from mmtrain.train.parallel import apply_activation_checkpointing
from mmtrain.train.precision import make_precision
from mmtrain.train.step import forward_backward

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_export_hf_folder import save_lm  # noqa: E402

PAIRS = 3
MODELS = {  # plan model, its training, a row
    "tiny-vlm": lambda: load_model("tiny-vlm", context=160),
    "tiny-vlm frozen image": lambda: load_model("tiny-vlm", context=160).with_modes(
        {"image": "frozen"}
    ),
    "tiny-vlm lora": lambda: load_model("tiny-vlm", context=160).with_modes(
        {"image": "frozen", "text": "lora"}, 8
    ),
    "tiny-qwen2-vl": lambda: load_model("tiny-qwen2-vl", context=320),
    "llava-1.5-7b freeze-blocks": lambda: (
        load_model("llava-1.5-7b", context=2048)
        .with_modes({"image": "frozen"})
        .with_frozen_blocks({"text": 4})
    ),
}


def _plan(model, **cfg):
    return make_plan(model, PlanConfig(**cfg), default_catalog())


def _head_terms(model, rows: int, o_sft, o_dpo) -> float:
    """Per the planner's own functions: what DPO keeps at the LM head beyond SFT's loss."""
    stack = pref.scored_stack(model)
    dpo = pref.logits_bytes(stack, rows, o_dpo) + pref.head_input_change(stack, rows, o_dpo)
    return dpo - _loss_bytes(stack, rows, o_sft)


# ----------------------------------------------------------------------------- the planner
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("precision", "ac"), [("bf16", "none"), ("bf16", "selective"),
                                               ("fp32", "full")])  # fmt: skip
def test_dpo_activations_are_sfts_at_twice_the_rows_with_the_logits(name, precision, ac):
    model, mb = MODELS[name](), 2
    sft = training_memory(model, PlanConfig(precision=precision, ac=ac, micro_batch=2 * mb), None)
    dpo = training_memory(
        model, PlanConfig(precision=precision, ac=ac, micro_batch=mb, objective="dpo"), None
    )
    o_sft = activation_options(precision, "flash", ac, 1, False, dense_packed_mask=True)
    o_dpo = replace(o_sft, objective="dpo")
    rows = pref.ROWS_PER_PAIR * mb
    assert dpo.saved_activations_bytes == sft.saved_activations_bytes + _head_terms(
        model, rows, o_sft, o_dpo
    )
    # The working set: a recomputed block, or the head's (a loss chunk / DPO's fp32 gradients)
    blocks = max(
        stack_activations(replace(s, vocab=0), rows, o_sft, input_grad=g).recompute_bytes
        for s, g in zip(model.stacks, model.input_grads(), strict=True)
    )
    head = pref.scored_stack(model)
    assert sft.recompute_bytes == max(blocks, loss_chunk_bytes(head, rows, o_sft))
    assert dpo.recompute_bytes == max(blocks, pref.logits_working_bytes(head, rows, o_dpo))
    assert dpo.logits_bytes == pref.logits_bytes(head, rows, o_dpo) > 0
    # the logits themselves dominate: [rows, text ids, vocab] in the activation dtype at least
    assert dpo.logits_bytes >= rows * pref.logit_rows(head) * head.vocab * o_dpo.act_bytes


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_dpo_flops_are_sfts_at_twice_the_rows_plus_the_references_forward(name, ac):
    model = MODELS[name]()
    sft, sft_hardware = flops_per_sample(model, ac)
    plan = _plan(model, ac=ac, micro_batch=2, global_batch=8, objective="dpo")
    out = plan.to_dict()
    forward = model.forward_flops()
    assert out["model"]["train_flops_per_sample"] == 2 * sft + 2 * forward
    assert out["model"]["hardware_flops_per_sample"] == 2 * sft_hardware + 2 * forward
    assert out["objective"]["reference_forward_flops_per_sample"] == 2 * forward
    # the step: 4 micro-batches of 2 pairs, at the rate the SFT plan of the same rows gets
    rows = _plan(model, ac=ac, micro_batch=4, global_batch=16)
    expected = rows.time.compute_s * (2 * sft_hardware + 2 * forward) / (2 * sft_hardware)
    assert plan.time.compute_s == pytest.approx(expected, rel=1e-12)
    assert plan.time.samples_per_s == pytest.approx(8 / plan.time.step_time_s, rel=1e-12)


@pytest.mark.parametrize(("precision", "bytes_a_param"), [("bf16", 2), ("fp16", 2),
                                                          ("fp32", 4), ("fp8", 4)])  # fmt: skip
def test_the_copy_reference_adds_the_weights_bytes(precision, bytes_a_param):
    """A full fine-tune's reference is a frozen copy in the dtype build_reference makes it:
    the autocast dtype under bf16 / fp16, the parameters' (fp32) otherwise."""
    model = MODELS["tiny-vlm"]()
    plan = _plan(model, precision=precision, micro_batch=2, objective="dpo")
    mem = plan.memory
    assert plan.to_dict()["objective"]["reference"] == "copy"
    assert mem.reference_bytes == model.params() * bytes_a_param
    others = mem.model_state_bytes + mem.activations_bytes + mem.overhead_bytes
    assert mem.total_bytes == others + mem.dequantized_bytes + mem.reference_bytes
    # static, like the weights: no fragmentation on it
    assert mem.fragmentation_bytes == pytest.approx(
        0.10 * (mem.activations_bytes + mem.comm_buffers_bytes), rel=1e-12
    )
    lora = _plan(MODELS["tiny-vlm lora"](), precision=precision, micro_batch=2, objective="dpo")
    assert lora.memory.reference_bytes == 0
    assert lora.to_dict()["objective"]["reference"] == "adapters"


def test_a_copy_under_fsdp_is_sharded_and_recommend_searches_what_the_trainer_runs():
    model = MODELS["tiny-vlm"]()
    fsdp = _plan(model, gpus=4, zero=3, micro_batch=2, objective="dpo")
    assert fsdp.not_run_by_train == []
    assert fsdp.memory.reference_bytes == model.params() * 2 / 4  # sharded as the policy is
    whole = _plan(model, gpus=4, zero=0, micro_batch=2, objective="dpo")
    assert whole.memory.reference_bytes == model.params() * 2  # DDP: whole on every rank
    lora = _plan(MODELS["tiny-vlm lora"](), gpus=4, zero=3, micro_batch=2, objective="dpo")
    assert lora.not_run_by_train == []
    from mmtrain.plan.recommend import recommend

    base = PlanConfig(global_batch=16, objective="dpo")
    found = recommend(model, base, default_catalog(), ["h100"], max_gpus=8)
    assert found.ranked and all(p.not_run_by_train == [] for p in found.ranked)
    assert all(p.config.sequence_parallel == 1 for p in found.ranked)
    lora_found = recommend(MODELS["tiny-vlm lora"](), base, default_catalog(), ["h100"], 8)
    assert any(p.config.zero == 3 for p in lora_found.ranked)


# ----------------------------------------------------------------------------- the command
def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--model", "tiny-clip"], "--objective"),
        (["--model", "tiny-dit"], "--objective"),
        (["--model", "vit-g-14"], "--objective"),
        (["--model", "tiny-vlm", "--packed"], "--packed"),
        (["--model", "tiny-vlm", "--gpus", "2", "--sequence-parallel", "2"],
         "--sequence-parallel"),
        (["--model", "tiny-vlm", "--inference"], "--inference"),
        (["--model", "tiny-vlm", "--measure"], "--measure"),
    ],
)  # fmt: skip
def test_what_dpo_cannot_plan_is_refused_naming_the_flag(capsys, argv, flag):
    code, _, err = _cli(capsys, *argv, "--objective", "dpo")
    assert code == 2
    assert f"{flag}:" in err


def test_the_plan_counts_pairs_and_says_what_dpo_adds(capsys):
    argv = ["--model", "tiny-vlm", "--context", "160", "--micro-batch", "2",
            "--global-batch", "8", "--samples", "10000000", "--objective", "dpo"]  # fmt: skip
    code, out, _ = _cli(capsys, *argv, "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["inputs"]["objective"] == "dpo" and plan["inputs"]["global_batch"] == 8
    assert plan["objective"]["sample"] == "pair" and plan["objective"]["rows_per_sample"] == 2
    assert any(note.startswith("dpo: a sample is a preference pair") for note in
               plan["model"]["notes"])  # fmt: skip
    time = plan["time"]
    # --json rounds seconds to 1e-6: relative 1e-8 of the ~50 s these pairs take
    assert time["time_to_train_s"] == pytest.approx(1e7 / time["samples_per_s"], rel=1e-7)
    code, text, _ = _cli(capsys, *argv)
    text = " ".join(text.split())
    assert "= global 8 pairs (4 rows a micro-batch)" in text
    assert "pairs/s" in text and "10,000,000 pairs:" in text
    assert "frozen copy of the model" in text and "dpo reference (frozen copy)" in text
    _, lora, _ = _cli(capsys, *argv, "--lora", "text", "--freeze", "image")
    assert "LoRA adapters disabled" in " ".join(lora.split())
    assert "dpo reference" not in lora


# ----------------------------------------------------------------------------- measured
@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The tiny Qwen2 folder's spec (saved beside it) and a batch of PAIRS real pairs, built
    by `data build` from TRL's standard form and laid out by the trainer's pair path."""
    root = tmp_path_factory.mktemp("plan-dpo")
    save_lm(root / "hf")
    records = [{"prompt": f"Say {i}.", "chosen": f"colour {i}", "rejected": f"colour {i + 1}"}
               for i in range(PAIRS)]  # fmt: skip
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["data", "build", str(root / "prefs.jsonl"), "--out", str(root / "shards"),
            "--workers", "1"]  # fmt: skip
    assert main(argv) == 0
    spec, _ = read_hf_model(root / "hf")
    spec.save(root / "spec.json")
    data = DataConfig(train=str(root / "shards"), tokenizer=str(root / "hf"),
                      chat_template=str(root / "hf"), sequence_length=64)  # fmt: skip
    batcher = ConversationBatcher(data, spec)
    decode = PairDecoder(batcher.decoder(spec))
    shards = ShardSet.open(root / "shards")
    outs = [decode(shards.read(i), np.random.default_rng(0)) for i in range(PAIRS)]
    return root / "spec.json", spec, collate_pairs(spec, batcher)(outs)


def _planned(capsys, spec_path: Path, batch: dict, *argv: str) -> dict:
    """The CLI's plan of the batch's rows (their padded length) at PAIRS pairs, fp32."""
    positions = str(batch["text"].shape[1])
    code, out, _ = _cli(capsys, "--model", str(spec_path), "--context", positions,
                        "--micro-batch", str(PAIRS), "--precision", "fp32", "--objective",
                        "dpo", "--json", *argv)  # fmt: skip
    assert code == 0
    return json.loads(out)


def test_a_real_dpo_step_computes_the_planned_flops(capsys, pairs):
    """Full fine-tune: the trainer's step (reference copy's forward, the policy's forward and
    backward over both rows of each pair) counts, matmul for matmul, what the plan counts."""
    spec_path, spec, batch = pairs
    model = create_model(spec, seed=0)
    reference = create_model(spec, seed=0).requires_grad_(False)
    objective = DpoObjective(model, DpoConfig(reference="copy"), 1, reference)
    precision = make_precision("fp32", torch.device("cpu"))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        forward_backward(model, [objective], [batch], precision)
    planned = _planned(capsys, spec_path, batch)["model"]["train_flops_per_sample"]
    assert counter.get_total_flops() == planned * PAIRS > 0


def test_the_lora_reference_is_one_forward_of_the_base(capsys, pairs):
    spec_path, spec, batch = pairs
    model = create_model(spec, seed=0)
    apply_lora(model, {"text": LoraConfig(rank=4)}, seed=1)
    objective = DpoObjective(model, DpoConfig(), 1)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        objective.prepare(model, [batch], make_precision("fp32", torch.device("cpu")))
    planned = _planned(capsys, spec_path, batch, "--lora", "text", "--lora-rank", "4")
    assert planned["objective"]["reference"] == "adapters"
    assert (
        counter.get_total_flops()
        == planned["objective"]["reference_forward_flops_per_sample"] * PAIRS
    )


def _kept_bytes(model: torch.nn.Module, run) -> int:
    """What `run()` leaves held for the backward: the storages autograd saved that its graph
    still holds (parameters aside, as train/measure_step.py counts them) and the storages of
    the tensors `run` returns (the step's output it keeps until the backward is over)."""
    from mmtrain.train.measure_step import held_storages, saved_storages

    with saved_storages(model) as saved:
        held = run()
    kept = held_storages(saved)
    for t in held:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(kept.values())


def _dpo_over_sft(model: torch.nn.Module, batch: dict, reference=None) -> int:
    """Bytes a DPO step keeps for its backward beyond a next-token step on the same rows."""
    objective = DpoObjective(model, DpoConfig(reference="copy" if reference else "auto"), 1,
                             reference)  # fmt: skip
    objective.prepare(model, [batch], None)

    def dpo():
        out = model(objective.inputs(batch, 0))
        return out["logits"], objective.loss(out, batch, 0)

    def sft():
        return (next_token_loss(model(batch), batch["labels"]),)

    return _kept_bytes(model, dpo) - _kept_bytes(model, sft)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("lora", [False, True])
def test_what_a_real_dpo_step_keeps_beyond_sft_is_what_the_plan_adds(capsys, pairs, ac, lora):
    """Exact in bytes: the held logits, their log-softmax, the targets' index and mask, the
    loss's per-pair tensors, and the head's input (a trained head's at every logit row, a
    frozen one's not at all) in place of the chunked loss's targets and input."""
    spec_path, spec, batch = pairs
    model = create_model(spec, seed=0)
    reference = None
    if lora:
        apply_lora(model, {"text": LoraConfig(rank=4)}, seed=1)
    else:
        reference = create_model(spec, seed=0).requires_grad_(False)
    apply_activation_checkpointing(model, ac, ["text"])
    measured = _dpo_over_sft(model, batch, reference)
    tower = ["--lora", "text", "--lora-rank", "4"] if lora else []
    dpo = _planned(capsys, spec_path, batch, "--ac", ac, *tower)["memory"]
    sft_argv = ["--model", str(spec_path), "--context", str(batch["text"].shape[1]),
                "--micro-batch", str(2 * PAIRS), "--precision", "fp32", "--ac", ac,
                "--json", *tower]  # fmt: skip
    code, out, _ = _cli(capsys, *sft_argv)
    sft = json.loads(out)["memory"]
    assert measured == dpo["saved_activations_bytes"] - sft["saved_activations_bytes"] > 0


@pytest.mark.parametrize("freeze_image", [False, True])
def test_a_vlms_dpo_step_keeps_beyond_sft_what_the_plan_adds(freeze_image):
    """tiny-vlm: the logits at the text ids only (an image's tokens are no logit rows)."""
    spec, pairs_, positions = load_spec("tiny-vlm"), 2, 96
    model = create_model(spec, seed=0)
    plan_model = load_model("tiny-vlm", context=positions, images=1)
    if freeze_image:
        towers = {"image": TowerTrainConfig(freeze=True)}
        freeze_parameters(model, TrainConfig(steps=1, batch_size=1, towers=towers))
        plan_model = plan_model.with_modes({"image": "frozen"})
    batch = language_batch(spec, 2 * pairs_, positions, 1, torch.Generator().manual_seed(0))
    measured = _dpo_over_sft(model, batch, create_model(spec, seed=0).requires_grad_(False))
    dpo = training_memory(
        plan_model, PlanConfig(precision="fp32", micro_batch=pairs_, objective="dpo"), None
    )
    sft = training_memory(plan_model, PlanConfig(precision="fp32", micro_batch=2 * pairs_), None)
    assert measured == dpo.saved_activations_bytes - sft.saved_activations_bytes > 0
