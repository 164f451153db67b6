"""CPU offload (FSDP2's CPUOffloadPolicy, train.offload, `mmtrain plan --offload`): what the host
holds, the host memory a server needs, and the host link's traffic and time per step.

What lives where (torch.distributed.fsdp._fully_shard, `FSDPParam` and `foreach_reduce`):
- Every sharded parameter (trained and frozen) is kept on the host, in pinned memory, as the
  model holds it (fp32 under autocast; a frozen weight in the compute dtype, NF4 as NF4); its
  gradient shard arrives there in fp32 (the reduce dtype), also pinned (a non-blocking
  device-to-host copy allocates pinned memory); the optimizer's states are created on the host
  beside them (`zeros_like`: pageable memory) and the optimizer steps on the CPU.
- Pinned memory comes from PyTorch's CachingHostAllocator, which rounds every allocation up to
  a power of two (ATen/core/CachingHostAllocator.h, `PowerOf2Ceil`, unless
  PYTORCH_CUDA_ALLOC_CONF's pinned_max_round_threshold says otherwise): a 33.6 MB shard takes
  64 MiB. The planner rounds each parameter tensor's shard (fsdp_units.py lists them; a stack's
  small tensors, biases and norms, are rounded together, and the parameters outside its blocks
  as one tensor, at their unit's mean bytes per parameter).
- A server needs the host memory of all its ranks: ranks per server x (pinned parameters and
  gradients + optimizer states). Not counted: the processes themselves (Python, CUDA's host
  side, data-loader workers and their decoded samples), which take GBs per rank of their own;
  the plan keeps the GPU's headroom share of the server's memory free for them.

Traffic per micro-batch and rank over the GPU's host link (hardware/gpus.csv `host_link`: PCIe
or NVLink-C2C, full duplex, at its achievable rate): each unit's shards are copied in for each
of its all-gathers (a block twice: forward and backward; the root once), and each trained
gradient shard copied out after its reduce-scatter (fp32). Copies in are issued ahead with the
all-gathers and hide behind compute like them (up to OVERLAP of it); the first micro-batch's
copies out likewise behind its backward. With gradient accumulation FSDP2 copies the later
micro-batches' gradient shards synchronously and adds them on the CPU (`foreach_reduce`: no
non-blocking copy when a gradient is accumulated): those copies are exposed. The optimizer's
step on the host is not timed; its host-memory traffic (each trained parameter, gradient and
state read, each parameter and state written) is reported beside the plan.

DPO (plan/preference.py): a reference that runs in the step copies weights in once more a
micro-batch (`adapters`: the model's shards; `copy`: the frozen copy's, whose shards live in
pinned host memory too, in the compute dtype); a cached reference copies nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.hardware import GIB, GPU, Catalog
from mmtrain.plan import preference as pref
from mmtrain.plan.activations import BF16_MODEL
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.fsdp_units import Unit, fsdp_units, host_param_bytes, trained_param_bytes
from mmtrain.plan.model import PlanModel
from mmtrain.plan.states import state_bytes
from mmtrain.structured import FieldError

OVERLAP = 0.8  # as compute.py: the share of compute a prefetched copy can hide behind


@dataclass(frozen=True)
class HostEstimate:
    """Host memory and host-link traffic of one rank under CPU offload, and its server's."""

    params_bytes: float  # this rank's parameter shards on the host
    grads_bytes: float  # its gradient shards (fp32)
    optimizer_bytes: float  # its optimizer states (pageable)
    pinned_bytes: float  # parameters and gradients as the pinned allocator rounds them
    ranks_per_server: int
    server_memory_bytes: float | None  # the server's host memory (None: not in the catalog)
    server_memory_source: str
    headroom: float
    h2d_bytes: float  # copied to the GPU per step
    d2h_bytes: float  # copied from the GPU per step
    link: str
    h2d_s: float
    d2h_s: float
    exposed_s: float  # of the link time, what compute does not hide (in the step time)
    optimizer_traffic_bytes: float  # host memory the optimizer step reads and writes, a rank

    @property
    def rank_bytes(self) -> float:
        """Host memory one rank holds: its pinned shards and its optimizer states."""
        return self.pinned_bytes + self.optimizer_bytes

    @property
    def server_bytes(self) -> float:
        """Host memory a server needs for its ranks' offloaded states."""
        return self.rank_bytes * self.ranks_per_server

    @property
    def server_budget_bytes(self) -> float | None:
        if self.server_memory_bytes is None:
            return None
        return self.server_memory_bytes * (1 - self.headroom)

    @property
    def fits(self) -> bool | None:
        """Whether a server's host memory holds its ranks' states (None: unknown memory)."""
        budget = self.server_budget_bytes
        return None if budget is None else self.server_bytes <= budget

    def to_dict(self) -> dict:
        return {
            "params_bytes": int(self.params_bytes),
            "grads_bytes": int(self.grads_bytes),
            "optimizer_bytes": int(self.optimizer_bytes),
            "pinned_bytes": int(self.pinned_bytes),
            "rank_bytes": int(self.rank_bytes),
            "ranks_per_server": self.ranks_per_server,
            "server_bytes": int(self.server_bytes),
            "server_memory_bytes": None
            if self.server_memory_bytes is None
            else int(self.server_memory_bytes),
            "server_memory_source": self.server_memory_source,
            "server_budget_bytes": None
            if self.server_budget_bytes is None
            else int(self.server_budget_bytes),
            "fits": self.fits,
            "h2d_bytes_per_step": int(self.h2d_bytes),
            "d2h_bytes_per_step": int(self.d2h_bytes),
            "link": self.link,
            "h2d_s": round(self.h2d_s, 6),
            "d2h_s": round(self.d2h_s, 6),
            "exposed_s": round(self.exposed_s, 6),
            "optimizer_traffic_bytes": int(self.optimizer_traffic_bytes),
        }


def pinned_size(nbytes: float) -> int:
    """Bytes the CachingHostAllocator reserves for a pinned block of `nbytes` (a power of two)."""
    n = max(int(-(-nbytes // 1)), 1)
    return 1 << (n - 1).bit_length()


def grad_host_bytes(precision: str) -> int:
    """A gradient shard on the host: the reduce dtype (fp32), bf16 for a bf16 model."""
    return 2 if precision == "bf16-pure" else 4


def optimizer_host_bytes(precision: str, optimizer: str, bytes_per_param: int) -> float:
    """Optimizer states per trained parameter beside it on the host: under autocast the
    parameter itself is the fp32 master, so only the optimizer's own states, as an fp32
    model's (AdamW 8); a bf16 model's as states.py counts them (bf16-weights with its fp32
    master, bf16-pure without)."""
    held = precision if precision in BF16_MODEL else "fp32"
    return state_bytes(held, optimizer, bytes_per_param).optimizer


def _pinned(unit: Unit, precision: str, shards: int) -> float:
    """One unit's pinned parameter and gradient shards, each tensor rounded (module docstring)."""
    per_param = host_param_bytes(unit, precision) / max(unit.params, 1)
    params = sum(pinned_size(n / shards * per_param) for n in unit.tensors)
    grads = 0.0
    if unit.trainable:
        tensors = unit.tensors if unit.trainable == unit.params else (unit.trainable,)
        grads = sum(pinned_size(n / shards * grad_host_bytes(precision)) for n in tensors)
    return params + grads


def _copy_pinned(units: list[Unit], cfg: PlanConfig, shards: int) -> float:
    """DPO's frozen copy offloaded (train/model_setup.py `build_reference`, FSDP2 as the policy):
    each tensor's shard in the compute dtype, pinned and rounded (module docstring)."""
    per_param = pref.reference_weight_bytes(cfg.precision)
    return sum(u.count * sum(pinned_size(n / shards * per_param) for n in u.tensors)
               for u in units)  # fmt: skip


def _ranks_per_server(gpu: GPU, cfg: PlanConfig) -> int:
    per_server = gpu.server_gpus or cfg.gpus_per_node or gpu.gpus_per_node
    return min(cfg.gpus, per_server)


def _server_memory(gpu: GPU, cfg: PlanConfig) -> tuple[float | None, str]:
    if cfg.host_memory_gib is not None:
        return cfg.host_memory_gib * GIB, "--host-memory-gib"
    if gpu.server_memory_gib is None:
        return None, f"no reference server for {gpu.key} in the catalog: pass --host-memory-gib"
    return gpu.server_memory_gib * GIB, gpu.host_source


def host_estimate(
    model: PlanModel,
    cfg: PlanConfig,
    gpu: GPU,
    catalog: Catalog,
    micro_compute_s: float,
) -> HostEstimate:
    """Host memory and host-link traffic of `cfg` (offload on) for one rank and its server;
    `micro_compute_s` is one micro-batch's compute on a GPU (what the copies hide behind)."""
    if not gpu.host_link:
        raise FieldError(
            f"gpus.{gpu.key}.host_link",
            "CPU offload is planned over the GPU's host link, which the catalog lacks for "
            f"{gpu.key}: add host_link (pcie4, pcie5, nvlink-c2c, ...) in --hardware",
        )
    link = catalog.link(gpu.host_link, f"gpus.{gpu.key}.host_link")
    shards = cfg.shard_ranks * cfg.tp * cfg.pp  # every rank holds 1/gpus of each unit
    units = fsdp_units(model, cfg.shard_ranks)
    trained = sum(u.count * u.trainable for u in units) / shards
    params = sum(u.count * host_param_bytes(u, cfg.precision) for u in units) / shards
    grads = trained * grad_host_bytes(cfg.precision)
    optimizer = trained * optimizer_host_bytes(cfg.precision, cfg.optimizer, cfg.bytes_per_param)
    pinned = sum(u.count * _pinned(u, cfg.precision, shards) for u in units)
    copy = pref.reference_copy_bytes(model, cfg) / cfg.shard_ranks  # a frozen copy's shards
    params += copy
    pinned += _copy_pinned(units, cfg, shards) if copy else 0.0
    # DPO's reference in the step is one more forward of offloaded weights: the model's
    # without its adapters (its shards copied in once more), or the frozen copy's (its shards,
    # in the compute dtype); a cached reference adds none
    adapters = pref.is_dpo(cfg) and pref.reference_kind(model, cfg) == "adapters"
    h2d_micro = sum(
        u.count * (u.gathers + adapters) * host_param_bytes(u, cfg.precision) for u in units
    )
    h2d_micro /= shards
    h2d_micro += copy
    d2h_micro = grads
    rate = link.bytes_per_s()
    m = cfg.accumulation
    h2d_s, d2h_s = h2d_micro / rate, d2h_micro / rate
    backward = micro_compute_s * 2 / 3
    exposed = m * max(0.0, h2d_s - OVERLAP * micro_compute_s)
    exposed += max(0.0, d2h_s - OVERLAP * backward) + (m - 1) * d2h_s
    memory, source = _server_memory(gpu, cfg)
    per_param = trained_param_bytes(cfg.precision)
    opt_per_param = optimizer / trained if trained else 0.0
    traffic = trained * (2 * per_param + grad_host_bytes(cfg.precision) + 2 * opt_per_param)
    return HostEstimate(
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=optimizer,
        pinned_bytes=pinned,
        ranks_per_server=_ranks_per_server(gpu, cfg),
        server_memory_bytes=memory,
        server_memory_source=source,
        headroom=cfg.headroom,
        h2d_bytes=m * h2d_micro,
        d2h_bytes=m * d2h_micro,
        link=link.key,
        h2d_s=m * h2d_s,
        d2h_s=m * d2h_s,
        exposed_s=exposed,
        optimizer_traffic_bytes=traffic,
    )
