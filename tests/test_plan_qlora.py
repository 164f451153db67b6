"""QLoRA in the plan (`--qlora TOWER`, train.towers.TOWER.lora.quantize_base: nf4): the frozen
block linears held as torchao's NF4 tensor, counted as torchao lays it out, the adapters trained."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.cli import main
from mmtrain.hardware import default_catalog
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.quantized import nf4_bytes, quantizable
from mmtrain.plan.workloads import load_model

# Qwen2.5-VL-72B's text block linears (out x in): q/k/v fused, out, gate and value fused, down
LINEARS = ((8192 + 2 * 1024) * 8192, 8192 * 8192, 2 * 29568 * 8192, 8192 * 29568)
TEXT = 72_706_203_648  # the LM's parameters, embedding and head included
VISION = 704_573_696


@pytest.mark.parametrize(
    "shape, dtype",
    [((1024, 256), torch.bfloat16), ((512, 512), torch.float32), ((3840, 1280), torch.bfloat16)],
)
def test_nf4_bytes_are_torchaos_layout(shape, dtype):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    tensor = to_nf4(torch.randn(shape, dtype=dtype))  # block 64, scaler block 256: the defaults
    parts = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    held = sum(getattr(tensor, p).numel() * getattr(tensor, p).element_size() for p in parts)
    assert quantizable(*shape)
    assert nf4_bytes(shape[0] * shape[1], torch.finfo(dtype).bits // 8) == held


def test_torchao_refuses_what_the_planner_keeps_in_the_compute_dtype():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    assert not quantizable(1280, 3420)  # Qwen2.5-VL-7B's vision MLP: 68,400 scalers
    with pytest.raises(AssertionError, match="divisible by scaler block size"):
        to_nf4(torch.zeros(1280, 3420, dtype=torch.bfloat16))
    # Qwen2.5-VL-72B's vision q/k/v whole, and a rank's 480 of its 3,840 rows over 8 (FSDP2)
    assert quantizable(3840, 1280) and not quantizable(3840, 1280, shards=8)
    with pytest.raises(AssertionError, match="divisible by scaler block size"):
        to_nf4(torch.zeros(480, 1280, dtype=torch.bfloat16))


def test_what_fsdp_cannot_split_stays_in_the_compute_dtype(capsys):
    argv = ["plan", "--model", "Qwen2.5-VL-72B", "--context", "8192", "--qlora", "vision"]
    assert main([*argv, "--gpus", "8", "--zero", "3", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["model"]["notes"]
    kept = "on each of 8 rank(s); 3840x1280, 1280x1280, 6912x1280, 1280x3456 kept in the compute"
    assert any(kept in n for n in notes)  # a rank's rows of each hold no whole scaler blocks
    assert main([*argv, "--json"]) == 0  # one process holds every vision linear in NF4
    notes = json.loads(capsys.readouterr().out)["model"]["notes"]
    assert not any("kept in the compute dtype" in n for n in notes)


def test_qlora_weights_by_hand():
    model = load_model("Qwen2.5-VL-72B", context=8192)
    qlora = model.with_modes({"text": "lora"}).with_quantized_base(["text"])
    plan = make_plan(qlora, PlanConfig(ac="full"), default_catalog())
    adapters = qlora.stack("text").lora_params()
    nf4 = 80 * sum(n / 2 + n / 64 + n / (64 * 256) * 2 + 17 * 2 for n in LINEARS)
    # the rest of the frozen LM in bf16 (the head, biases), its embedding and norms in fp32
    fp32 = 152_064 * 8192 + (2 * 80 + 1) * 8192
    dense = (TEXT - 80 * sum(LINEARS) - fp32) * 2 + fp32 * 4
    trained = VISION + adapters  # the vision tower trains whole, the LM's adapters
    m = plan.memory
    assert m.weights_bytes == pytest.approx(trained * 2 + dense + nf4)
    assert m.gradients_bytes == pytest.approx(trained * 2)
    assert m.optimizer_bytes == pytest.approx(trained * 12)
    assert m.dequantized_bytes == 2 * 29568 * 8192 * 2  # fc1 in bf16, one matmul at a time
    lora = make_plan(model.with_modes({"text": "lora"}), PlanConfig(ac="full"), default_catalog())
    saved = lora.memory.weights_bytes - m.weights_bytes
    assert saved == pytest.approx(80 * sum(LINEARS) * 2 - nf4)  # 4.13 instead of 16 bits


def test_qlora_flags(capsys):
    argv = ["plan", "--model", "Qwen2.5-VL-72B", "--gpus", "8", "--context", "8192"]
    qlora = ["--qlora", "text", "--freeze", "vision", "--zero", "3", "--ac", "full"]
    assert main([*argv, *qlora, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["towers"]["text"]["mode"] == "lora"
    assert out["memory"]["dequantized_bytes"] > 0 and out["memory"]["fits"]
    assert main([*argv, "--qlora", "text", "--precision", "fp8"]) == 2
    assert "--qlora: a 4-bit base cannot also run fp8 matmuls" in capsys.readouterr().err
    small = ["plan", "--model", "Qwen2.5-VL-7B", "--context", "2048", "--json"]
    assert main([*small, "--qlora", "vision"]) == 0
    notes = json.loads(capsys.readouterr().out)["model"]["notes"]
    assert any("6840x1280, 1280x3420 kept in the compute dtype" in n for n in notes)


def test_the_docs_show_what_the_qlora_plan_prints(capsys):
    """docs/PLANNER.md, "Big models on fewer GPUs": its QLoRA command and figures."""
    from pathlib import Path

    from mmtrain.hardware import GIB

    docs = " ".join((Path(__file__).parents[1] / "docs" / "PLANNER.md").read_text().split())
    argv = ["plan", "--model", "Qwen2.5-VL-72B", "--gpus", "8", "--context", "8192", "--ac",
            "full", "--zero", "3", "--freeze", "vision", "--qlora", "text"]  # fmt: skip
    assert f"mmtrain {' '.join(argv)}" in docs
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    m, step = out["memory"], out["time"]["step_time_s"]
    nf4 = 80 * sum(nf4_bytes(n, 2) for n in LINEARS)
    shown = (
        f"a GPU holds {m['total_bytes'] / GIB:.1f} GiB ({m['weights_bytes'] / GIB:.1f} GiB of "
        f"weights: the {80 * sum(LINEARS) / 1e9:.1f}B block weights in NF4 are {nf4 / 1e9:.1f} GB "
        f"over the 8), no host memory, and steps in {step:.1f} s"
    )
    assert out["host"] is None and shown in docs, shown
