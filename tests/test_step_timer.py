"""The step-time split (train/step_timer.py): on a GPU the host only launches kernels, so the
forward+backward is timed by device events read after the step's one device->host read.

No GPU here: `FakeGPU` is a stream that runs what the host launches in order, each kernel
after its launch, and events that complete when the stream reaches them and can be read only
then (as CUDA's `elapsed_time` refuses an unfinished event). The real loop is checked with
events that know whether the step's read has happened since they were recorded."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from micro import make_shards, micro_run
from mmtrain.train import loop
from mmtrain.train.step_timer import StepTimer

DATA_S = 0.010
KERNELS, LAUNCH_S, KERNEL_S = 20, 0.0005, 0.005  # forward+backward: device-bound
CLIP_S, OPTIMIZER_S = 0.002, 0.003  # device time of the clip and the optimizer step


class FakeGPU:
    """One stream and the host clock (seconds)."""

    def __init__(self):
        self.host = 0.0
        self.stream_end = 0.0  # when the work queued so far is done
        self.reads = 0

    def launch(self, device_s: float, host_s: float = LAUNCH_S) -> None:
        self.host += host_s  # the kernel can start once launched
        self.stream_end = max(self.stream_end, self.host) + device_s

    def read(self) -> None:
        """A device->host read: the host waits for everything queued."""
        self.host = max(self.host, self.stream_end)
        self.reads += 1

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGPU):
        self.gpu, self.at = gpu, None

    def record(self) -> None:
        self.at = max(self.gpu.stream_end, self.gpu.host)  # when the stream reaches it

    def query(self) -> bool:
        return self.at is not None and self.gpu.host >= self.at

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time")
        return (end.at - self.at) * 1000.0

    def synchronize(self) -> None:
        raise AssertionError("the timer must not wait for the device")

    wait = synchronize


def _gpu_step(gpu: FakeGPU, timer: StepTimer, read: bool = True) -> dict[str, float]:
    timer.start()
    gpu.host += DATA_S  # the loader
    timer.data_ready()
    for _ in range(KERNELS):
        gpu.launch(KERNEL_S)
    timer.compute_done()
    gpu.launch(CLIP_S)
    if read:
        gpu.read()  # the NaN guard's flags
    gpu.launch(OPTIMIZER_S)
    return timer.finish()


def test_on_a_gpu_compute_is_the_device_time_of_forward_and_backward():
    gpu = FakeGPU()
    start = gpu.host
    times = _gpu_step(gpu, StepTimer(torch.device("cuda"), gpu.event, lambda: gpu.host))
    step_s = gpu.host - start
    assert gpu.reads == 1  # the step's own read; the timer added none
    assert times["data"] == pytest.approx(DATA_S, rel=1e-12)
    # From the first kernel's launch to the last kernel's end, on the device.
    assert times["compute"] == pytest.approx(LAUNCH_S + KERNELS * KERNEL_S, rel=1e-12)
    assert sum(times.values()) == pytest.approx(step_s, rel=1e-12)
    # The rest: the clip, the host's wait at the read, the optimizer's launch. Host stamps
    # would have called the launches (10 ms) compute and the wait (~90 ms) optimizer.
    assert times["optimizer"] == pytest.approx(CLIP_S + LAUNCH_S, rel=1e-9)
    assert times["compute"] > 0.8 * step_s


def test_the_previous_steps_optimizer_kernels_are_not_compute():
    gpu = FakeGPU()
    timer = StepTimer(torch.device("cuda"), gpu.event, lambda: gpu.host)
    _gpu_step(gpu, timer)  # leaves OPTIMIZER_S of kernels running
    timer.start()
    timer.data_ready()  # no data wait: the stream is still busy with them
    for _ in range(KERNELS):
        gpu.launch(KERNEL_S)
    timer.compute_done()
    gpu.read()
    times = timer.finish()
    assert times["compute"] == pytest.approx(KERNELS * KERNEL_S, rel=1e-9)


def test_without_a_read_the_timer_keeps_the_host_split_and_waits_for_nothing():
    gpu = FakeGPU()
    times = _gpu_step(gpu, StepTimer(torch.device("cuda"), gpu.event, lambda: gpu.host), False)
    assert gpu.reads == 0 and gpu.host < gpu.stream_end  # still running: nothing waited
    assert times["compute"] == pytest.approx(KERNELS * LAUNCH_S, rel=1e-12)


def test_on_a_cpu_the_host_stamps_split_the_step():
    now = iter([0.0, 0.25, 1.0, 1.5])
    timer = StepTimer(torch.device("cpu"), clock=lambda: next(now))
    timer.start()
    timer.data_ready()
    timer.compute_done()
    assert timer.finish() == {"data": 0.25, "compute": 0.75, "optimizer": 0.5}


def test_stamps_out_of_order_are_refused():
    timer = StepTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="out of order"):
        timer.compute_done()
    timer.start()
    with pytest.raises(RuntimeError, match="finish before"):
        timer.finish()


# ----------------------------------------------------------------------------- in the loop
class CountTolist(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "tolist":
            self.reads += 1
        return func(*args, **(kwargs or {}))


class ReadAwareEvent:
    """Complete once the step's read (`tolist`) has happened after its record; times by the
    host clock (a CPU runs each op when called)."""

    def __init__(self, reads: CountTolist):
        self.reads = reads

    def record(self) -> None:
        import time

        self.seen, self.at = self.reads.reads, time.perf_counter()

    def query(self) -> bool:
        return self.reads.reads > self.seen

    def elapsed_time(self, end: ReadAwareEvent) -> float:
        assert self.query() and end.query(), "events read before the step's read"
        return (end.at - self.at) * 1000.0


def test_the_loop_reads_the_events_after_its_one_read(tmp_path, monkeypatch):
    reads = CountTolist()
    timed: list[bool] = []

    class Timer(StepTimer):
        def __init__(self, device):
            super().__init__(device, event_factory=lambda: ReadAwareEvent(reads))

        def _device_compute_s(self, host_s):
            seconds = super()._device_compute_s(host_s)
            timed.append(seconds is not None)
            return seconds

    monkeypatch.setattr(loop, "StepTimer", Timer)
    shards = make_shards(tmp_path / "shards", 24)
    config = micro_run(tmp_path, shards, train={"steps": 3, "batch_size": 8, "micro_batch": 4})
    with reads:
        result = loop.train(config)
    assert timed == [True, True, True]  # every step's compute came from its events
    for row in result.history:
        parts = row["data_wait_s"] + row["compute_s"] + row["optimizer_s"]
        assert parts == pytest.approx(row["step_s"], rel=1e-12)
        assert 0 < row["compute_s"] <= row["step_s"]
