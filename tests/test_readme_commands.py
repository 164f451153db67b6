"""The shell commands of README.md and docs/*.md run as written (those that can run here).

Every line of a ```bash block that calls `mmtrain` (or `scripts/mmtrain`, the README's wrapper
around the project's virtualenv) becomes a test case, run as `python -m mmtrain ...` from the
repository root. A command is skipped by exactly one of the rules in `skip_reason`, each with
its reason in the test report; everything else must exit 0 in seconds, so a broken example in
the docs fails here.
"""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LAUNCHERS = {"mmtrain", "scripts/mmtrain"}
# Commands that train (minutes to hours) have their own tests: test_quickstart*.py, test_train*.py.
OWN_TESTS = {"quickstart": "test_quickstart*.py", "train": "test_train*.py"}
WRITES = {"--out", "--contact-sheet"}  # would write into the repository
FILE_SUFFIXES = {".json", ".jsonl", ".csv", ".jpg", ".png", ".bin", ".tar", ".yaml", ".safetensors"}


def shell_commands(path: Path) -> list[tuple[str, str]]:
    """(where, command line) for each command of the ```bash blocks of `path`, with `\\`
    continuations joined."""
    commands, block, pending = [], False, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            block = line.strip() in ("```bash", "```sh")
            continue
        if not block:
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            commands.append((f"{path.relative_to(ROOT)}:{number}", pending.strip()))
        pending = ""
    return commands


def looks_like_path(token: str) -> bool:
    return "/" in token or Path(token).suffix in FILE_SUFFIXES


def skip_reason(argv: list[str]) -> str | None:
    """Why a documented command is not run here, or None to run it."""
    if not argv or argv[0] not in LAUNCHERS:
        return "not an mmtrain command (set-up, the test suite, torchrun)"
    command = argv[1] if len(argv) > 1 else ""
    if command in OWN_TESTS:
        return f"`mmtrain {command}` trains; covered by {OWN_TESTS[command]}"
    if argv[1:3] == ["launch", "local"]:
        return "`launch local` starts the training job; covered by test_launch_local.py"
    if any(token.startswith("s3://") for token in argv):
        return "needs an S3 bucket; s3:// reading is covered by test_s3.py"
    outputs = {b for a, b in zip(argv, argv[1:], strict=False) if a in WRITES}
    inputs = [t for t in argv[2:] if looks_like_path(t) and t not in outputs]
    missing = [t for t in inputs if not (ROOT / t).exists()]
    if missing:
        return f"needs files the reader brings: {', '.join(missing)}"
    if WRITES & set(argv):
        return "writes files into the repository"
    return None


CASES = [(where, line) for doc in DOCS for where, line in shell_commands(doc)]


@pytest.mark.parametrize(("where", "line"), CASES, ids=[where for where, _ in CASES])
def test_documented_command_runs(where, line):
    argv = shlex.split(line, comments=True)
    reason = skip_reason(argv)
    if reason:
        pytest.skip(reason)
    # `--submit` hands the script to sbatch/kubectl; without it the command prints that script.
    args = [a for a in argv[1:] if a != "--submit"]
    done = subprocess.run(
        [sys.executable, "-m", "mmtrain", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{where}: {line}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{where}: printed nothing"


def test_the_rules_skip_and_run_what_they_say():
    # A guard against rules that silently skip everything: the README's planner examples run.
    runnable = [line for _, line in CASES if not skip_reason(shlex.split(line, comments=True))]
    assert sum("plan --model" in line for line in runnable) >= 4
    assert skip_reason(["mmtrain", "eval", "runs/x", "--data", "nowhere/"]).startswith(
        "needs files"
    )
    assert skip_reason(["mmtrain", "plan", "--model", "tiny-clip"]) is None
