"""Parallelism applied from outside the model: activation checkpointing per block and per tower
(gradients unchanged, activations saved fewer), FSDP2 on 2 real gloo processes following DDP's
losses and gathering checkpoints in the single-process format, and torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch

import mmtrain
from dist_helpers import run_distributed
from micro import micro_spec
from mmtrain.losses import ContrastiveLoss
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train import parallel
from mmtrain.train.loop import forward_backward, optimizer_step
from mmtrain.train.measure_step import random_batch
from mmtrain.train.objectives import ContrastiveObjective
from mmtrain.train.precision import make_precision

MICRO = micro_spec("micro", embed_dim=16, context_length=8, text_pooling=None)
# Runs that differ only in the order of float sums (FSDP's reduce-scatter vs DDP's all-reduce,
# compiled vs eager kernels) compare in float64, where rounding is ~1e-16 per operation: a few
# steps of a micro model stay below ~1e-12, so EXACT holds on any CPU yet fails for any real
# difference. float32 rounding depends on the CPU's vector width and summation order.
FP64 = make_precision("fp64", torch.device("cpu"))
EXACT = {"rtol": 1e-9, "atol": 1e-12}


def _float64(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def _model(seed: int = 0):
    return mmtrain.create_model(ModelSpec.from_dict(MICRO), seed=seed)


def _batch(n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    return random_batch(ModelSpec.from_dict(MICRO), n, torch.Generator().manual_seed(seed))


def _saved_bytes(model, batch) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for backward (non-parameter storages) and the gradients."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(batch)
        loss, _ = ContrastiveLoss("clip", distributed=False)(
            out, model.spec.pairs, model.logit_scale
        )
    loss.backward()
    return sum(saved.values()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("mode", "towers"), [("full", None), ("selective", ["text"])])
def test_activation_checkpointing_keeps_gradients_and_saves_less(mode, towers):
    batch = _batch()
    plain_bytes, plain_grads = _saved_bytes(_model(), batch)
    model = parallel.apply_activation_checkpointing(_model(), mode, towers)
    kept_bytes, grads = _saved_bytes(model, batch)
    assert kept_bytes < plain_bytes
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    # Parameter names are untouched: checkpoints load into a plain model.
    assert list(model.state_dict()) == list(_model().state_dict())


def test_activation_checkpointing_modes_order_their_savings():
    batch = _batch(8)
    saved = {
        mode: _saved_bytes(parallel.apply_activation_checkpointing(_model(), mode), batch)[0]
        for mode in parallel.AC_MODES
    }
    assert saved["full"] < saved["selective"] < saved["none"]


def test_activation_checkpointing_rejects_bad_input():
    with pytest.raises(ValueError, match="'some' is not one of none, selective, full"):
        parallel.apply_activation_checkpointing(_model(), "some")
    with pytest.raises(FieldError, match=r"train\.towers\.audio: the model has no tower"):
        parallel.apply_activation_checkpointing(_model(), "full", ["audio"])
    model = parallel.apply_activation_checkpointing(_model(), "full", ["image"])
    parallel.apply_activation_checkpointing(model, "full", ["text"])  # another tower: fine
    with pytest.raises(ValueError, match="already applied to tower 'image'"):
        parallel.apply_activation_checkpointing(model, "selective", ["image"])


def test_fsdp_mixed_precision_policy_follows_train_precision():
    bf16 = parallel.fsdp_mixed_precision("bf16")
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.float32
    assert parallel.fsdp_mixed_precision("fp8").param_dtype == torch.bfloat16
    fp32 = parallel.fsdp_mixed_precision("fp32")
    assert fp32.param_dtype is None and fp32.reduce_dtype is None
    with pytest.raises(FieldError, match=r"train\.precision: 'int4'"):
        parallel.fsdp_mixed_precision("int4")


# ----------------------------------------------------------------------------- FSDP vs DDP
STEPS = 3


def _step(trained, model, optimizer, step: int, rank: int, world: int) -> tuple[float, float]:
    """One optimizer step of the global batch of 8 samples for `step`: this rank's share, in two
    micro-batches (contrastive-correct accumulation, whose first micro-batch skips the gradient
    reduction). Returns the global loss and the gradient norm."""
    spec = model.spec
    full = _float64(random_batch(spec, 8, torch.Generator().manual_seed(100 + step)))
    mine = {k: v.chunk(world)[rank] for k, v in full.items()}
    micro = [{k: v.chunk(2)[j] for k, v in mine.items()} for j in range(2)]
    optimizer.zero_grad(set_to_none=True)
    loss, _ = forward_backward(
        trained, [ContrastiveObjective(model, ContrastiveLoss.from_spec(spec))], micro, FP64
    )
    norm, stepped, _ = optimizer_step(model, optimizer, FP64, grad_clip=1.0)
    assert stepped
    if world > 1:
        torch.distributed.all_reduce(loss)
    return float(loss) / world, norm


def _parallel_model(strategy: str, rank: int, world: int, weights=None):
    model = _model().double()
    if weights is not None:
        model.load_state_dict(weights)
    parallel.apply_activation_checkpointing(model, "full", ["image"])  # before FSDP, as in train
    if strategy == "fsdp":
        trained = parallel.apply_fsdp(model, "fp64")
    else:
        env = parallel.DistributedEnv(torch.device("cpu"), rank, world, rank, False)
        trained = parallel.wrap_data_parallel(model, env, "ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, trained, optimizer


def _train_and_resume(rank: int, world: int, strategy: str) -> dict:
    """STEPS steps of a micro CLIP; the state a checkpoint saves; one more step. Under FSDP also
    resume that state into a freshly sharded model and take the same step there."""
    model, trained, optimizer = _parallel_model(strategy, rank, world)
    steps = [_step(trained, model, optimizer, s, rank, world) for s in range(STEPS)]
    saved = {
        "weights": parallel.full_model_state_dict(model),
        "optimizer": parallel.optimizer_state_dict(model, optimizer),
    }
    result = {"steps": steps, "saved": saved}
    if strategy == "fsdp":
        # Every rank reads the checkpoint from disk in `train`; here rank 0 hands over a copy
        # (the optimizer may adopt the tensors it is given).
        shared = [copy.deepcopy(saved)]
        torch.distributed.broadcast_object_list(shared, src=0)
        fresh, fresh_trained, fresh_optimizer = _parallel_model(
            strategy, rank, world, shared[0]["weights"]
        )
        parallel.load_optimizer_state_dict(fresh, fresh_optimizer, shared[0]["optimizer"])
        result["resumed"] = _step(fresh_trained, fresh, fresh_optimizer, STEPS, rank, world)
    result["next"] = _step(trained, model, optimizer, STEPS, rank, world)
    result["final"] = parallel.full_model_state_dict(model)
    return result


@pytest.mark.slow
def test_fsdp_follows_ddp_gathers_full_checkpoints_and_resumes_on_other_rank_counts():
    ddp = run_distributed(_train_and_resume, 2, ("ddp",), timeout_s=300)[0]
    fsdp, fsdp1 = run_distributed(_train_and_resume, 2, ("fsdp",), timeout_s=300)
    f64 = torch.float64
    torch.testing.assert_close(
        torch.tensor(fsdp["steps"], dtype=f64), torch.tensor(ddp["steps"], dtype=f64), **EXACT
    )
    assert fsdp1["saved"] == {"weights": {}, "optimizer": {}}  # gathered on rank 0 only
    weights = fsdp["saved"]["weights"]
    assert list(weights) == list(_model().state_dict())  # the single-process names
    torch.testing.assert_close(weights, ddp["saved"]["weights"], **EXACT)

    # Resumed into a freshly sharded model: the next step is the uninterrupted run's.
    torch.testing.assert_close(
        torch.tensor(fsdp["resumed"], dtype=f64), torch.tensor(fsdp["next"], dtype=f64), **EXACT
    )
    # Resumed in ONE process (no process group, plain model): the same next step and weights.
    model, trained, optimizer = _parallel_model("none", 0, 1, weights)
    parallel.load_optimizer_state_dict(model, optimizer, fsdp["saved"]["optimizer"])
    one = _step(trained, model, optimizer, STEPS, 0, 1)
    torch.testing.assert_close(
        torch.tensor(one, dtype=f64), torch.tensor(fsdp["next"], dtype=f64), **EXACT
    )
    torch.testing.assert_close(model.state_dict(), fsdp["final"], **EXACT)


# ----------------------------------------------------------------------------- torch.compile
@pytest.mark.slow
def test_compiled_blocks_compile_once_and_train_like_eager():
    """`train.compile`: every transformer block compiled in place (names unchanged) after
    activation checkpointing; dynamo compiles graphs on the first step and none on the next
    steps of the same shapes, and each step equals eager's in float64. Inductor needs a C++
    compiler on the CPU (.ci/run installs one); CPU training is slower compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _model().double()
    compiled = parallel.apply_activation_checkpointing(_model().double(), "full", ["image"])
    parallel.apply_compile(compiled)
    assert all(
        block._compiled_call_impl is not None
        for tower in compiled.towers.values()
        for block in tower.blocks
    )
    assert set(compiled.state_dict()) == set(eager.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, compiled)]
    graphs = []
    for step in range(3):
        batch = _float64(_batch(seed=step))
        losses = []
        for model, optimizer in zip((eager, compiled), optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            loss, _ = forward_backward(
                model, [ContrastiveObjective(model, ContrastiveLoss("clip"))], [batch], FP64
            )
            optimizer_step(model, optimizer, FP64, grad_clip=1.0)
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], **EXACT)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "dynamo compiled nothing"
    assert graphs[2] == graphs[0], f"recompiled on later steps: unique graphs {graphs}"
    assert not counters["recompiles"], dict(counters["recompiles"])
    torch.testing.assert_close(compiled.state_dict(), eager.state_dict(), **EXACT)
