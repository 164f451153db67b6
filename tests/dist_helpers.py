"""Run a function in N real `torch.distributed` processes (gloo on CPU) and collect the results.

    results = run_distributed(fn, world_size=2, args=(x,))   # [fn(0, 2, x), fn(1, 2, x)]

`fn(rank, world_size, *args)` must be a module-level (picklable) function; it runs after
`init_process_group` (file:// rendezvous in a private temporary folder, so no port can clash)
and its return value travels back through `torch.save`, so tensors, dicts and lists are fine.

Robust by construction: every collective has a timeout, the parent waits with a deadline and
kills what is left, and the first rank that fails is reported with its own traceback (the other
ranks, now stuck in a collective, are terminated rather than awaited). A rank that finished
destroys its group and ends without Python's finalization (mmtrain.distributed's
`leave_process_group` and `end_rank_process` say why: an abort under load otherwise).
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mmtrain.distributed


class DistributedTestError(RuntimeError):
    """A rank raised, crashed or did not finish in time; the message says which and why."""


def _worker(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    folder: str,
    backend: str,
    timeout_s: float,
    threads: int,
) -> None:
    out = Path(folder)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # as torchrun says it: one node's ranks
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"file://{out / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        tmp = out / f"result_{rank}.pt.tmp"
        torch.save(result, tmp)
        os.replace(tmp, out / f"result_{rank}.pt")
        del result
        mmtrain.distributed.leave_process_group()
    except BaseException:
        # Report at once, then leave without tearing anything down: destroying a group whose
        # peers are mid-collective can block for seconds, and the parent stops the other ranks.
        (out / f"error_{rank}.txt").write_text(traceback.format_exc())
        mmtrain.distributed.end_rank_process(1)
    # As a torchrun rank of `mmtrain` does: no Python finalization while gloo threads may live.
    mmtrain.distributed.end_rank_process(0)


def _stop(processes: list[Any]) -> None:
    """Terminate, then kill, every process still alive (only the ones this helper started)."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def _failure(processes: list[Any], folder: Path) -> DistributedTestError:
    """The error for a run in which some rank failed: every failed rank's traceback, the one
    that failed first (oldest error file) first, since the others usually fail because of it."""
    time.sleep(0.5)  # let ranks that fail as a consequence finish writing their reports
    errors = sorted(folder.glob("error_*.txt"), key=lambda path: path.stat().st_mtime_ns)
    parts = [f"rank {path.stem.split('_')[1]} raised:\n{path.read_text()}" for path in errors]
    reported = {int(path.stem.split("_")[1]) for path in errors}
    for rank, p in enumerate(processes):
        if rank not in reported and p.exitcode not in (0, None):
            parts.append(f"rank {rank} died with exit code {p.exitcode} without a Python traceback")
    return DistributedTestError("\n".join(parts))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return the results by rank.

    Raises DistributedTestError naming the rank (with its traceback) if one fails, or the ranks
    still running after `timeout_s` seconds (then killed). `threads` is torch's intra-op thread
    count per rank (1 keeps N ranks from fighting over a small machine's cores).
    """
    folder = Path(tempfile.mkdtemp(prefix="mmtrain-dist-"))
    context = mp.get_context("spawn")
    processes = []
    try:
        for rank in range(world_size):
            p = context.Process(
                target=_worker,
                args=(rank, world_size, fn, tuple(args), str(folder), backend, timeout_s, threads),
                # Not daemonic: a rank may start DataLoader workers of its own.
                daemon=False,
            )
            p.start()
            processes.append(p)
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in processes):
            if any(not p.is_alive() and p.exitcode != 0 for p in processes):
                raise _failure(processes, folder)
            if time.monotonic() > deadline:
                late = [r for r, p in enumerate(processes) if p.is_alive()]
                raise DistributedTestError(f"ranks {late} did not finish within {timeout_s:.0f} s")
            time.sleep(0.05)
        if any(p.exitcode != 0 for p in processes):
            raise _failure(processes, folder)
        return [
            torch.load(folder / f"result_{r}.pt", weights_only=False) for r in range(world_size)
        ]
    finally:
        _stop(processes)
        shutil.rmtree(folder, ignore_errors=True)
