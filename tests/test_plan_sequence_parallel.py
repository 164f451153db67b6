"""Sequence (context) parallelism in the planner: what it splits, what it sends, what it costs.

The expected numbers are derived here from the layout the trainer uses (docs/PLANNER.md,
"Sequence parallelism") and the spec's own widths and heads, never read back from the planner.
"""

import json
from dataclasses import replace

import pytest

from mmtrain.cli import main
from mmtrain.denoiser_spec import TIMESTEP_FREQUENCIES
from mmtrain.hardware import default_catalog
from mmtrain.plan.activations import (
    ActivationOptions,
    layer_bytes,
    layer_terms,
    stack_activations,
)
from mmtrain.plan.comm import group_link
from mmtrain.plan.compute import flops_per_sample
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.memory import model_states
from mmtrain.plan.model import PlanModel
from mmtrain.plan.recommend import GPU_COUNTS, SP_SIZES, _per_sample, layouts, recommend
from mmtrain.plan.workloads import decoder, load_model
from mmtrain.spec import load_spec
from mmtrain.structured import FieldError

LONG_ROW = ("Qwen2.5-VL-7B", 131072)  # 28 heads: SP 2 and 4 all-to-all, SP 8 ring


def _options(n: int, mode: str, **kw) -> ActivationOptions:
    return ActivationOptions(sequence_parallel=n, sp_attention=mode, **kw)


# ----------------------------------------------------------------------------- activations
@pytest.mark.parametrize("mode", ["all_to_all", "ring"])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_decoder_activations_scale_as_one_over_n_and_the_vision_tower_not(mode, ac, n):
    spec = load_spec("tiny-vlm")
    model = load_model("tiny-vlm")  # image tower, projector, 512-position decoder
    b, t, w = 2, spec.decoder.max_positions, spec.decoder.width
    text = t - (spec.image_tokens() - 1)  # one image per row
    upstream = False
    for stack in model.stacks:
        one = stack_activations(stack, b, ActivationOptions(ac=ac), input_grad=upstream)
        split = stack_activations(stack, b, _options(n, mode, ac=ac), input_grad=upstream)
        upstream = True
        if stack.kind != "decoder":
            assert split == one
            continue
        # each rank holds T/N positions; its head scores all of them (their targets travel as
        # int64) and reads the final norm's output, not a 16-bit copy of the text ids' rows
        assert split.layers_bytes == pytest.approx(one.layers_bytes / n, rel=1e-12)
        head_copy = b * (text - 1) * w * 2
        assert split.stem_bytes == pytest.approx((one.stem_bytes - head_copy) / n, rel=1e-12)
        assert split.logits_bytes == one.logits_bytes * t / (text - 1) / n == b * t / n * 8
        # live in backward: a recomputed block, or the loss's chunk of logits (16-bit, fp32
        # copy, log-softmax and gradient) over this rank's positions, the larger
        block = layer_bytes(stack, b, ActivationOptions()) / n if ac != "none" else 0
        chunk = b * t / n * spec.decoder.vocab_size * (2 + 3 * 4)
        assert split.recompute_bytes == pytest.approx(max(block, chunk), rel=1e-12)


def test_all_to_all_math_softmax_is_heads_over_n_of_the_full_row_and_ring_keeps_the_lse():
    stack = load_model("tiny-vlm").stack("text")
    b, t, a, n = 2, stack.tokens, stack.heads, 4
    one = layer_terms(stack, b, ActivationOptions(attention="math"))
    a2a = layer_terms(stack, b, _options(n, "all_to_all", attention="math"))
    ring = layer_terms(stack, b, _options(n, "ring", attention="math"))
    # all-to-all: heads/N heads over all T queries and keys, 16-bit
    assert a2a["attention_softmax"] == (a // n) * t * t * b * 2 == one["attention_softmax"] / n
    # ring: blockwise, its scores are transient; its T/N queries' fp32 log-sum-exp stays
    assert "attention_softmax" not in ring
    assert ring["attention_lse"] == a * (t // n) * b * 4


def test_denoiser_splits_its_tokens_but_not_its_conditioning():
    stack = load_model("tiny-dit").stack("denoiser")
    d = load_spec("tiny-dit").denoiser
    b, w, n = 3, d.width, 2
    one = layer_terms(stack, b, ActivationOptions())
    split = layer_terms(stack, b, _options(n, "all_to_all"))
    assert split["modulation"] == one["modulation"] == b * 9 * w * 2  # per sample: whole
    for name in ("norm_inputs", "qkv", "attention_output", "mlp_hidden", "gated_outputs"):
        assert split[name] == one[name] / n
    # outside the blocks: the noisy sample the patch projection reads (before the split), the
    # timestep MLP (256 features, hidden before and after SiLU), c, the final layer's SiLU(c)
    # and (1 + scale), and the class ids stay whole
    pixels = d.channels * d.sample_size**2
    whole = b * ((pixels + TIMESTEP_FREQUENCIES + 3 * w + 2 * w) * 2 + 8)
    stem_1 = stack_activations(stack, b, ActivationOptions()).stem_bytes
    stem_n = stack_activations(stack, b, _options(n, "all_to_all")).stem_bytes
    assert stem_n == pytest.approx(whole + (stem_1 - whole) / n, rel=1e-12)


def test_plan_memory_splits_the_decoder_and_shards_states_over_dp_times_sp():
    model, catalog = load_model(*LONG_ROW[:1], context=LONG_ROW[1]), default_catalog()
    base = PlanConfig(gpus=8, zero=3, ac="full")
    one = make_plan(model, base, catalog).memory
    four = make_plan(model, replace(base, sequence_parallel=4), catalog)
    assert four.config.dp == 2 and four.config.shard_ranks == 8
    by = four.memory.activations_by_stack
    # a quarter of the positions, less the head input's gathered copy (the terms: above)
    quarter = one.activations_by_stack["text"] / 4
    head_copy = model.stack("text").logit_rows * model.stack("text").width * 2 / 4
    assert quarter - head_copy <= by["text"] < quarter
    assert by["vision"] == one.activations_by_stack["vision"]  # every rank encodes every image
    assert four.memory.model_state_bytes == one.model_state_bytes  # ZeRO-3 over all 8 ranks
    assert not one.fits and four.memory.fits
    # SP over 2 GPUs leaves one data-parallel replica, but ZeRO still shards over both
    two = PlanConfig(gpus=2, zero=3, sequence_parallel=2)
    assert two.dp == 1
    assert sum(model_states(model, two)[:3]) == pytest.approx(
        sum(model_states(model, PlanConfig(gpus=2, zero=3))[:3])
    )


def test_each_rank_computes_its_share_of_the_decoder_and_all_of_the_vision_tower():
    model = load_model("tiny-vlm")
    text = model.stack("text")
    hw_1 = flops_per_sample(model, "none")[1]
    hw_4 = flops_per_sample(model, "none", 4)[1]
    assert hw_1 - hw_4 == pytest.approx(3 * text.forward_flops * (1 - 1 / 4))  # trained: 3x
    model_1, model_4 = flops_per_sample(model, "none")[0], flops_per_sample(model, "none", 4)[0]
    assert model_1 - model_4 == pytest.approx(3 * text.forward_flops * (1 - 1 / 4))


# ----------------------------------------------------------------------------- communication
def _small_decoder() -> tuple[PlanModel, dict]:
    """2 layers, width 64, 8 heads of 8, 2 kv heads, 1,024 positions."""
    shape = dict(layers=2, width=64, heads=8, kv_heads=2, head_dim=8, tokens=1024)
    stack = decoder("llm", 2, 64, 8, 2, 256, 1000, 1024, "test", head_dim=8)
    return PlanModel("small", (stack,), language_model=True), shape


def _link_bytes_per_s(cfg: PlanConfig) -> float:
    catalog = default_catalog()
    gpu = catalog.gpu(cfg.gpu)
    return group_link(catalog, gpu, cfg.sequence_parallel, gpu.gpus_per_node, None).bytes_per_s()


@pytest.mark.parametrize("ac, forwards", [("none", 1), ("full", 2)])
def test_all_to_all_volume_by_hand(ac, forwards):
    model, s = _small_decoder()
    n, b = 4, 2
    cfg = PlanConfig(gpus=4, micro_batch=b, sequence_parallel=n, ac=ac)
    plan = make_plan(model, cfg, default_catalog())
    t = s["tokens"] // n  # 256 local positions
    # forward: q and the output (heads x head_dim), k and v (kv_heads x head_dim), bf16
    local = b * t * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"]) * 2
    assert local == 163_840
    passes = forwards + 1  # the backward's four all-to-alls of the gradients
    sent = s["layers"] * passes * local * (n - 1) / n
    assert plan.config.sequence_parallel_attention == "all_to_all"  # auto: 4 divides 8 heads
    assert plan.time.sp_comm_bytes == pytest.approx(sent)
    assert plan.time.sp_comm_s == pytest.approx(sent / _link_bytes_per_s(cfg), rel=1e-4)
    assert plan.time.sp_exposed_s == plan.time.sp_comm_s  # on the critical path


def test_ring_volume_and_exposed_time_by_hand():
    model, s = _small_decoder()
    n, b = 4, 2
    cfg = PlanConfig(gpus=4, micro_batch=b, sequence_parallel=n, sequence_parallel_attention="ring")
    plan = make_plan(model, cfg, default_catalog())
    t = s["tokens"] // n
    kv = b * t * 2 * s["kv_heads"] * s["head_dim"] * 2  # the local k and v block, bf16
    passes = (n - 1) + 2 * (n - 1) + 1  # forward; backward k, v and grads; the grads' last pass
    assert plan.time.sp_comm_bytes == pytest.approx(s["layers"] * passes * kv)
    pass_s = kv / _link_bytes_per_s(cfg)
    rate = default_catalog().gpu("h100").peak_flops("bf16") * plan.time.achievable_fraction
    block_s = 4 * b * t * t * s["heads"] * s["head_dim"] / rate  # QK^T and PV of one block
    exposed = (n - 1) * max(0, pass_s - block_s) + (n - 1) * max(0, 2 * pass_s - 2 * block_s)
    assert plan.time.sp_exposed_s == pytest.approx(s["layers"] * (exposed + pass_s), rel=1e-4)
    assert plan.time.sp_exposed_s < plan.time.sp_comm_s  # the passes hide behind the blocks


def test_denoiser_gathers_its_output_patches():
    model, catalog = load_model("tiny-dit"), default_catalog()
    d = load_spec("tiny-dit").denoiser
    n, b = 2, 4
    cfg = PlanConfig(gpus=2, micro_batch=b, sequence_parallel=n)
    plan = make_plan(model, cfg, catalog)
    t, hd = d.tokens() // n, d.width // d.heads
    layers = b * t * hd * 4 * d.heads * 2 * (n - 1) / n * 2 * d.layers  # MHA: 4 heads wide
    patches = b * d.tokens() * d.patch_volume() * d.out_channels() * 2  # gathered, bf16
    gather = patches * (n - 1) / n + 2 * patches * (n - 1) / n  # all-gather, grad all-reduce
    assert plan.time.sp_comm_bytes == pytest.approx(layers + gather)


def test_step_time_holds_the_exposed_sp_communication_and_its_share():
    model = load_model(*LONG_ROW[:1], context=LONG_ROW[1])
    plan = make_plan(model, PlanConfig(gpus=8, zero=3, ac="full", sequence_parallel=4),
                     default_catalog())  # fmt: skip
    t = plan.time
    parts = t.compute_s + t.tp_comm_s + t.dp_exposed_s + t.sp_exposed_s + t.bubble_s
    assert t.step_time_s == pytest.approx(parts)
    assert t.sp_exposed_s > 0 and t.sp_comm_share == pytest.approx(t.sp_exposed_s / t.step_time_s)
    assert t.sp_link == "nvlink4"  # 4 consecutive GPUs: inside one node


# ----------------------------------------------------------------------------- --measure
@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "tiny-vlm", "--context", "512", "--micro-batch", "2", "--packed",
         "--images", "2", "--gpus", "2", "--sequence-parallel", "2"],
        ["--model", "tiny-vlm", "--context", "512", "--micro-batch", "2", "--ac", "full",
         "--gpus", "4", "--sequence-parallel", "4", "--sequence-parallel-attention", "ring"],
        ["--model", "tiny-qwen2-vl", "--context", "512", "--gpus", "2", "--sequence-parallel", "2"],
        ["--model", "tiny-dit", "--micro-batch", "4", "--gpus", "2", "--sequence-parallel", "2",
         "--sequence-parallel-attention", "ring"],
        ["--model", "tiny-mmdit", "--micro-batch", "2", "--ac", "full", "--gpus", "2",
         "--sequence-parallel", "2"],
    ],
    ids=["vlm-packed-a2a", "vlm-full-ac-ring4", "native-vlm", "dit-ring", "mmdit-full-ac"],
)  # fmt: skip
def test_measure_on_sequence_parallel_ranks_agrees_with_the_plan(capsys, argv):
    """--measure runs the step on N gloo ranks splitting each row as the trainer does; the
    rank that keeps the most is within 10% of the plan (as tests/test_plan_measure.py)."""
    assert main(["plan", *argv, "--measure", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert abs(measured["activations_error"]) < 0.10
    assert abs(measured["model_state_error"]) < 0.01
    assert measured["activations_bytes"] > 0


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "cfg, heads, flag, words",
    [
        (PlanConfig(gpus=8, sequence_parallel=3), [4], "--sequence-parallel", "does not divide"),
        (PlanConfig(gpus=8, sequence_parallel=0), [4], "--sequence-parallel", "at least 1"),
        (PlanConfig(gpus=8, sequence_parallel=2), [], "--sequence-parallel", "no stack"),
        (
            PlanConfig(gpus=8, sequence_parallel=8, sequence_parallel_attention="all_to_all"),
            [28],
            "--sequence-parallel-attention",
            "divide the 28 attention heads",
        ),
        (
            PlanConfig(gpus=8, sequence_parallel=2, sequence_parallel_attention="ulysses"),
            [4],
            "--sequence-parallel-attention",
            "ulysses",
        ),
    ],
)
def test_validation_names_the_flag(cfg, heads, flag, words):
    with pytest.raises(FieldError, match=words) as err:
        cfg.validate(heads, heads)
    assert err.value.path == flag


def test_cli_refuses_sequence_parallelism_without_a_split_stack(capsys):
    assert main(["plan", "--model", "tiny-clip", "--gpus", "2", "--sequence-parallel", "2"]) == 2
    assert "--sequence-parallel: the model has no stack" in capsys.readouterr().err


def test_megatron_sp_flag_is_told_apart_in_its_help(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Megatron-LM sequence parallelism inside the TP group" in help_text
    assert "not --sequence-parallel" in help_text


# ----------------------------------------------------------------------------- CLI and search
def _cli(capsys, *argv) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_cli_text_and_json_show_the_layout_and_its_communication(capsys):
    argv = ["--model", LONG_ROW[0], "--context", str(LONG_ROW[1]), "--gpus", "8", "--zero", "3",
            "--ac", "full"]  # fmt: skip
    text = " ".join(_cli(capsys, *argv, "--sequence-parallel", "4").split())
    assert "SP 4 (all_to_all)" in text and "sequence parallel 4 (all_to_all) over nvlink4" in text
    out = json.loads(_cli(capsys, *argv, "--sequence-parallel", "8", "--json"))
    assert out["inputs"]["sequence_parallel"] == 8
    assert out["inputs"]["sequence_parallel_attention"] == "ring"  # auto: 8 does not divide 28
    assert out["inputs"]["dp"] == 1
    time = out["time"]
    assert time["sp_comm_bytes"] > 0 and time["sp_comm_s"] > 0
    share = time["sp_exposed_s"] / time["step_time_s"]
    assert 0 < time["sp_comm_share"] == pytest.approx(share, abs=1e-6)  # rounded to 6 places
    plain = json.loads(_cli(capsys, *argv, "--json"))
    assert plain["inputs"]["sequence_parallel"] == 1 and plain["time"]["sp_comm_bytes"] == 0


def test_recommend_splits_rows_that_fit_no_gpu_whole(capsys):
    model, catalog = load_model(LONG_ROW[0], context=LONG_ROW[1]), default_catalog()
    # the lightest strategy without sequence parallelism on 8 H100s does not fit
    lightest = PlanConfig(gpus=8, zero=3, ac="full", global_batch=64)
    assert not make_plan(model, lightest, catalog).memory.fits
    rec = recommend(model, lightest, catalog, ["h100"], 8)
    assert rec.ranked and all(p.config.sequence_parallel > 1 for p in rec.ranked)
    win = rec.ranked[0].config
    assert win.sequence_parallel in SP_SIZES and win.gpus % win.sequence_parallel == 0
    assert "no strategy without sequence parallelism fits in memory" in rec.explanation
    argv = ["--model", LONG_ROW[0], "--context", str(LONG_ROW[1]), "--recommend", "--gpu", "h100",
            "--max-gpus", "8", "--global-batch", "64"]  # fmt: skip
    text = " ".join(_cli(capsys, *argv).split())
    assert f"SP {win.sequence_parallel} ({win.sequence_parallel_attention})" in text
    out = json.loads(_cli(capsys, *argv, "--json"))
    assert out["ranked"][0]["inputs"]["sequence_parallel"] == win.sequence_parallel


def _exhaustive(model, base, catalog, gpu, max_gpus):
    """Every strategy mmtrain train runs, sequence parallelism included, that fits, without
    the search's pruning."""
    plans = []
    for count in (c for c in GPU_COUNTS if c <= max_gpus):
        for sp in (n for n in SP_SIZES if count % n == 0 and n <= 8):
            dp = count // sp
            if base.global_batch % dp:
                continue
            for zero, offload in layouts(count):  # what mmtrain train runs
                for ac in ("none", "selective", "full"):
                    mb = 1
                    while mb <= base.global_batch // dp:
                        cfg = replace(base, gpu=gpu, gpus=count, zero=zero, offload=offload,
                                      ac=ac, micro_batch=mb, sequence_parallel=sp)  # fmt: skip
                        plan = make_plan(model, cfg, catalog)
                        if plan.fits:
                            plans.append(plan)
                        mb *= 2
    return plans


def test_sequence_parallel_pruning_loses_no_optimum():
    # rows long enough for a 40 GB GPU to need splitting at some strategies
    model, catalog = load_model("tiny-vlm", context=65536), default_catalog()
    base = PlanConfig(global_batch=16, samples=10**5)
    every = _exhaustive(model, base, catalog, "a100-40g", 8)
    assert any(p.config.sequence_parallel > 1 for p in every)
    for by in ("time", "cost"):
        rec = recommend(model, base, catalog, ["a100-40g"], 8, by, deadline_h=1e9)
        assert len(rec.ranked) < len(every)
        best = min(_per_sample(p, by) for p in every)
        assert _per_sample(rec.ranked[0], by) <= best * 1.005
