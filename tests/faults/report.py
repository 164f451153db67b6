"""Regenerate docs/RELIABILITY.md from a real run of the fault suite and the hostile-input tests.

    python -m tests.faults.report                   # run, then write docs/RELIABILITY.md
    python tests/faults/report.py                   # the same (where a site-packages `tests`
                                                    # package shadows ours)
    MMTRAIN_FAULT_KILLS=50 python -m tests.faults.report --out /tmp/RELIABILITY.md

Runs pytest on the tests each row of the table names, with a JUnit XML result; the figure of a
row is what its tests measured (`record_property("figure", ...)`) or, for tests that only pass
or fail, their count. A failed test shows as FAILED in the table: the page never claims more
than the run showed. Exit code: pytest's.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "docs" / "RELIABILITY.md"


@dataclass(frozen=True)
class Row:
    section: str
    fault: str
    behaviour: str
    tests: tuple[str, ...]  # pytest node ids; a parametrized test id matches all its cases
    figure: str = ""  # for tests that record none: what a pass means


ROWS = [
    # -- faults ----------------------------------------------------------------------------
    Row(
        "Faults",
        "SIGKILL at random moments (seeded): while starting or resuming, in a step, "
        "inside a checkpoint write",
        "the rerun resumes from the newest checkpoint whose manifest "
        "verifies; half-written `step_N.tmp` folders are ignored and replaced; the metrics log "
        "keeps each step once",
        (
            "tests/faults/test_kill.py::test_sigkill_at_random_moments_then"
            "_resume_is_bitwise_identical",
        ),
    ),
    Row(
        "Faults",
        "Disk full during a checkpoint write (RLIMIT_FSIZE: the write fails part-way)",
        "the run stops with a CheckpointError naming the folder and what to do; the half-written "
        "folder is removed; earlier checkpoints are untouched; the rerun resumes",
        (
            "tests/faults/test_storage.py::test_full_disk_during_a_checkpoint_keeps_the_previous_one"
            "_and_resumes",
        ),
    ),
    Row(
        "Faults",
        "Checkpoint files truncated, bit-flipped or deleted at rest",
        "size and sha256 in `manifest.json` catch each one; the checkpoint is skipped with a "
        "warning naming the file (kept for inspection), and the run resumes from the one before",
        (
            "tests/faults/test_storage.py::test_damaged_checkpoints_are_detected_by_the_manifest_and"
            "_skipped",
            "tests/test_checkpoint.py::test_newest_valid_checkpoint_wins_and_corrupt_"
            "ones_are_skipped",
        ),
    ),
    Row(
        "Faults",
        "SIGTERM during data loading, during the forward pass, during a checkpoint write",
        "with no step since the last checkpoint the run stops where it is (that checkpoint "
        "stands); otherwise the step finishes and a checkpoint is written and verified; exit "
        "code 0 either way; the rerun resumes",
        (
            "tests/faults/test_signals.py::test_sigterm_ends_with_a_valid_checkpoint_and_exit_0",
            "tests/test_run_stops.py::test_a_signal_before_the_first_step_completes_stops_the_"
            "run_where_it_is",
        ),
    ),
    Row(
        "Faults",
        "SIGTERM sent to a real `python -m mmtrain train` process",
        "same: checkpoint, exit code 0",
        ("tests/faults/test_signals.py::test_sigterm_to_the_command_from_outside_exits_0",),
    ),
    Row(
        "Faults",
        "NaN inputs, an infinite loss, a NaN gradient",
        "the step is skipped (weights "
        "and optimizer state untouched), counted in `skipped_steps` and logged with its sample "
        "keys; no non-finite weight is ever saved (the save refuses them)",
        (
            "tests/faults/test_numerics.py::test_nan_inputs_loss_and_gradients_are_skipped_and_"
            "counted",
        ),
    ),
    Row(
        "Faults",
        "K non-finite steps in a row (`guards.max_nonfinite_in_a_row`)",
        "roll back to the last checkpoint (optionally lowering the learning rate) and replay",
        (
            "tests/faults/test_numerics.py::test_k_non_finite_steps_in_a_row_roll_back_to_the_last_"
            "checkpoint",
        ),
    ),
    Row(
        "Faults",
        "A run that keeps diverging after rollbacks",
        "stops with a FloatingPointError "
        "naming `guards.max_rollbacks` and the last good checkpoint; writes no final weights",
        (
            "tests/faults/test_numerics.py::test_a_run_that_keeps_diverging_stops_with_a_clear_"
            "error",
        ),
        "stopped with the error, all saved weights finite",
    ),
    Row(
        "Faults",
        "fp16 overflow",
        "GradScaler skips the step and halves its scale; counted, never a rollback",
        ("tests/faults/test_numerics.py::test_fp16_overflow_is_left_to_the_loss_scaler",),
    ),
    Row(
        "Faults",
        "One of 2 gloo ranks killed (SIGKILL)",
        "the survivor's next collective fails (gloo: connection reset by peer); it prints that "
        "another rank stopped and that restarting every rank resumes from the newest valid "
        "checkpoint, and exits 1 at once instead of hanging in teardown; restarting both "
        "ranks resumes",
        (
            "tests/faults/test_distributed.py::test_a_killed_rank_stops_the_"
            "survivor_clearly_and_a_restart_resumes",
        ),
    ),
    Row(
        "Faults",
        "Data no batch can be filled from (every sample too long for data.sequence_length, "
        "or undecodable)",
        "the run stops in its first step with exit 2 naming the field to change (the positions "
        "the samples need and the largest image), and records why for `mmtrain doctor`, "
        "instead of cycling through its epochs",
        (
            "tests/test_run_stops.py::test_a_row_too_short_for_every_sample_stops_at_once_with_"
            "exit_2",
            "tests/test_loader.py::test_all_corrupt_data_fails_clearly",
        ),
    ),
    Row(
        "Faults",
        "The same command run again with a changed LoRA rank, LoRA <-> full fine-tuning, "
        "another spec, freezing or EMA",
        "refused with exit 2 naming each changed key and both values; the checkpoint is left "
        "byte for byte as it was; settings a resume may change (steps, learning rate, weight "
        "decay) apply from the next step with a warning",
        (
            "tests/test_resume_changes.py::test_a_change_of_the_checkpoints_tensors_is_refused_"
            "naming_it",
            "tests/test_resume_changes.py::test_a_changed_learning_rate_and_weight_decay_apply_"
            "from_the_resumed_step",
        ),
    ),
    # -- hostile data --------------------------------------------------------------------
    Row(
        "Hostile inputs",
        "A shard holding a decompression bomb (60000 x 60000 PNG header), "
        "truncated and bit-flipped images, a WAV in a `.png` member, a non-UTF-8 caption, a "
        "sample missing its text, a 2 MB caption",
        "bad samples are skipped and counted, each "
        "logged with shard, key and reason; the bomb is refused from its header; the caption is "
        "cut to the context length; nothing is written anywhere",
        (
            "tests/test_hostile_inputs."
            "py::test_a_hostile_shard_yields_only_its_good_samples_and_names_each_bad_one",
        ),
        "7/7 bad samples refused and named, 4/4 good ones batched",
    ),
    Row(
        "Hostile inputs",
        "Tar members `../x`, `/abs`, symlinks, hard links, devices, FIFOs, "
        "pickle-like members (`.pth`, `.pickle`, ...)",
        "refused at indexing with a reason, "
        "never extracted nor unpickled; the rest of the sample is read",
        (
            "tests/test_hostile_inputs.py::test_index_of_the_hostile_shard_lists_every_refused_"
            "member",
            "tests/test_shards.py::test_unsafe_members_are_refused_and_reported",
        ),
    ),
    Row(
        "Hostile inputs",
        "Truncated shard; garbage in the middle of a shard",
        "the samples before the damage are read; the damage is logged with its byte offset",
        (
            "tests/test_shards.py::test_truncated_shard_yields_the_samples_before_the_damage",
            "tests/test_shards.py::test_garbage_in_the_middle_is_damage_with_its_offset",
            "tests/test_loader.py::test_truncated_shard_is_read_up_to_the_damage",
        ),
    ),
    Row(
        "Hostile inputs",
        "A shard whose sha256 does not match its manifest",
        "`mmtrain data inspect DIR --verify` names each shard; training does not hash shards at "
        "start (cost), but reads them with the checks above",
        ("tests/test_shards.py::test_manifest_verification_reports_each_bad_shard",),
    ),
    Row(
        "Hostile inputs",
        "`mmtrain data build` over empty, truncated, garbage, bomb, "
        "mislabelled, non-UTF-8 and caption-less files",
        "each is rejected into rejects.jsonl "
        "with its path and reason and the build continues; nothing is written outside `--out`",
        (
            "tests/test_ingest.py::test_each_bad_kind_is_rejected_with_its_path_and_reason",
            "tests/test_ingest.py::test_nothing_is_written_outside_out",
        ),
    ),
    Row(
        "Hostile inputs",
        "Fuzz: bit-flipped and truncated tar shards",
        "the reader returns "
        "the samples it can prove, or raises ShardError naming the file; never reads past the "
        "file",
        (
            "tests/test_hostile_inputs.py::test_fuzzed_shards_never_crash_the_reader_nor_"
            "read_past_the_file",
        ),
        "60 mutated shards (derandomized), no crash",
    ),
    Row(
        "Hostile inputs",
        "Fuzz: bit-flipped and truncated PNG, JPEG, WAV, NPY, CSV, text",
        "each decoder returns an array or raises MediaError with a reason",
        ("tests/test_hostile_inputs.py::test_fuzzed_media_decode_or_raise_media_error",),
        "6 formats x 60 mutations, no crash",
    ),
    Row(
        "Hostile inputs",
        "Property: loader order (hypothesis)",
        "every key once per epoch on "
        "any world size; a resume on another world size sees exactly the unseen samples",
        (
            "tests/test_loader.py::test_every_sample_once_per_epoch_on_any_world_size",
            "tests/test_loader.py::test_resume_on_another_world_size_sees_exactly_the_unseen_"
            "samples",
        ),
    ),
    # -- configs and loading ---------------------------------------------------------------
    Row(
        "Configs and loading",
        "Unknown keys, wrong types, negative LR, zero steps, batch not "
        "divisible by ranks x micro-batch",
        "exit code 2, the message names the field (and the "
        "closest valid key) and the config file; nothing is written",
        (
            "tests/test_hostile_inputs.py::test_bad_configs_exit_2_naming_the_field_and_write_"
            "nothing",
        ),
    ),
    Row(
        "Configs and loading",
        "YAML tags that run code (`!!python/object/apply`)",
        "refused by the safe loader, exit code 2",
        ("tests/test_hostile_inputs.py::test_yaml_tags_that_run_code_are_refused",),
    ),
    Row(
        "Configs and loading",
        "A checkpoint whose state.pt carries a pickle payload (manifest re-signed)",
        "`torch.load(weights_only=True)` refuses it; no code runs",
        (
            "tests/test_hostile_inputs.py::test_a_checkpoint_state_that_carries_code_is_not_"
            "unpickled",
        ),
    ),
    Row(
        "Configs and loading",
        "Model weights as a pickle",
        "weights load only from safetensors (or `weights_only=True` for converted checkpoints)",
        (
            "tests/test_convert.py::test_pickled_python_objects_are_not_loaded",
            "tests/test_models.py::test_corrupt_weights_give_a_clear_error",
        ),
    ),
    Row(
        "Configs and loading",
        "A checkpoint written by a newer mmtrain",
        "refused, not skipped: exit code 2 naming the folder and saying to upgrade",
        (
            "tests/test_hostile_inputs.py::test_a_checkpoint_from_a_newer_mmtrain_is_refused_not_"
            "skipped",
            "tests/test_checkpoint.py::test_newer_schema_is_refused_with_a_clear_message",
        ),
    ),
]


@dataclass
class Case:
    outcome: str  # passed, failed, skipped, xfailed
    seconds: float
    figure: str
    message: str


def run_tests(junit: Path) -> tuple[int, float]:
    nodes = sorted({node for row in ROWS for node in row.tests})
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
        "junit_family=xunit1", f"--junitxml={junit}", *nodes,
    ]  # fmt: skip
    started = time.monotonic()
    code = subprocess.call(command, cwd=REPO)
    return code, time.monotonic() - started


def read_junit(junit: Path) -> dict[str, Case]:
    """Cases by node id (`file::name[params]`)."""
    cases = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "")
        node = module.replace(".", "/") + ".py::" + case.get("name", "")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                message = found.get("message", "")
                outcome = "failed" if tag != "skipped" else "skipped"
                if tag == "skipped" and found.get("type") == "pytest.xfail":
                    outcome = "xfailed"
        cases[node] = Case(outcome, float(case.get("time", 0)), props.get("figure", ""), message)
    return cases


def _matching(cases: dict[str, Case], node: str) -> list[Case]:
    return [case for key, case in cases.items() if key == node or key.startswith(node + "[")]


def figure(row: Row, cases: dict[str, Case]) -> str:
    found = [case for node in row.tests for case in _matching(cases, node)]
    if not found:
        return "not run"
    failed = [c for c in found if c.outcome == "failed"]
    if failed:
        return f"**FAILED** {len(failed)}/{len(found)}: {failed[0].message[:120]}"
    passed = [c for c in found if c.outcome == "passed"]
    parts = [c.figure for c in found if c.figure]
    text = "; ".join(parts) or row.figure or f"{len(passed)}/{len(passed)} cases pass"
    if not parts and row.figure and len(passed) > 1:
        text += f" ({len(passed)} tests)"
    xfailed = [c for c in found if c.outcome == "xfailed"]
    if xfailed:
        text += f"; known bug (xfail): {xfailed[0].message.removeprefix('reason: ')}"
    return text


def _test_names(row: Row) -> str:
    return "<br>".join(f"`{node.removeprefix('tests/')}`" for node in row.tests)


def render(cases: dict[str, Case], seconds: float, kills: str) -> str:
    import torch

    lines = [
        "# Reliability: what mmtrain survives",
        "",
        "Every row is a test that injects the fault or feeds the input, and the figure is what "
        "the last run measured. Regenerate with `scripts/reliability-report` (or "
        "`python tests/faults/report.py` in the venv; it runs the tests; `MMTRAIN_FAULT_KILLS=N` sets the "
        "number of SIGKILLs, default 20).",
        "",
        f"Last run: {date.today().isoformat()}, {platform.machine()} with {os.cpu_count()} CPU "
        f"cores, Python {platform.python_version()}, torch {torch.__version__}; "
        f"{len(cases)} test cases in {seconds:.0f} s; {kills} SIGKILLs.",
        "",
    ]
    section = None
    for row in ROWS:
        if row.section != section:
            section = row.section
            lines += [
                f"## {section}",
                "",
                "| fault or input | what mmtrain does | proved by | figure measured |",
                "|---|---|---|---|",
            ]
        cells = [row.fault, row.behaviour, _test_names(row), figure(row, cases)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if row is ROWS[-1] or ROWS[ROWS.index(row) + 1].section != section:
            lines.append("")
    lines += [
        "## How the faults are injected",
        "",
        "- Kills and signals hit real child processes running `mmtrain train` (forked from a "
        "server that has imported torch, so that twenty restarts fit in the suite's budget; "
        "`MMTRAIN_FAULTS_EXEC=1` runs those without an in-process hook as `python -m mmtrain "
        "train` instead; one signal test always does). Kill moments "
        "come from a seeded generator; a kill inside a checkpoint write is caught by polling for "
        "the `step_N.tmp` folder and is counted only if that folder is still there afterwards.",
        "- A full disk is RLIMIT_FSIZE in the child with SIGXFSZ ignored: the write fails "
        "part-way with EFBIG exactly where ENOSPC would.",
        "- SIGTERM at an exact place (data loading, forward, checkpoint write) is sent by the "
        "child to itself from a wrapper around that function; the handler runs mid-call.",
        "- Non-finite numbers are real: `guards.inject_nan_steps` overwrites a batch's inputs "
        "(`guards.inject_overflow_steps` multiplies them by 1e5: finite in fp32 and bf16, past "
        "fp16's 65504), and wrappers around the loss and the optimizer step put inf/NaN into the "
        "loss and a gradient.",
        "- The bitwise comparisons are against an uninterrupted run of the same config on the "
        "same thread count (1).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="page to write")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        code, seconds = run_tests(junit)
        if not junit.exists():
            print("pytest wrote no result; nothing to report", file=sys.stderr)
            return code or 1
        cases = read_junit(junit)
    kills = os.environ.get("MMTRAIN_FAULT_KILLS", "20")
    from mmtrain.atomic import atomic_write_text

    atomic_write_text(args.out, render(cases, seconds, kills))
    print(f"wrote {args.out} ({len(cases)} test cases, pytest exit code {code})")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
