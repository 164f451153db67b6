"""Frozen weights in the compute dtype (train/model_setup.py): under bf16 (fp16) autocast the
trainer holds a frozen linear or convolution layer's weight and bias in bf16 (fp16), the
values autocast would cast them to at every call. LLaVA's stage 1 trains the projector through
the frozen LM: held in fp32, the LM cost 4 bytes a parameter plus the 16-bit copy of every
weight autograd keeps for the input's gradient. Checked on the CPU: the dtypes after the
trainer's build, the planner's frozen bytes against the built model's (a 7B on the meta
device), the same step bit for bit without those copies, and a bf16 run that resumes and
exports."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from micro import micro_run
from mmtrain.config import TowerTrainConfig, TrainConfig
from mmtrain.models import create_model
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.memory import model_states
from mmtrain.plan.states import state_bytes
from mmtrain.plan.workloads import load_model
from mmtrain.spec import load_spec
from mmtrain.train import parallel
from mmtrain.train.loop import train
from mmtrain.train.measure_step import language_batch, next_token_loss
from mmtrain.train.model_setup import CAST_BY_AUTOCAST, build_model, hold_frozen_in_compute_dtype
from mmtrain.train.optim import freeze_parameters
from mmtrain.train.precision import make_precision
from test_train_vlm import _config, shards  # noqa: F401  (the tiny VLM's shards: a fixture)

STAGE_1 = {"image": {"freeze": True}, "text": {"freeze": True}}  # the projector trains
CPU = torch.device("cpu")


def _built(tmp_path, precision: str, towers: dict = STAGE_1) -> nn.Module:
    """tiny-vlm as the trainer builds it (one CPU process)."""
    spec = load_spec("tiny-vlm")
    config = micro_run(tmp_path / precision, "unused", spec=spec.to_dict(),
                       train={"precision": precision, "towers": towers})  # fmt: skip
    env = parallel.DistributedEnv(CPU, 0, 1, 0, owns_group=False)
    return build_model(config, spec, make_precision(precision, CPU), env, None).model


def _frozen_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def _planned_frozen_bytes(name: str, precision: str, modes: dict[str, str]) -> float:
    plan = load_model(name).with_modes(modes)
    weights = model_states(plan, PlanConfig(precision=precision))[0]
    return weights - plan.trainable_params() * state_bytes(precision, "adamw").weights


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_frozen_matmul_weights_are_held_in_the_compute_dtype(tmp_path, precision):
    model = _built(tmp_path, precision)
    low = make_precision(precision, CPU).dtype or torch.float32
    matmul = {id(p) for m in model.modules() if isinstance(m, CAST_BY_AUTOCAST)
              for p in m.parameters(recurse=False)}  # fmt: skip
    for name, param in model.named_parameters():
        frozen_matmul = id(param) in matmul and not param.requires_grad
        expected = low if frozen_matmul else torch.float32  # tables, norms, the projector
        assert param.dtype == expected, name
    assert not any(p.requires_grad for p in model.towers.parameters())
    assert model.towers["text"].embed.weight.dtype == torch.float32  # feeds the residual stream
    planned = _planned_frozen_bytes("tiny-vlm", precision, {"image": "frozen", "text": "frozen"})
    assert _frozen_bytes(model) == planned


def test_the_planned_frozen_bytes_are_a_7b_vlms_as_built():
    """llava-1.5-7b with both towers frozen, built on the meta device through the same set-up:
    the planner's frozen weights are the bytes the trainer holds (14.3 GB: 2 bytes a matmul
    parameter, 4 for the embedding table and norms), not 4 bytes a parameter (28 GB)."""
    model = create_model(load_spec("llava-1.5-7b"), device="meta")
    towers = {name: TowerTrainConfig(freeze=True) for name in ("image", "text")}
    freeze_parameters(model, TrainConfig(steps=1, batch_size=1, lr=1.0, towers=towers))
    hold_frozen_in_compute_dtype(model, make_precision("bf16", CPU))
    planned = _planned_frozen_bytes("llava-1.5-7b", "bf16", {"image": "frozen", "text": "frozen"})
    assert _frozen_bytes(model) == planned
    assert _frozen_bytes(model) < 0.51 * 4 * sum(p.numel() for p in model.parameters())


def _step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One bf16-autocast forward and backward of a tiny-vlm batch: the loss, the gradients and
    the bytes autograd keeps for backward (by storage, parameters excluded, as --measure)."""
    spec = load_spec("tiny-vlm")
    batch = language_batch(spec, 2, 160, 1, torch.Generator().manual_seed(0))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, StorageWeakRef]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and (ptr not in saved or saved[ptr][1].expired()):
            saved[ptr] = (storage.nbytes(), StorageWeakRef(storage))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with make_precision("bf16", CPU).autocast():
            loss = next_token_loss(model(batch), batch["labels"])
    kept = sum(n for n, ref in saved.values() if not ref.expired())
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None], kept


def test_bf16_frozen_weights_compute_the_same_step_without_the_weight_copies(tmp_path):
    """The stage-1 step under bf16 autocast, the frozen weights held in fp32 (as a fp32 run
    builds them) and in bf16 (as a bf16 run does): the same loss and projector gradients bit
    for bit (autocast's cast and the stored bf16 round alike), and autograd keeps 2 bytes less
    for every weight of the frozen LM's blocks: the bf16 copies the input's gradient read."""
    fp32_loss, fp32_grads, fp32_kept = _step(_built(tmp_path, "fp32"))
    model = _built(tmp_path, "bf16")
    loss, grads, kept = _step(model)
    assert torch.equal(loss, fp32_loss)
    assert len(grads) == len(fp32_grads) == 4  # the projector's two linears
    assert all(torch.equal(a, b) for a, b in zip(grads, fp32_grads, strict=True))
    blocks = model.towers["text"].blocks
    lm_weights = sum(m.weight.numel() for m in blocks.modules() if isinstance(m, nn.Linear))
    assert fp32_kept - kept == 2 * lm_weights


def test_a_bf16_stage_1_run_resumes_exactly_and_exports_its_frozen_weights(tmp_path, shards):  # noqa: F811
    """A run halted after a checkpoint resumes to the uninterrupted run's weights; the export
    holds the frozen linears in bf16 (untouched: the initial weights, rounded once) beside the
    trained fp32 projector, and loads back into a model."""
    import mmtrain

    towers = {**STAGE_1, "text": {"freeze": True, "activation_checkpointing": True}}
    options = {"precision": "bf16", "towers": towers}
    train(_config(tmp_path / "whole", shards, train=options))
    stopped = _config(tmp_path / "stopped", shards, train=options)
    train(stopped, halt_after_step=3)  # dead after step 3: the step-2 checkpoint is the last
    assert train(stopped).resumed_from == 2
    whole = safetensors.torch.load_file(str(tmp_path / "whole" / "model.safetensors"))
    resumed = safetensors.torch.load_file(str(tmp_path / "stopped" / "model.safetensors"))
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    start = create_model(load_spec(stopped.model), seed=stopped.seed).state_dict()
    qkv = "towers.text.blocks.0.attn.qkv.weight"
    assert whole[qkv].dtype == torch.bfloat16
    assert torch.equal(whole[qkv], start[qkv].to(torch.bfloat16))
    assert whole["towers.text.embed.weight"].dtype == torch.float32
    assert whole["projector.fc1.weight"].dtype == torch.float32
    assert not torch.equal(whole["projector.fc1.weight"], start["projector.fc1.weight"])
    loaded = mmtrain.load_model(tmp_path / "whole")
    assert torch.equal(loaded.state_dict()[qkv], whole[qkv].float())
