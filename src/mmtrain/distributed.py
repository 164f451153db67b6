"""Small helpers over `torch.distributed` that also work when it is not initialised.

Library code asks `world_size()` / `rank()` instead of checking `dist.is_initialized()` itself,
so the same code runs in one process (world size 1) and under `torchrun`.

`all_gather_with_grad` is the collective a distributed contrastive loss needs: every rank sees
the embeddings of the whole global batch, and gradients flow back to the rank that produced them.

Each collective here runs inside `timed_collective()`: during a training step it counts towards
the step's `comm_s` / `comm_exposed_s` (mmtrain.train.comm_timing); elsewhere that is a no-op.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist

# The timer of the training step in progress (train/comm_timing.py's CommTimer registers itself
# while it is entered); the collectives below time themselves against it. A hook, so that this
# low layer does not import the trainer.
_timer: Any = None
EXPOSED_ALL = "all"  # a blocking collective: the caller waited for all of it
EXPOSED_HIDDEN = "none"  # in flight beside computation: only the waits for it are exposed


def set_collective_timer(timer: Any, only_if: Any = None) -> None:
    """Register `timer` (an object with `in_step`, `begin(exposure)` and `stamp()`), or clear
    it (None; with `only_if`, only when that timer is the registered one)."""
    global _timer
    if only_if is None or _timer is only_if:
        _timer = timer


@contextlib.contextmanager
def timed_collective(collective: str) -> Iterator[None]:
    """Time the blocking collective(s) issued inside this block as exposed communication of the
    current step, under the name `collective` (rows break the exposed time down by it); a
    no-op outside a timed step (one process, eval, checkpoints, tests)."""
    timer = _timer
    if timer is None or not timer.in_step:
        yield
        return
    span = timer.begin(EXPOSED_ALL, collective)
    try:
        yield
    finally:
        span.end = timer.stamp()


def begin_in_flight(collective: str) -> Any:
    """An interval of the current step for a collective launched now that runs beside the
    computation (a ring attention's pass of keys and values): it counts in `comm_s`, and the
    caller's wait for it in `comm_exposed_s` through `timed_collective`. None outside a timed
    step; close it with `end_in_flight` once the collective completed."""
    timer = _timer
    if timer is None or not timer.in_step:
        return None
    return timer.begin(EXPOSED_HIDDEN, collective)


def end_in_flight(span: Any) -> None:
    if span is not None and _timer is not None:
        span.end = _timer.stamp()


_MAX_DIMS = 8

__all__ = [
    "is_initialized",
    "rank",
    "world_size",
    "all_gather",
    "all_gather_with_grad",
    "leave_process_group",
    "end_rank_process",
]


def is_initialized() -> bool:
    """True when a default process group exists (`torch.distributed` available and initialised)."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in `group` (default group when None); 0 when not distributed."""
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: Any = None) -> int:
    """Number of ranks in `group` (default group when None); 1 when not distributed."""
    return dist.get_world_size(group) if is_initialized() else 1


def backend_for(cuda: bool) -> str:
    """The process group's backend: NCCL for CUDA tensors with gloo beside it for host values,
    gloo alone on CPU. Flags, counts and shapes are host values: sent over gloo they never make
    the host wait for the GPU's queue, where an NCCL collective's result read on the host would."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def _host_values_device() -> torch.device:
    """Where host values travel in a collective: the CPU when the group has gloo (every group
    `backend_for` makes), the current GPU only for a group someone made with NCCL alone."""
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(
    values: list[float], device: Any = None, dtype: torch.dtype = torch.float64
) -> list[float]:
    """Element-wise sums of `values` over the ranks (one all-reduce; the values alone without
    a process group). Host values: they travel over gloo where the group has it."""
    if world_size() == 1:
        return list(values)
    total = torch.tensor(values, dtype=dtype, device=device or _host_values_device())
    with timed_collective("all_reduce"):
        dist.all_reduce(total)
    return total.tolist()


def sum_tensor_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over the ranks, on its own device, without reading it on the host (the
    caller reads it when it must); `tensor` itself without a process group."""
    if world_size() == 1:
        return tensor
    total = tensor.clone()
    with timed_collective("all_reduce"):
        dist.all_reduce(total)
    return total


def agree_any(flags: list[bool]) -> list[bool]:
    """Per flag: True if it is True on any rank (one tiny all-reduce), so every rank branches alike."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(flags)
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=_host_values_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v) for v in values.tolist()]


def leave_process_group() -> None:
    """Destroy the default process group now, so that gloo's worker threads end while the
    interpreter is fully alive. Call it last in a rank, with every collective finished.

    Why (a torch behaviour, seen as "terminate called without an active exception", exit code
    -6, on loaded machines): a gloo worker thread releases each finished collective after the
    caller has seen it complete, and dropping the last reference to a tensor made in Python
    takes the GIL. If the process is finalizing by then (it exits without destroying the group,
    or a reference cycle such as DDP's reducer keeps the group alive past
    `destroy_process_group`), Python ends that thread with pthread_exit, whose unwinding through
    a noexcept destructor calls std::terminate (gdb on the core: ProcessGroupGloo::runLoop ->
    ~AsyncWork -> decref_pyobject -> take_gil -> PyThread_exit_thread). `gc.collect()` first
    frees such cycles, so that destroying the group shuts it down and joins its threads.
    """
    gc.collect()
    if is_initialized():
        dist.destroy_process_group()


def end_rank_process(code: int) -> None:
    """End this rank's process now with `code`, skipping Python's finalization.

    Destroying the group is not always enough: after DDP, its C++ reducer keeps the gloo
    backend (and its worker threads) alive through reference cycles Python cannot collect, so
    the race described in `leave_process_group` stays open until the process ends. Everything a
    rank writes is closed (or atomically renamed) before this is called; stdout, stderr and the
    logging handlers are flushed here.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads both
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def default_allocator_settings(
    shapes_vary: bool, environ: MutableMapping[str, str] = os.environ
) -> bool:
    """At a rank's start, before CUDA initialises: let CUDA's caching allocator grow its
    segments in place (`expandable_segments`) when the run's tensors change shape from step to
    step (a language model's rows, a native VLM's pages). With fixed-size segments, blocks
    freed at one shape seldom fit the next, and reserved memory climbs past what tensors use
    (fragmentation: PyTorch's CUDA memory-management notes; torchtitan launches every run so).
    An allocator setting the user gave (either variable) is left as it is. True when set here."""
    if not shapes_vary or any(name in environ for name in ALLOC_CONF_VARIABLES):
        return False
    if torch.cuda.is_initialized():  # the allocator has read its settings: too late
        logging.getLogger(__name__).info(
            "CUDA is initialised already: %s=%s not set", ALLOC_CONF_VARIABLES[0],
            EXPANDABLE_SEGMENTS,
        )  # fmt: skip
        return False
    environ[ALLOC_CONF_VARIABLES[0]] = EXPANDABLE_SEGMENTS
    return True


# glibc's malloc: allocations of at least this many bytes get an mmap of their own, returned
# to the system when freed. Without a fixed threshold glibc raises it (up to 32 MiB) each time
# such a block is freed, after which FSDP's freed all-gather buffers stay in the heap: a 2.24
# GiB Llama sharded over 2 CPU ranks peaks at 2.87 GiB per rank against 2.25 GiB with the
# threshold at 1 MB (bench/big_model_memory.py, bench/RESULTS.md).
MMAP_THRESHOLD_BYTES = 1_000_000
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
MMAP_THRESHOLD_VARIABLE = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at start-up
MMAP_THRESHOLD_TUNABLE = "glibc.malloc.mmap_threshold"  # ... or this in GLIBC_TUNABLES


def fix_malloc_mmap_threshold(environ: Mapping[str, str] = os.environ, libc: Any = None) -> bool:
    """At a rank's start: fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES (mallopt through
    ctypes), so that large freed host buffers go back to the system instead of staying in the
    heap, whatever launched the rank. A threshold the user set (MALLOC_MMAP_THRESHOLD_, or
    glibc.malloc.mmap_threshold in GLIBC_TUNABLES) is left as it is; elsewhere than glibc
    (macOS, musl) nothing happens. `libc`: the C library to call (default: glibc's, when this
    process runs on it). True when the threshold was set here."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if MMAP_THRESHOLD_VARIABLE in environ or MMAP_THRESHOLD_TUNABLE in tunables:
        return False
    libc = libc if libc is not None else _glibc()
    if libc is None:
        return False
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not done:
        logging.getLogger(__name__).info("mallopt(M_MMAP_THRESHOLD) refused; heap left as is")
    return done


def _glibc() -> Any:
    """glibc through ctypes, or None on another C library or system."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def _check_same_shape(tensor: torch.Tensor, group: Any) -> None:
    """Raise on every rank when ranks hold tensors of different shapes.

    Gathering unequal shapes fails obscurely (gloo) or hangs (NCCL); one tiny collective turns
    that into a clear error, raised on all ranks alike so none is left waiting. The shapes are
    host values (`tensor.shape`): they travel over gloo where the group has it, so the check does
    not wait for the GPU's queue.
    """
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(
            f"all_gather supports tensors of up to {_MAX_DIMS} dims, got {tensor.dim()}"
        )
    # [ndim, size_0, ..., size_{ndim-1}, -1 padding]: one fixed-length row per rank.
    row = [tensor.dim(), *tensor.shape] + [-1] * (_MAX_DIMS - tensor.dim())
    local = torch.tensor(row, dtype=torch.int64, device=_host_values_device())
    shapes = [torch.empty_like(local) for _ in range(world_size(group))]
    with timed_collective("shape_check"):
        dist.all_gather(shapes, local, group=group)
    rows = [s.tolist() for s in shapes]
    if any(r != rows[0] for r in rows):
        described = ", ".join(f"rank {i}: {r[1 : 1 + r[0]]}" for i, r in enumerate(rows))
        raise ValueError(
            f"all_gather needs the same tensor shape on every rank, got {described}; "
            "make every rank use the same per-rank batch size (e.g. drop the last partial batch)"
        )


def all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate `tensor` from every rank along dim 0, without gradient (rank order)."""
    if world_size(group) == 1:
        return tensor
    _check_same_shape(tensor, group)
    parts = [torch.empty_like(tensor) for _ in range(world_size(group))]
    with timed_collective("all_gather"):
        dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: concatenate every rank's tensor. Backward: sum the gradients all ranks computed
    for the concatenation and return this rank's slice.

    Every rank's loss may depend on every rank's features, so the gradient for this rank's
    features is the sum over ranks of d loss_r / d features. With DDP's averaging of parameter
    gradients on top, a loss whose mean over ranks is the global loss gets the exact
    single-process gradient.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rows = tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(world_size(group))]
        with timed_collective("all_gather"):
            dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # all_reduce instead of reduce_scatter: gloo has no reduce_scatter, and the tensors are
        # embeddings (batch x dim), so the extra traffic is negligible.
        total = grad.contiguous().clone()
        with timed_collective("all_gather_grad"):
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        start = rank(ctx.group) * ctx.rows
        return total[start : start + ctx.rows], None


def all_gather_with_grad(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate `tensor` [B, ...] from every rank along dim 0 -> [world_size * B, ...].

    Gradients flow back to each rank's own slice, summed over the ranks that used it. Every rank
    must pass the same shape (checked, with an error on all ranks otherwise). Without a process
    group (or with one rank) the tensor is returned unchanged.
    """
    if world_size(group) == 1:
        return tensor
    _check_same_shape(tensor, group)
    return _AllGatherWithGrad.apply(tensor, group)
