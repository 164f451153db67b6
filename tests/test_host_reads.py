"""The step never waits on the device but once: mmtrain's code reads device values on the host
(`item`, `tolist`, `cpu`, `float(t)`, `bool(t)`...) once per optimizer step, the NaN guard's
flags, and once more on a logging step, where the recorder reads the interval's rows. A native
VLM's forward and backward make no device sync at all, and copy host values to the device only
asynchronously.

A CPU has no second device, so `DeviceCounter` simulates one. A tensor built by the counted
code on the host is a *host* tensor: a factory call without `device=` (`torch.arange(n)`,
`torch.tensor(values)`), and whatever is computed from host tensors only. Every other tensor
(the batch, which the loader's pinned copies bring, the parameters, and all computed from them)
stands for a *device* tensor. Then, in the counted code, what a GPU would wait for is:

- read: a device tensor's values read on the host: `tolist`, `cpu`, `torch.equal`..., and every
  scalar read, which aten sees as `_local_scalar_dense` whoever asked (`item`, `int(t)`,
  `bool(t)`, and a factory given a device scalar: `torch.arange(t.max())`);
- shape: an op whose output shape depends on a device tensor's values (`nonzero`, boolean-mask
  indexing, `unique`, `bincount`, `masked_select`, `repeat_interleave` without output_size):
  CUDA copies the count to the host;
- blocking copy: a host tensor moved to the device without `non_blocking=True`, host data
  given straight to the device (`torch.tensor(values, device=d)`, `t.new_tensor(values)`), or a
  host tensor of one or more dimensions meeting a device tensor in an op (an implicit copy, or
  an error on CUDA).

An asynchronous copy (`.to(device, non_blocking=True)` of a host tensor, from page-locked
memory on CUDA: models/host_copy.py) is counted apart, as `copy`: the host does not wait.
Reads of host tensors are free, as on a GPU. What torch's own code does (an optimizer's CPU
step counter) is torch's business; bench/gpu_vlm_syncs.py runs a native VLM step on a GPU
under `torch.cuda.set_sync_debug_mode("warn")` for the rest.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mmtrain
from micro import make_shards, micro_run
from mmtrain.train import loop
from test_train_native_vlm import _config as native_config
from test_train_native_vlm import shards as native_shards  # noqa: F401  (a fixture)
from test_train_vlm import _config as vlm_config
from test_train_vlm import shards as vlm_shards  # noqa: F401  (a fixture)

MMTRAIN = Path(mmtrain.__file__).parent
HOST_SIDE = MMTRAIN / "data"  # the data pipeline runs on the host by design
TORCH = Path(torch.__file__).parent
OVERRIDES = TORCH / "overrides.py"

# Reads that reach no scalar read at aten level (`item`, `int(t)`, `bool(t)`... do: _DispatchSide).
READS = {"tolist", "cpu", "numpy", "equal"}
SCALAR_READ = "aten._local_scalar_dense.default"
FACTORIES = {"arange", "zeros", "ones", "full", "empty", "linspace", "logspace", "eye", "rand",
             "randn", "randint", "randperm", "tensor", "as_tensor", "scalar_tensor"}  # fmt: skip
HOST_DATA = {"tensor", "as_tensor", "new_tensor"}  # Python values, not tensors, become one
MOVES = {"to", "cuda"}
DATA_SHAPED = {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
               "aten.unique_dim.default", "aten.unique_consecutive.default",
               "aten.bincount.default", "aten.argwhere.default"}  # fmt: skip
SYNCS = ("read", "shape", "blocking copy")


def _caller(name: str) -> Path | None:
    """The file:line of mmtrain's code that called torch's `name` (None when torch's own code
    did: an optimizer's step, a module's forward). A Python wrapper of torch (`F.pad`) and
    its `handle_torch_function` stand between the caller and the mode: skipped."""
    frame = sys._getframe(2)
    while frame is not None and Path(frame.f_code.co_filename) == OVERRIDES:
        frame = frame.f_back
    if frame is not None and frame.f_code.co_name == name:
        if Path(frame.f_code.co_filename).is_relative_to(TORCH):
            frame = frame.f_back
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(MMTRAIN) or path.is_relative_to(HOST_SIDE):
        return None
    return path.with_name(f"{path.name}:{frame.f_lineno}")


class DeviceCounter:
    """Counts, by kind, what a GPU would wait for in mmtrain's code (the module docstring says
    how a CPU stands for two devices). `events` are (kind, what, file:line)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.paused = 0
        self.caller: Path | None = None  # who made the torch call under way (`_caller`)
        self._host: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._modes = (_FunctionSide(self), _DispatchSide(self))

    def __enter__(self) -> DeviceCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def is_host(self, value: object) -> bool:
        return isinstance(value, torch.Tensor) and self._host.get(id(value)) is value

    def mark(self, value: object, host: bool) -> None:
        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, torch.Tensor):
                if host:
                    self._host[id(tensor)] = tensor
                else:
                    self._host.pop(id(tensor), None)

    def record(self, kind: str, what: str) -> None:
        """An event of the torch call under way, when mmtrain's code made it."""
        where = self.caller
        if not self.paused and where is not None:
            self.events.append((kind, what, where.name))


class _FunctionSide(TorchFunctionMode):
    """Reads, host tensors and the copies between the two sides, as the code calls torch."""

    def __init__(self, counter: DeviceCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        counter = self.counter
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [counter.is_host(t) for t in tensors]
        on_device = "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])
        outer, counter.caller = counter.caller, _caller(name)
        try:
            if name in READS and tensors and not host[0]:
                counter.record("read", name)
            result = func(*args, **kwargs)  # its aten ops are the caller's (_DispatchSide)
            self._follow(name, result, tensors, host, on_device, kwargs)
        finally:
            counter.caller = outer
        return result

    def _follow(self, name, result, tensors, host, on_device, kwargs) -> None:
        """Mark the result's side; record the copies between the sides."""
        counter = self.counter
        if name in HOST_DATA and not (tensors and name == "as_tensor"):
            if on_device or (name == "new_tensor" and not host[0]):
                counter.record("blocking copy", name)  # host values straight to the device
                counter.mark(result, host=False)
            else:
                counter.mark(result, host=True)
        elif name in FACTORIES and not tensors:
            counter.mark(result, host=not on_device)
        elif name in MOVES and tensors and host[0] and (on_device or name == "cuda"):
            kind = "copy" if kwargs.get("non_blocking") else "blocking copy"
            counter.record(kind, name)
            counter.mark(result, host=False)
        elif name == "pin_memory":
            counter.mark(result, host=True)
        elif tensors and all(host):
            counter.mark(result, host=True)
        elif any(h and t.dim() > 0 for h, t in zip(host, tensors, strict=True)):
            counter.record("blocking copy", f"{name} of a host tensor with a device one")
            counter.mark(result, host=False)
        else:
            counter.mark(result, host=False)


class _DispatchSide(TorchDispatchMode):
    """Scalar reads and ops whose output shape depends on a device tensor's values (aten level:
    boolean-mask indexing becomes `aten.index` with a bool index only here). What an op makes
    of host tensors only is a host tensor (a composite's intermediates, e.g. the count
    `repeat_interleave` reads)."""

    def __init__(self, counter: DeviceCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        counter = self.counter
        shaped = name in DATA_SHAPED or (
            name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None
        )
        if name.startswith(("aten.index.", "aten.index_put")) and len(args) > 1:
            shaped = any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
            )
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        from_host = bool(tensors) and all(counter.is_host(t) for t in tensors)
        if name == SCALAR_READ and not from_host:
            counter.record("read", name)
        elif shaped and not from_host:
            counter.record("shape", name)
        result = func(*args, **kwargs)
        if from_host:
            counter.mark(result, host=True)
        return result


def test_the_counter_sees_each_wait_a_gpu_would_make():
    """The counter can fail: mmtrain's own functions on the paths the native forward no longer
    takes are counted, each as its kind, where they are; the paths it takes count nothing."""
    from mmtrain.models.host_copy import to_device
    from mmtrain.models.mrope import rope_index
    from mmtrain.models.splice import id_spans
    from mmtrain.models.visual_inputs import visual_order

    image, clip = 9, 8
    text = torch.tensor([[1, image, 2, clip, 3]])  # made outside the counter: device tensors
    valid = torch.ones_like(text, dtype=torch.bool)
    tokens = torch.tensor([4, 2])
    cpu = torch.device("cpu")
    with DeviceCounter() as counter:
        is_visual, _ = visual_order(text, image, clip, valid, 1)  # a boolean mask
        id_spans(is_visual, tokens)  # the placeholders counted on the device: int(t)
        rope_index(text[0], [(1, 2, 2)], [(1, 2, 2)], image_token_id=image, video_token_id=clip,
                   merge_size=2)  # the ids read (tolist), positions moved back blocking  # fmt: skip
    assert Counter((kind, where.split(":")[0]) for kind, _, where in counter.events) == {
        ("shape", "visual_inputs.py"): 1,
        ("read", "splice.py"): 1,
        ("read", "mrope.py"): 1,
        ("blocking copy", "mrope.py"): 1,
    }
    with DeviceCounter() as counter:
        is_visual, _ = visual_order(text, image, clip, valid, 1, inputs=2)  # a scatter
        id_spans(is_visual, tokens, placeholders=2)  # the count from the host
        to_device(torch.arange(3), cpu)  # host values, copied asynchronously
    assert [kind for kind, _, _ in counter.events] == ["copy"]


@pytest.fixture(scope="module")
def clip_shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"), 40)


def _events_per_step(config, monkeypatch):
    """Train `config`; the events each step made (set-up excluded) and the result."""
    counter = DeviceCounter()
    per_step: list[list[tuple[str, str, str]]] = []
    step, fetch = loop.Trainer.step, loop.Trainer._next_micro_batches

    def counted_step(self):
        before = len(counter.events)
        with counter:
            step(self)
        per_step.append(counter.events[before:])

    def host_side_fetch(self, *args):
        counter.paused += 1
        try:
            with torch.overrides._pop_mode_temporarily(), torch._C.DisableTorchFunction():
                return fetch(self, *args)
        finally:
            counter.paused -= 1

    monkeypatch.setattr(loop.Trainer, "step", counted_step)
    monkeypatch.setattr(loop.Trainer, "_next_micro_batches", host_side_fetch)
    return per_step, loop.train(config)


def _reads(events: list[tuple[str, str, str]]) -> list[str]:
    return [f"{what} at {where}" for kind, what, where in events if kind == "read"]


def test_one_host_read_per_step_and_one_per_logging_step(tmp_path, clip_shards, monkeypatch):
    # batch 8 in micro-batches of 4: two forward/backward passes per step, still one read
    train = {"steps": 12, "batch_size": 8, "micro_batch": 4}
    config = micro_run(tmp_path, clip_shards, seed=3, train=train)
    config.metrics.log_every = 5
    per_step, result = _events_per_step(config, monkeypatch)

    assert result.step == 12 and len(result.history) == 12  # every step still has its row
    for number, events in enumerate(per_step, start=1):
        reads = _reads(events)
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
    per_step, result = _events_per_step(config, monkeypatch)

    assert result.step == 3 and all(row["target_tokens"] > 0 for row in result.history)
    for number, events in enumerate(per_step, start=1):
        reads = _reads(events)
        logging_step = number % 2 == 0 or number == 3
        assert len(reads) == 1 + logging_step, (number, reads)
        assert "tolist at step.py" in reads[0]


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_a_native_vlm_forward_and_backward_never_wait_on_the_device(
    tmp_path,
    native_shards,  # noqa: F811  (the fixture imported above)
    pack,
    monkeypatch,
):
    """Pages and clips at their own sizes: the tower's attention layout, the merged grids and
    the clips' time steps are host values (image shapes, frame rates) that go to the device in
    a few asynchronous copies per forward; the placeholders' count comes with the batch
    ("splice_sizes"), and the placeholders' inputs are ordered by a scatter, not a mask.

    The whole step is counted, not only models/: the backward's ops are attributed to the line
    of train/step.py that calls `backward()`, so a sync there (a boolean mask's index_put) shows
    beside the NaN guard's one read. The recorder's reads on the logging step (the last) are
    the test above's."""
    config = native_config(tmp_path / "run", native_shards, data={"pack": pack},
                           train={"steps": 2, "precision": "fp32"})  # fmt: skip
    per_step, result = _events_per_step(config, monkeypatch)

    assert result.step == 2 and all(row["target_tokens"] > 0 for row in result.history)
    forwards = config.train.batch_size // config.train.micro_batch
    for events in per_step:
        syncs = [e for e in events if e[0] in SYNCS and not e[2].startswith("recorder.py:")]
        assert [(kind, what) for kind, what, _ in syncs] == [("read", "tolist")], Counter(syncs)
        assert syncs[0][2].startswith("step.py:")  # the NaN guard's flags
        copies = Counter(where for kind, _, where in events if kind == "copy")
        assert sum(copies.values()) <= 3 * forwards, copies  # layout, grids, time steps
