"""fp8 training (train/precision.py, torchao float8): which linears convert, LoRA's frozen base
included, and that checkpoints load across fp8 and bf16 runs. torchao's fp8 matmuls run on this
CPU too (emulated), so a step runs here; speed and the loss curve on a GPU are bench/gpu.sh's."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import LoraConfig
from mmtrain.models import create_model
from mmtrain.spec import load_spec
from mmtrain.train.lora import LoraLinear, apply_lora
from mmtrain.train.precision import convert_to_fp8, fp8_targets

torchao = pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def _vlm():
    """tiny-vlm with an untied head: every kind of linear a VLM has."""
    spec = load_spec("tiny-vlm").to_dict()
    spec["decoder"]["tie_embeddings"] = False
    from mmtrain.spec import ModelSpec

    return create_model(ModelSpec.from_dict(spec), seed=0)


def test_block_linears_convert_and_the_rest_stays():
    model = _vlm()
    blocks = {
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".blocks." in name
    }
    converted = convert_to_fp8(model)
    assert set(converted) == blocks and blocks
    for name, module in model.named_modules():
        if name in blocks:
            assert isinstance(module, Float8Linear), name
        elif isinstance(module, torch.nn.Linear):  # lm_head, projector, tower heads
            assert not isinstance(module, Float8Linear), name
    assert not isinstance(model.decoder.lm_head, Float8Linear)
    assert not isinstance(model.projector.fc1, Float8Linear)


def test_dims_not_multiples_of_16_and_named_layers_stay():
    model = _vlm()
    odd = {n for n, m in fp8_targets(model).items() if m.out_features % 16}
    assert not odd  # tiny-vlm's block linears are all multiples of 16 ...
    kept = fp8_targets(model, keep_bf16=["towers.image"])
    assert kept and not any(name.startswith("towers.image") for name in kept)
    linear = torch.nn.Linear(24, 40)  # ... and a 24 x 40 one would not be
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([torch.nn.Module()])
    holder.blocks[0].fc = linear
    assert fp8_targets(holder) == {}


def test_lora_base_runs_in_fp8_and_adapters_train():
    model = _vlm()
    apply_lora(model, {"text": LoraConfig(rank=4)}, seed=0)
    names = set(model.state_dict())
    converted = convert_to_fp8(model, recipe="rowwise")
    loras = {n for n, m in converted.items() if isinstance(m, LoraLinear)}
    assert loras and all(".blocks." in n for n in loras)
    assert set(model.state_dict()) == names  # names unchanged: checkpoints fit both ways
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (2, 12), generator=g)
    ids[0, 1] = model.spec.projector.image_token_id  # one image: the vision blocks run in fp8
    batch = {"text": ids, "image": torch.randn(1, 3, 64, 64, generator=g)}
    with torch.autocast("cpu", torch.bfloat16):
        loss = model.logits(batch).float().logsumexp(-1).mean()
    loss.backward()
    lora = next(m for n, m in converted.items() if n in loras)
    assert lora.lora_b.grad is not None and lora.weight.grad is None  # frozen base, fp8 matmul


def test_checkpoints_load_across_fp8_and_bf16():
    fp8 = _vlm()
    convert_to_fp8(fp8)
    state = fp8.state_dict()
    plain = _vlm().to(torch.bfloat16)
    plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()})
    back = _vlm()
    convert_to_fp8(back)
    back.load_state_dict(plain.state_dict())
    for name, value in back.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name].to(value.dtype)), name


# ----------------------------------------------------------------------------- fp8 compiles
def _fp8_config(**train):
    from mmtrain.config import config_from_dict

    config = config_from_dict({
        "model": "tiny-vlm", "data": {"train": "shards/"},
        "train": {"steps": 1, "batch_size": 1, "precision": "fp8", **train},
    })  # fmt: skip
    config.validate()
    return config


def test_fp8_turns_compile_on_and_says_why(caplog):
    from mmtrain.train.model_setup import _apply_wrappers

    with caplog.at_level("INFO", logger="mmtrain.config"):
        config = _fp8_config()
    assert config.train.compile is True  # recorded so in the run's config.yaml
    assert any("fp8" in r.message and "train.compile" in r.message for r in caplog.records)
    # The model the loop builds from it: fp8 linears inside compiled blocks.
    model = _vlm()
    _apply_wrappers(model, config)
    blocks = [block for tower in model.towers.values() for block in tower.blocks]
    assert blocks and all(block._compiled_call_impl is not None for block in blocks)
    assert any(isinstance(m, Float8Linear) for m in blocks[0].modules())


def test_fp8_with_compile_off_is_refused_naming_the_field():
    from mmtrain.structured import FieldError

    with pytest.raises(FieldError, match=r"train\.compile: fp8 without torch\.compile"):
        _fp8_config(compile=False)
    assert _fp8_config(compile=True).train.compile is True
    assert _fp8_config(precision="bf16").train.compile is False  # off unless asked for
