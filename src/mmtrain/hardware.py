"""GPU and interconnect catalog: what the planner budgets against.

Data lives beside this module (`hardware/gpus.csv`, `hardware/interconnects.yaml`), derived from
the project's reference table with every assumption written in its `notes` column. Memory is kept
twice: the vendor label (`memory_nominal_gb`, decimal GB as marketed) and what a process can
allocate (`memory_usable_gib`, as nvidia-smi reports it). The planner uses only the usable figure.

Names are matched case-insensitively, ignoring spaces, dashes and underscores, against the key,
its aliases, the full name and its `device_names`, so `B300`, `hgx-b300`, `NVIDIA B300 SXM
(Blackwell Ultra)` and `NVIDIA B300 SXM6 AC` are one GPU. `device_names` are the product names the
CUDA driver reports (what `torch.cuda.get_device_name()` and `nvidia-smi --query-gpu=name` print,
e.g. `NVIDIA H100 80GB HBM3` for the SXM part and `NVIDIA H100 PCIe` for the PCIe one): each is
listed on the one row it names, never guessed from a substring, because the variants of a chip
differ in clocks, memory and links. Two rows claiming one name is an error. On a MIG instance the
driver appends ` MIG 1g.10gb`; `resolve_device` splits that off and returns the instance's share
of the GPU's compute. A user YAML (`--hardware FILE`) adds or overrides GPUs and interconnects.

Prices (`price_per_gpu_hour`) are indicative on-demand list prices in US dollars per GPU-hour,
rounded, as set for this catalog in 2026-11 from public cloud list prices (no single provider's
quote; reserved and spot prices are often half of them or less). They only rank strategies
and give an order of magnitude: pass `--price-per-gpu-hour` (or a YAML row) with your own.

The host side, for CPU offload (plan/offload.py): `host_link` is the interconnect a GPU copies to
and from its host's memory over (PCIe, or NVLink-C2C to a Grace CPU), and `server_memory_gib` the
host memory of a reference server holding `server_gpus` of them (an MLPerf system description,
cited in `host_source`); empty where no reference server is cited.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from mmtrain.structured import FieldError, closest, from_dict

DATA_DIR = Path(__file__).parent / "hardware"
GIB = 1024**3
GB = 10**9
CURRENCY = "USD"
PRICE_SOURCE = "indicative on-demand list price, catalog of 2026-11"


@dataclass(frozen=True)
class MigProfile:
    """One MIG instance shape: `name` as NVIDIA writes it (e.g. 3g.40gb), how many fit per GPU."""

    name: str
    memory_gib: float
    instances: int


@dataclass(frozen=True)
class Interconnect:
    """A link class; `gbps` is GB/s per GPU per direction, `efficiency` the achievable share."""

    key: str
    name: str
    gbps: float
    efficiency: float = 0.8
    source: str = ""

    def bytes_per_s(self) -> float:
        return self.gbps * GB * self.efficiency


@dataclass(frozen=True)
class GPU:
    """One accelerator model. TFLOPS are dense (no sparsity) tensor-core peaks."""

    key: str
    name: str
    vendor: str
    memory_nominal_gb: float
    memory_usable_gib: float
    mem_bw_tbps: float
    bf16_tflops: float | None
    fp16_tflops: float | None
    fp8_tflops: float | None
    tf32_tflops: float | None
    mamf_fraction: float  # best measured matmul / spec-sheet peak (stas00 MAMF table)
    intra_node: str  # interconnect key between GPUs of a node
    gpus_per_node: int
    network: str  # interconnect key between nodes
    mig_profiles: tuple[MigProfile, ...] = ()
    tdp_w: float | None = None
    price_per_gpu_hour: float | None = None  # USD, indicative; override with --price-per-gpu-hour
    price_source: str = PRICE_SOURCE  # where the price comes from, printed beside costs
    aliases: tuple[str, ...] = ()
    device_names: tuple[str, ...] = ()  # as torch.cuda.get_device_name() prints them
    source: str = ""
    notes: str = ""
    host_link: str = ""  # interconnect key to the host's memory ("": unknown)
    server_memory_gib: float | None = None  # host memory of a reference server
    server_gpus: int | None = None  # GPUs sharing that server's host memory
    host_source: str = ""

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_usable_gib * GIB)

    @property
    def nominal_bytes(self) -> int:
        return int(self.memory_nominal_gb * GB)

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for the matmul dtype a precision mode runs in.

        fp32 training is assumed to use TF32 tensor cores (`torch.backends.cuda.matmul.allow_tf32`).
        """
        column = {
            "fp32": "tf32_tflops",
            "bf16": "bf16_tflops",
            "bf16-weights": "bf16_tflops",
            "bf16-pure": "bf16_tflops",
        }.get(precision, f"{precision}_tflops")
        tflops = getattr(self, column, None)
        if not tflops:
            raise FieldError(
                "precision",
                f"{self.name} has no published {precision} tensor rate; pick another precision",
            )
        return tflops * 1e12


def normalise(name: str) -> str:
    """`NVIDIA H100-SXM 80GB` -> `nvidiah100sxm80gb`: the form names are compared in."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


class Catalog:
    """GPUs and interconnects by key, with alias lookup."""

    def __init__(self, gpus: dict[str, GPU], links: dict[str, Interconnect]):
        self.gpus = gpus
        self.links = links
        self._index: dict[str, str] = {}
        for key, gpu in gpus.items():
            for name in (key, gpu.name, *gpu.aliases, *gpu.device_names):
                other = self._index.setdefault(normalise(name), key)
                if other != key:
                    raise FieldError(
                        f"gpus.{key}", f"name {name!r} already names GPU {other!r}; drop one"
                    )

    def gpu(self, name: str) -> GPU:
        """The GPU called `name` (key, alias or full name, any case); errors list the closest."""
        key = self._index.get(normalise(name))
        if key is None:
            raise FieldError(
                "--gpu",
                f"unknown GPU {name!r}{closest(name, self.gpus)}; known: {', '.join(self.gpus)}",
            )
        return self.gpus[key]

    def resolve_device(self, device_name: str) -> tuple[GPU, float]:
        """The GPU a driver-reported name stands for, and the share of its compute the device has:
        1 for a whole GPU, `g / slices` for a MIG instance (`NVIDIA A100-SXM4-40GB MIG 3g.20gb`
        has 3 of the 7 compute slices, the most any of the GPU's profiles has)."""
        base, mig, profile = device_name.partition(" MIG ")
        gpu = self.gpu(base.strip())
        if not mig:
            return gpu, 1.0
        slices = max((int(p.name.split("g.")[0]) for p in gpu.mig_profiles), default=0)
        match = re.fullmatch(r"(\d+)g\.\d+gb(\+me)?", profile.strip())
        if not match or not slices:
            raise FieldError("--gpu", f"unknown MIG profile {profile!r} of {gpu.name}")
        return gpu, int(match.group(1)) / slices

    def link(self, key: str, field_name: str = "network") -> Interconnect:
        if key not in self.links:
            raise FieldError(
                field_name,
                f"unknown interconnect {key!r}{closest(key, self.links)}; known: {', '.join(self.links)}",
            )
        return self.links[key]

    def extended(self, path: str | Path) -> Catalog:
        """A copy with the GPUs and interconnects of a user YAML added or overridden.

        The file holds `gpus: {key: {field: value, ...}}` and/or `interconnects: {key: {...}}`; a
        GPU whose key exists starts from the catalog row, so one field can be changed alone.
        """
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise FieldError("hardware", f"cannot read {path}: {err}") from None
        if not isinstance(data, dict) or set(data) - {"gpus", "interconnects"}:
            raise FieldError(
                "hardware", f"{path}: expected a mapping with keys gpus and/or interconnects"
            )
        links = dict(self.links)
        for key, row in (data.get("interconnects") or {}).items():
            links[key] = from_dict(
                Interconnect, {"key": key, **row}, f"{path}: interconnects.{key}"
            )
        gpus = dict(self.gpus)
        for key, row in (data.get("gpus") or {}).items():
            if isinstance(row, dict) and "price_per_gpu_hour" in row:
                row.setdefault("price_source", str(path))  # the user's price, not the catalog's
            gpus[key] = _gpu_from_yaml(key, row, gpus.get(key), f"{path}: gpus.{key}")
        return Catalog(gpus, links)


def _gpu_from_yaml(key: str, row: Any, base: GPU | None, path: str) -> GPU:
    if not isinstance(row, dict):
        raise FieldError(path, "expected a mapping of GPU fields")
    row = dict(row)
    if "mig_profiles" in row:
        row["mig_profiles"] = tuple(
            from_dict(MigProfile, m, f"{path}.mig_profiles") for m in row["mig_profiles"]
        )
    for listed in ("aliases", "device_names"):
        if listed in row:
            row[listed] = tuple(row[listed])
    if base is not None:
        known = {f.name for f in fields(GPU)}
        unknown = set(row) - known
        if unknown:
            name = sorted(unknown)[0]
            raise FieldError(f"{path}.{name}", f"unknown key{closest(name, known)}")
        return replace(base, **row)
    return from_dict(GPU, {"key": key, **row}, path)


def _number(text: str) -> float | None:
    return float(text) if text.strip() else None


def _mig(text: str, usable_gib: float) -> tuple[MigProfile, ...]:
    """`1g.10gb:7;...;7g.80gb:1` -> profiles; memory scaled so the full profile is `usable_gib`
    (MIG names carry rounded vendor GB labels, not what a process can allocate)."""
    if not text.strip():
        return ()
    pairs = [item.split(":") for item in text.split(";")]
    labels = [float(re.search(r"\.(\d+)gb", name).group(1)) for name, _ in pairs]
    scale = usable_gib / max(labels)
    return tuple(
        MigProfile(name, round(label * scale, 1), int(n))
        for (name, n), label in zip(pairs, labels, strict=False)
    )


def _gpu_from_csv(row: dict[str, str]) -> GPU:
    usable = float(row["memory_usable_gib"])
    return GPU(
        key=row["key"],
        name=row["name"],
        vendor=row["vendor"],
        memory_nominal_gb=float(row["memory_nominal_gb"]),
        memory_usable_gib=usable,
        mem_bw_tbps=float(row["mem_bw_tbps"]),
        bf16_tflops=_number(row["bf16_tflops"]),
        fp16_tflops=_number(row["fp16_tflops"]),
        fp8_tflops=_number(row["fp8_tflops"]),
        tf32_tflops=_number(row["tf32_tflops"]),
        mamf_fraction=float(row["mamf_fraction"]),
        intra_node=row["intra_node"],
        gpus_per_node=int(row["gpus_per_node"]),
        network=row["network"],
        mig_profiles=_mig(row["mig_profiles"], usable),
        tdp_w=_number(row["tdp_w"]),
        price_per_gpu_hour=_number(row["price_per_gpu_hour"]),
        aliases=tuple(a for a in row["aliases"].split(";") if a),
        device_names=tuple(a for a in row["device_names"].split(";") if a),
        source=row["source"],
        notes=row["notes"],
        host_link=row.get("host_link", ""),
        server_memory_gib=_number(row.get("server_memory_gib", "")),
        server_gpus=int(row["server_gpus"]) if row.get("server_gpus", "").strip() else None,
        host_source=row.get("host_source", ""),
    )


@lru_cache(maxsize=1)
def default_catalog() -> Catalog:
    """The built-in catalog (read once per process)."""
    with open(DATA_DIR / "gpus.csv", newline="") as f:
        gpus = {row["key"]: _gpu_from_csv(row) for row in csv.DictReader(f)}
    raw = yaml.safe_load((DATA_DIR / "interconnects.yaml").read_text())
    links = {key: Interconnect(key=key, **value) for key, value in raw.items()}
    return Catalog(gpus, links)


def load_catalog(extra: str | Path | None = None) -> Catalog:
    """The built-in catalog, extended by a user YAML when one is given."""
    catalog = default_catalog()
    return catalog.extended(extra) if extra else catalog


def get_gpu(name: str) -> GPU:
    """Shorthand: a GPU of the built-in catalog by key, alias or name."""
    return default_catalog().gpu(name)
