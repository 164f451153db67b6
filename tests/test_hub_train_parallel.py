"""A hub model (tiny Qwen3-VL, transformers' own class) under FSDP2 on 2 real CPU ranks equals
one process, and a run stopped after a checkpoint resumes bitwise (issue 42, item 6).

float64 (`precision: fp64`): FSDP's reduce-scatter and one process's backward sum in different
orders; float64's rounding (~1e-16 per operation, ~1e-12 after a few steps of a tiny model)
keeps 1e-9 true on any CPU, float32's does not. A resume repeats the very same operations in
the same order: bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dist_helpers import run_distributed

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from hub_folders import FAMILIES, conversation, image, make_folder  # noqa: E402
from test_hub_train import conversation_shards  # noqa: E402

pytestmark = pytest.mark.slow
EXACT = {"rtol": 1e-9, "atol": 1e-12}


def _config(root: Path, folder: Path, shards: Path, name: str, **train) -> dict:
    return {
        "init": str(folder),
        "data": {"train": str(shards), "sequence_length": 128},
        "train": {
            "steps": 3,
            "batch_size": 4,
            "lr": 1e-2,
            "warmup_steps": 0,
            "precision": "fp64",
            **train,
        },  # fmt: skip
        "checkpoint": {"every_steps": 1, "format": "full"},
        "out": str(root / name),
    }


def _train(rank: int, world_size: int, config: dict) -> list[float]:
    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    return [row["loss"] for row in train(config_from_dict(config)).history]


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_on_two_ranks_equals_one_process_and_resume_is_bitwise(tmp_path, family):
    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    folder = make_folder(family, tmp_path)
    shards = conversation_shards(tmp_path / "shards", n=16)
    # eps 1: AdamW's update is then Lipschitz in the gradient (at most lr / eps per unit of
    # gradient), so the two runs' differently ordered float64 sums stay rounding-sized in the
    # weights. At eps 1e-8 a gradient that is zero but for rounding (a key bias, under
    # softmax's shift invariance: SigLIP's in Gemma 3) gets an update of about +-lr whose sign
    # is the rounding's.
    one = _config(tmp_path, folder, shards, "one", eps=1.0)
    single = [row["loss"] for row in train(config_from_dict(one)).history]
    fsdp = _config(tmp_path, folder, shards, "fsdp", parallel="fsdp", micro_batch=2, eps=1.0)
    first, second = run_distributed(_train, world_size=2, args=(fsdp,), timeout_s=300)
    assert first == second  # every rank logs the global loss
    torch.testing.assert_close(torch.tensor(first), torch.tensor(single), **EXACT)
    want = load_file(tmp_path / "one" / "model.safetensors")
    source = load_file(folder / "model.safetensors")
    moved = max((want[k] - v.double()).abs().max().item() for k, v in source.items() if k in want)
    assert moved > 1e-6  # the steps changed the weights far beyond the tolerance below
    got = load_file(tmp_path / "fsdp" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, value in want.items():
        # Some classes compute parts in float32 whatever the model's dtype (Gemma 3's RMSNorm:
        # `x.float()`): the two runs then agree to float32's rounding (2^-24 a step, a few
        # dozen of them) of each weight's update over the run, not to float64's.
        update = (value - source[name].double()).abs().max().item() if name in source else 0.0
        torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-12 + 1e-6 * update,
                                   msg=name)  # fmt: skip

    resumed = _config(tmp_path, folder, shards, "resumed", eps=1.0)
    train(config_from_dict(resumed), halt_after_step=2)  # dies in step 2, after step 1's checkpoint
    result = train(config_from_dict(resumed))
    assert result.resumed_from == 1
    again = load_file(tmp_path / "resumed" / "model.safetensors")
    for name, value in want.items():
        assert torch.equal(again[name], value), name


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_run_writes_a_peft_adapter_that_peft_loads(tmp_path, family):
    peft = pytest.importorskip("peft")
    import transformers

    folder = make_folder(family, tmp_path)
    shards = conversation_shards(tmp_path / "shards", n=8)
    config = _config(tmp_path, folder, shards, "lora", steps=2, batch_size=2)
    config["train"]["precision"] = "fp32"
    config["train"]["towers"] = {
        "text": {"lora": {"rank": 4, "alpha": 8, "targets": ["attn", "mlp"]}},
        "vision": {"lora": {"rank": 2, "targets": ["attn"]}},
    }
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(config))
    from mmtrain.cli import main

    assert main(["train", str(tmp_path / "lora.yaml")]) == 0
    run = tmp_path / "lora"
    base = transformers.AutoModelForImageTextToText.from_pretrained(folder)
    adapted = peft.PeftModel.from_pretrained(base, run / "adapter").eval()
    merged = transformers.AutoModelForImageTextToText.from_pretrained(run).eval()
    inputs = _inputs(folder, family)
    with torch.no_grad():
        want = merged(**inputs).logits
        got = adapted(**inputs).logits
        plain = (
            transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()(**inputs).logits
        )
    # The adapters moved the logits, and PEFT applies them as the merged export holds them:
    # float32 rounding of W x + s B A x against (W + s B A) x, a few ulps of the logits.
    assert (want - plain).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _inputs(folder: Path, family: str) -> dict:
    from hub_folders import processed

    return dict(processed(folder, [[image(3)]], [conversation(family)]))


def test_a_hub_qlora_run_keeps_the_nf4_base_out_of_checkpoints_and_resumes_exactly(tmp_path):
    """QLoRA on a hub model's language model: its block linears held in NF4 (torchao), left
    out of checkpoints and read again from `init` on a resume, which ends bitwise where the
    uninterrupted run ends (float64: NF4 dequantises to it)."""
    pytest.importorskip("torchao")
    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    folder = _widened(make_folder("qwen3_vl", tmp_path))
    shards = conversation_shards(tmp_path / "shards", n=8)
    lora = {"text": {"lora": {"rank": 4, "targets": ["attn", "mlp"], "quantize_base": "nf4"}}}

    def config(name: str) -> dict:
        made = _config(tmp_path, folder, shards, name, steps=3, batch_size=2, towers=lora)
        return made

    whole = train(config_from_dict(config("whole")))
    checkpoint = sorted((tmp_path / "whole" / "checkpoints").glob("step_*"))[-1]
    saved = load_file(checkpoint / "model.safetensors")
    # The 4-bit base comes from init, not from checkpoints; k_proj and v_proj (64 x 128) are
    # too small for NF4 and stay in the checkpoint.
    base = [n for n in saved if ".language_model.layers." in n and n.endswith("proj.weight")]
    assert base and all(n.endswith(("k_proj.weight", "v_proj.weight")) for n in base)
    assert any(n.endswith("lora_b") for n in saved)
    train(config_from_dict(config("resumed")), halt_after_step=2)
    resumed = train(config_from_dict(config("resumed")))
    assert resumed.resumed_from == 1
    assert [r["loss"] for r in resumed.history][-1] == [r["loss"] for r in whole.history][-1]
    want = load_file(tmp_path / "whole" / "model.safetensors")
    got = load_file(tmp_path / "resumed" / "model.safetensors")
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    adapter = load_file(tmp_path / "whole" / "adapter" / "adapter_model.safetensors")
    assert any("language_model.layers.0.mlp.gate_proj.lora_B" in n for n in adapter)


def _widened(folder: Path) -> Path:
    """The tiny Qwen3-VL with a language model wide enough for NF4 (torchao quantises weights
    of a multiple of 64 x 256 values: 128 x 128 and 256 x 128 here), weights drawn again."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.head_dim = 128, 256, 32
    text.rope_parameters["mrope_section"] = [4, 6, 6]  # sums to head_dim / 2
    config.vision_config.out_hidden_size = 128
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config)
    model.save_pretrained(folder)
    return folder


def test_activation_checkpointing_and_compile_per_block_train_the_same_steps(tmp_path):
    """Per-block activation checkpointing (both towers) recomputes exactly the eager ops: the
    losses are bitwise the plain run's. Compiled blocks (inductor on the CPU) fuse and reorder
    fp32 sums: each of the ~10 matmuls and norms a position passes rounds to 2^-24 relative,
    and their errors add up over 3 steps well under 1e-4 of the loss."""
    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    folder = make_folder("qwen3_vl", tmp_path)
    shards = conversation_shards(tmp_path / "shards", n=8)
    ac = {"text": {"activation_checkpointing": True}, "vision": {"activation_checkpointing": True}}

    def losses(name: str, **train_settings) -> list[float]:
        config = _config(tmp_path, folder, shards, name, batch_size=2, **train_settings)
        config["train"]["precision"] = "fp32"
        return [row["loss"] for row in train(config_from_dict(config)).history]

    plain = losses("plain")
    assert losses("checkpointed", towers=ac) == plain
    compiled = losses("compiled", towers=ac, compile=True)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(plain), rtol=1e-4, atol=0)


def test_cpu_offload_trains_what_the_plain_run_trains(tmp_path):
    """`train.offload` (FSDP2 with its shards, gradients and optimizer state in host memory,
    on one rank) trains a hub model as the plain run does: float64, losses to 1e-9."""
    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    folder = make_folder("gemma3", tmp_path)
    shards = conversation_shards(tmp_path / "shards", n=8)

    def losses(name: str, **settings) -> list[float]:
        config = _config(tmp_path, folder, shards, name, batch_size=2, eps=1.0, **settings)
        return [row["loss"] for row in train(config_from_dict(config)).history]

    plain = losses("plain")
    offloaded = losses("offloaded", parallel="fsdp", offload=True)
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(plain), rtol=1e-9, atol=0)
    want = load_file(tmp_path / "plain" / "model.safetensors")
    got = load_file(tmp_path / "offloaded" / "model.safetensors")
    assert got.keys() == want.keys()
