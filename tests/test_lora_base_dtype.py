"""LoRA under bf16: the frozen base of each adapted linear is held in the compute dtype (2 bytes
a parameter, what autocast would cast it to at every call), the adapters train in fp32, and the
export merges them in float64 into an fp32 weight: an update smaller than bf16's resolution of
the base survives the merge (rounded to the base's dtype, it would be lost)."""

from __future__ import annotations

import safetensors.torch
import torch

from micro import make_shards, micro_run
from mmtrain.checkpoint import latest_checkpoint, load_checkpoint
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.lora import LoraLinear, lora_modules, merged
from mmtrain.train.model_setup import build_model
from mmtrain.train.precision import make_precision

LORA = {"image": {"lora": {"rank": 4, "alpha": 8}}, "text": {"lora": {"rank": 2}}}


def _built(config, ckpt=None):
    env = parallel.DistributedEnv(torch.device("cpu"), 0, 1, 0, owns_group=False)
    spec = ModelSpec.load(config.model)
    return build_model(config, spec, make_precision(config.train.precision, env.device), env, ckpt)


def test_lora_bases_are_held_in_the_compute_dtype(tmp_path):
    config = micro_run(tmp_path, "unused", train={"precision": "bf16", "towers": LORA})
    adapted = lora_modules(_built(config).model)
    assert adapted and all(isinstance(m, LoraLinear) for m in adapted.values())
    for name, module in adapted.items():
        assert module.weight.dtype == torch.bfloat16, name
        assert module.lora_a.dtype == module.lora_b.dtype == torch.float32, name
        if module.bias is not None:
            assert module.bias.dtype == torch.bfloat16, name
    fp32 = micro_run(tmp_path, "unused", train={"towers": LORA})  # no lower compute dtype
    assert {m.weight.dtype for m in lora_modules(_built(fp32).model).values()} == {torch.float32}


def test_the_merge_keeps_an_update_finer_than_the_base_dtype():
    base = torch.tensor([[1.0, -2.0], [0.5, 4.0]], dtype=torch.bfloat16)
    a = torch.tensor([[1.0, 1.0]])
    b = torch.tensor([[1e-3], [-1e-3]])  # below bf16's spacing at these values (>= 2^-8)
    weight = merged(base, a, b, scale=1.0)
    assert weight.dtype == torch.float32
    expected = (base.double() + b.double() @ a.double()).float()
    assert torch.equal(weight, expected)
    assert not torch.equal(weight, base.float())


def test_a_bf16_lora_run_exports_fp32_merged_weights(tmp_path):
    from mmtrain.train.loop import train

    shards = make_shards(tmp_path / "shards", 16)
    config = micro_run(tmp_path, shards, train={"precision": "bf16", "towers": LORA, "steps": 2})
    train(config)
    exported = safetensors.torch.load_file(tmp_path / "run" / "model.safetensors")
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    trained = _built(config, ckpt).model  # the final step's base (bf16) and adapters (fp32)
    for name, module in lora_modules(trained).items():
        weight = exported[f"{name}.weight"]
        assert module.weight.dtype == torch.bfloat16 and weight.dtype == torch.float32, name
        want = merged(module.weight, module.lora_a, module.lora_b, module.scale)
        assert torch.equal(weight, want), name
