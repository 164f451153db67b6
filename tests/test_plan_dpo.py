"""`mmtrain plan --objective dpo` (plan/preference.py): a sample of the plan is a preference
pair, two rows of the micro-batch.

The planner's own relations: a native model's DPO activations are the SFT plan's at twice the
rows with the per-target NLL on top (the same chunked head and loss), and its vision stacks'
those of one set of images a pair (with each row's index into them); its FLOPs the SFT plan's
at twice the rows with one set of images a pair plus, where the reference runs in the step
(adapters, copy), its forward of the pair; a hub model keeps the whole logits and encodes each
row's images; a `copy` reference holds the frozen copy, and a cached one (`cache`) neither holds
a copy nor runs a forward a step but prices one pass over the run's pairs before training.

Then the real thing, on the CPU in fp32: one DPO step of mmtrain's trainer
(`train.step.forward_backward` with `DpoObjective`) on real pairs (built by `data build`, or
decoded and collated by the trainer's pair path) of a tiny Qwen2 LM, as tests/test_dpo.py's
fixture makes it, and of tiny-vlm, computes exactly the FLOPs the plan counts (torch's
FlopCounterMode, the math attention kernel, whose matmuls it sees) once the departures of the
trainer's modules from the plan's MFU convention are added, which a next-token step shows alike
(`_head_as_run`: the chunked head; a patch embedding computes no gradient for the pixels); and
what it keeps beyond a next-token step on the same rows (autograd's saved tensors, as
train/measure_step.py counts them, and the outputs the step holds) is exactly what the plan
adds, for tiny-vlm and tiny-qwen2-vl with each pair's images held once. `train/measure_step.py`
has no DPO step, so the measurement helpers are here.
"""

from __future__ import annotations

import io
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mmtrain.cli import main
from mmtrain.config import DataConfig, DpoConfig, LoraConfig, TowerTrainConfig, TrainConfig
from mmtrain.data.stream.conversation_batches import ConversationBatcher
from mmtrain.data.stream.preference_batches import PairDecoder, collate_pairs
from mmtrain.hardware import default_catalog
from mmtrain.models.build import create_model
from mmtrain.models.formats.hf import read_hf_model
from mmtrain.models.visual_inputs import IMAGE_SOURCES
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
from mmtrain.plan.model import Rows, Stack, native_rows
from mmtrain.plan.workloads import load_model
from mmtrain.spec import load_spec
from mmtrain.train.dpo import DpoObjective
from mmtrain.train.lora import apply_lora
from mmtrain.train.measure_step import language_batch, native_language_batch
from mmtrain.train.optim import freeze_parameters
from mmtrain.train.parallel import apply_activation_checkpointing
from mmtrain.train.precision import make_precision
from mmtrain.train.step import forward_backward

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_dpo import pair_batch  # noqa: E402
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


def _shared(model):
    """(stack, whether a gradient flows into it) of the stacks a pair's rows share (a native
    VLM's vision stacks), and the model of those stacks alone (they come first in the chain,
    so their FLOPs are the same on their own)."""
    pairs = [(s, g) for s, g in zip(model.stacks, model.input_grads(), strict=True)
             if pref.shares_inputs(s)]  # fmt: skip
    return pairs, replace(model, stacks=tuple(s for s, _ in pairs))


# ----------------------------------------------------------------------------- the planner
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("precision", "ac"), [("bf16", "none"), ("bf16", "selective"),
                                               ("fp32", "full")])  # fmt: skip
def test_dpo_activations_are_sfts_at_twice_the_rows_with_one_set_of_images_and_the_nll(
    name, precision, ac
):
    """A native model's DPO: the next-token step's chunked head and loss at twice the rows,
    plus the per-target NLL and the pair loss; its vision stacks over each pair's images
    once, plus each row's index into them."""
    model, mb = MODELS[name](), 2
    sft = training_memory(model, PlanConfig(precision=precision, ac=ac, micro_batch=2 * mb), None)
    dpo = training_memory(
        model, PlanConfig(precision=precision, ac=ac, micro_batch=mb, objective="dpo"), None
    )
    o = activation_options(precision, "flash", ac, 1, False, dense_packed_mask=True)
    rows, head = pref.ROWS_PER_PAIR * mb, pref.scored_stack(model)
    shared, _ = _shared(model)
    assert shared  # every model here is a native VLM

    def kept(stack, grad, n):
        return stack_activations(stack, n, o, input_grad=grad).saved

    once = sum(kept(s, g, mb) - kept(s, g, rows) for s, g in shared)
    index = sum(pref.taken_index_bytes(s, rows) for s, _ in shared if model.keeps_activations(s))
    assert index > 0  # their output needs a gradient: a trained projector or tower
    assert dpo.saved_activations_bytes == (
        sft.saved_activations_bytes + once + index + pref.token_nll_bytes(head, rows)
    )

    # The working set: a recomputed block, or the head's chunk (with DPO beside the NLL's
    # gradient its chunks read); a shared stack's block over the pairs' inputs only
    def block(stack, grad, n):
        return stack_activations(replace(stack, vocab=0), n, o, input_grad=grad).recompute_bytes

    stacks = list(zip(model.stacks, model.input_grads(), strict=True))
    chunk = loss_chunk_bytes(head, rows, o)
    assert sft.recompute_bytes == max(max(block(s, g, rows) for s, g in stacks), chunk)
    blocks = max(block(s, g, mb if pref.shares_inputs(s) else rows) for s, g in stacks)
    assert dpo.recompute_bytes == max(blocks, chunk + pref.token_nll_gradient_bytes(head, rows))
    # no logits are held: what the head's rows keep is the loss's targets and the NLL
    assert dpo.logits_bytes == _loss_bytes(head, rows, o) + pref.token_nll_bytes(head, rows)
    assert dpo.logits_bytes < rows * pref.logit_rows(head) * head.vocab * o.act_bytes


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("reference", ["copy", "cache"])
def test_dpo_flops_are_sfts_at_twice_the_rows_with_one_set_of_images_plus_a_reference(
    name, ac, reference
):
    """A pair is two rows through the LM and one set of images through a native VLM's vision
    stacks; copy (as adapters) runs one more forward of that a step, cache none."""
    model = MODELS[name]()
    sft, sft_hardware = flops_per_sample(model, ac)
    shared, vision = _shared(model)
    once, once_hardware = flops_per_sample(vision, ac)
    assert 0 < once < sft
    plan = _plan(model, ac=ac, micro_batch=2, global_batch=8, objective="dpo",
                 reference=reference)  # fmt: skip
    out = plan.to_dict()
    pair_forward = 2 * model.forward_flops() - sum(s.forward_flops for s, _ in shared)
    forward = pair_forward if reference == "copy" else 0
    dpo, dpo_hardware = 2 * sft - once + forward, 2 * sft_hardware - once_hardware + forward
    assert out["objective"]["reference"] == reference
    assert out["model"]["train_flops_per_sample"] == dpo
    assert out["model"]["hardware_flops_per_sample"] == dpo_hardware
    assert out["objective"]["reference_forward_flops_per_sample"] == forward
    # the step: 4 micro-batches of 2 pairs, at the rate the SFT plan of the same rows gets
    rows = _plan(model, ac=ac, micro_batch=4, global_batch=16)
    expected = rows.time.compute_s * dpo_hardware / (2 * sft_hardware)
    assert plan.time.compute_s == pytest.approx(expected, rel=1e-12)
    assert plan.time.samples_per_s == pytest.approx(8 / plan.time.step_time_s, rel=1e-12)
    # MFU counts the reference's forward in the step as model work
    mfu = rows.time.mfu * dpo / (2 * sft) * rows.time.step_time_s
    assert plan.time.mfu == pytest.approx(mfu / plan.time.step_time_s, rel=1e-12)


def test_a_hub_models_dpo_scores_by_token_and_encodes_each_pairs_images_once(
    capsys, monkeypatch, tmp_path
):
    """A hub model's log-probs come from the same chunked head as its next-token loss, and a
    padded pair batch's images go through its vision encoder once (models/hub/
    shared_pixels.py): the DPO plan is the next-token plan of twice the text rows with the
    per-target NLL (fp32, one a scored position) on top, and of one image a pair."""
    from mmtrain.models.hub import trace as hub_trace

    monkeypatch.setenv(hub_trace.CACHE_ENV, str(tmp_path / "cache"))
    argv = ["--model", "Qwen3-VL-4B", "--precision", "fp32", "--json"]
    sft = {}
    for rows in (2, 4):
        code, out, _ = _cli(capsys, *argv, "--micro-batch", str(rows))
        assert code == 0
        sft[rows] = json.loads(out)
    code, out, _ = _cli(capsys, *argv, "--micro-batch", "2", "--objective", "dpo")
    assert code == 0
    dpo = json.loads(out)
    positions = sft[4]["model"]["tokens_per_sample"]["text"]
    kept = dpo["memory"]["logits_bytes"]
    rows = 4  # 2 pairs
    assert kept == rows * (positions - 1) * 4 + rows * 4  # fp32 NLL a target, the loss's floats
    by_tower = dpo["memory"]["activations_by_tower"]
    vision, text = (sft[n]["memory"]["activations_by_tower"] for n in (2, 4))
    assert by_tower["vision"] == vision["vision"] > 0  # one image a pair: 2 images
    assert by_tower["text"] == text["text"] + kept  # 4 text rows
    assert dpo["objective"]["reference"] == "cache"
    one, pair = sft[4]["model"], dpo["model"]  # a pair: the text twice, the image once
    assert one["train_flops_per_sample"] < pair["train_flops_per_sample"]
    assert pair["train_flops_per_sample"] < 2 * one["train_flops_per_sample"]
    image = 2 * one["forward_flops_per_sample"] - dpo["objective"]["reference_pass_flops_per_sample"]
    assert 0 < image < one["forward_flops_per_sample"]
    note = " ".join(dpo["model"]["notes"])
    assert "chunked head" in note and "each pair's images once" in note


@pytest.mark.parametrize(("precision", "bytes_a_param"), [("bf16", 2), ("fp16", 2),
                                                          ("fp32", 4), ("fp8", 4)])  # fmt: skip
def test_the_copy_reference_adds_the_weights_bytes(precision, bytes_a_param):
    """A full fine-tune's reference is a frozen copy in the dtype build_reference makes it:
    the autocast dtype under bf16 / fp16, the parameters' (fp32) otherwise."""
    model = MODELS["tiny-vlm"]()
    plan = _plan(model, precision=precision, micro_batch=2, objective="dpo", reference="copy")
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
    # a cached reference (auto's choice without LoRA) holds nothing: the copy's plan less it
    cached = _plan(model, precision=precision, micro_batch=2, objective="dpo")
    assert cached.to_dict()["objective"]["reference"] == "cache"
    assert cached.memory.reference_bytes == 0
    assert cached.memory.total_bytes == mem.total_bytes - mem.reference_bytes


def test_a_copy_under_fsdp_is_sharded_and_recommend_searches_what_the_trainer_runs():
    model = MODELS["tiny-vlm"]()
    fsdp = _plan(model, gpus=4, zero=3, micro_batch=2, objective="dpo", reference="copy")
    assert fsdp.not_run_by_train == []
    assert fsdp.memory.reference_bytes == model.params() * 2 / 4  # sharded as the policy is
    assert "sharded over 4 ranks as the policy is" in pref.describe(model, fsdp.config)
    whole = _plan(model, gpus=4, zero=0, micro_batch=2, objective="dpo", reference="copy")
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


def test_a_cached_reference_prices_its_pass_before_training_in_time_and_cost():
    """One forward of each of --samples pairs (both rows, their images once), over every GPU
    at the rate the step's hardware FLOPs run at, added to the run's time and cost; the step
    is SFT's at twice the rows with one set of images a pair."""
    model, pairs_ = MODELS["tiny-vlm"](), 10_000_000
    catalog = default_catalog()
    plan = _plan(model, gpus=4, micro_batch=2, global_batch=8, samples=pairs_,
                 objective="dpo", price_per_gpu_hour=3.0)  # fmt: skip
    t, out = plan.time, plan.to_dict()
    shared, vision = _shared(model)
    forward = 2 * model.forward_flops() - sum(s.forward_flops for s, _ in shared)
    assert out["objective"]["reference"] == "cache"
    assert out["objective"]["reference_pass_flops_per_sample"] == forward
    assert out["objective"]["reference_pass_flops"] == forward * pairs_
    rate = catalog.gpu("h100").peak_flops("bf16") * t.achievable_fraction * 4
    assert t.reference_pass_samples_per_s == pytest.approx(rate / forward, rel=1e-12)
    assert t.reference_pass_s == pytest.approx(pairs_ * forward / rate, rel=1e-12)
    assert t.time_to_train_s == pytest.approx(pairs_ / t.samples_per_s + t.reference_pass_s,
                                              rel=1e-12)  # fmt: skip
    assert t.cost == pytest.approx(t.time_to_train_s / 3600 * 4 * 3.0, rel=1e-12)
    assert t.reference_pass_cost == pytest.approx(t.reference_pass_s / 3600 * 4 * 3.0, rel=1e-12)
    assert out["time"]["reference_pass_s"] == round(t.reference_pass_s, 6) > 0
    rows = _plan(model, gpus=4, micro_batch=4, global_batch=16, samples=2 * pairs_,
                 price_per_gpu_hour=3.0)  # fmt: skip
    sft, once = flops_per_sample(model, "none")[1], flops_per_sample(vision, "none")[1]
    assert t.compute_s == pytest.approx(rows.time.compute_s * (2 * sft - once) / (2 * sft),
                                        rel=1e-12)  # fmt: skip
    for reference in ("copy", "adapters"):  # in the step: no pass
        lora = MODELS["tiny-vlm lora"]()
        other = _plan(lora, gpus=4, micro_batch=2, global_batch=8, samples=pairs_,
                      objective="dpo", reference=reference)  # fmt: skip
        assert other.time.reference_pass_s == other.time.reference_pass_samples_per_s == 0
        assert other.to_dict()["objective"]["reference_pass_flops"] == 0
        assert other.time.time_to_train_s == pytest.approx(pairs_ / other.time.samples_per_s,
                                                           rel=1e-12)  # fmt: skip


@pytest.mark.parametrize("name", ["tiny-vlm", "tiny-vlm lora"])
def test_under_zero3_a_reference_in_the_step_gathers_once_more_and_a_cache_does_not(name):
    """Per micro-batch: the policy's two gathers and a reduce-scatter, as SFT of the same rows;
    adapters one more gather of the model, a copy one of the copy (2 bytes a parameter)."""
    from mmtrain.plan.comm import all_gather_s

    model = MODELS[name]()
    catalog = default_catalog()
    link = catalog.link(catalog.gpu("h100").intra_node, "gpu")
    sft = _plan(model, gpus=4, zero=3, micro_batch=4, global_batch=32).time.dp_comm_s

    def comm(reference):
        return _plan(model, gpus=4, zero=3, micro_batch=2, global_batch=16, objective="dpo",
                     reference=reference).time.dp_comm_s  # fmt: skip

    assert comm("cache") == pytest.approx(sft, rel=1e-12)
    copy = 2 * all_gather_s(model.params() * 2, 4, link)  # 2 micro-batches
    assert comm("copy") == pytest.approx(sft + copy, rel=1e-12)
    if name.endswith("lora"):  # the adapters' (bf16 16 B convention: 2 bytes) and the base
        from mmtrain.plan.fsdp_units import frozen_gathered_bytes

        gathered = model.trainable_params() * 2 + frozen_gathered_bytes(model, "bf16", 4)
        policy = 2 * all_gather_s(gathered, 4, link)
        assert comm("adapters") == pytest.approx(sft + policy, rel=1e-12)


def test_under_offload_a_copy_lives_on_the_host_and_a_cache_copies_nothing_more():
    model = MODELS["tiny-vlm"]()
    sft = _plan(model, zero=3, offload=True, micro_batch=4).host
    cache = _plan(model, zero=3, offload=True, micro_batch=2, objective="dpo").host
    copy = _plan(model, zero=3, offload=True, micro_batch=2, objective="dpo",
                 reference="copy").host  # fmt: skip
    # the same copies; what compute hides of them is less (a pair's images encoded once)
    assert replace(cache, exposed_s=0.0) == replace(sft, exposed_s=0.0)
    assert cache.exposed_s >= sft.exposed_s
    shard = model.params() * 2  # one rank: the whole copy in the compute dtype
    assert copy.params_bytes == sft.params_bytes + shard
    assert copy.h2d_bytes == sft.h2d_bytes + shard
    assert copy.pinned_bytes >= sft.pinned_bytes + shard  # each tensor rounded up


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
        (["--model", "tiny-vlm", "--reference", "adapters"], "--reference"),
        (["--model", "tiny-vlm", "--freeze", "image", "--reference", "adapters"],
         "--reference"),
    ],
)  # fmt: skip
def test_what_dpo_cannot_plan_is_refused_naming_the_flag(capsys, argv, flag):
    code, _, err = _cli(capsys, *argv, "--objective", "dpo")
    assert code == 2
    assert f"{flag}:" in err


def test_a_reference_without_dpo_is_refused_naming_the_flag(capsys):
    code, _, err = _cli(capsys, "--model", "tiny-vlm", "--reference", "copy")
    assert code == 2 and "--reference:" in err and "--objective dpo" in err
    with pytest.raises(SystemExit) as exit_:  # argparse's choices
        _cli(capsys, "--model", "tiny-vlm", "--objective", "dpo", "--reference", "frozen")
    assert exit_.value.code == 2


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
    # --json rounds seconds to 1e-6: relative 1e-7 of the ~50 s these pairs take
    assert plan["objective"]["reference"] == "cache"  # auto without LoRA
    steps = 1e7 / time["samples_per_s"] + time["reference_pass_s"]
    assert time["time_to_train_s"] == pytest.approx(steps, rel=1e-7)
    assert time["reference_pass_s"] > 0 and time["reference_pass_cost"] > 0
    code, text, _ = _cli(capsys, *argv)
    text = " ".join(text.split())
    assert "= global 8 pairs (4 rows a micro-batch)" in text
    assert "pairs/s" in text and "10,000,000 pairs:" in text
    assert "reference's log-probs are cached" in text and "dpo reference" not in text
    assert "reference pass (once, before the first step)" in text
    assert "10,000,000 pairs in" in text and "(in the time and cost below)" in text
    _, copy, _ = _cli(capsys, *argv, "--reference", "copy")
    copy = " ".join(copy.split())
    assert "frozen copy of the model" in copy and "dpo reference (frozen copy)" in copy
    assert "reference pass" not in copy
    _, lora, _ = _cli(capsys, *argv, "--lora", "text", "--freeze", "image")
    assert "LoRA adapters disabled" in " ".join(lora.split())
    assert "dpo reference" not in lora and "reference pass" not in lora
    _, untimed, _ = _cli(capsys, *argv[:-4], "--objective", "dpo")  # no --samples
    assert "pairs/s; --samples times it" in " ".join(untimed.split())


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
    return root / "spec.json", spec, pair_batch(root, spec, PAIRS)



def _counted_copy_step(spec, batch) -> tuple[FlopCounterMode, torch.nn.Module]:
    """The FLOPs of one DPO step of a full fine-tune of `spec` with a frozen copy (math SDPA:
    the kernel the counter sees whole), and the model it trained."""
    model = create_model(spec, seed=0)
    copy = create_model(spec, seed=0).requires_grad_(False)
    objective = DpoObjective(model, DpoConfig(reference="copy"), 1, copy)
    precision = make_precision("fp32", torch.device("cpu"))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        forward_backward(model, [objective], [batch], precision)
    return counter, model

def _planned(capsys, spec_path: Path, batch: dict, *argv: str) -> dict:
    """The CLI's plan of the batch's rows (their padded length) at PAIRS pairs, fp32."""
    positions = str(batch["text"].shape[1])
    code, out, _ = _cli(capsys, "--model", str(spec_path), "--context", positions,
                        "--micro-batch", str(PAIRS), "--precision", "fp32", "--objective",
                        "dpo", "--json", *argv)  # fmt: skip
    assert code == 0
    return json.loads(out)


def _head_as_run(stack: Stack, rows: int, passes: int, gradient: bool) -> int:
    """What the LM head of `rows` rows computes beyond what the plan counts for it. The plan
    counts every language model's head as the MFU convention does, SFT's alike (spec.py: its
    matmul, 2 x width x vocab FLOPs a position, at every position, `passes` times: 3 trained,
    2 LoRA, 1 a forward without gradients); mmtrain's chunked head (models/token_loss.py)
    runs it at the logit rows but the last (the positions that predict an id) and, under
    gradients, once more in backward (each chunk's forward is recomputed)."""
    runs = passes + (1 if gradient else 0)
    head = 2 * stack.width * stack.vocab
    return rows * head * (runs * (pref.logit_rows(stack) - 1) - passes * stack.tokens)


def _text_stack(spec_path: Path, batch: dict) -> Stack:
    return pref.scored_stack(load_model(str(spec_path), context=batch["text"].shape[1]))


def test_a_real_dpo_step_computes_the_planned_flops(capsys, pairs):
    """Full fine-tune: the trainer's step (reference copy's forward, the policy's forward and
    backward over both rows of each pair) counts, matmul for matmul, what the plan counts,
    with the chunked head as it runs, exactly as a next-token step of the same rows."""
    spec_path, spec, batch = pairs
    counter, model = _counted_copy_step(spec, batch)
    planned = _planned(capsys, spec_path, batch, "--reference", "copy")
    head, rows = _text_stack(spec_path, batch), 2 * PAIRS
    as_run = _head_as_run(head, rows, 3, True) + _head_as_run(head, rows, 1, False)
    assert counter.get_total_flops() == planned["model"]["train_flops_per_sample"] * PAIRS + as_run
    assert as_run != 0
    # the same head in a next-token step of the same rows (the SFT plan's convention)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(batch)["nll_sum"].backward()
    argv = ["--model", str(spec_path), "--context", str(batch["text"].shape[1]),
            "--micro-batch", str(rows), "--precision", "fp32", "--json"]  # fmt: skip
    sft = json.loads(_cli(capsys, *argv)[1])["model"]["train_flops_per_sample"]
    assert counter.get_total_flops() == sft * rows + _head_as_run(head, rows, 3, True)


def test_a_cached_run_computes_the_planned_pass_and_steps_without_a_reference_forward(
    capsys, pairs, tmp_path
):
    """train.dpo.reference cache, as the loop runs it: the pass before the first step
    (train/reference_cache.py's `ReferencePass` scoring each pair with train/dpo.py's
    `reference_logps`) computes one forward of both rows of each pair, the plan's
    reference_pass_flops over --samples pairs; a step reading the stored values computes the
    plan's step FLOPs, in which no reference forward is counted (the head as it runs)."""
    from mmtrain.data.stream.preference_batches import PAIR_INDEX
    from mmtrain.train.dpo import reference_logps, scores_by_token
    from mmtrain.train.reference_cache import ReferencePass

    spec_path, spec, batch = pairs
    model = create_model(spec, seed=0)
    precision = make_precision("fp32", torch.device("cpu"))
    store = ReferencePass(tmp_path, {"run": "plan-dpo"}, PAIRS, 0, lambda: None)
    once = {**batch, "__index__": list(range(PAIRS))}  # as TrainData.pairs_once's batches
    by_token = scores_by_token(model)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        cached = store.run([once], lambda b: reference_logps(model, b, precision,
                                                             by_token=by_token))  # fmt: skip
    pass_flops = counter.get_total_flops()
    objective = DpoObjective(model, DpoConfig(reference="cache"), 1, cached=cached)
    step = {**batch, PAIR_INDEX: list(range(PAIRS))}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        forward_backward(model, [objective], [step], precision)
    planned = _planned(capsys, spec_path, batch, "--reference", "cache", "--samples", str(PAIRS))
    head, rows = _text_stack(spec_path, batch), 2 * PAIRS
    assert planned["objective"]["reference_forward_flops_per_sample"] == 0
    step_flops = planned["model"]["train_flops_per_sample"] * PAIRS
    assert counter.get_total_flops() == step_flops + _head_as_run(head, rows, 3, True) > 0
    pass_planned = planned["objective"]["reference_pass_flops"]
    assert pass_flops == pass_planned + _head_as_run(head, rows, 1, False) > 0
    assert planned["objective"]["reference_pass_flops_per_sample"] == 2 * model_forward(
        spec_path, batch
    )


def model_forward(spec_path: Path, batch: dict) -> float:
    """The plan's forward FLOPs of one row of `batch`'s padded length."""
    return load_model(str(spec_path), context=batch["text"].shape[1]).forward_flops()


@pytest.mark.parametrize(("reference", "resolved", "copy_bytes"),
                         [("copy", None, 4), ("cache", None, 0), ("auto", None, 0),
                          ("auto", "copy", 4)])  # fmt: skip
def test_a_runs_planned_memory_holds_a_copy_only_for_a_copy_reference(
    pairs, tmp_path, reference, resolved, copy_bytes
):
    """The plan record a run writes (train/metrics.py `planned_memory`) plans the run's
    reference: a full fine-tune's copy (fp32: 4 bytes a parameter) or, cached (auto's choice
    here), none: the model states of next-token training. `dpo_reference`, what the run
    resolved (auto gives randomly cropped images a copy), overrides train.dpo.reference. Its
    activations are `mmtrain plan --objective dpo`'s at the run's rows."""
    import dataclasses

    import yaml

    from mmtrain.config import load_config
    from mmtrain.train.metrics import planned_memory

    spec_path, spec, _ = pairs
    root = spec_path.parent
    config = {"model": str(spec_path), "data": {"train": str(root / "shards"),
              "tokenizer": str(root / "hf"), "chat_template": str(root / "hf"),
              "sequence_length": 64},
              "train": {"steps": 1, "batch_size": 2, "precision": "fp32", "objective": "dpo",
                        "dpo": {"reference": reference}},
              "metrics": {"tensorboard": False}, "out": str(tmp_path / "run")}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    dpo = load_config(tmp_path / "run.yaml")
    sft = dataclasses.replace(dpo, train=dataclasses.replace(dpo.train, objective=None))
    cpu = torch.device("cpu")
    records = [planned_memory(spec, c, world_size=1, recompute=[], device=cpu,
                              dpo_reference=resolved) for c in (dpo, sft)]  # fmt: skip
    states = [r["predicted_model_state_bytes"] for r in records]
    assert states[0] - states[1] == copy_bytes * spec.params()
    plan = PlanConfig(precision="fp32", micro_batch=2, objective="dpo",
                      reference=resolved or reference)  # fmt: skip
    planned = training_memory(load_model(str(spec_path), context=64), plan, None)
    assert records[0]["predicted_activations_bytes"] == int(planned.activations_bytes)


def test_the_lora_reference_is_one_forward_of_the_base(capsys, pairs):
    spec_path, spec, batch = pairs
    model = create_model(spec, seed=0)
    apply_lora(model, {"text": LoraConfig(rank=4)}, seed=1)
    objective = DpoObjective(model, DpoConfig(), 1)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        objective.prepare(model, [batch], make_precision("fp32", torch.device("cpu")))
    planned = _planned(capsys, spec_path, batch, "--lora", "text", "--lora-rank", "4")
    assert planned["objective"]["reference"] == "adapters"
    forward = planned["objective"]["reference_forward_flops_per_sample"] * PAIRS
    head = _head_as_run(_text_stack(spec_path, batch), 2 * PAIRS, 1, False)
    assert counter.get_total_flops() == forward + head


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


def _dpo_over_sft(model: torch.nn.Module, batch: dict, reference=None, rows=None) -> int:
    """Bytes a DPO step on `batch` keeps for its backward beyond a next-token step of the
    model on `rows` (default: the same batch): what the step's output holds (the outputs the
    objective reads) and autograd keeps, the model's and the loss's. The next-token step is
    the model's own (its nll_sum; the objective's division by the step's target count, an
    int64 scalar autograd keeps, is planned for neither)."""
    objective = DpoObjective(model, DpoConfig(reference="copy" if reference else "auto"), 1,
                             reference)  # fmt: skip
    objective.prepare(model, [batch], None)

    def dpo():
        out = model(objective.inputs(batch, 0))
        return *(out[k] for k in objective.reads(batch)), objective.loss(out, batch, 0)

    def sft():
        return (model(batch if rows is None else rows)["nll_sum"],)

    return _kept_bytes(model, dpo) - _kept_bytes(model, sft)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("lora", [False, True])
def test_what_a_real_dpo_step_keeps_beyond_sft_is_what_the_plan_adds(capsys, pairs, ac, lora):
    """Exact in bytes: the per-target NLL the step's output holds and the pair loss's, beside
    the chunked head and loss of a next-token step of the same rows (no logits are held)."""
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
    rows, positions = batch["text"].shape
    assert measured == rows * positions * 4  # the NLL [rows, T - 1] and a float a row, fp32


def _shared_pairs(spec, pairs_: int, positions: int, generator) -> tuple[dict, dict]:
    """A DPO micro-batch of `pairs_` pairs whose two rows share their images (each held once,
    `image_sources`), and the same rows each with its own copy of its pair's images (what a
    next-token step of those rows holds). Every row full: the planner's rows."""
    rows = 2 * pairs_
    if spec.vision is not None:
        inputs = native_rows(spec, Rows(positions, images=1)).visual_inputs
        batch = native_language_batch(spec, rows, positions, inputs, generator)
        own = [x.clone() for x in batch["image"][:pairs_]]
        apart = own + [x.clone() for x in own]
    else:
        batch = language_batch(spec, rows, positions, 1, generator)
        own = batch["image"][:pairs_].clone()
        apart = torch.cat([own, own])
    return {**batch, "image": own, IMAGE_SOURCES: [*range(pairs_)] * 2}, {**batch, "image": apart}


@pytest.mark.parametrize(("name", "positions", "freeze", "ac"),
                         [("tiny-vlm", 96, False, "none"), ("tiny-vlm", 96, True, "full"),
                          ("tiny-qwen2-vl", 320, False, "none"),
                          ("tiny-qwen2-vl", 320, False, "full")])  # fmt: skip
def test_a_vlms_dpo_step_keeps_one_set_of_images_a_pair_and_what_the_plan_adds(
    name, positions, freeze, ac
):
    """A native VLM: its vision stacks keep each pair's images once (and each row's index into
    them), beside the NLL the LM head's rows keep (at the text ids only), to the byte."""
    spec, pairs_ = load_spec(name), 2
    tower = "image" if spec.vision is None else "vision"
    model = create_model(spec, seed=0)
    plan_model = load_model(name, context=positions, images=1)
    if freeze:
        towers = {tower: TowerTrainConfig(freeze=True)}
        freeze_parameters(model, TrainConfig(steps=1, batch_size=1, towers=towers))
        plan_model = plan_model.with_modes({tower: "frozen"})
    apply_activation_checkpointing(model, ac, [tower, "text"] if not freeze else ["text"])
    shared, apart = _shared_pairs(spec, pairs_, positions, torch.Generator().manual_seed(0))
    copy = create_model(spec, seed=0).requires_grad_(False)
    measured = _dpo_over_sft(model, shared, copy, rows=apart)
    dpo = training_memory(
        plan_model,
        PlanConfig(precision="fp32", ac=ac, micro_batch=pairs_, objective="dpo"),
        None,
    )
    sft = training_memory(plan_model, PlanConfig(precision="fp32", ac=ac,
                                                 micro_batch=2 * pairs_), None)  # fmt: skip
    assert measured == dpo.saved_activations_bytes - sft.saved_activations_bytes < 0


@pytest.fixture(scope="module")
def vlm_pairs():
    """tiny-vlm (LLaVA-style) and PAIRS real pairs, each about its own image, laid out by the
    trainer's pair path: each image once in the micro-batch, taken by both of its rows."""
    from mmtrain.config import DataSource

    spec = load_spec("tiny-vlm")
    data = DataConfig(train=[DataSource("unused")], chat_template="plain", sequence_length=160)
    batcher = ConversationBatcher(data, spec)
    decode = PairDecoder(batcher.decoder(spec, train=False))
    samples = [_image_pair(i) for i in range(PAIRS)]
    batch = collate_pairs(spec, batcher)([decode(s, np.random.default_rng(0)) for s in samples])
    assert batch["image"].shape[0] == PAIRS and batch[IMAGE_SOURCES] == [*range(PAIRS)] * 2
    return spec, batch


def _image_pair(i: int) -> dict:
    pixels = np.random.default_rng(i).integers(0, 256, (40 + 8 * i, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    record = {"id": str(i), "images": ["0.png"],
              "messages": [{"role": "user", "content": "<image>What colour?"}],
              "chosen": f"colour {i}", "rejected": f"colour {i + 1}"}  # fmt: skip
    return {"__key__": f"{i:09d}", "json": json.dumps(record).encode(), "0.png": buffer.getvalue()}


def test_a_vlms_dpo_step_encodes_each_pairs_image_once_as_planned(vlm_pairs):
    """tiny-vlm, full fine-tune with a frozen copy, on real pairs: the image tower and the
    projector compute one image a pair (the policy's training and the copy's forward), the
    plan's vision FLOPs a pair; the whole step the plan's FLOPs. Both as they run against the
    MFU convention the plan counts, SFT's alike: the chunked head, and the patch embedding,
    which computes no gradient for the pixels (the convention counts 3 passes of every
    trained layer: one forward of it less an image)."""
    spec, batch = vlm_pairs
    counter, model = _counted_copy_step(spec, batch)
    rows, ids = batch["text"].shape
    positions = ids + spec.image_tokens() - 1  # one image a row
    plan_model = load_model("tiny-vlm", context=positions, images=1)
    plan = _plan(plan_model, precision="fp32", micro_batch=PAIRS, objective="dpo",
                 reference="copy").to_dict()  # fmt: skip
    shared, vision = _shared(plan_model)
    tower = flops_per_sample(vision, "none")[0] + sum(s.forward_flops for s, _ in shared)
    counts = counter.get_flop_counts()
    vision_parts = re.compile(r"LanguageModel\.(towers\.image\.(stem|blocks\.\d+)|projector)$")
    measured = sum(sum(c.values()) for k, c in counts.items() if vision_parts.match(k))
    image = spec.towers["image"]
    pixel_gradient = 2 * image.stem.patches() * image.stem.patch_dim() * image.width
    assert measured == (tower - pixel_gradient) * PAIRS > 0  # one image a pair, not one a row
    head = pref.scored_stack(plan_model)
    as_run = _head_as_run(head, rows, 3, True) + _head_as_run(head, rows, 1, False)
    as_run -= pixel_gradient * PAIRS
    assert counter.get_total_flops() == plan["model"]["train_flops_per_sample"] * PAIRS + as_run


# ----------------------------------------------------------------------------- the docs
def test_the_docs_dpo_table_is_what_its_commands_plan(capsys):
    """docs/PLANNER.md, "Preference tuning: DPO": each command of its bash block (the last
    three rows, in order) and the same without dpo (the first two) plan the table's figures."""
    import shlex

    docs = (Path(__file__).resolve().parents[1] / "docs" / "PLANNER.md").read_text()
    section = docs.split("## Preference tuning: DPO")[1].split("\n## ")[0]
    block = section.split("```bash\n")[1].split("```")[0]
    commands = [shlex.split(line)[2:] for line in block.splitlines()]
    assert len(commands) == 3 and all("--objective" in argv for argv in commands)
    table = [line for line in section.splitlines() if line.startswith("| sft") or
             line.startswith("| dpo")]  # fmt: skip
    sft = [[a for a in argv if a not in ("--objective", "dpo", "--samples", "100000")]
           for argv in commands[:2]]  # fmt: skip
    rows = []
    for argv in [*sft[::-1], *commands]:
        code, out, _ = _cli(capsys, *argv, "--json")
        assert code == 0
        rows.append(_table_row(json.loads(out)))
    assert table == rows


def _table_row(plan: dict) -> str:
    gib = 1024**3
    mem, t, obj = plan["memory"], plan["time"], plan["objective"]
    text = "LoRA" if plan["model"]["towers"]["text"]["mode"] == "lora" else "trained"
    if obj["name"] == "sft":
        return (f"| sft ({plan['inputs']['micro_batch']} rows) | {text} | "
                f"{mem['total_bytes'] / gib:.1f} GiB | - | {t['step_time_s']:.2f} s | "
                f"{t['samples_per_s']:.1f} rows | - |")  # fmt: skip
    kind = obj["reference"]
    names = {"adapters": "adapters (auto)", "cache": "cache (auto)", "copy": "copy (sharded)"}
    reference = names[kind]
    copy = f"{mem['reference_bytes'] / gib:.1f} GiB" if mem["reference_bytes"] else "-"
    hours = f"{t['time_to_train_s'] / 3600:.2f} h"
    if t["reference_pass_s"]:
        hours += (f", of which the reference pass {t['reference_pass_s'] / 3600:.2f} h "
                  f"({t['reference_pass_samples_per_s']:.1f} pairs/s)")  # fmt: skip
    return (f"| dpo ({plan['inputs']['micro_batch']} pairs) | {text}, {reference} | "
            f"{mem['total_bytes'] / gib:.1f} GiB | {copy} | {t['step_time_s']:.2f} s | "
            f"{t['samples_per_s']:.1f} pairs | {hours} |")  # fmt: skip
