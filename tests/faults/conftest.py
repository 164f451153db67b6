"""Shared fixtures of the fault suite: shards and the uninterrupted run to compare against."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.harness import kill_leftovers, make_shards, start, tiny_run

STEPS = 8  # the storage, signal and distributed tests train this many steps


@pytest.fixture(scope="session")
def fault_shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("fault-shards"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory, fault_shards) -> bytes:
    """`model.safetensors` of the tiny run trained STEPS steps without interruption."""
    folder = tmp_path_factory.mktemp("reference")
    child = start(tiny_run(folder, steps=STEPS, shards=fault_shards), log=folder / "out.log")
    assert child.wait(300) == 0, child.output()
    return (folder / "run" / "model.safetensors").read_bytes()


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    yield
    kill_leftovers()
