"""What the launch tests share: a small tiny-clip run to start on two "nodes", the reference
weights of that run trained without interruption on two ranks, and run-folder probes.

The reference is trained once per test session (a module-level cache: several test modules
ask for it) by two plain `python -m mmtrain train` processes, no torchrun, with exactly the
environment the Kubeflow training operator gives the pods of a two-pod PyTorchJob with one
process each (`operator_pod_env`): so it also shows that the trainer runs on that environment
alone. Every launcher is compared with this uninterrupted two-rank run: same config, same world
size, same thread count (1), so the same samples, the same reductions and the same bits.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from micro import make_shards

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
STEPS = 12  # long enough that a fault injected after checkpoint 2 lands mid-run
RUN_TIMEOUT_S = 240

# One thread per rank everywhere: bitwise equality needs the same reduction order.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def write_run(folder: Path, shards: Path, steps: int = STEPS) -> Path:
    """A tiny-clip run config under `folder` (run folder `folder/run`, data `shards`)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model": "tiny-clip",
        "data": {"train": str(shards), "tokenizer": "byte", "shuffle_window": 8},
        "train": {"steps": steps, "batch_size": 8, "lr": 1e-3, "warmup_steps": 1},
        "checkpoint": {"every_steps": 1, "keep": 2},
        "metrics": {"tensorboard": False, "log_every": 1, "comm_timing": False},
        "seed": 3,
        "out": str(folder / "run"),
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def shards_in(folder: Path) -> Path:
    make_shards(folder, samples=32)
    return folder


def newest_checkpoint_step(run: Path) -> int:
    """The newest completed checkpoint's step as the folder shows it (0: none yet)."""
    folder = run / "checkpoints"
    names = os.listdir(folder) if folder.is_dir() else []
    return max((int(n.split("_")[1]) for n in names if not n.endswith(".tmp")), default=0)


def step_rows(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "kind" not in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.05, alive=None) -> None:
    """Poll `condition` until true; AssertionError naming `what` on timeout, or when `alive`
    (a callable) says the thing that should make it true has ended."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if alive is not None and not alive():
            if condition():
                return
            raise AssertionError(f"ended before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def start_ranks(config: Path, log_dir: Path, env_per_rank: list[dict[str, str]]):
    """`python -m mmtrain train CONFIG` once per env (each added to this environment)."""
    processes = []
    for rank, extra in enumerate(env_per_rank):
        log = open(log_dir / f"rank{rank}.log", "ab")  # noqa: SIM115 - the child owns it
        processes.append(
            subprocess.Popen(
                [PYTHON, "-m", "mmtrain", "train", str(config)],
                env={**_without_rank_env(os.environ), **THREAD_ENV, **extra},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        )
        log.close()
    return processes


def operator_pod_env(rank: int, pods: int, port: int) -> dict[str, str]:
    """What training-operator sets in pod `rank` of a PyTorchJob of `pods` pods (Master +
    Workers) with one process per pod: the same in every operator version when nprocPerNode is
    1 (docs/MULTINODE.md). No LOCAL_RANK: the operator sets none. MASTER_ADDR stands for the
    master's service name, which resolves to nothing here."""
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": str(pods),
        "RANK": str(rank),
        "PET_NNODES": str(pods),
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(rank),
    }


def wait_all(processes, timeout_s: float = RUN_TIMEOUT_S) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes = []
    try:
        for p in processes:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return codes


_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _without_rank_env(env) -> dict[str, str]:
    """This environment without what a launcher would set for a rank (a test run under
    torchrun must not leak its own)."""
    return {k: v for k, v in env.items() if k not in _RANK_VARIABLES}


_REFERENCE: dict[str, bytes] = {}


def reference_weights(tmp_root: Path, shards: Path, steps: int = STEPS) -> bytes:
    """model.safetensors of the run trained `steps` steps by two ranks without interruption
    (shards from `shards_in`: the same content wherever they lie)."""
    key = f"weights-{steps}"
    if key not in _REFERENCE:
        folder = tmp_root / f"reference-{steps}"
        folder.mkdir(parents=True, exist_ok=True)
        config = write_run(folder, shards, steps)
        port = free_port()
        ranks = start_ranks(config, folder, [operator_pod_env(r, 2, port) for r in range(2)])
        codes = wait_all(ranks)
        logs = "".join(p.read_text() for p in sorted(folder.glob("rank*.log")))
        assert codes == [0, 0], logs
        _REFERENCE[key] = (folder / "run" / "model.safetensors").read_bytes()
    return _REFERENCE[key]


def run_log(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.log")))
