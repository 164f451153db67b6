"""QLoRA (`train.towers.NAME.lora.quantize_base: nf4`, train/qlora.py): a Llama from a HF
folder, its blocks' frozen linears held as torchao NF4 tensors, LoRA adapters on top.

- after set-up the bases are NF4Tensor and step 0 computes exactly the model whose weights are
  the dequantised NF4 values (the adapters' B starts at zero);
- a run learns, its checkpoints leave the 4-bit base out (it comes from `init`), a run killed
  after a checkpoint resumes to the uninterrupted run's files bit for bit;
- the export holds plain weights (adapters merged into the dequantised base) whose logits are
  the trained QLoRA model's;
- FSDP2 on 2 gloo ranks shards the NF4 weights and trains as one process does (and so does
  DDP), and resumes exactly from its sharded checkpoint, and offloaded from a full one;
- bf16 runs (NF4 quantised from bf16, autocast forward).

float64 (train.precision fp64): NF4 dequantises to float64 then, so "equal up to rounding"
means float64 rounding. The Llama's matrices are multiples of 64 x 256 values (torchao's NF4
blocks) on each of 2 ranks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import safetensors.torch
import torch

from dist_helpers import run_distributed
from mmtrain.checkpoint import latest_checkpoint, load_checkpoint
from mmtrain.config import config_from_dict
from mmtrain.models import create_model, load_model
from mmtrain.models.formats.hf import read_hf_model
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train import parallel
from mmtrain.train.init_start import load_init
from mmtrain.train.lora import LORA_FILE
from mmtrain.train.model_setup import build_model
from mmtrain.train.precision import make_precision
from test_export_hf_folder import conversation_shards, token_ids, tokenizer
from test_hf_llava import hf_lm

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

BLOCK_LINEARS = ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")
FILES = ("model.safetensors", LORA_FILE)
# float64: two runs that differ only in the order of their sums (2 ranks x 1 row against 1 x
# 2) round at ~1e-16 relative per operation; 4 AdamW steps amplify that by at most ~1/eps.
EXACT = {"rtol": 1e-9, "atol": 1e-12}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A HF Llama folder (width 256, 2 blocks: every block matrix a multiple of 2 x 64 x 256
    values) with a byte-level BPE and a chat template, and its conversation shards."""
    root = tmp_path_factory.mktemp("qlora")
    tok = tokenizer("lm")
    hf = hf_lm("llama-sharded", seed=3, vocab_size=len(tok), hidden_size=256,
               intermediate_size=512, bos_token_id=None,
               eos_token_id=token_ids(tok)["<|im_end|>"])  # fmt: skip
    hf.save_pretrained(root / "hf", max_shard_size="300KB")
    tok.save_pretrained(root / "hf")
    spec, _ = read_hf_model(root / "hf")
    spec.save(root / "spec.json")
    conversation_shards(root / "shards", images=False)
    return root


def _config(llama: Path, out: Path, **train):
    return config_from_dict({
        "model": str(llama / "spec.json"),
        "init": str(llama / "hf"),
        "data": {"train": str(llama / "shards"), "tokenizer": str(llama / "hf"),
                 "chat_template": str(llama / "hf"), "sequence_length": 32},
        "train": {"steps": 4, "batch_size": 2, "lr": 1e-2, "warmup_steps": 0,
                  "precision": "fp64",
                  "towers": {"text": {"lora": {"rank": 4, "alpha": 8, "quantize_base": "nf4"}}},
                  **train},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "metrics": {"tensorboard": False},
        "out": str(out),
    })  # fmt: skip


def _built(config, checkpoint=None):
    spec = ModelSpec.load(config.model)
    env = parallel.DistributedEnv(torch.device("cpu"), 0, 1, 0, owns_group=False)
    ckpt = load_checkpoint(checkpoint) if checkpoint is not None else None
    return build_model(config, spec, make_precision(config.train.precision, env.device), env, ckpt)


def _ids() -> torch.Tensor:
    return torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(4))


def _files(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {name: safetensors.torch.load_file(run / name) for name in FILES}


def test_the_base_is_held_in_nf4_and_step_0_is_the_dequantised_model(llama, tmp_path):
    built = _built(_config(llama, tmp_path / "run"))
    blocks = built.model.towers["text"].blocks
    for block in blocks:
        for path in BLOCK_LINEARS:
            weight = block.get_submodule(path).weight
            assert isinstance(weight, nf4_tensor.NF4Tensor), path
            assert weight.dtype == torch.float64 and not weight.requires_grad

    # The reference: the plain model whose block matrices are the dequantised NF4 values.
    spec = ModelSpec.load(llama / "spec.json")
    reference = create_model(spec, dtype=torch.float64)
    load_init(reference, str(llama / "hf"))
    with torch.no_grad():
        for block in reference.towers["text"].blocks:
            for path in BLOCK_LINEARS:
                linear = block.get_submodule(path)
                linear.weight.copy_(nf4_tensor.to_nf4(linear.weight).get_original_weight())
    with torch.no_grad():
        got = built.model.eval().logits({"text": _ids()})
        want = reference.eval().logits({"text": _ids()})
    assert torch.equal(got, want)  # B = 0 adds exact zeros; the same matmuls otherwise


def test_a_qlora_linear_compiles_without_a_graph_break(llama, tmp_path):
    """`train.compile` wraps each block in torch.compile: its NF4 linears (adapted or not)
    trace into the block's graph (fullgraph refuses any break) and compute what they do
    eagerly."""
    block = _built(_config(llama, tmp_path / "run")).model.towers["text"].blocks[0]
    generator = torch.Generator().manual_seed(5)
    for path in BLOCK_LINEARS:
        linear = block.get_submodule(path)
        x = torch.randn(2, 3, linear.in_features, dtype=torch.float64, generator=generator)
        compiled = torch.compile(linear, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x), linear(x)), path


def test_a_qlora_run_learns_leaves_the_base_out_of_checkpoints_and_resumes_exactly(llama, tmp_path):
    from mmtrain.train.loop import train

    whole = train(_config(llama, tmp_path / "whole"))
    losses = [row["loss"] for row in whole.history]
    assert len(losses) == 4 and losses[-1] < losses[0]

    checkpoint = latest_checkpoint(tmp_path / "whole" / "checkpoints")
    saved = safetensors.torch.load_file(checkpoint / "model.safetensors")
    quantised = [f"towers.text.blocks.{i}.{p}.weight" for i in range(2) for p in BLOCK_LINEARS]
    assert not set(quantised) & set(saved)  # the 4-bit base comes from init, not checkpoints
    assert any(name.endswith("lora_b") for name in saved)

    halted = train(_config(llama, tmp_path / "resumed"), halt_after_step=3)
    assert [row["loss"] for row in halted.history] == losses[:3]
    resumed = train(_config(llama, tmp_path / "resumed"))
    assert resumed.resumed_from == 2
    assert [row["loss"] for row in resumed.history] == losses[2:]
    want, got = _files(tmp_path / "whole"), _files(tmp_path / "resumed")
    for file, tensors in want.items():
        assert set(got[file]) == set(tensors)
        for key, value in tensors.items():
            assert torch.equal(got[file][key], value), (file, key)

    # The export: plain float64 weights, adapters merged into the dequantised base. Its
    # logits are the trained QLoRA model's (rebuilt from the final checkpoint): W x + s B A x
    # against (W + s B A) x, which float64 rounds apart by ~1e-16 of the sums' magnitudes.
    exported = load_model(tmp_path / "whole").eval()
    assert {v.dtype for v in exported.state_dict().values()} == {torch.float64}
    trained = _built(_config(llama, tmp_path / "whole"), checkpoint).model.eval()
    with torch.no_grad():
        got_logits = exported.logits({"text": _ids()})
        want_logits = trained.logits({"text": _ids()})
        base = create_model(ModelSpec.load(llama / "spec.json"), dtype=torch.float64)
        load_init(base, str(llama / "hf"))
        untrained = base.eval().logits({"text": _ids()})
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-9, atol=1e-9)
    assert (got_logits - untrained).abs().max() > 1e-3  # the adapters changed the model


def test_bf16_quantises_from_the_compute_dtype_and_trains(llama, tmp_path):
    from mmtrain.train.loop import train

    config = _config(llama, tmp_path / "run", precision="bf16", steps=2)
    built = _built(config)
    qkv = built.model.towers["text"].blocks[0].attn.qkv
    assert isinstance(qkv.weight, nf4_tensor.NF4Tensor) and qkv.weight.dtype == torch.bfloat16
    assert qkv.lora_a.dtype == torch.float32  # the adapters train in fp32 master weights
    losses = [row["loss"] for row in train(config).history]
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))
    # The export: fp32 merged weights (bf16 base + fp32 update, rounded once).
    weights = safetensors.torch.load_file(tmp_path / "run" / "model.safetensors")
    assert weights["towers.text.blocks.0.attn.qkv.weight"].dtype == torch.float32


def _fsdp_runs(rank: int, world: int, configs: dict) -> dict:
    from mmtrain.train.loop import train

    # The set-up: each rank holds its half of the rows of every NF4 weight, as NF4.
    spec = ModelSpec.load(configs["fsdp"].model)
    env = parallel.DistributedEnv(torch.device("cpu"), rank, world, rank, owns_group=False)
    built = build_model(configs["fsdp"], spec, make_precision("fp64", env.device), env, None)
    qkv = built.model.towers["text"].blocks[0].attn.qkv.weight
    shard = qkv.to_local()
    layout = (type(shard).__name__, shard.shape[0], qkv.shape[0])
    del built

    losses = {name: [row["loss"] for row in train(configs[name]).history] for name in ("ddp", "fsdp")}  # fmt: skip
    for name in ("resumed", "offload"):  # killed after step 3, run again
        halted = train(configs[name], halt_after_step=3)
        losses[f"{name} halted"] = [row["loss"] for row in halted.history]
        resumed = train(configs[name])
        assert resumed.resumed_from == 2
        losses[name] = [row["loss"] for row in resumed.history]
    return {"losses": losses, "layout": layout}


@pytest.mark.slow
def test_ddp_and_fsdp_train_qlora_as_one_process_and_fsdp_resumes_exactly(llama, tmp_path):
    from mmtrain.train.loop import train

    one = [r["loss"] for r in train(_config(llama, tmp_path / "one")).history]
    configs = {
        name: _config(llama, tmp_path / name, parallel=parallel, micro_batch=1)
        for name, parallel in (("ddp", "ddp"), ("fsdp", "fsdp"), ("resumed", "fsdp"))
    }
    # Offloaded, with full checkpoints: the resume builds the whole model on the CPU (the base
    # read from init and quantised whole) and each rank copies its rows of the NF4 weights.
    configs["offload"] = dataclasses.replace(
        _config(llama, tmp_path / "offload", parallel="fsdp", micro_batch=1, offload=True),
        checkpoint=dataclasses.replace(configs["fsdp"].checkpoint, format="full"),
    )
    first, second = run_distributed(_fsdp_runs, world_size=2, args=(configs,), timeout_s=600)
    assert first["losses"] == second["losses"]  # every rank logs the global loss
    assert first["layout"] == second["layout"] == ("NF4Tensor", 256, 512)
    reference = _files(tmp_path / "one")
    for name in ("ddp", "fsdp"):  # DDP: every rank quantised the same base (not broadcast)
        losses = torch.tensor(first["losses"][name])
        torch.testing.assert_close(losses, torch.tensor(one), **EXACT)
        got = _files(tmp_path / name)
        for file, tensors in reference.items():
            assert set(got[file]) == set(tensors)
            for key, value in tensors.items():
                torch.testing.assert_close(got[file][key], value, **EXACT, msg=f"{name} {key}")
    fsdp = _files(tmp_path / "fsdp")
    # Killed after step 3 (checkpoint at 2, the NF4 base read again from init): bit for bit,
    # from the sharded checkpoint and, offloaded, from the full one.
    for name in ("resumed", "offload"):
        assert first["losses"][f"{name} halted"] == first["losses"]["fsdp"][:3], name
        assert first["losses"][name] == first["losses"]["fsdp"][2:], name
        resumed = _files(tmp_path / name)
        for file, tensors in fsdp.items():
            for key, value in tensors.items():
                assert torch.equal(resumed[file][key], value), (name, file, key)


def test_quantize_base_is_checked_by_name(llama, tmp_path):
    with pytest.raises(FieldError, match=r"train\.towers\.text\.lora\.quantize_base.*'nf8'"):
        _config(llama, tmp_path, towers={"text": {"lora": {"quantize_base": "nf8"}}})
    with pytest.raises(FieldError, match=r"train\.towers\.text\.lora\.quantize_base.*fp8"):
        _config(llama, tmp_path, precision="fp8")


def test_a_resume_refuses_a_changed_base(llama, tmp_path):
    """The checkpoint has no 4-bit base: a resume reads it from init again, which must be the
    files the run started from (their recorded sha256)."""
    import shutil

    from mmtrain.train.init import InitError
    from mmtrain.train.loop import train

    hf = tmp_path / "hf"
    shutil.copytree(llama / "hf", hf)
    config = dataclasses.replace(_config(llama, tmp_path / "run"), init=str(hf))
    train(config, halt_after_step=3)  # a checkpoint at step 2
    changed = hf_lm("llama-sharded", seed=9, vocab_size=len(tokenizer("lm")), hidden_size=256,
                    intermediate_size=512, bos_token_id=None)  # fmt: skip
    shutil.rmtree(hf)
    changed.save_pretrained(hf, max_shard_size="300KB")
    with pytest.raises(InitError, match="sha256"):
        train(dataclasses.replace(_config(llama, tmp_path / "run"), init=str(hf)))


def test_offload_on_one_rank_refuses_an_nf4_base_by_name(llama, tmp_path):
    """FSDP2 unshards a one-rank group by copying one all-gather input per parameter; an NF4
    weight has three (torch's fsdp_param_group.wait_for_unshard), so the set-up says so."""
    config = _config(llama, tmp_path / "run", parallel="fsdp", offload=True)
    with pytest.raises(FieldError, match=r"train\.offload.*one rank"):
        _built(config)


def test_a_resume_refuses_a_changed_quantize_base_by_name(llama, tmp_path):
    """A LoRA checkpoint holds its base, a QLoRA one does not: switching between them on a
    resume would miss or leave over tensors, so it is refused naming the field."""
    from mmtrain.train.loop import train

    plain = {"text": {"lora": {"rank": 4, "alpha": 8}}}
    train(_config(llama, tmp_path / "run", towers=plain), halt_after_step=3)
    with pytest.raises(FieldError, match=r"train\.towers\.text\.lora\.quantize_base: unset -> nf4"):
        train(_config(llama, tmp_path / "run"))
