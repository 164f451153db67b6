"""Per-step communication time (train/comm_timing.py): on 2 real gloo processes the DDP hook,
FSDP2's timed comms and the contrastive loss's gathers report communication that fits inside
the step, without changing the loss or a single gradient bit; one rank reports none."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch
from torch import nn

import mmtrain
from dist_helpers import run_distributed
from micro import micro_spec
from mmtrain.distributed import timed_collective
from mmtrain.losses import ContrastiveLoss
from mmtrain.report.plots import step_time_plot
from mmtrain.report.rundata import load_run
from mmtrain.spec import ModelSpec
from mmtrain.train import parallel
from mmtrain.train.comm_timing import (
    EXPOSED_AFTER_LAST_LAUNCH,
    EXPOSED_ALL,
    EXPOSED_UNKNOWN,
    CommTimer,
    union_length,
)
from mmtrain.train.loop import forward_backward
from mmtrain.train.measure_step import random_batch
from mmtrain.train.objectives import ContrastiveObjective
from mmtrain.train.precision import make_precision
from test_train import make_config, make_shards

CPU = torch.device("cpu")
MICRO = micro_spec("micro", embed_dim=16, context_length=8)


def test_union_counts_overlaps_once():
    assert union_length([]) == 0.0
    assert union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_length([(1.0, 2.0), (0.0, 5.0)]) == pytest.approx(5.0)  # nested
    assert union_length([(2.0, 1.0)]) == 0.0  # an empty interval adds nothing...
    assert union_length([(0.0, 1.0), (3.0, 2.0), (3.0, 4.0)]) == pytest.approx(2.0)  # ...here too


def test_ddp_buckets_count_as_waited_for_only_after_the_last_launch():
    timer = CommTimer(CPU, world_size=2)
    timer.start_step()
    origin = timer._origin
    for exposure, name, start_ms, end_ms in [
        (EXPOSED_AFTER_LAST_LAUNCH, "ddp_all_reduce", 0, 10),  # done while backward computes
        (EXPOSED_ALL, "all_gather", 2, 4),  # a blocking feature all-gather
        (EXPOSED_AFTER_LAST_LAUNCH, "ddp_all_reduce", 20, 30),  # last launch at 20 ms: waits
        (EXPOSED_AFTER_LAST_LAUNCH, "ddp_all_reduce", 15, 25),  # in flight at the last launch
        (EXPOSED_UNKNOWN, "fsdp_all_gather", 28, 35),  # FSDP on a GPU side stream
        (EXPOSED_ALL, "all_reduce", 26, 32),  # the losses' all-reduce, beside the last bucket
    ]:
        span = timer.begin(exposure, name)
        span.start, span.end = origin + start_ms / 1e3, origin + end_ms / 1e3
    figures = timer.finish_step()
    assert figures["comm_s"] == pytest.approx(0.010 + 0.020)  # 0-10 and 15-35 ms
    assert figures["comm_exposed_s"] == pytest.approx(0.002 + 0.012)  # 2-4 and 20-32 ms
    # by collective, each its own union (they overlap at 26-30 ms: 0.018 s in all)
    by_collective = {k: v for k, v in figures.items() if k.startswith("comm_exposed_s/")}
    assert by_collective == {
        "comm_exposed_s/all_gather": pytest.approx(0.002),
        "comm_exposed_s/all_reduce": pytest.approx(0.006),
        "comm_exposed_s/ddp_all_reduce": pytest.approx(0.010),  # 20-30: 15-25 waits from 20
    }


def test_one_rank_reports_no_communication():
    timer = CommTimer(CPU, world_size=1).attach(nn.Linear(2, 2))
    with timer:
        timer.start_step()
        with timed_collective("all_reduce"):  # nothing to time on one rank
            pass
        assert timer.finish_step() == {}


def _step(trained, model, batch, timer: CommTimer | None):
    """One forward/backward; returns (loss, gradients by name, comm figures, step seconds)."""
    loss_fn = ContrastiveLoss.from_spec(model.spec)
    fp32 = make_precision("fp32", CPU)
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    if timer is not None:
        timer.start_step()
    loss, _ = forward_backward(trained, [ContrastiveObjective(model, loss_fn)], [batch], fp32)
    figures = timer.finish_step() if timer is not None else {}
    elapsed = time.perf_counter() - started
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads[name] = grad.detach().clone()
    return float(loss), grads, figures, elapsed


def _timed_vs_plain(rank: int, world: int) -> dict:
    """DDP and FSDP2, each twice from the same weights and batches: with and without timing."""
    spec = ModelSpec.from_dict(MICRO)
    batches = [random_batch(spec, 4, torch.Generator().manual_seed(10 * rank + i)) for i in (0, 1)]
    out = {}
    for strategy in ("ddp", "fsdp"):
        runs = []
        for timed in (True, False):
            model = mmtrain.create_model(spec, seed=0)
            env = parallel.DistributedEnv(CPU, rank, world, rank, owns_group=False)
            trained = parallel.wrap_data_parallel(model, env, strategy)
            timer = CommTimer(CPU, world).attach(trained) if timed else None
            with timer if timer is not None else contextlib.nullcontext():
                runs.append([_step(trained, model, b, timer) for b in batches])
        out[strategy] = runs
    return out


def _two_ranks(rank: int, world: int, config) -> dict:
    from mmtrain.train.loop import train

    return {"steps": _timed_vs_plain(rank, world), "rows": train(config).history}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One spawn of 2 gloo ranks for every check here (starting processes is the slow part)."""
    folder = tmp_path_factory.mktemp("comm")
    config = make_config(folder / "two", make_shards(folder / "shards", 16), steps=2, micro_batch=2)
    config.metrics.comm_timing = True  # off by default
    return folder / "two" / "run", run_distributed(
        _two_ranks, world_size=2, args=(config,), timeout_s=240
    )


@pytest.mark.slow  # starts 2 processes (with the next test): 15-30 s on a busy 2-core machine
def test_two_ranks_time_communication_and_leave_gradients_unchanged(two_ranks):
    _, results = two_ranks
    for rank, result in enumerate(results):
        for strategy, (timed, plain) in result["steps"].items():
            for (loss, grads, figures, elapsed), (loss0, grads0, _, _) in zip(
                timed, plain, strict=True
            ):
                assert loss == loss0, (rank, strategy)
                for name, grad in grads.items():
                    assert torch.equal(grad, grads0[name]), (rank, strategy, name)
                assert 0 < figures["comm_s"] <= elapsed, (rank, strategy, figures)
                assert 0 <= figures["comm_exposed_s"] <= figures["comm_s"]
                # each collective's exposed time lies within the whole's, and they cover it
                parts = [v for k, v in figures.items() if k.startswith("comm_exposed_s/")]
                whole = figures["comm_exposed_s"]
                assert max(parts) <= whole <= sum(parts) * (1 + 1e-9), (strategy, figures)
            names = {k for *_, f, _ in timed for k in f if k.startswith("comm_exposed_s/")}
            # the contrastive loss's feature all-gather and its shape check on both
            assert {"comm_exposed_s/all_gather", "comm_exposed_s/shape_check"} <= names
            if strategy == "fsdp":
                # On a CPU FSDP2's collectives and the loss's gathers all block the step.
                assert all(f["comm_exposed_s"] == pytest.approx(f["comm_s"]) for *_, f, _ in timed)
                assert {"comm_exposed_s/fsdp_all_gather",
                        "comm_exposed_s/fsdp_reduce_scatter"} <= names  # fmt: skip
            else:
                assert "comm_exposed_s/ddp_all_reduce" in names


@pytest.mark.slow
def test_training_rows_carry_communication(two_ranks):
    run, results = two_ranks
    rows = results[0]["rows"]
    assert len(rows) == 2
    for row in rows:
        assert 0 < row["comm_exposed_s"] <= row["comm_s"] <= row["step_s"]
        assert row["comm_exposed_fraction"] == pytest.approx(row["comm_exposed_s"] / row["step_s"])
    written = (run / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in written if '"kind"' not in line]
    assert [r["comm_s"] for r in steps] == [r["comm_s"] for r in rows]


@pytest.mark.slow
def test_report_draws_communication_beside_the_step_split(two_ranks, tmp_path):
    run, _ = two_ranks
    plot = step_time_plot(load_run(run))
    assert plot.png is not None and "waited for" in plot.note

    one = tmp_path / "one"  # a single-process run logs no communication: nothing to draw
    one.mkdir()
    row = {"step": 1, "loss": 1.0, "step_s": 0.1, "data_wait_s": 0.01, "compute_s": 0.09}
    (one / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert step_time_plot(load_run(one)).png is None
