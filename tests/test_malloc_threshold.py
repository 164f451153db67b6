"""An FSDP2 rank fixes glibc's mmap threshold at its start (distributed.fix_malloc_mmap_threshold),
so that large freed host buffers (FSDP's all-gathers on CPU) return to the system whatever
launched it; a threshold the user set in the environment is left alone. The effect on a
sharded 2.2 GiB Llama is bench/big_model_memory.py's (bench/RESULTS.md)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from mmtrain import distributed
from mmtrain.train import parallel


class RecordingLibc:
    """Stands for glibc: records the mallopt calls a rank makes."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch) -> RecordingLibc:
    fake = RecordingLibc()
    monkeypatch.setattr(distributed, "_glibc", lambda: fake)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    return fake


def test_the_rank_start_fixes_the_mmap_threshold(libc):
    parallel.init_distributed("cpu")  # not sharded: glibc's own threshold stays
    assert libc.calls == []
    parallel.init_distributed("cpu", sharded=True)
    assert libc.calls == [(distributed.M_MMAP_THRESHOLD, distributed.MMAP_THRESHOLD_BYTES)]
    assert distributed.M_MMAP_THRESHOLD == -3 and distributed.MMAP_THRESHOLD_BYTES == 1_000_000


@pytest.mark.parametrize(
    "name, value",
    [("MALLOC_MMAP_THRESHOLD_", "4194304"),
     ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=65536")],
)  # fmt: skip
def test_a_threshold_the_user_set_is_left_alone(libc, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    parallel.init_distributed("cpu", sharded=True)
    assert libc.calls == []


def test_other_glibc_tunables_do_not_stop_it(libc, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    parallel.init_distributed("cpu", sharded=True)
    assert len(libc.calls) == 1


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_accepts_the_threshold():
    """The real call, in a process of its own (this one's heap stays as it is)."""
    code = (
        "import sys; from mmtrain.distributed import fix_malloc_mmap_threshold as fix; "
        "sys.exit(0 if fix({}) else 3)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
