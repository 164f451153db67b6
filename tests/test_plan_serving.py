"""`mmtrain plan --inference` honours --gpus and --tp (replicas of TP groups) and gives decode
tokens/s (memory-bandwidth bound) and time to first token (compute bound) beside memory, checked
by hand for Qwen2.5-VL-72B on H100s (catalog: 3.35 TB/s HBM, 989 dense bf16 TFLOPS, NVLink 4 at
450 GB/s x 0.85)."""

from __future__ import annotations

import json

import pytest

from mmtrain.cli import main
from mmtrain.plan.workloads import load_model

ARGV = ["plan", "--model", "Qwen2.5-VL-72B", "--gpu", "h100", "--inference", "--context", "8192"]
TEXT = 72_706_203_648  # the LM: two 152,064 x 8,192 tables, 80 blocks, a norm
EMBEDDING = 152_064 * 8192
BLOCK_MATRICES = 877_658_112  # a block's weight matrices (biases and norms apart)
NVLINK4 = 450e9 * 0.85


def _serve(capsys, *flags) -> dict:
    assert main([*ARGV, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _all_reduce_s(size: float, n: int) -> float:
    return size / NVLINK4 * 2 * (n - 1) / n


def test_eight_gpus_are_not_one(capsys):
    one = _serve(capsys, "--gpus", "1")
    eight = _serve(capsys, "--gpus", "8", "--tp", "8")
    assert one["inference"]["max_batch"] == 0 and not one["inference"]["fits"]  # 147 GB of bf16
    assert eight["inference"]["weights_bytes"] == one["inference"]["weights_bytes"] // 8
    assert eight["inference"]["max_batch"] > 0 and eight["inference"]["fits"]
    assert eight["inference"]["kv_bytes_per_token"] == 2 * 80 * 1 * 128 * 2  # one kv head a GPU
    assert _serve(capsys, "--tp", "8") == eight  # --tp alone: one group of that many GPUs


def test_decode_tokens_per_second_by_hand(capsys):
    s = _serve(capsys, "--gpus", "8", "--tp", "8")["serving"]
    read = (TEXT - EMBEDDING) * 2 / 8 + 2 * 80 * 1 * 128 * 2 * 8192  # weights, one row's cache
    assert s["decode_bytes_per_gpu"] == pytest.approx(read)
    step = read / 3.35e12 + 80 * 2 * _all_reduce_s(8192 * 2, 8)
    assert s["decode_step_s"] == pytest.approx(step, abs=5e-7)  # JSON rounds to 6 places
    assert s["tokens_per_s_per_sequence"] == pytest.approx(1 / step, abs=5e-7)  # as above
    assert s["tokens_per_s_per_sequence"] > 100  # 5.4 ms a step
    replicas = _serve(capsys, "--gpus", "8", "--tp", "4", "--batch", "8")
    r = replicas["serving"]
    assert replicas["inference"]["replicas"] == 2
    assert r["tokens_per_s"] == pytest.approx(2 * r["tokens_per_s_per_replica"])
    assert r["tokens_per_s_per_replica"] == pytest.approx(8 * r["tokens_per_s_per_sequence"])


def test_time_to_first_token_by_hand(capsys):
    out = _serve(capsys, "--gpus", "8", "--tp", "8", "--prompt-tokens", "4096")
    s, p = out["serving"], 4096
    vision = load_model("Qwen2.5-VL-72B").stack("vision").forward_flops  # the prompt's page
    flops = 2 * 80 * BLOCK_MATRICES * p + 2 * 80 * p**2 * 64 * 128 + 2 * 152_064 * 8192 + vision
    assert s["prefill_flops"] == pytest.approx(flops)
    rate = 989e12 * s["achievable_fraction"]
    ttft = flops / (8 * rate) + 80 * 2 * _all_reduce_s(p * 8192 * 2, 8)
    assert s["ttft_s"] == pytest.approx(ttft, abs=5e-7) and s["ttft_s"] > 0
    assert main([*ARGV, "--gpus", "8", "--tp", "8"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "1 replica(s) of TP 8" in text and "time to first token" in text and "assumptions" in text
    )


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--gpus", "8", "--tp", "3"], "--tp: 3 does not divide --gpus 8"),
        (["--gpus", "6", "--tp", "6"], "--tp: tensor parallel 6 does not divide the 16"),
        (["--gpus", "8", "--tp", "8", "--prompt-tokens", "9000"], "--prompt-tokens: must be betw"),
    ],
)
def test_bad_layouts_name_the_flag(capsys, flags, error):
    assert main([*ARGV, *flags]) == 2
    assert error in capsys.readouterr().err


def test_the_docs_show_what_the_plans_print(capsys):
    """docs/PLANNER.md, "Serving": its figures are these plans'."""
    from pathlib import Path

    docs = " ".join((Path(__file__).parents[1] / "docs" / "PLANNER.md").read_text().split())
    tp8 = _serve(capsys, "--gpus", "8", "--tp", "8")
    i, s = tp8["inference"], tp8["serving"]
    tp4 = _serve(capsys, "--gpus", "8", "--tp", "4", "--batch", "8")["serving"]
    shown = [
        f"largest batch {i['max_batch']}",
        f"a decode step reads {s['decode_bytes_per_gpu'] / 1e9:.1f} GB a GPU, "
        f"{s['decode_step_s'] * 1e3:.1f} ms: {s['tokens_per_s_per_sequence']:.0f} tokens/s a "
        f"sequence, {s['max_batch_tokens_per_s']:,.0f} tokens/s at the largest batch",
        f"after {s['ttft_s']:.2f} s",
        f"{tp4['tokens_per_s_per_sequence']:.0f} tokens/s a sequence, "
        f"{tp4['tokens_per_s']:,.0f} tokens/s over both",
    ]
    for text in shown:
        assert text in docs, text
