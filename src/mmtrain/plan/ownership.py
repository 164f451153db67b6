"""Rent on demand, rent servers by the month, or buy them: a year's GPU work priced three ways.

The model (all money in one currency, `OwnershipInputs.currency`; G GPUs a server, T months of
horizon, 730 hours a month):

- On demand: each useful GPU-hour at `price_per_gpu_hour`; nothing while idle.
- Monthly: whole servers for whole months at `monthly_server_price`. Each repetition of a run of
  H GPU-hours on n GPUs rents ceil(n / G) servers for ceil(H / n / 730) months (renting by
  project: two short runs are two rentals); an inference service of N GPUs for M months a year
  rents ceil(N / G) servers for M months. Break-even compares with its rate at full use,
  `monthly_server_price / (G x 730)` per GPU-hour: a month rented is a month used.
- Buy, per server over T months (`fixed_per_server`):
    capital = purchase x (1 - residual) x min(T, D) / D: straight-line over D depreciation
              months down to the residual share. A horizon shorter than D counts only the
              share used up, as if the book value left were still the owner's (it is not cash
              until sold: the payback month below counts the whole price); a longer horizon
              counts all of it once, the servers running on after their accounting life;
    staff   = staff_fraction x purchase x T / 12: support and staff time, a yearly share of the
              purchase price, for as long as the servers are kept;
    hosting = hosting_per_kw_month x G x tdp_w / 1000 x T: colocation charged on the GPUs'
              IT load, energy apart;
  plus energy on useful hours only, tdp_w / 1000 x pue x power_price per GPU-hour. Both count
  the GPUs' TDP only: idle draw and the server's CPUs, NICs and fans are left out, which
  favours buying.
- Utilisation u: useful GPU-hours over the owned GPUs' hours in the horizon. Owning costs
  fixed / (G x 730 x T x u) + energy per useful GPU-hour, infinite (None) at u = 0. Break-even
  with a rental rate r: u* = fixed / (G x 730 x T x (r - energy)); None ("never") when r is no
  more than the energy or u* > 1. A given `utilisation` charges the plan its share of a fleet
  that busy (work / u GPU-hours of servers), whatever `servers` says.
- Break-even month (payback, in cash): buying pays the servers at month 0 and its running costs
  (staff, hosting, energy) monthly, renting pays monthly; the first whole month by which the
  rental has cost at least as much. Resale is not cash until sold, so it is not counted here.
- Deadline: a rented fleet grows until each training run finishes within it (GPU-hours held
  constant as GPUs are added: optimistic; plan the larger count to check); an owned fleet is the
  servers bought, less the GPUs its inference services hold.
- Figures the catalog has no source for: residual value and staff share are assumed 0 (named as
  assumptions; the decision adds the break-even at a 30% residual value, `SENSITIVITY_RESIDUAL`),
  and without a monthly server price the monthly option is left out (and named so).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from mmtrain.hardware import DATA_DIR, GPU, Catalog, default_catalog
from mmtrain.structured import FieldError

HOURS_PER_MONTH = 730.0  # 8,760 hours a year / 12
CATALOG_CURRENCY = "USD"  # the currency of every price in ownership.yaml and gpus.csv
OPTIONS = ("on_demand", "monthly", "buy")
MONEY = ("price_per_gpu_hour", "monthly_server_price", "purchase_price", "power_price",
         "hosting_per_kw_month")  # fmt: skip
FIGURES = ("price_per_gpu_hour", "monthly_server_price", "purchase_price", "depreciation_months",
           "residual_value", "pue", "power_price", "hosting_per_kw_month", "staff_fraction")  # fmt: skip
# A figure whose absence leaves an option out rather than stopping the comparison.
PRICES_OF_OPTIONS = {"monthly_server_price": "monthly"}
# The residual value of the verdict's sensitivity line: where buying breaks even if the servers
# resell for this share of their price (the default assumes no resale at all).
SENSITIVITY_RESIDUAL = 0.3


def flag(field_name: str) -> str:
    """`monthly_server_price` -> `--monthly-server-price`: the option a value comes from."""
    return "--" + field_name.replace("_", "-")


def _ceil(x: float) -> int:
    """ceil, forgiving float noise: 12.0000000001 months is 12."""
    return math.ceil(round(x, 9))


@dataclass(frozen=True)
class Figure:
    """A figure the user did not give and what stood in for it (`kind`): "sourced", a catalog
    default (its source and date); "assumed", ownership.yaml's assumption (`source` says why,
    `as_of` is empty); "left out", no figure (`value` None), the option it prices left out."""

    name: str
    value: float | None
    source: str
    as_of: str
    flag: str
    kind: str = "sourced"


@lru_cache(maxsize=1)
def ownership_catalog() -> dict:
    """hardware/ownership.yaml: `defaults` (per figure), `servers` (per GPU key), `currencies`."""
    return yaml.safe_load((DATA_DIR / "ownership.yaml").read_text())


def currencies() -> frozenset[str]:
    """The ISO 4217 codes `--currency` accepts (ownership.yaml)."""
    return frozenset(ownership_catalog()["currencies"].split())


@dataclass(frozen=True)
class Given:
    """What the user passed; None takes the catalog's default where there is one."""

    currency: str = CATALOG_CURRENCY
    horizon_months: float = 36
    price_per_gpu_hour: float | None = None
    monthly_server_price: float | None = None  # one server, one month
    purchase_price: float | None = None  # one server
    depreciation_months: float | None = None
    residual_value: float | None = None  # share of the purchase price left after depreciation
    pue: float | None = None
    power_price: float | None = None  # per kWh
    hosting_per_kw_month: float | None = None
    staff_fraction: float | None = None  # of the purchase price, per year
    utilisation: float | None = None  # of the owned fleet; None: the work's share of it
    servers: int | None = None  # servers bought; None: enough for the work
    deadline_days: float | None = None

    def validate(self) -> None:
        """FieldError naming the flag of the first impossible value."""
        if self.currency.upper() not in currencies():
            raise FieldError("--currency", f"unknown currency code {self.currency!r}: give an "
                             "ISO 4217 code such as USD, EUR, CNY or JPY")  # fmt: skip
        positive = ("horizon_months", "depreciation_months", "deadline_days")  # 0 is no span
        rules = {  # field: (lowest, highest, what it is)
            "residual_value": (0, 1, "a share of the purchase price"),
            "utilisation": (0, 1, "a share of the owned fleet's hours"),
            "pue": (1, None, "total facility power over IT power"),
            "servers": (1, None, "servers"),
        }
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "currency":
                continue
            low, high, what = rules.get(f.name, (0, None, "a price, span or share"))
            ok = value > low if f.name in positive else value >= low  # NaN fails both
            if not ok or not math.isfinite(value) or (high is not None and value > high):
                bound = f"> {low}" if f.name in positive else f">= {low}"
                bound += f" and <= {high}" if high is not None else " and finite"
                raise FieldError(flag(f.name), f"must be {bound} ({what}), got {value}")


@dataclass(frozen=True)
class OwnershipInputs:
    """Every figure the three prices need, resolved for one GPU type, in `currency`."""

    gpu: str
    currency: str
    horizon_months: float
    gpus_per_server: int
    tdp_w: float
    price_per_gpu_hour: float
    monthly_server_price: float | None  # None: no monthly option
    purchase_price: float
    depreciation_months: float
    residual_value: float
    pue: float
    power_price: float
    hosting_per_kw_month: float
    staff_fraction: float
    defaults_used: tuple[Figure, ...] = ()


def catalog_figures(gpu: GPU) -> dict[str, dict]:
    """The sourced figures for `gpu`: ownership.yaml's defaults and server, and the on-demand
    price of gpus.csv; a figure absent here has no default."""
    data = ownership_catalog()
    server = data["servers"].get(gpu.key, {})
    figures = dict(data["defaults"]) | {k: v for k, v in server.items() if isinstance(v, dict)}
    if gpu.price_per_gpu_hour is not None:
        figures["price_per_gpu_hour"] = {
            "value": gpu.price_per_gpu_hour,
            "source": gpu.price_source,
            "as_of": " ".join(re.findall(r"\d{4}-\d{2}", gpu.price_source)) or "undated",
        }
    return figures


def resolve_inputs(gpu: GPU, given: Given) -> OwnershipInputs:
    """`given` completed from the catalog for `gpu`: its sourced figures (money only when the
    currency is USD, the catalog's), then ownership.yaml's assumptions; a price of an option
    (PRICES_OF_OPTIONS) may stay None, leaving that option out; any other missing figure
    raises FieldError naming its flag."""
    given.validate()
    currency = given.currency.upper()
    if gpu.tdp_w is None:
        raise FieldError("--gpu", f"{gpu.key} has no tdp_w in the catalog; add it with --hardware")
    figures, assumed = catalog_figures(gpu), ownership_catalog().get("assumed", {})
    values, used, missing = {}, [], []
    for name in FIGURES:
        mine, figure = getattr(given, name), figures.get(name)
        if mine is not None:
            values[name] = float(mine)
        elif figure is not None and (name not in MONEY or currency == CATALOG_CURRENCY):
            values[name] = float(figure["value"])
            used.append(Figure(name, values[name], " ".join(figure["source"].split()),
                               str(figure["as_of"]), flag(name)))  # fmt: skip
        elif name in assumed:
            values[name] = float(assumed[name]["value"])
            used.append(Figure(name, values[name], " ".join(assumed[name]["why"].split()), "",
                               flag(name), "assumed"))  # fmt: skip
        elif name in PRICES_OF_OPTIONS:
            values[name] = None
            why = (f"the {PRICES_OF_OPTIONS[name]} option is left out (no sourced default; "
                   f"give {flag(name)} to price it)")  # fmt: skip
            used.append(Figure(name, None, why, "", flag(name), "left out"))
        else:
            missing.append(flag(name))
    if missing:
        why = (f"the catalog's prices are {CATALOG_CURRENCY}; in {currency} give"
               if currency != CATALOG_CURRENCY
               else f"hardware/ownership.yaml has no sourced default of these for {gpu.key}; "
                    "give")  # fmt: skip
        raise FieldError(missing[0], f"{why} {', '.join(missing)}")
    server = ownership_catalog()["servers"].get(gpu.key, {})
    per_server = int(server.get("gpus", min(gpu.gpus_per_node, 8)))  # an 8-GPU HGX/DGX at most
    return OwnershipInputs(gpu.key, currency, float(given.horizon_months), per_server,
                           float(gpu.tdp_w), defaults_used=tuple(used), **values)  # fmt: skip


def capital_per_server(i: OwnershipInputs, months: float) -> float:
    """The share of one server's price used up in `months` (module docstring)."""
    used = min(months, i.depreciation_months) / i.depreciation_months
    return i.purchase_price * (1 - i.residual_value) * used


def running_per_server_month(i: OwnershipInputs) -> float:
    """Staff and hosting of one server for one month, busy or idle."""
    kw = i.gpus_per_server * i.tdp_w / 1000
    return i.staff_fraction * i.purchase_price / 12 + i.hosting_per_kw_month * kw


def fixed_per_server(i: OwnershipInputs, months: float) -> float:
    """What one owned server costs over `months` whether it works or not."""
    return capital_per_server(i, months) + running_per_server_month(i) * months


def energy_per_gpu_hour(i: OwnershipInputs) -> float:
    """Power of one busy GPU-hour at its TDP, with the facility's overhead (PUE)."""
    return i.tdp_w / 1000 * i.pue * i.power_price


def monthly_rate(i: OwnershipInputs) -> float:
    """A monthly-rented server's price per GPU-hour at full use."""
    return i.monthly_server_price / (i.gpus_per_server * HOURS_PER_MONTH)


def rental_rates(i: OwnershipInputs) -> dict[str, float]:
    """Each priced rental's price per useful GPU-hour at its best: what buying must beat (the
    monthly one only with a monthly server price)."""
    rates = {"on_demand": i.price_per_gpu_hour}
    if i.monthly_server_price is not None:
        rates["monthly"] = monthly_rate(i)
    return rates


def residual_sensitivity(i: OwnershipInputs, residual: float = SENSITIVITY_RESIDUAL) -> dict:
    """The break-even utilisation with each rental had the servers resold for `residual` of
    their price: how much the residual value (default: none) moves the verdict."""
    resold = replace(i, residual_value=residual)
    return {
        "residual_value": residual,
        "break_even_utilisation": {
            k: break_even_utilisation(resold, r) for k, r in rental_rates(i).items()
        },
    }


def owning_per_useful_gpu_hour(
    i: OwnershipInputs, utilisation: float, months: float | None = None
) -> float | None:
    """Owning's cost per useful GPU-hour at `utilisation` of its fleet; None (never) at 0."""
    if utilisation <= 0:
        return None
    months = i.horizon_months if months is None else months
    fleet_hours = i.gpus_per_server * HOURS_PER_MONTH * months
    return fixed_per_server(i, months) / (fleet_hours * utilisation) + energy_per_gpu_hour(i)


def break_even_utilisation(
    i: OwnershipInputs, rate: float, months: float | None = None
) -> float | None:
    """The utilisation at which owning costs `rate` per useful GPU-hour; None when no
    utilisation up to 1 gets there."""
    months = i.horizon_months if months is None else months
    margin = rate - energy_per_gpu_hour(i)  # what each useful hour leaves to pay the fixed
    if margin <= 0:
        return None
    u = fixed_per_server(i, months) / (i.gpus_per_server * HOURS_PER_MONTH * months * margin)
    return u if u <= 1 else None


def payback_month(capital: float, running_per_month: float, rental_per_month: float) -> int | None:
    """The first whole month by which renting has cost as much as buying in cash (`capital`
    at month 0, then `running_per_month`); None when renting costs no more a month."""
    saving = rental_per_month - running_per_month
    if saving <= 0:
        return None
    return max(1, _ceil(capital / saving))


@dataclass(frozen=True)
class GpuHourPrices:
    """A number of GPU-hours priced the three ways (`price_gpu_hours`)."""

    gpu_hours: float
    currency: str
    on_demand: float
    monthly: float  # at full use of the rented servers
    buy: float | None  # at `utilisation`; None without one, or at 0 (infinite)
    utilisation: float | None
    break_even_utilisation: dict[str, float | None]
    defaults_used: tuple[Figure, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def price_gpu_hours(
    gpu_hours: float, gpu_key: str, given: Given = Given(), catalog: Catalog | None = None
) -> GpuHourPrices:
    """`gpu_hours` (measured or planned) on `gpu_key` on demand, by the month (at full use)
    and owned at `given.utilisation` of the owned fleet, over `given.horizon_months`."""
    if not gpu_hours >= 0:
        raise FieldError("gpu_hours", f"must be >= 0, got {gpu_hours}")
    i = resolve_inputs((catalog or default_catalog()).gpu(gpu_key), given)
    if i.monthly_server_price is None:  # its three rows include a monthly rental
        raise FieldError("--monthly-server-price", "the cost of GPU-hours by the month needs "
                         "the price of one server rented for a month; give it (no sourced "
                         "default: hardware/ownership.yaml says why)")  # fmt: skip
    u = given.utilisation
    per_hour = owning_per_useful_gpu_hour(i, u) if u is not None else None
    rates = rental_rates(i)
    return GpuHourPrices(
        gpu_hours, i.currency, gpu_hours * rates["on_demand"], gpu_hours * rates["monthly"],
        None if per_hour is None else gpu_hours * per_hour, u,
        {k: break_even_utilisation(i, r) for k, r in rates.items()}, i.defaults_used,
    )  # fmt: skip


def plan_gpu_hours(plan: Any) -> float:
    """The GPU-hours of a plan (mmtrain.plan.estimate.Plan): its time to train on its GPUs."""
    return plan.time.time_to_train_s / 3600 * plan.config.gpus


@dataclass(frozen=True)
class Job:
    """A line of a year's work: a training run (repeated) or an inference service."""

    name: str
    gpus: int
    gpu_hours: float  # one repetition; a service's: gpus x months x 730
    repetitions: int = 1  # a year
    service_months: float = 0  # > 0: an inference service, holding `gpus` these months a year

    @property
    def yearly_gpu_hours(self) -> float:
        return self.gpu_hours * self.repetitions


def service(name: str, gpus: int, months: float) -> Job:
    return Job(name, gpus, gpus * months * HOURS_PER_MONTH, 1, months)


def deadline_gpus(job: Job, deadline_days: float | None) -> int:
    """GPUs a training run needs to finish in the deadline (at least its planned count)."""
    if deadline_days is None or job.service_months:
        return job.gpus
    return max(job.gpus, _ceil(job.gpu_hours / (deadline_days * 24)))


def monthly_servers_and_months(
    job: Job, i: OwnershipInputs, deadline_days: float | None
) -> tuple[int, float]:
    """(servers, months) a monthly rental holds for one repetition of `job`."""
    gpus = deadline_gpus(job, deadline_days)
    servers = _ceil(gpus / i.gpus_per_server)
    if job.service_months:
        return servers, job.service_months
    return servers, _ceil(job.gpu_hours / gpus / HOURS_PER_MONTH)  # the run's wall time


def default_servers(jobs: tuple[Job, ...], gpus_per_server: int) -> int:
    """Servers to buy: the largest run beside every service, and the year's hours at most."""
    services = sum(j.gpus for j in jobs if j.service_months)
    largest = max((j.gpus for j in jobs if not j.service_months), default=0)
    yearly = sum(j.yearly_gpu_hours for j in jobs)
    return max(_ceil((largest + services) / gpus_per_server),
               _ceil(yearly / (gpus_per_server * 12 * HOURS_PER_MONTH)), 1)  # fmt: skip


def owned_fleet(jobs: tuple[Job, ...], i: OwnershipInputs, given: Given) -> tuple[int, float]:
    """(servers bought, utilisation): `given.servers` or enough for the work; `given.utilisation`
    or the work's share of the servers' hours."""
    g = i.gpus_per_server
    servers = given.servers or default_servers(jobs, g)
    share = sum(j.yearly_gpu_hours for j in jobs) / (servers * g * 12 * HOURS_PER_MONTH)
    if share > 1:
        need = default_servers(jobs, g)
        raise FieldError("--servers", f"{servers} servers give {servers * g} GPUs, the work "
                         f"needs {share:.0%} of their hours; buy at least {need}")  # fmt: skip
    return servers, share if given.utilisation is None else given.utilisation


@dataclass(frozen=True)
class Option:
    name: str  # on_demand | monthly | buy
    total: float | None  # over the horizon; None: infinite (buying at zero utilisation)
    per_useful_gpu_hour: float | None
    meets_deadline: bool
    detail: dict[str, Any]


@dataclass(frozen=True)
class Decision:
    inputs: OwnershipInputs
    jobs: tuple[Job, ...]
    useful_gpu_hours: float  # over the horizon
    servers_owned: int
    utilisation: float
    deadline_days: float | None
    options: tuple[Option, ...]  # on demand, monthly (when priced), buy
    cheapest: str | None
    break_even_utilisation: dict[str, float | None]
    break_even_month: dict[str, int | None]
    sensitivity: dict[str, Any]  # residual_sensitivity: the break-even at a 30% residual

    def option(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["defaults_used"] = out["inputs"].pop("defaults_used")
        out["why"] = explain(self)
        return out


def compare(jobs: tuple[Job, ...], i: OwnershipInputs, given: Given = Given()) -> Decision:
    """The year's `jobs`, repeated over the horizon, on demand, by the month and bought."""
    yearly = sum(j.yearly_gpu_hours for j in jobs)
    if not yearly > 0:
        raise FieldError("--samples", "the plan has no GPU-hours to price; give --samples N")
    useful, days = yearly * i.horizon_months / 12, given.deadline_days
    servers, u = owned_fleet(jobs, i, given)
    rentals = [_on_demand(jobs, i, useful, days)]
    if i.monthly_server_price is not None:  # else left out (defaults_used says so)
        rentals.append(_monthly(jobs, i, useful, days))
    buy = _buy(jobs, i, useful, days, servers, u)
    eligible = [o for o in (*rentals, buy) if o.total is not None and o.meets_deadline]
    charged = buy.detail["servers_charged"]
    running = charged * running_per_server_month(i) + yearly / 12 * energy_per_gpu_hour(i)
    return Decision(
        i, tuple(jobs), useful, servers, u, days, (*rentals, buy),
        min(eligible, key=lambda o: o.total).name if eligible else None,
        {k: break_even_utilisation(i, r) for k, r in rental_rates(i).items()},
        {o.name: payback_month(charged * i.purchase_price, running, o.total / i.horizon_months)
         if u > 0 else None for o in rentals},
        residual_sensitivity(i),
    )  # fmt: skip


def _on_demand(jobs: tuple[Job, ...], i: OwnershipInputs, useful: float, days) -> Option:
    peak = max(deadline_gpus(j, days) for j in jobs)
    return Option("on_demand", useful * i.price_per_gpu_hour, i.price_per_gpu_hour, True,
                  {"peak_gpus": peak})  # fmt: skip


def _monthly(jobs: tuple[Job, ...], i: OwnershipInputs, useful: float, days) -> Option:
    rented = [monthly_servers_and_months(j, i, days) for j in jobs]
    server_months = sum(s * m * j.repetitions for j, (s, m) in zip(jobs, rented, strict=True))
    total = server_months * i.monthly_server_price * i.horizon_months / 12
    return Option("monthly", total, total / useful, True,
                  {"server_months_a_year": server_months,
                   "peak_servers": max(s for s, _ in rented)})  # fmt: skip


def _buy(jobs, i: OwnershipInputs, useful: float, days, servers: int, u: float) -> Option:
    """Owning `servers`, the plan charged for its share at utilisation `u`; it meets the
    deadline when the GPUs no service holds are enough for each run in time."""
    per_hour = owning_per_useful_gpu_hour(i, u)
    months = i.horizon_months
    charged = useful / (u * i.gpus_per_server * HOURS_PER_MONTH * months) if u > 0 else 0.0
    held = sum(j.gpus for j in jobs if j.service_months)  # the services' GPUs, all year
    free = servers * i.gpus_per_server - held
    runs = [j for j in jobs if not j.service_months] if days is not None else []
    late = [j.name for j in runs if deadline_gpus(j, days) > free]
    widest = max((deadline_gpus(j, days) for j in runs), default=0)
    enough = max(servers, _ceil((widest + held) / i.gpus_per_server))  # what would meet it
    detail = {"servers": servers, "utilisation": u, "servers_charged": charged,
              "capital": charged * capital_per_server(i, months),
              "staff_and_hosting": charged * running_per_server_month(i) * months,
              "energy": useful * energy_per_gpu_hour(i), "gpus_free_for_runs": free,
              "late_runs": late, "servers_for_deadline": enough}  # fmt: skip
    total = None if per_hour is None else useful * per_hour
    return Option("buy", total, per_hour, not late, detail)


def explain(d: Decision) -> str:
    """Why the cheapest option wins, and at what utilisation buying would."""
    said = {"on_demand": "renting on demand", "monthly": "renting servers by the month",
            "buy": "buying"}  # fmt: skip
    be = {k: "never" if v is None else f"{v:.1%}" for k, v in d.break_even_utilisation.items()}
    text = f"{said[d.cheapest]} is cheapest" if d.cheapest else "no option meets the deadline"
    text += (f": the plan keeps the bought servers {d.utilisation:.1%} busy, and buying "
             f"matches on demand at {be['on_demand']} utilisation")  # fmt: skip
    if "monthly" in be:
        text += f" and a fully used monthly server at {be['monthly']}"
    buy = d.option("buy")
    if not buy.meets_deadline:
        text += (f"; the {buy.detail['gpus_free_for_runs']} owned GPUs free for training "
                 f"cannot finish {', '.join(buy.detail['late_runs'])} within "
                 f"{d.deadline_days:g} days ({buy.detail['servers_for_deadline']} servers "
                 "would: --servers)")  # fmt: skip
    i, months = d.inputs, d.break_even_month.values()
    if d.cheapest == "buy" and any(m is None or m > i.horizon_months for m in months):
        # the total counts the share of the price used up; the cash payback counts all of it
        used = min(i.horizon_months, i.depreciation_months) / i.depreciation_months
        text += (f"; its total counts {used:.0%} of the servers' depreciation (the "
                 f"{i.horizon_months:g} of {i.depreciation_months:g} months used), the cash "
                 "payback all of the price")  # fmt: skip
    return text


def load_projects(
    path: str | Path, gpu: str | None, catalog: Catalog
) -> tuple[str, tuple[Job, ...]]:
    """A year's projects from YAML: `runs` (name, model + samples or gpu_hours, gpu, gpus,
    repetitions, micro_batch, global_batch) and `inference` (name, gpus, months). A run's
    GPU-hours come from the planner; every run is on one GPU type (the one bought)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise FieldError("--projects", f"cannot read {path}: {err}") from None
    if not isinstance(data, dict) or set(data) - {"runs", "inference"}:
        raise FieldError("--projects", f"{path}: expected a mapping with runs and/or inference")
    runs, served = data.get("runs") or [], data.get("inference") or []
    keys = {r.get("gpu") for r in runs if isinstance(r, dict)} - {None}
    if len(keys | ({gpu} if gpu else set())) > 1:
        raise FieldError("--projects", f"{path}: runs on {sorted(keys)} and --gpu {gpu}: price "
                         "one GPU type at a time (the servers bought hold one)")  # fmt: skip
    key = catalog.gpu(gpu or next(iter(keys), "h100")).key
    jobs = [_run_job(r, f"{path}: runs[{n}]", key, catalog) for n, r in enumerate(runs)]
    for n, row in enumerate(served):
        where = f"{path}: inference[{n}]"
        _known_keys(row, {"name", "gpus", "months"}, where)
        gpus, months = _whole(row, "gpus", where), _number(row, "months", where)
        if not 0 < months <= 12:
            raise FieldError(f"{where}.months", f"must be in (0, 12] months a year, got {months}")
        jobs.append(service(str(row.get("name", f"inference {n}")), gpus, months))
    if not jobs:
        raise FieldError("--projects", f"{path}: no runs and no inference")
    return key, tuple(jobs)


def _known_keys(row: Any, known: set[str], where: str) -> None:
    if not isinstance(row, dict):
        raise FieldError(where, "expected a mapping")
    unknown = sorted(set(row) - known)
    if unknown:
        raise FieldError(f"{where}.{unknown[0]}", f"unknown key; valid: {', '.join(sorted(known))}")


def _number(row: dict, name: str, where: str, default: float | None = None) -> float:
    value = row.get(name, default)
    try:
        number = float(value)  # YAML reads 4e8 as text
    except (TypeError, ValueError):
        raise FieldError(f"{where}.{name}", f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise FieldError(f"{where}.{name}", f"expected a finite number, got {value!r}")
    return number


def _whole(row: dict, name: str, where: str, default: float | None = None, low: int = 1) -> int:
    """A count of the projects file: a whole number >= `low` (2.5 GPUs is a typo)."""
    number = _number(row, name, where, default)
    if number != int(number) or number < low:
        raise FieldError(f"{where}.{name}", f"expected a whole number >= {low}, got {number:g}")
    return int(number)


def _run_job(row: Any, where: str, gpu: str, catalog: Catalog) -> Job:
    """One training run of the projects file as a Job; a model's GPU-hours from its plan."""
    from mmtrain.plan.config import PlanConfig
    from mmtrain.plan.estimate import make_plan
    from mmtrain.plan.workloads import load_model

    _known_keys(row, {"name", "model", "gpu", "gpus", "samples", "gpu_hours", "repetitions",
                      "micro_batch", "global_batch"}, where)  # fmt: skip
    gpus, reps = _whole(row, "gpus", where, 1), _whole(row, "repetitions", where, 1)
    if ("model" in row) == ("gpu_hours" in row):
        raise FieldError(where, "give a model with samples, or gpu_hours (one of the two)")
    if "gpu_hours" in row:
        hours = _number(row, "gpu_hours", where)
    else:
        batch = _whole(row, "global_batch", where) if "global_batch" in row else None
        cfg = PlanConfig(gpu=gpu, gpus=gpus, samples=_whole(row, "samples", where, 0, low=0),
                         micro_batch=_whole(row, "micro_batch", where, 1),
                         global_batch=batch)  # fmt: skip
        hours = plan_gpu_hours(make_plan(load_model(str(row["model"])), cfg, catalog))
    if not hours > 0:
        raise FieldError(where, "the run has no GPU-hours (give samples > 0 or gpu_hours > 0)")
    return Job(str(row.get("name", row.get("model", where))), gpus, hours, reps)
