"""Run a function on N gloo ranks of this machine and collect what each returns: the CPU
measurements of a layout that only exists across ranks (`plan --measure` under sequence
parallelism). Not a launcher for training (that is torchrun / `mmtrain launch`).

    results = run_on_local_ranks(fn, 2, args=(x,))   # [fn(*x) on rank 0, fn(*x) on rank 1]

`fn` must be a module-level function (the ranks are spawned processes); the rendezvous is a
file in a private temporary folder, so no port can clash, and each rank's result travels
back pickled (written by this machine's own processes, so no untrusted input).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(minutes=10)  # a collective waits this long for a stuck rank


def _rank(rank: int, world: int, fn: Callable, args: Sequence, folder: str, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(folder) / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    try:
        (Path(folder) / f"result_{rank}.pickle").write_bytes(pickle.dumps(fn(*args)))
    finally:
        dist.destroy_process_group()


def run_on_local_ranks(fn: Callable[..., Any], world: int, args: Sequence[Any] = ()) -> list:
    """`fn(*args)` on `world` spawned gloo ranks, each with its share of the cores; the ranks'
    results in rank order. A rank that raises makes this raise (torch.multiprocessing's
    ProcessRaisedException carries its traceback)."""
    threads = max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory(prefix="mmtrain-ranks-") as folder:
        mp.start_processes(
            _rank, args=(world, fn, args, folder, threads), nprocs=world, start_method="spawn"
        )
        folder = Path(folder)
        return [pickle.loads((folder / f"result_{r}.pickle").read_bytes()) for r in range(world)]
