"""`mmtrain doctor`: on runs that really have a problem it names it with its evidence and the
change to make; a healthy run gets no finding.

Real runs of the micro CLIP model on real shards: NaN inputs injected into two steps
(`guards.inject_nan_steps`), a decoder that sleeps 50 ms per image (a slow disk or codec), and
a plain run. The communication finding is asserted on a sequence-parallel run with a slow
all-to-all (tests/test_train_vlm.py). The data-wait share of the slow decoder's steps is
~0.9 against ~0.08 for the healthy run (a wider model), on either side of the 0.3 threshold
whatever the load."""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import time

import pytest
import yaml

from dist_helpers import run_distributed
from micro import MICRO_SPEC, make_shards, matmul_tflops, micro_run
from mmtrain.cli import main
from mmtrain.data.ingest.filters import laplacian_variance
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.media import decode_image
from mmtrain.data.stream.transforms import ImageTransform
from mmtrain.report import build_report
from mmtrain.report.doctor import INPUT_BOUND_SHARE, diagnose
from mmtrain.report.rundata import load_run
from mmtrain.report.scaling import SCALING_EFFICIENCY, scaling
from mmtrain.train.loop import train

STALL_S = 1.0  # a slow sample's decode in the stall test


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("doctor-shards"), 32)


def _run(tmp_path, shards, spec=MICRO_SPEC, **sections):
    config = micro_run(tmp_path, shards, spec=spec, **sections)
    result = train(config)
    return load_run(tmp_path / "run"), result


def _computing_spec() -> dict:
    """The micro CLIP with towers of width 128, 4 blocks and 64 image tokens: its step computes
    long enough for reading 8 small PNGs to be a small part of it (a micro model's step is so
    short that it is input-bound)."""
    spec = json.loads(json.dumps(MICRO_SPEC))
    for tower in spec["towers"].values():
        tower.update(width=128, layers=4, heads=4)
    spec["towers"]["image"]["stem"].update(image_size=32, patch_size=4)
    return spec


def test_a_healthy_run_gets_no_finding(tmp_path, shards, capsys):
    run, _ = _run(tmp_path, shards, spec=_computing_spec(), train={"steps": 4})
    assert diagnose(run) == []
    assert main(["doctor", str(tmp_path / "run")]) == 0
    assert "no finding in 4 steps" in capsys.readouterr().out


def test_skipped_steps_are_named_with_their_batches_sample_keys(tmp_path, shards, capsys):
    run, result = _run(tmp_path, shards, train={"steps": 5}, guards={"inject_nan_steps": [2, 4]})
    assert result.skipped_steps == 2
    (finding,) = [f for f in diagnose(run) if f.kind == "non_finite"]
    assert finding.steps == [2, 4] and finding.severity == "error"
    keys = finding.evidence["samples"]
    # every key of the two batches of 8 (the shards' keys are s00000 .. s00031)
    assert len(keys) == 2 * 8 and set(keys) <= {f"s{i:05d}" for i in range(32)}
    assert main(["doctor", str(tmp_path / "run"), "--json"]) == 0
    findings = json.loads(capsys.readouterr().out)["findings"]
    (printed,) = [f for f in findings if f["kind"] == "non_finite"]
    assert printed["kind"] == "non_finite" and printed["evidence"]["steps"] == [2, 4]
    assert set(printed) == {"kind", "severity", "evidence", "why", "advice", "cost_s"}
    # the report opens with the same finding, before its summary
    html = build_report(tmp_path / "run", gallery=False).html.read_text(encoding="utf-8")
    headings = re.findall(r"<h2>(.*?)</h2>", html)
    assert headings[0].startswith("Diagnosis") and headings[1] == "Summary"
    diagnosis = html[html.index("Diagnosis") : html.index("<h2>Summary")]
    assert "non_finite" in diagnosis and "steps 2, 4" in diagnosis and keys[0] in diagnosis


def _planted_at_step_30(tmp_path, capsys, samples=64, **dirt) -> tuple[str, list[str]]:
    """Shards of `samples` samples with the 8 that step 30 reads (found with `mmtrain data
    order`, as a user would) made dirty as `dirt` says (make_shards' mismatched=,
    placeholders=)."""
    clean = make_shards(tmp_path / "clean", samples)
    # step 30 reads samples 232..239: of 64, epoch 3's 40..47
    epoch, position = divmod((30 - 1) * 8, samples)
    order = ["data", "order", clean, "--seed", "1", "--epoch", str(epoch), "--shuffle-window", "8",
             "--skip", str(position), "--limit", "8"]  # fmt: skip
    assert main(order) == 0
    planted = capsys.readouterr().out.split()
    indices = tuple(int(k[1:]) for k in planted)
    dirty = make_shards(tmp_path / "dirty", samples, **{k: indices for k in dirt})
    return dirty, sorted(planted)


def test_a_batch_of_mismatched_pairs_is_a_loss_spike_named_by_its_keys(tmp_path, capsys):
    """64 samples, 40 steps of 8: the loss settles at ln 2 (each batch holds two squares of each
    colour) within 15 steps; step 30's batch is planted with captions of the wrong colour, its
    keys found with `mmtrain data order` as a user would. A shuffle window of 8 keeps those 8
    samples together at the same place in each epoch of 8 steps: they spike at steps 22, 30
    and 38 (at 6 and 14 too, inside the detector's 20-step warm-up)."""
    dirty, planted = _planted_at_step_30(tmp_path, capsys, mismatched=True)
    run, _ = _run(tmp_path, dirty, train={"steps": 40}, checkpoint={"every_steps": 100})
    (finding,) = [f for f in diagnose(run) if f.kind == "loss_spike"]  # (a micro model's step
    # is input-bound too)
    assert finding.kind == "loss_spike" and finding.steps == [22, 30, 38]
    assert finding.evidence["samples"] == sorted(planted)
    assert "mmtrain data build" in finding.advice
    # 40 steps at a sound learning rate: the loss leaves chance (ln 8) and stays away
    assert not [f for f in diagnose(run) if f.kind == "learning_rate"]
    # the run's own model scores the planted captions far under the run's other pairs: the
    # relevance filter it proposes (keeping 95% of the others) drops all of them; measured as
    # data build measures them (--quality), they are like the others and fail no other filter
    capsys.readouterr()
    assert main(["doctor", str(tmp_path / "run"), "--relevance", "--quality", "--json"]) == 0
    (spike,) = [f for f in json.loads(capsys.readouterr().out)["findings"]
                if f["kind"] == "loss_spike"]  # fmt: skip
    evidence = spike["evidence"]
    assert evidence["relevance_median_spike"] < evidence["relevance_median_others"]  # ~7 vs ~53
    assert evidence["samples_below_threshold"] == sorted(planted)
    assert "filters_failed" not in evidence and "--min-" not in spike["advice"]
    threshold = evidence["relevance_threshold"]
    assert (
        f"--relevance-model {tmp_path / 'run'} --relevance-threshold {threshold:.1f}"
        in (spike["advice"])
    )


def test_a_batch_of_placeholder_images_is_a_spike_the_sharpness_filter_drops(tmp_path, capsys):
    """Of 256 samples (an epoch of 32 steps: the batch comes once, after the detector's
    warm-up), step 30's 8 images replaced by one flat grey (captions kept): the batch's image
    embeddings are alike, its loss ~2.6 against the settled ln 2. `--quality` measures the
    spike's samples as `data build` does: a Laplacian variance of 0 against the others' noise,
    so the sharpness bound that keeps 95% of the others drops all 8; their sides, aspect and
    captions are the others' and no other filter is proposed."""
    dirty, planted = _planted_at_step_30(tmp_path, capsys, samples=256, placeholders=True)
    _run(tmp_path, dirty, train={"steps": 40}, checkpoint={"every_steps": 100})
    assert main(["doctor", str(tmp_path / "run"), "--quality", "--json"]) == 0
    (spike,) = [f for f in json.loads(capsys.readouterr().out)["findings"]
                if f["kind"] == "loss_spike"]  # fmt: skip
    evidence = spike["evidence"]
    assert evidence["steps"] == [30] and evidence["samples"] == planted
    assert evidence["sharpness_median_spike"] == 0.0 < evidence["sharpness_median_others"]
    (bound,) = evidence["filters_failed"].values()
    assert list(evidence["filters_failed"]) == ["--min-sharpness"]
    assert evidence["samples_failing"] == planted
    assert spike["advice"].endswith(f"mmtrain data build SRC --out DIR --min-sharpness {bound}")
    # the proposed filter, as data build applies it, drops the 8 and keeps ~95% of the others
    # (the bound is the 5th percentile of 64 of them, spread over the shards)
    shards = ShardSet.open([dirty])
    sharpness = {shards.key(i): laplacian_variance(decode_image(shards.read(i)["png"]))
                 for i in range(len(shards))}  # fmt: skip
    shards.close()
    dropped = {k for k, v in sharpness.items() if v < bound}
    assert dropped >= set(planted)
    kept = 1 - (len(dropped) - 8) / (256 - 8)
    assert kept >= 0.9


def test_unreadable_samples_are_a_data_quality_finding(tmp_path):
    """4 of 32 images cut in half: the loader skips them, doctor names the share and the
    command that finds them."""
    broken = make_shards(tmp_path / "broken", 32, corrupt=(3, 9, 17, 30))
    run, result = _run(tmp_path, broken, train={"steps": 4})
    (finding,) = [f for f in diagnose(run) if f.kind == "data_quality"]
    assert finding.evidence["corrupt_samples"] == result.corrupt_samples >= 1
    assert finding.evidence["samples_seen"] == 4 * 8
    assert f"mmtrain data inspect {broken}" in finding.advice and finding.steps


def test_a_too_large_learning_rate_collapses_the_loss_to_chance(tmp_path, shards):
    """At train.lr=1 the micro CLIP's embeddings collapse within the warm-up: every pair gets
    the same score and the loss sits at ln 8 (batch 8) to within 1e-3 from step 3 on."""
    run, _ = _run(tmp_path, shards, train={"steps": 16, "lr": 1.0, "warmup_steps": 2},
                  checkpoint={"every_steps": 100})  # fmt: skip
    (finding,) = [f for f in diagnose(run) if f.kind == "learning_rate"]
    assert finding.severity == "error" and finding.steps[-1] == 16 and len(finding.steps) >= 10
    assert finding.evidence["chance_loss"] == pytest.approx(math.log(8), abs=1e-6)
    assert finding.evidence["loss_mean"] == pytest.approx(math.log(8), rel=0.01)
    assert "train.lr=0.1 (now 1)" in finding.advice


def test_a_vision_tower_fine_tuned_at_the_text_rate_is_named(tmp_path, shards):
    """A run that starts from another run's weights (`init`) and trains both towers at one
    rate gets the per-tower advice; a tenth of the rate for the image tower silences it."""
    _run(tmp_path / "base", shards, train={"steps": 2})
    base = str(tmp_path / "base" / "run")
    same, _ = _run(tmp_path / "same", shards, train={"steps": 2}, init=base)
    (finding,) = [f for f in diagnose(same) if f.kind == "learning_rate"]
    assert finding.evidence == {"lr of image": 2e-3, "lr of text": 2e-3, "init": base}
    assert "train.towers.image.lr=0.0002" in finding.advice
    slower, _ = _run(tmp_path / "slower", shards, train={"steps": 2, "towers": {"image": {"lr": 2e-4}}},
                     init=base)  # fmt: skip
    assert not [f for f in diagnose(slower) if f.kind == "learning_rate"]


def test_fp16_overflows_are_a_precision_finding_that_bf16_fixes(tmp_path, shards):
    """Inputs scaled by 1e5 at steps 4 and 8 (`guards.inject_overflow_steps`) pass 65504 in
    fp16: the scaler skips both steps and halves its scale twice. The same run in bf16, the
    change doctor gives, trains every step."""
    sections = {"guards": {"inject_overflow_steps": [4, 8]}, "checkpoint": {"every_steps": 100}}
    run, result = _run(tmp_path / "fp16", shards, train={"steps": 10, "precision": "fp16"},
                       **sections)  # fmt: skip
    assert result.skipped_steps == 2
    (finding,) = [f for f in diagnose(run) if f.kind == "precision"]
    assert finding.steps == [4, 8] and "train.precision=bf16" in finding.advice
    assert finding.evidence["loss_scale_min"] == 2.0**16 / 4  # halved at each overflow
    run, result = _run(tmp_path / "bf16", shards, train={"steps": 10, "precision": "bf16"},
                       **sections)  # fmt: skip
    assert result.skipped_steps == 0
    assert not [f for f in diagnose(run) if f.kind in ("precision", "non_finite")]


def test_a_slow_decoder_is_an_input_bound_run(tmp_path, shards, monkeypatch, capsys):
    decode = ImageTransform.decode

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(ImageTransform, "decode", slow)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(micro_run(tmp_path, shards, train={"steps": 3}).to_dict()))
    assert main(["train", str(recipe)]) == 0
    # the training log names it once, with the change
    hints = [line for line in capsys.readouterr().err.splitlines() if "hint:" in line]
    assert len(hints) == 1 and "input_bound (steps 2-3)" in hints[0]
    assert "data.workers=2" in hints[0]
    (finding,) = diagnose(load_run(tmp_path / "run"))
    assert finding.kind == "input_bound" and finding.steps == [2, 3]
    assert finding.evidence["data_wait_fraction_mean"] > INPUT_BOUND_SHARE
    assert finding.evidence["data.workers"] == 0
    assert "data.workers=2" in finding.advice
    assert finding.cost_s >= 2 * 8 * 0.05  # 8 images a step slept at least this long


def test_a_decoder_that_stalls_now_and_then_is_named_by_its_stalled_steps(
    tmp_path, shards, monkeypatch
):
    """Every 64th image decodes 1 s slow (a slow sample, a shard fetched from far away): on
    the wider model (a step of ~50 ms quiet, ~8% of it reading) the mean data-wait share stays
    under 30% (~20%), but the 3 steps holding those images (of 200 read, wherever the shuffle
    buffer reads ahead) wait most of their time, and doctor names exactly those. The stall is
    long enough to stay most of its step (doctor's 50%) even when a busy machine makes the
    step's compute several times slower, and no other step waits that long."""
    decode, calls = ImageTransform.decode, []

    def sometimes_slow(self, *args, **kwargs):
        calls.append(None)
        if len(calls) % 64 == 0:
            time.sleep(STALL_S)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(ImageTransform, "decode", sometimes_slow)
    run, _ = _run(tmp_path, shards, spec=_computing_spec(), train={"steps": 25},
                  checkpoint={"every_steps": 100})  # fmt: skip
    (finding,) = [f for f in diagnose(run) if f.kind == "input_bound"]
    waited = [r["step"] for r in run.train_rows[1:] if r["data_wait_s"] >= STALL_S]
    assert len(waited) == 3 and finding.steps == waited and finding.severity == "info"
    assert finding.evidence["stalled_steps"] == 3
    assert finding.evidence["data_wait_fraction_mean"] <= INPUT_BOUND_SHARE
    assert finding.cost_s >= 3 * STALL_S
    assert "data.workers=2 (now 0" in finding.advice


def _train_with_slow_gathers(rank: int, world: int, config) -> int:
    """Train with every all-gather 100 ms late (a slow link between the ranks)."""
    import torch.distributed as dist

    gather = dist.all_gather

    def slow(*args, **kwargs):
        time.sleep(0.1)
        return gather(*args, **kwargs)

    dist.all_gather = slow  # the contrastive loss gathers the batch's features through it
    return len(train(config).history)


def _per_rank_throughput(run) -> float:
    """What doctor compares, from the rows: the median samples/s after step 1, per rank."""
    rows = [r for r in run.train_rows if r["step"] > 1]
    return (
        statistics.median(r["samples_per_s"] for r in rows) / run.events["layout"][-1]["world_size"]
    )


@pytest.mark.slow
def test_two_ranks_slowed_by_their_gathers_are_a_scaling_finding(tmp_path, shards, capsys):
    """The same config on 1 and on 2 ranks (gloo) whose feature all-gathers wait 100 ms: each
    step of 2 ranks waits >= 0.2 s against ~0.02 s of computing, so each rank trains a small part
    of what one rank alone does, whatever the load; doctor says so and names communication."""
    sections = {"train": {"steps": 6}, "metrics": {"comm_timing": True, "tensorboard": False}}
    train(micro_run(tmp_path / "one", shards, **sections))
    config = micro_run(tmp_path / "two", shards, **sections)
    assert run_distributed(_train_with_slow_gathers, world_size=2, args=(config,)) == [6, 6]
    one, two = load_run(tmp_path / "one" / "run"), load_run(tmp_path / "two" / "run")
    finding = scaling([two, one])  # any order: the fewest ranks are the base
    expected = _per_rank_throughput(two) / _per_rank_throughput(one)
    assert finding.kind == "scaling" and finding.steps == [2, 3, 4, 5, 6]
    assert finding.evidence["world_size"] == [1, 2]
    assert finding.evidence["scaling_efficiency"][0] == 1.0
    assert finding.evidence["scaling_efficiency"][1] == pytest.approx(expected, abs=5e-5)
    assert expected < SCALING_EFFICIENCY
    comm = finding.evidence["comm_exposed_fraction_mean"]
    assert comm[0] == 0.0 and comm[1] > 0.5  # one rank has nothing to wait for
    assert "--gpus 2 --recommend" in finding.advice and "communication" in finding.advice
    # the command: the scaling finding, then each run's own
    assert main(["doctor", str(tmp_path / "one" / "run"), str(tmp_path / "two" / "run"),
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert [f["kind"] for f in out["findings"]] == ["scaling"]
    assert out["findings"][0]["evidence"]["steps"] == [2, 3, 4, 5, 6]
    (comm,) = [f for f in out["runs"][str(tmp_path / "two" / "run")]["findings"]
               if f["kind"] == "communication"]  # fmt: skip
    # the wait by collective: the two slowed all-gathers (the features' and their shape check)
    # lead, each 0.1 s late in each of the 5 steps
    by_collective = comm["evidence"]["comm_exposed_s_by_collective"]
    assert set(list(by_collective)[:2]) == {"all_gather", "shape_check"}
    assert min(by_collective["all_gather"], by_collective["shape_check"]) >= 5 * 0.1
    # runs that cannot be compared are refused, naming the run and what differs
    assert main(["doctor", str(tmp_path / "one" / "run"), str(tmp_path / "one" / "run")]) == 2
    assert "all 2 runs have 1 ranks" in capsys.readouterr().err
    other = tmp_path / "fp16"
    shutil.copytree(tmp_path / "one" / "run", other)
    resolved = yaml.safe_load((other / "config.yaml").read_text())
    resolved["train"]["precision"] = "fp16"
    (other / "config.yaml").write_text(yaml.safe_dump(resolved))
    assert main(["doctor", str(other), str(tmp_path / "two" / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'two' / 'run'}: another train.precision than {other}" in err


def test_a_model_too_small_for_its_device_is_an_mfu_finding(tmp_path, shards):
    """The micro CLIP (width 32, batches of 8) against this CPU's measured matmul peak runs at
    ~1-2% MFU, under half the 11.5% of published CLIP runs (OpenCLIP on A100: 11-12%), a
    factor of ~4 below the line on a quiet or a busy machine (the peak and the steps slow
    alike)."""
    run, _ = _run(tmp_path, shards, train={"steps": 6},
                  metrics={"tensorboard": False, "peak_tflops": matmul_tflops()})  # fmt: skip
    (finding,) = [f for f in diagnose(run) if f.kind == "mfu"]
    rows = [r for r in run.train_rows if r["step"] > 1]
    assert finding.steps == [r["step"] for r in rows]
    assert finding.evidence["mfu_median"] == round(statistics.median(r["mfu"] for r in rows), 4)
    assert finding.evidence["achievable_mfu"] == pytest.approx((0.11 + 0.12) / 2, abs=5e-5)
    assert finding.evidence["efficiency_family"] == "contrastive"
    assert finding.evidence["mfu_median"] < 0.5 * finding.evidence["achievable_mfu"]
    waits = finding.evidence["data_wait_fraction_mean"] > INPUT_BOUND_SHARE
    assert finding.advice.startswith("feed the step") == waits
    assert "train.compile=true" in finding.advice and "train.micro_batch=16" in finding.advice


def test_gradients_clipped_in_most_later_steps_are_named(tmp_path, shards):
    """The micro CLIP's gradient norm settles near 0.5 by step 10 (from ~20 at step 1): with
    train.grad_clip=0.05 every later step is clipped; the wider model's norms settle under
    0.5, well inside the default clip of 1, and its later steps clip none."""
    run, _ = _run(tmp_path / "tight", shards, train={"steps": 16, "grad_clip": 0.05})
    (finding,) = [f for f in diagnose(run) if f.kind == "learning_rate"]
    later = run.train_rows[8:]
    assert finding.steps == [r["step"] for r in later if r["grad_norm"] > 0.05]
    assert finding.evidence["clipped_steps"] > 4 and finding.evidence["steps_judged"] == 8
    assert "train.lr=0.000667" in finding.advice and "train.grad_clip" in finding.advice
    run, _ = _run(tmp_path / "default", shards, spec=_computing_spec(), train={"steps": 16})
    assert not [f for f in diagnose(run) if f.kind == "learning_rate"]


def test_a_fine_tune_without_warm_up_that_undoes_its_checkpoint_is_named(tmp_path, shards):
    """A micro CLIP trained 30 steps to ln 2 (the floor for batches of 8 over 4 colours), then
    fine-tuned at train.lr=6e-3 (the image tower at a tenth): with no warm-up its first update
    (every weight moved by about the rate) sends the loss to 5-9x its start at step 2, and step
    3's is still 2.1-4.5x (3 seeds measured), where a dirty batch's is back at once; warmed up over the advised 10 steps (a tenth of 100, under 2/(1-0.98) = 100) it
    stays within 1.4x of it."""
    _run(tmp_path / "base", shards, train={"steps": 30, "warmup_steps": 3},
         checkpoint={"every_steps": 100})  # fmt: skip
    base = str(tmp_path / "base" / "run")
    fine_tune = {"steps": 100, "lr": 6e-3, "warmup_steps": 0, "towers": {"image": {"lr": 6e-4}}}
    cold, _ = _run(tmp_path / "cold", shards, train=fine_tune, init=base,
                   checkpoint={"every_steps": 1000})  # fmt: skip
    (finding,) = [f for f in diagnose(cold) if f.kind == "learning_rate"]
    assert finding.steps[0] == 2 and len(finding.steps) >= 2  # the next batches' loss rose too
    assert finding.evidence["peak_step"] == 2
    assert finding.evidence["loss_first"] == pytest.approx(math.log(2), rel=0.01)
    assert finding.evidence["init"] == base and finding.evidence["recovered_at_step"] < 20
    assert finding.evidence["grad_norm_peak"] > 10 * finding.evidence["grad_norm_first"]
    assert "train.warmup_steps=10 (now 0)" in finding.advice
    warm, _ = _run(tmp_path / "warm", shards, train={**fine_tune, "warmup_steps": 10}, init=base,
                   checkpoint={"every_steps": 1000})  # fmt: skip
    assert not [f for f in diagnose(warm) if f.kind == "learning_rate"]
