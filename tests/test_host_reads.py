"""The step never waits on the device but once: mmtrain's code reads device values on the host
(`item`, `tolist`, `cpu`, `float(t)`, `bool(t)`...) once per optimizer step, the NaN guard's
flags, and once more on a logging step, where the recorder reads the interval's rows.

On a CPU every tensor is a host tensor, so the test counts the reads whose caller is mmtrain's
own code, outside what is host-side by design: the data pipeline (mmtrain/data/, the trainer's
`_next_micro_batches` on the host copies). What torch's own code reads (an optimizer's CPU step
counter) is torch's business; bench/gpu.sh runs a GPU step under
`torch.cuda.set_sync_debug_mode("warn")` for those.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch.overrides import TorchFunctionMode

import mmtrain
from micro import make_shards, micro_run
from mmtrain.train import loop
from test_train_vlm import _config as vlm_config
from test_train_vlm import shards as vlm_shards  # noqa: F401  (a fixture)

READS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"}
MMTRAIN = str(Path(mmtrain.__file__).parent)
HOST_SIDE = (str(Path(MMTRAIN) / "data"),)


class CountReads(TorchFunctionMode):
    """Counts device->host reads made by mmtrain's code (the direct caller's file)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and not self.paused:
            caller = sys._getframe(1)
            where = caller.f_code.co_filename
            if where.startswith(MMTRAIN) and not where.startswith(HOST_SIDE):
                self.reads.append(f"{name} at {Path(where).name}:{caller.f_lineno}")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def clip_shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"), 40)


def _reads_per_step(config, monkeypatch) -> tuple[list[list[str]], object]:
    """Train `config`; the reads each step made (set-up excluded) and the result."""
    counter = CountReads()
    per_step: list[list[str]] = []
    step, fetch = loop.Trainer.step, loop.Trainer._next_micro_batches

    def counted_step(self):
        before = len(counter.reads)
        with counter:
            step(self)
        per_step.append(counter.reads[before:])

    def host_side_fetch(self, *args):
        counter.paused += 1
        try:
            return fetch(self, *args)
        finally:
            counter.paused -= 1

    monkeypatch.setattr(loop.Trainer, "step", counted_step)
    monkeypatch.setattr(loop.Trainer, "_next_micro_batches", host_side_fetch)
    return per_step, loop.train(config)


def test_one_host_read_per_step_and_one_per_logging_step(tmp_path, clip_shards, monkeypatch):
    # batch 8 in micro-batches of 4: two forward/backward passes per step, still one read
    train = {"steps": 12, "batch_size": 8, "micro_batch": 4}
    config = micro_run(tmp_path, clip_shards, seed=3, train=train)
    config.metrics.log_every = 5
    per_step, result = _reads_per_step(config, monkeypatch)

    assert result.step == 12 and len(result.history) == 12  # every step still has its row
    for number, reads in enumerate(per_step, start=1):
        logging_step = number % 5 == 0 or number == 12
        assert len(reads) == 1 + logging_step, (number, reads)
        assert "tolist at step.py" in reads[0]  # the NaN guard's flags, counted like any read


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_a_vision_language_step_reads_the_device_once_too(
    tmp_path,
    vlm_shards,  # noqa: F811  (the fixture imported above)
    pack,
    monkeypatch,
):
    """A VLM's forward needs the length of its rows once the images are spliced in (a shape),
    the padding side and the image count: the loader's workers count them on the host when
    they lay out the rows ("splice_sizes"), so the step reads the device only for the NaN guard."""
    config = vlm_config(tmp_path / "run", vlm_shards, data={"pack": pack}, train={"steps": 3})
    config.metrics.log_every = 2
    per_step, result = _reads_per_step(config, monkeypatch)

    assert result.step == 3 and all(row["target_tokens"] > 0 for row in result.history)
    for number, reads in enumerate(per_step, start=1):
        logging_step = number % 2 == 0 or number == 3
        assert len(reads) == 1 + logging_step, (number, reads)
        assert "tolist at step.py" in reads[0]
