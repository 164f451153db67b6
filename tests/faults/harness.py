"""What the fault tests share: a tiny run to break, and child processes to break it in.

`tiny_run(folder, steps=...)` writes a few PNG + caption shards, a tiny CLIP spec (16 px
images, two layers per tower) and a run config that checkpoints every step, and returns the
config's path. `Launcher.start(config, overrides)` runs `mmtrain train CONFIG key=value ...` in a
child process that the test can SIGKILL, SIGTERM or starve of disk space.

Why children come from a fork server: importing torch takes seconds (tens on a busy 2-core
machine), and the kill test starts twenty-odd processes. A `multiprocessing` fork server
imports torch and mmtrain once; each child is forked from it (no torch op ever ran there, so no
thread pool is copied half-initialised) and then calls the same `mmtrain.cli.main(argv)` that
`python -m mmtrain` calls, with its own memory, files and signals: a SIGKILL kills it exactly as
it would kill the command. `MMTRAIN_FAULTS_EXEC=1` runs every child that needs no in-process
fault hook as a real `python -m mmtrain train ...` instead (slower; same assertions).
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from micro import make_shards, micro_spec

REPO = Path(__file__).resolve().parents[2]
THREADS = 1  # every child, every run: bitwise equality needs the same reduction order
EXEC = os.environ.get("MMTRAIN_FAULTS_EXEC") == "1"

FAULT_SPEC = micro_spec("fault-clip")


# ----------------------------------------------------------------------------- the tiny run
def tiny_run(folder: Path, steps: int = 12, shards: Path | None = None, **sections: dict) -> Path:
    """Write spec.yaml and run.yaml (plus shards unless given) under `folder`; the run folder
    is `folder/run`. `sections` update the config's sections, e.g. train={"precision": "fp16"}."""
    folder.mkdir(parents=True, exist_ok=True)
    if shards is None:
        shards = make_shards(folder / "shards")
    (folder / "spec.yaml").write_text(yaml.safe_dump(FAULT_SPEC))
    config = {
        "model": str(folder / "spec.yaml"),
        "data": {"train": str(shards), "shuffle_window": 8},
        "train": {"steps": steps, "batch_size": 8, "lr": 1e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": 1, "keep": 2},
        "metrics": {"tensorboard": False, "log_every": 1},
        "seed": 5,
        "out": str(folder / "run"),
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def step_rows(run: Path) -> list[int]:
    """The step numbers of metrics.jsonl's step rows, in file order."""
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "kind" not in r]


# ----------------------------------------------------------------------------- children
def _child(argv: list[str], log: str, env: dict[str, str], setup: Callable | None) -> None:
    """Body of a forked child: output to `log`, optional fault setup, then the CLI."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    import torch

    torch.set_num_threads(THREADS)
    if setup is not None:
        setup()
    from mmtrain.cli import main

    try:
        code = main(argv)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        # torch._dynamo: building a model on the meta device imports it (seconds) on first use.
        _CONTEXT.set_forkserver_preload(
            [
                "torch",
                "torch._dynamo",
                "mmtrain.cli",
                "mmtrain.commands.train",
                "mmtrain.train.loop",
            ]
        )
    return _CONTEXT


@dataclass
class Child:
    """A running `mmtrain train`; `log` holds its stdout and stderr."""

    pid: int
    log: Path
    _wait: Callable[[float | None], int | None]
    _alive: Callable[[], bool]

    def alive(self) -> bool:
        return self._alive()

    def wait(self, timeout_s: float = 120.0) -> int:
        """Exit code (negative: killed by that signal); raises TimeoutError if still running."""
        code = self._wait(timeout_s)
        if code is None:
            raise TimeoutError(f"mmtrain train (pid {self.pid}) still runs after {timeout_s} s")
        return code

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start(
    config: Path,
    overrides: Sequence[str] = (),
    *,
    log: Path,
    env: dict[str, str] | None = None,
    setup: Callable[[], None] | None = None,
    file_size_limit: int | None = None,
    real_process: bool = False,
) -> Child:
    """Start `mmtrain train CONFIG OVERRIDES...` in a child process.

    `setup` (a module-level function) runs in the child before the CLI: fault injection that
    needs to sit inside the process (a signal at an exact place). `file_size_limit` sets
    RLIMIT_FSIZE in the child with SIGXFSZ ignored, so a write past it fails with EFBIG as on a
    full disk. `real_process` (or MMTRAIN_FAULTS_EXEC=1) runs `python -m mmtrain` instead; it
    cannot take `setup`.
    """
    argv = ["train", str(config), *overrides]
    env = dict(env or {})
    if file_size_limit is not None:
        setup = _with_file_limit(setup, file_size_limit)
    if real_process or (EXEC and setup is None):
        return _start_process(argv, log, env, file_size_limit)
    ctx = _context()
    process = ctx.Process(target=_child, args=(argv, str(log), env, setup), daemon=False)
    process.start()

    def wait(timeout: float | None) -> int | None:
        process.join(timeout)
        return process.exitcode

    return _track(Child(process.pid, log, wait, process.is_alive))


_STARTED: list[Child] = []


def _track(child: Child) -> Child:
    _STARTED.append(child)
    return child


def kill_leftovers() -> None:
    """SIGKILL every child still running: a failed test must not leave a training process
    behind (it would hold the test run's output open and keep CI waiting)."""
    while _STARTED:
        child = _STARTED.pop()
        if child.alive():
            child.signal(signal.SIGKILL)
            child.wait(30)


class _FileLimit:
    """Picklable setup: RLIMIT_FSIZE = limit bytes, SIGXFSZ ignored (writes fail with EFBIG)."""

    def __init__(self, then: Callable | None, limit: int):
        self.then, self.limit = then, limit

    def __call__(self) -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.limit))
        if self.then is not None:
            self.then()


def _with_file_limit(setup: Callable | None, limit: int) -> Callable:
    return _FileLimit(setup, limit)


def _start_process(
    argv: list[str], log: Path, env: dict[str, str], file_size_limit: int | None
) -> Child:
    full_env = {**os.environ, **env, "OMP_NUM_THREADS": str(THREADS)}
    preexec = _FileLimit(None, file_size_limit) if file_size_limit is not None else None
    handle = open(log, "ab")  # noqa: SIM115 - the child owns it once started
    process = subprocess.Popen(
        [sys.executable, "-m", "mmtrain", *argv],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=full_env,
        cwd=REPO,
        preexec_fn=preexec,
    )
    handle.close()

    def wait(timeout: float | None) -> int | None:
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    return _track(Child(process.pid, log, wait, lambda: process.poll() is None))


def wait_for(condition: Callable[[], bool], child: Child, timeout_s: float, poll_s: float) -> bool:
    """Poll `condition` until it holds (True) or the child exits or time runs out (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if not child.alive():
            return condition()
        time.sleep(poll_s)
    return False
