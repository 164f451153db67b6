"""The planner: published figures it must reproduce, the CLI contract and bad-input errors."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from mmtrain.cli import main
from mmtrain.hardware import GIB, default_catalog, get_gpu
from mmtrain.plan.activations import ActivationOptions, layer_bytes
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.inference import inference_memory, kv_cache_bytes
from mmtrain.plan.memory import model_states
from mmtrain.plan.model import PlanModel, Stack
from mmtrain.plan.recommend import (
    DEFAULT_DEADLINE_H,
    GPU_COUNTS,
    _per_sample,
    recommend,
)
from mmtrain.plan.states import shard, state_bytes
from mmtrain.plan.workloads import load_model
from mmtrain.spec import preset_names
from mmtrain.structured import FieldError


def _dense(params: float) -> PlanModel:
    stack = Stack("llm", "decoder", 1, 4096, 32, 32, 128, 16384, int(params), 0, 1)
    return PlanModel("dense", (stack,))


def test_zero_paper_example_7_5b_on_64_gpus():
    b = state_bytes("bf16", "adamw", 16)
    totals = [sum(vars(shard(7.5e9, b, zero, 64)).values()) / 1e9 for zero in range(4)]
    assert totals[0] == pytest.approx(120)
    assert totals[1] == pytest.approx(31.4, abs=0.05)
    assert totals[2] == pytest.approx(16.6, abs=0.05)
    assert totals[3] == pytest.approx(1.9, abs=0.05)


def test_30b_mixed_precision_adamw_is_480_gb_not_240():
    cfg = PlanConfig(gpus=1)
    weights, grads, opt, convention = model_states(_dense(30e9), cfg)
    assert (weights + grads + opt) / 1e9 == pytest.approx(480)
    assert "16 B/param" in convention
    w18 = sum(model_states(_dense(30e9), PlanConfig(bytes_per_param=18))[:3])
    assert w18 / 1e9 == pytest.approx(540)
    pure = sum(model_states(_dense(30e9), PlanConfig(precision="bf16-pure"))[:3])
    assert pure / 1e9 == pytest.approx(240)  # the 8 B/param rule holds only without fp32 states


def test_70b_bf16_weights_and_llama3_kv_cache():
    est = inference_memory(_dense(70e9), get_gpu("b300"), 1, 1)
    assert est.weights_bytes / 1e9 == pytest.approx(140)
    assert est.weights_bytes / GIB == pytest.approx(130.4, abs=0.05)
    vlm = load_model("vlm-70b")
    assert kv_cache_bytes(vlm, 32 * 1024, 1) / 1e9 == pytest.approx(10.7, abs=0.05)
    assert vlm.stack("text").params / 1e9 == pytest.approx(70.55, abs=0.01)  # Llama-3-70B


@pytest.mark.parametrize("name", preset_names())
def test_parameter_counts_equal_the_built_module(name):
    from mmtrain.models.build import create_model

    model = create_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == load_model(name).params()


def test_openclip_flops_come_from_the_spec():
    assert load_model("ViT-B-32").forward_flops() / 1e9 == pytest.approx(14.78, rel=0.02)
    assert load_model("ViT-L-14").forward_flops() / 1e9 == pytest.approx(175.33, rel=0.02)
    assert load_model("ViT-L-14", image_size=336).tokens_per_sample()["image"] == 577


def test_korthikanti_table_2_forms():
    # 16-bit activations with dropout masks, GELU MLP (f = 4h), LayerNorm: sbh (34 + 5as/h)
    s, b, h, a = 2048, 1, 12288, 96
    stack = Stack("gpt3", "decoder", 1, h, a, a, h // a, 4 * h, 0, 0, s)
    stats = 4 * s * b * 4  # two LayerNorms x (mean, rstd) in fp32, beyond the paper's terms
    lse = a * s * b * 4

    def per_layer(**kw):
        return layer_bytes(
            stack, b, ActivationOptions(act_bytes=2, residual_bytes=2, dropout=True, **kw)
        )

    assert per_layer(attention="math") - stats == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert per_layer(attention="math", tp=8) - stats == pytest.approx(
        s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    )
    assert per_layer(attention="math", tp=8, sp=True) - stats / 8 == pytest.approx(
        s * b * h * (34 / 8 + 5 * a * s / (h * 8))
    )
    assert per_layer(attention="flash") - stats - lse == pytest.approx(
        s * b * h * 34
    )  # quadratic term dropped
    assert per_layer(attention="flash", ac="full") == pytest.approx(2 * s * b * h)


def test_gpu_catalog_aliases_and_usable_memory():
    catalog = default_catalog()
    assert get_gpu("B300") is get_gpu("hgx-b300") is get_gpu("NVIDIA B300 SXM (Blackwell Ultra)")
    for alias, key in [
        ("gb300", "gb300"),
        ("H100-PCIE", "h100-pcie"),
        ("a100-40g", "a100-40g"),
        ("RTX 4090", "rtx4090"),
        ("mi300x", "mi300x"),
        ("l40s", "l40s"),
    ]:
        assert catalog.gpu(alias).key == key
    for gpu in catalog.gpus.values():
        assert gpu.usable_bytes <= gpu.nominal_bytes * 1.08, gpu.key  # AMD labels are GiB
    assert get_gpu("h100").memory_usable_gib == pytest.approx(79.6)
    with pytest.raises(FieldError, match="did you mean 'h100'"):
        get_gpu("h1000")


def test_user_hardware_yaml_extends_the_catalog(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text(
        "gpus:\n  h100:\n    price_per_gpu_hour: 1.25\ninterconnects:\n  slow: {name: slow, gbps: 1}\n"
    )
    catalog = default_catalog().extended(path)
    assert catalog.gpu("h100").price_per_gpu_hour == 1.25
    assert catalog.gpu("h100").price_source == str(path)  # costs then name the user's file
    assert catalog.link("slow").gbps == 1
    path.write_text("gpus:\n  h100:\n    memory_usabel_gib: 3\n")
    with pytest.raises(FieldError, match="memory_usable_gib"):
        default_catalog().extended(path)


def test_memory_and_time_respond_to_strategy():
    model = load_model("ViT-L-14")
    catalog = default_catalog()
    base = PlanConfig(gpu="h100", gpus=8, micro_batch=64, global_batch=512, samples=10**8)
    plans = {
        z: make_plan(model, PlanConfig(**{**vars(base), "zero": z}), catalog) for z in range(4)
    }
    states = [plans[z].memory.model_state_bytes for z in range(4)]
    assert states[0] > states[1] > states[2] > states[3]
    acts = [
        make_plan(model, PlanConfig(**{**vars(base), "ac": ac}), catalog)
        for ac in ("none", "selective", "full")
    ]
    assert (
        acts[0].memory.saved_activations_bytes
        > acts[1].memory.saved_activations_bytes
        > acts[2].memory.saved_activations_bytes
    )
    assert acts[2].time.step_time_s > acts[0].time.step_time_s  # recompute costs time
    t = plans[0].time
    assert 0 < t.mfu <= t.achievable_fraction + 1e-9
    assert t.cost == pytest.approx(
        t.time_to_train_s / 3600 * 8 * get_gpu("h100").price_per_gpu_hour
    )
    frozen = model.with_modes({"image": "frozen"})
    assert make_plan(frozen, base, catalog).memory.total_bytes < plans[0].memory.total_bytes


def test_recommend_ranks_fitting_strategies_and_explains():
    rec = recommend(
        load_model("vlm-70b"),
        PlanConfig(global_batch=256, samples=10**6),
        default_catalog(),
        ["h100", "b300"],
    )
    assert rec.ranked and all(p.memory.fits for p in rec.ranked)
    assert rec.by == "cost" and rec.deadline_h == DEFAULT_DEADLINE_H  # the default policy
    assert all(p.time.time_to_train_s <= DEFAULT_DEADLINE_H * 3600 for p in rec.ranked)
    assert "within 720 h" in rec.policy and "default" in rec.policy
    costs = [p.time.cost for p in rec.ranked]
    assert costs[0] <= min(costs) * 1.005  # scores equal to 3 significant figures tie
    assert rec.explanation.startswith("winner:") and "runner-up" in rec.explanation


def _exhaustive(model, base, catalog, gpu, max_gpus):
    """Every strategy mmtrain train runs that fits, without the search's pruning (small models
    only): DDP, FSDP2 and FSDP2 with CPU offload (on one GPU too)."""
    plans = []
    for count in (c for c in GPU_COUNTS if c <= max_gpus):
        dp = count
        if base.global_batch % dp:
            continue
        for zero, offload in (
            ((0, False), (3, False), (3, True)) if dp > 1 else ((0, False), (3, True))
        ):
            for ac in ("none", "selective", "full"):
                mb = 1
                while mb <= base.global_batch // dp:
                    cfg = PlanConfig(
                        **{**vars(base), "gpu": gpu, "gpus": count, "zero": zero}
                        | {"ac": ac, "micro_batch": mb, "offload": offload}
                    )
                    if base.global_batch % (mb * dp) == 0:
                        plan = make_plan(model, cfg, catalog)
                        if plan.fits:
                            plans.append(plan)
                    mb *= 2
    return plans


@pytest.mark.parametrize("name", ["tiny-clip", "ViT-L-14"])
def test_recommend_pruning_loses_no_optimum(name):
    model, catalog = load_model(name), default_catalog()
    base = PlanConfig(global_batch=64, samples=10**7)
    every = _exhaustive(model, base, catalog, "a100-40g", 8)
    for by in ("time", "cost"):
        rec = recommend(model, base, catalog, ["a100-40g"], 8, by, deadline_h=1e9)
        assert len(rec.ranked) < len(every)  # dominated strategies were pruned
        best = min(_per_sample(p, by) for p in every)
        assert _per_sample(rec.ranked[0], by) <= best * 1.005


def test_recommend_deadline_and_default_order():
    model, catalog = load_model("video-dit-30b"), default_catalog()
    base = PlanConfig(global_batch=256, samples=10**6)
    rec = recommend(model, base, catalog, ["b300"], 512, deadline_h=100)
    assert rec.met_deadline and rec.ranked
    assert all(p.time.time_to_train_s <= 100 * 3600 for p in rec.ranked)
    assert rec.fitting > len(rec.ranked)  # slower strategies were dropped
    late = recommend(model, base, catalog, ["b300"], 512, deadline_h=0.01)
    assert not late.met_deadline and late.by == "time"
    assert "none of the" in late.policy and "fastest first" in late.policy
    times = [p.time.step_time_s / p.config.effective_global_batch for p in late.ranked]
    assert times[0] <= min(times) * 1.005
    no_samples = recommend(model, PlanConfig(global_batch=256), catalog, ["b300"], 512)
    assert no_samples.by == "time" and no_samples.deadline_h is None
    assert "--samples" in no_samples.policy
    with pytest.raises(FieldError, match="needs --samples") as err:
        recommend(model, PlanConfig(global_batch=256), catalog, ["b300"], 512, deadline_h=10)
    assert err.value.path == "--deadline"


def test_costs_print_currency_and_price_source(capsys):
    argv = ["plan", "--model", "ViT-B-16", "--gpu", "h100", "--gpus", "8", "--samples", "10000000"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "at $2.50 per GPU-hour (indicative on-demand list price, catalog of 2026-11)" in out
    assert main([*argv, "--price-per-gpu-hour", "1.1", "--json"]) == 0
    time = json.loads(capsys.readouterr().out)["time"]
    assert time["price_per_gpu_hour"] == 1.1 and time["price_source"] == "--price-per-gpu-hour"
    assert time["currency"] == "USD"


def test_inference_max_batch_and_mig():
    model = load_model("llava-1.5-7b")
    est = inference_memory(model, get_gpu("h100"), 4096, 1)
    assert est.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # MHA: 0.5 MiB per token
    assert est.mig_profile == "1g.20gb" and est.mig_instances == 4
    bigger = inference_memory(model, get_gpu("h100"), 4096, est.max_batch + 1)
    assert (
        bigger.total_bytes
        > bigger.usable_bytes
        >= inference_memory(model, get_gpu("h100"), 4096, est.max_batch).total_bytes
    )


def _cli_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_schema(capsys):
    out = _cli_json(
        capsys,
        "--model",
        "ViT-B-16",
        "--gpu",
        "a100",
        "--gpus",
        "8",
        "--micro-batch",
        "32",
        "--samples",
        "1000000",
    )
    assert set(out["model"]) >= {
        "name",
        "params",
        "trainable_params",
        "forward_flops_per_sample",
        "tokens_per_sample",
    }
    assert set(out["memory"]) >= {
        "weights_bytes",
        "gradients_bytes",
        "optimizer_bytes",
        "activations_bytes",
        "overhead_bytes",
        "total_bytes",
        "usable_bytes",
        "fits",
    }
    assert set(out["time"]) >= {"step_time_s", "samples_per_s", "mfu", "time_to_train_s", "cost"}
    assert out["inputs"]["gpus"] == 8 and out["inputs"]["dp"] == 8
    inf = _cli_json(
        capsys, "--model", "vlm-70b", "--inference", "--context", "32768", "--gpu", "b300"
    )
    assert set(inf["inference"]) >= {"weights_bytes", "kv_cache_bytes", "total_bytes", "max_batch"}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--gpu", "h1000"], "--gpu: unknown GPU 'h1000' (did you mean 'h100'?)"),
        (["--model", "vit-b-23"], "--model: unknown model"),
        (
            ["--gpus", "3", "--tp", "3", "--model", "tiny-multimodal"],
            "--tp: tensor parallel 3 does not divide 4",
        ),
        (["--zero", "3"], "--zero: ZeRO-3 shards over data-parallel ranks"),
        (
            ["--micro-batch", "8", "--global-batch", "4"],
            "--micro-batch: 8 is larger than --global-batch 4",
        ),
        (
            ["--model", "vlm-70b", "--recommend", "--gpu", "rtx4090", "--max-gpus", "2"],
            "nothing fits; closest",
        ),
    ],
)
def test_bad_input_names_the_flag(capsys, argv, words):
    assert main(["plan", *argv]) == 2
    assert words in capsys.readouterr().err


def test_tp_must_divide_heads():
    with pytest.raises(FieldError, match="does not divide 4 attention heads") as err:
        make_plan(load_model("tiny-clip"), PlanConfig(gpus=8, tp=8), default_catalog())
    assert err.value.path == "--tp"


def test_workload_table_and_recommend_cli(capsys, tmp_path):
    assert main(["plan", "--workloads", "default", "--gpu", "b300"]) == 0
    out = capsys.readouterr().out
    assert "video generation" in out and "vlm-70b" in out
    path = tmp_path / "mine.yaml"
    path.write_text("- {task: my clip, model: ViT-B-32, global_batch: 4096, samples: 1000000}\n")
    assert main(["plan", "--workloads", str(path), "--gpu", "h100"]) == 0
    assert "my clip" in capsys.readouterr().out
    assert (
        main(
            [
                "plan",
                "--model",
                "ViT-B-32",
                "--recommend",
                "--gpu",
                "h100,a100",
                "--global-batch",
                "1024",
            ]
        )
        == 0
    )
    assert "winner:" in capsys.readouterr().out


def test_fusion_only_model_states_leave_out_unused_projections():
    model = load_model("tiny-fusion")  # no contrastive pairs: the towers' projections get no grad
    unused = sum(s.unused_params for s in model.stacks)
    assert unused == 3 * 64 * 64
    assert model.trainable_params() == model.params() - unused
    plan = make_plan(model, PlanConfig(precision="fp32"), default_catalog())
    assert plan.memory.model_state_bytes == pytest.approx(
        4 * model.params() + 12 * (model.params() - unused)
    )
    assert plan.memory.activations_by_stack["fusion head"] > 0


def test_plan_cli_imports_no_torch():
    code = (
        "import sys; from mmtrain.cli import main; "
        "main(['plan', '--model', 'tiny-clip', '--recommend', '--gpu', 'h100', '--json']); "
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.strip().endswith("False")


def test_planner_imports_no_torch():
    code = "import sys, mmtrain.hardware, mmtrain.plan.recommend, mmtrain.plan.inference, mmtrain.plan.workloads, mmtrain.plan.lengths, mmtrain.plan.data_plan, mmtrain.commands.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- achievable MFU
def test_workload_families_come_from_the_model():
    from mmtrain.plan.compute import workload_family

    assert workload_family(load_model("ViT-B-32")) == "contrastive"
    assert workload_family(load_model("clip-internvit-6b")) == "contrastive"
    assert workload_family(load_model("dit-2b")) == "diffusion"  # no published figure
    assert workload_family(load_model("tiny-fusion")) == "encoder"  # no pairs: no published figure
    assert workload_family(load_model("llava-1.5-7b")) == "vlm-padded"
    assert workload_family(load_model("llava-1.5-7b", packed=True)) == "vlm-packed"


def test_a_published_recipe_on_its_gpu_gives_back_its_published_mfu():
    """One GPU (no communication): the plan's MFU is the midpoint of the published range."""
    from mmtrain.plan.compute import PUBLISHED, recompute_ratio
    from mmtrain.plan.workloads import decoder

    catalog = default_catalog()
    clip = make_plan(load_model("ViT-L-14"), PlanConfig(gpu="a100", micro_batch=64), catalog)
    assert clip.time.efficiency_family == "contrastive"
    assert clip.time.mfu == pytest.approx((0.11 + 0.12) / 2)
    llama = decoder("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 8192, "torchtitan recipe")
    plan = make_plan(
        PlanModel("llama", (llama,)), PlanConfig(gpu="h100", micro_batch=2, ac="selective"), catalog
    )
    assert plan.time.efficiency_family == "llm"
    assert plan.time.mfu == pytest.approx((0.33 + 0.39) / 2)
    assert PUBLISHED["llm"].recipe == (32, 4096, 32, 8, 14336, 128256, 8192)
    assert recompute_ratio("vlm") == pytest.approx(4 / 3)  # full recompute: 8N over 6N
    assert 1 < recompute_ratio("llm") < 4 / 3


def test_the_fraction_moves_across_gpus_by_their_mamf():
    model, catalog = load_model("ViT-B-16"), default_catalog()
    a100 = make_plan(model, PlanConfig(gpu="a100"), catalog).time.achievable_fraction
    for key in ("h100", "mi300x", "b200"):
        other = make_plan(model, PlanConfig(gpu=key), catalog).time.achievable_fraction
        assert other / a100 == pytest.approx(
            get_gpu(key).mamf_fraction / get_gpu("a100").mamf_fraction
        )


def test_documented_shares_of_mamf():
    """The table in plan/compute.py's docstring and docs/PLANNER.md."""
    from mmtrain.plan.compute import share_of_mamf

    assert round(share_of_mamf("contrastive"), 3) == 0.132
    assert round(share_of_mamf("llm"), 3) == 0.502
    assert round(share_of_mamf("vlm"), 3) == 0.537


def test_unsourced_families_say_the_llm_figure_stands_in():
    from mmtrain.plan.compute import share_of_mamf

    catalog = default_catalog()
    dit = make_plan(load_model("dit-2b"), PlanConfig(gpu="h100"), catalog).time
    assert dit.efficiency_family == "diffusion"
    assert "no published diffusion run" in dit.efficiency_source
    assert "torchtitan" in dit.efficiency_source
    assert dit.achievable_fraction == pytest.approx(
        share_of_mamf("llm") * get_gpu("h100").mamf_fraction
    )


def test_mfu_flag_overrides_and_the_output_names_family_and_source(capsys):
    argv = ["--model", "ViT-B-16", "--gpu", "h100", "--gpus", "8", "--samples", "1000000"]
    out = _cli_json(capsys, *argv)["time"]
    assert out["efficiency_family"] == "contrastive"
    assert "OpenCLIP" in out["efficiency_source"]
    assert out["achievable_fraction"] == pytest.approx(
        0.115 / get_gpu("a100").mamf_fraction * get_gpu("h100").mamf_fraction, rel=1e-5
    )
    forced = _cli_json(capsys, *argv, "--mfu", "0.3")["time"]
    assert forced["achievable_fraction"] == 0.3 and forced["efficiency_family"] == "contrastive"
    assert forced["efficiency_source"].startswith("--mfu")
    cfg = PlanConfig(gpu="h100", gpus=8, samples=10**6)
    default = make_plan(load_model("ViT-B-16"), cfg, default_catalog()).time
    overridden = make_plan(load_model("ViT-B-16"), replace(cfg, mfu=0.3), default_catalog()).time
    assert overridden.compute_s == pytest.approx(
        default.compute_s * default.achievable_fraction / 0.3, rel=1e-12
    )  # compute time is hardware FLOPs over peak x fraction
    assert main(["plan", *argv]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "family contrastive" in text and "OpenCLIP" in text


# ----------------------------------------------------------------------------- precision modes
def test_bf16_weights_keeps_the_mixed_precision_states():
    model = _dense(30e9)
    for bpp in (16, 18):
        autocast = model_states(model, PlanConfig(precision="bf16", bytes_per_param=bpp))
        weights = model_states(model, PlanConfig(precision="bf16-weights", bytes_per_param=bpp))
        assert weights == autocast
        assert sum(weights[:3]) / 1e9 == pytest.approx(30 * bpp)
    assert get_gpu("a100").peak_flops("bf16-weights") == get_gpu("a100").peak_flops("bf16")


def test_a_bad_precision_names_the_field(capsys):
    with pytest.raises(FieldError) as err:
        PlanConfig(precision="bf16-deepspeed").validate()
    assert err.value.path == "--precision" and "bf16-weights" in str(err.value)
    with pytest.raises(SystemExit) as exit_:  # argparse's choices come from PRECISIONS
        main(["plan", "--precision", "bf16-deepspeed"])
    assert exit_.value.code == 2
    assert "--precision" in capsys.readouterr().err
    assert main(["plan", "--precision", "bf16-weights", "--json"]) == 0
