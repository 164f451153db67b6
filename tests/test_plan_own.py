"""`mmtrain plan --own`: rent on demand, rent by the month or buy (plan/ownership.py).

Expected values are derived by hand in each test from round inputs (comments show the
arithmetic); the code computes the same sums in float64, so they agree to rounding (rel 1e-12).
"""

import json
import math
import re

import pytest

from mmtrain.cli import main
from mmtrain.hardware import get_gpu
from mmtrain.plan import ownership as own
from mmtrain.structured import FieldError

REL = 1e-12


def _inputs(**changes) -> own.OwnershipInputs:
    """Round figures: 8 GPUs of 500 W a server, 100,000 a server, 60 months' depreciation."""
    base = dict(
        gpu="h100", currency="USD", horizon_months=36.0, gpus_per_server=8, tdp_w=500.0,
        price_per_gpu_hour=2.0, monthly_server_price=7300.0, purchase_price=100_000.0,
        depreciation_months=60.0, residual_value=0.1, pue=1.5, power_price=0.2,
        hosting_per_kw_month=100.0, staff_fraction=0.12,
    )  # fmt: skip
    return own.OwnershipInputs(**(base | changes))


def _given(**changes) -> own.Given:
    """The round figures of `_inputs` as the user's flags give them (no catalog default)."""
    base = dict(
        price_per_gpu_hour=2.0, monthly_server_price=7300, purchase_price=100_000,
        depreciation_months=60, residual_value=0.1, pue=1.5, power_price=0.2,
        hosting_per_kw_month=100, staff_fraction=0.12,
    )  # fmt: skip
    return own.Given(**(base | changes))


# the same figures as CLI flags
FLAGS = ["--price-per-gpu-hour", "2", "--monthly-server-price", "7300", "--purchase-price",
         "100000", "--depreciation-months", "60", "--residual-value", "0.1", "--pue", "1.5",
         "--power-price", "0.2", "--hosting-per-kw-month", "100", "--staff-fraction", "0.12"]  # fmt: skip
# the flags the catalog has no sourced figure for (hardware/ownership.yaml says why): without
# them the monthly option is left out and residual value and staff are assumed 0
NO_DEFAULT = ["--monthly-server-price", "7300", "--residual-value", "0.1",
              "--staff-fraction", "0.12"]  # fmt: skip


def test_costs_of_one_owned_server_over_a_horizon_shorter_than_depreciation():
    i = _inputs()
    # capital: 100,000 x (1 - 0.1) x 36 / 60 = 54,000 (only the share used up in 36 months)
    assert own.capital_per_server(i, 36) == pytest.approx(54_000, rel=REL)
    # staff 0.12 x 100,000 / 12 = 1,000 a month; hosting 100 x 8 x 0.5 kW = 400 a month
    assert own.running_per_server_month(i) == pytest.approx(1_400, rel=REL)
    # fixed over 36 months: 54,000 + 1,400 x 36 = 104,400
    assert own.fixed_per_server(i, 36) == pytest.approx(104_400, rel=REL)
    # energy: 0.5 kW x 1.5 x 0.2 = 0.15 per busy GPU-hour
    assert own.energy_per_gpu_hour(i) == pytest.approx(0.15, rel=REL)
    # monthly rate at full use: 7,300 / (8 x 730) = 1.25 per GPU-hour
    assert own.monthly_rate(i) == pytest.approx(1.25, rel=REL)


def test_a_horizon_longer_than_depreciation_counts_the_whole_depreciable_share_once():
    i = _inputs()
    # 90,000 depreciable (purchase less 10% residual), all of it by month 60, no more after
    assert own.capital_per_server(i, 60) == pytest.approx(90_000, rel=REL)
    assert own.capital_per_server(i, 120) == pytest.approx(90_000, rel=REL)


def test_break_even_utilisation_by_hand():
    i = _inputs()
    # fleet hours of one server in 36 months: 8 x 730 x 36 = 210,240
    # on demand (2.0): u* = 104,400 / (210,240 x (2.0 - 0.15)) = 104,400 / 388,944
    assert own.break_even_utilisation(i, 2.0) == pytest.approx(104_400 / 388_944, rel=REL)
    # monthly (1.25): u* = 104,400 / (210,240 x 1.10) = 104,400 / 231,264
    assert own.break_even_utilisation(i, 1.25) == pytest.approx(104_400 / 231_264, rel=REL)
    # at u*, owning costs the rental's rate per useful GPU-hour
    u = own.break_even_utilisation(i, 2.0)
    assert own.owning_per_useful_gpu_hour(i, u) == pytest.approx(2.0, rel=REL)
    # a rental at or under the energy price is never matched; nor one needing u* > 1
    assert own.break_even_utilisation(i, 0.15) is None
    assert own.break_even_utilisation(i, 0.6) is None  # 104,400 / (210,240 x 0.45) = 1.10


def test_break_even_utilisation_falls_once_the_horizon_passes_depreciation():
    i = _inputs()
    # 36 months (shorter than the 60 of depreciation): capital accrues 1,500 a month
    # (90,000 / 60), so u* is the same at 24 months: 24 x 2,900 / (8 x 730 x 24 x 1.85)
    short = own.break_even_utilisation(i, 2.0, months=24)
    assert short == pytest.approx(2_900 / (5_840 * 1.85), rel=REL)
    assert short == pytest.approx(own.break_even_utilisation(i, 2.0, months=36), rel=REL)
    # 120 months: capital 90,000 + running 1,400 x 120 = 258,000 over 8 x 730 x 120 = 700,800
    long = own.break_even_utilisation(i, 2.0, months=120)
    assert long == pytest.approx(258_000 / (700_800 * 1.85), rel=REL)
    assert long < short


def test_zero_utilisation_is_never():
    i = _inputs()
    assert own.owning_per_useful_gpu_hour(i, 0.0) is None
    prices = own.price_gpu_hours(1000, "h100", _given(utilisation=0.0))
    assert prices.buy is None and prices.on_demand == pytest.approx(2000, rel=REL)
    # a plan charged at 0 utilisation: buying has no total, never pays back, is never cheapest
    d = own.compare((own.Job("run", 8, 2920.0, 1),), i, own.Given(utilisation=0.0))
    by = {o.name: o for o in d.options}
    assert by["buy"].total is None and by["buy"].per_useful_gpu_hour is None
    assert d.break_even_month == {"on_demand": None, "monthly": None}
    assert d.cheapest == "on_demand"  # 2,920 x 3 years x 2.0 = 17,520; monthly 21,900
    assert by["on_demand"].total == pytest.approx(17_520, rel=REL)
    assert by["monthly"].total == pytest.approx(7_300 * 3, rel=REL)
    assert json.loads(json.dumps(d.to_dict()))["options"][2]["total"] is None  # JSON null


def test_price_gpu_hours_with_given_prices():
    # h100: 700 W in the catalog
    p = own.price_gpu_hours(1000, "h100", _given(utilisation=0.5, currency="cny"))
    assert p.currency == "CNY" and p.defaults_used == ()
    assert p.on_demand == pytest.approx(2000, rel=REL)  # 1,000 x 2.0
    assert p.monthly == pytest.approx(1250, rel=REL)  # 1,000 x 7,300 / (8 x 730)
    # fixed: 54,000 + 36 x (1,000 staff + 100 x 5.6 kW hosting) = 54,000 + 56,160 = 110,160
    # per useful hour at 0.5: 110,160 / (210,240 x 0.5) + 0.7 x 1.5 x 0.2 (= 0.21)
    assert p.buy == pytest.approx(1000 * (110_160 / 105_120 + 0.21), rel=REL)


def test_compare_a_plan_by_hand():
    i = _inputs()
    # one run a year: 8 GPUs, 2,920 GPU-hours (365 h of wall time), repeated 3 times
    jobs = (own.Job("run", 8, 2920.0, 3),)
    d = own.compare(jobs, i)
    # useful: 2,920 x 3 a year x 3 years = 26,280; one server: 8 x 8,760 = 70,080 h a year
    assert d.servers_owned == 1
    assert d.utilisation == pytest.approx(8760 / 70_080, rel=REL)  # 0.125
    by = {o.name: o for o in d.options}
    assert by["on_demand"].total == pytest.approx(26_280 * 2.0, rel=REL)
    # monthly: 1 server x ceil(365 / 730) = 1 month x 7,300 x 3 runs x 3 years = 65,700
    assert by["monthly"].total == pytest.approx(65_700, rel=REL)
    # buy: 104,400 fixed + 26,280 x 0.15 energy = 108,342
    assert by["buy"].total == pytest.approx(108_342, rel=REL)
    assert d.cheapest == "on_demand"  # 52,560
    # payback against on demand: 1,460 a month (8,760 h x 2.0 / 12) is less than owning's
    # running cost, 1,400 + 730 h x 0.15 = 1,509.5 a month: buying never pays back
    assert d.break_even_month["on_demand"] is None
    # against monthly: 65,700 / 36 = 1,825 a month: 100,000 / 315.5 = 316.9 -> month 317
    assert d.break_even_month["monthly"] == 317


def test_a_saturated_year_makes_buying_cheapest():
    i = _inputs()
    d = own.compare((own.service("api", 8, 12),), i)  # 8 GPUs all year: utilisation 1
    assert d.utilisation == pytest.approx(1.0, rel=REL)
    by = {o.name: o for o in d.options}
    # buy: 104,400 + 210,240 x 0.15 = 135,936; monthly 7,300 x 36 = 262,800
    assert by["buy"].total == pytest.approx(135_936, rel=REL)
    assert by["monthly"].total == pytest.approx(262_800, rel=REL)
    assert d.cheapest == "buy"
    # payback vs monthly: 7,300 a month against 1,400 + 5,840 x 0.15 = 2,276: 100,000 / 5,024
    assert d.break_even_month["monthly"] == math.ceil(100_000 / 5_024)  # 20


def test_a_deadline_only_a_larger_rented_fleet_meets():
    i = _inputs()
    # 2,920 GPU-hours on 8 GPUs take 365 h; a 5-day deadline (120 h) needs ceil(2,920 / 120)
    # = 25 GPUs: rented, 4 servers for ceil(2,920 / 25 / 730) = 1 month; the one server
    # bought cannot
    d = own.compare((own.Job("run", 8, 2920.0, 1),), i, own.Given(deadline_days=5))
    by = {o.name: o for o in d.options}
    assert not by["buy"].meets_deadline
    assert by["on_demand"].meets_deadline and by["on_demand"].detail["peak_gpus"] == 25
    assert by["monthly"].detail["peak_servers"] == 4
    # monthly: 4 servers x 1 month x 7,300 x 3 years = 87,600; on demand 8,760 x 2 = 17,520
    assert by["monthly"].total == pytest.approx(87_600, rel=REL)
    assert d.cheapest == "on_demand"
    # four servers bought would meet it
    d4 = own.compare((own.Job("run", 8, 2920.0, 1),), i, own.Given(deadline_days=5, servers=4))
    assert {o.name: o for o in d4.options}["buy"].meets_deadline


def test_a_deadline_turns_the_cheapest_from_buying_to_a_larger_rented_fleet():
    i = _inputs()
    # 12 runs a year of 5,840 GPU-hours on 8 GPUs (730 h each): one server busy all year
    jobs = (own.Job("run", 8, 5840.0, 12),)
    d = own.compare(jobs, i)
    by = {o.name: o for o in d.options}
    assert d.utilisation == pytest.approx(1.0, rel=REL)  # 70,080 of 8 x 8,760 hours
    # buy: 104,400 + 210,240 x 0.15 = 135,936; monthly: 12 x 7,300 x 3 = 262,800;
    # on demand: 210,240 x 2.0 = 420,480
    assert by["buy"].total == pytest.approx(135_936, rel=REL)
    assert d.cheapest == "buy"
    # 15 days (360 h): ceil(5,840 / 360) = 17 GPUs per run; the 8 bought cannot
    late = own.compare(jobs, i, own.Given(deadline_days=15))
    by = {o.name: o for o in late.options}
    assert not by["buy"].meets_deadline and by["buy"].detail["late_runs"] == ["run"]
    assert by["buy"].detail["servers_for_deadline"] == math.ceil(17 / 8)  # 3
    # monthly: ceil(17 / 8) = 3 servers for ceil(5,840 / 17 / 730) = 1 month, 12 times a year
    assert by["monthly"].detail["peak_servers"] == 3
    assert by["monthly"].total == pytest.approx(3 * 1 * 12 * 7_300 * 3, rel=REL)  # 788,400
    assert by["on_demand"].total == pytest.approx(420_480, rel=REL)  # GPU-hours unchanged
    assert late.cheapest == "on_demand"
    assert "3 servers would" in own.explain(late)


def test_too_few_servers_for_the_work_names_the_flag():
    with pytest.raises(FieldError) as err:
        own.compare((own.service("api", 16, 12),), _inputs(), own.Given(servers=1))
    assert err.value.path == "--servers" and "at least 2" in err.value.message


@pytest.mark.parametrize(
    ("given", "flag"),
    [
        (own.Given(price_per_gpu_hour=-1), "--price-per-gpu-hour"),
        (own.Given(monthly_server_price=-5), "--monthly-server-price"),
        (own.Given(purchase_price=-1), "--purchase-price"),
        (own.Given(utilisation=1.2), "--utilisation"),
        (own.Given(residual_value=1.5), "--residual-value"),
        (own.Given(pue=0.8), "--pue"),
        (own.Given(horizon_months=0), "--horizon-months"),
        (own.Given(deadline_days=0), "--deadline-days"),
        (own.Given(power_price=float("nan")), "--power-price"),
        (own.Given(currency="XYZ"), "--currency"),
    ],
)
def test_bad_inputs_name_their_flag(given, flag):
    with pytest.raises(FieldError) as err:
        own.resolve_inputs(get_gpu("h100"), given)
    assert err.value.path == flag


def test_defaults_are_used_only_in_usd_and_only_where_sourced():
    given = own.Given(monthly_server_price=7300, residual_value=0.1, staff_fraction=0.12)
    i = own.resolve_inputs(get_gpu("h100"), given)
    used = {f.name: f for f in i.defaults_used}
    assert set(used) == {"price_per_gpu_hour", "purchase_price", "depreciation_months", "pue",
                         "power_price", "hosting_per_kw_month"}  # fmt: skip
    assert all(f.source and f.as_of and f.flag == own.flag(f.name) for f in used.values())
    assert used["purchase_price"].value == 255_237  # 8 x $31,904.63 (Epoch AI's row)
    # no sourced figure for these three: residual value and staff are assumed 0, the monthly
    # rental has no price (its option is left out)
    bare = own.resolve_inputs(get_gpu("h100"), own.Given())
    assert (bare.residual_value, bare.staff_fraction, bare.monthly_server_price) == (0, 0, None)
    kinds = {f.name: f.kind for f in bare.defaults_used}
    assert kinds["residual_value"] == kinds["staff_fraction"] == "assumed"
    assert kinds["monthly_server_price"] == "left out" and kinds["pue"] == "sourced"
    with pytest.raises(FieldError) as err:  # no money default in another currency
        own.resolve_inputs(get_gpu("h100"), own.Given(currency="CNY"))
    assert err.value.path == "--price-per-gpu-hour" and "--purchase-price" in err.value.message
    with pytest.raises(FieldError) as err:  # no sourced server price for the A100
        own.resolve_inputs(get_gpu("a100"), given)
    assert err.value.path == "--purchase-price"


def test_every_catalog_default_is_named_dated_and_sourced():
    data = own.ownership_catalog()
    figures = dict(data["defaults"])
    for key, server in data["servers"].items():
        assert server["gpus"] == 8, key
        figures |= {f"{key}.{k}": v for k, v in server.items() if isinstance(v, dict)}
    for name, figure in figures.items():
        field = name.rpartition(".")[2]
        assert field in own.FIGURES, name
        assert figure["value"] >= 0 and len(figure["source"]) > 40, name
        assert re.fullmatch(r"\d{4}-\d{2}(-\d{2})?", str(figure["as_of"])), name
        assert figure.get("flag", own.flag(field)) == own.flag(field), name
    # no dated, attributable source: never a sourced default (assumptions are named as such)
    assert not {"monthly_server_price", "residual_value", "staff_fraction"} & set(figures)
    assert set(data["assumed"]) == {"residual_value", "staff_fraction"}
    for name, figure in data["assumed"].items():
        assert figure["value"] == 0 and figure["flag"] == own.flag(name), name
        assert len(figure["why"]) > 40, name


def _own_json(capsys, *args) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_shape_and_totals_by_hand(capsys):
    args = ["--model", "ViT-B-16", "--gpu", "h100", "--gpus", "8", "--micro-batch", "256",
            "--samples", "4e8"]  # fmt: skip
    gpu_hours = _own_json(capsys, *args)["time"]["time_to_train_s"] / 3600 * 8
    out = _own_json(capsys, *args, "--own", "--runs-per-year", "2", *FLAGS)
    assert [o["name"] for o in out["options"]] == ["on_demand", "monthly", "buy"]
    assert all({"total", "per_useful_gpu_hour", "meets_deadline"} <= set(o) for o in out["options"])
    assert set(out["break_even_utilisation"]) == set(out["break_even_month"])
    assert set(out["break_even_utilisation"]) == {"on_demand", "monthly"}
    assert out["defaults_used"] == []  # every figure was a flag
    by = {o["name"]: o for o in out["options"]}
    useful = gpu_hours * 2 * 3  # 2 runs a year, 36 months
    assert out["useful_gpu_hours"] == pytest.approx(useful, rel=1e-5)  # JSON rounds the plan
    assert by["on_demand"]["total"] == pytest.approx(useful * 2.0, rel=1e-5)
    # monthly: one server for ceil(wall-clock / 730 h) months a run, 6 runs in 36 months
    months = math.ceil(gpu_hours / 8 / 730)
    assert by["monthly"]["total"] == pytest.approx(months * 7_300 * 6, rel=1e-9)
    # buy: one server (h100: 700 W, so hosting 100 x 5.6 kW) plus energy 0.7 x 1.5 x 0.2
    fixed = 100_000 * 0.9 * 36 / 60 + (0.12 * 100_000 / 12 + 100 * 5.6) * 36  # 110,160
    assert by["buy"]["total"] == pytest.approx(fixed + useful * 0.21, rel=1e-5)
    assert out["cheapest"] == min(by, key=lambda n: by[n]["total"])
    margin = 2.0 - 0.21  # on demand: u* = fixed / (8 x 730 x 36 x (rate - energy))
    assert out["break_even_utilisation"]["on_demand"] == pytest.approx(
        fixed / (210_240 * margin), rel=1e-9
    )


def test_cli_text_says_which_figures_were_defaults(capsys):
    args = ["plan", "--model", "ViT-B-16", "--gpus", "8", "--micro-batch", "256", "--samples",
            "4e8", "--own", *NO_DEFAULT]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for line in ("on_demand", "monthly", "buy", "cheapest:", "why:",
                 "buying breaks even at a utilisation of: on_demand",
                 "pays back in cash against monthly", "defaults used (flag to override):",
                 "purchase_price = 255237 (--purchase-price): Epoch AI",
                 "pue = 1.58 (--pue): Uptime Institute"):  # fmt: skip
        assert line in out, line
    assert "monthly_server_price =" not in out  # the user's figure, not a default
    assert main([*args[: -len(NO_DEFAULT)], *FLAGS]) == 0  # every figure given
    assert "defaults used: none" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--monthly-server-price", "-5"], "--monthly-server-price"),
        (["--purchase-price", "-1"], "--purchase-price"),
        (["--utilisation", "1.5"], "--utilisation"),
        (["--currency", "XYZ"], "--currency"),
        (["--projects", "nowhere.yaml", "--samples", "1e6"], "--samples"),
    ],
)
def test_cli_bad_inputs_name_the_flag(capsys, extra, flag):
    args = ["plan", "--model", "ViT-B-16", "--samples", "1e6", "--own", *NO_DEFAULT]
    assert main([*args, *extra]) == 2
    assert f"error: {flag}" in capsys.readouterr().err


def test_cli_errors_name_the_flag(capsys):
    assert main(["plan", "--model", "ViT-B-16", "--own"]) == 2
    assert "--samples" in capsys.readouterr().err
    assert main(["plan", "--model", "ViT-B-16", "--samples", "1e6", "--own",
                 "--currency", "CNY"]) == 2  # fmt: skip
    assert "--price-per-gpu-hour" in capsys.readouterr().err
    assert main(["plan", "--model", "ViT-B-16", "--samples", "1e6", "--own", "--gpu", "a100"]) == 2
    assert "error: --purchase-price" in capsys.readouterr().err  # no sourced A100 server price


def test_projects_file_by_hand(tmp_path, capsys):
    """Two training runs repeated, an inference service of 8 GPUs for 6 months, on h100
    (700 W) at the round figures; every total by hand."""
    path = tmp_path / "year.yaml"
    path.write_text(
        "runs:\n"
        "  - {name: pretrain, gpus: 8, gpu_hours: 2920, repetitions: 2}\n"
        "  - {name: finetune, gpus: 16, gpu_hours: 500, repetitions: 4}\n"
        "inference:\n"
        "  - {name: api, gpus: 8, months: 6}\n"
    )
    out = _own_json(capsys, "--own", "--projects", str(path), "--gpu", "h100", *FLAGS)
    jobs = {j["name"]: j for j in out["jobs"]}
    assert jobs["api"]["gpu_hours"] == pytest.approx(8 * 6 * 730, rel=REL)  # 35,040
    yearly = 2920 * 2 + 500 * 4 + 35_040  # 42,880
    useful = yearly * 3
    assert out["useful_gpu_hours"] == pytest.approx(useful, rel=REL)  # 128,640
    by = {o["name"]: o for o in out["options"]}
    assert by["on_demand"]["total"] == pytest.approx(useful * 2.0, rel=REL)  # 257,280
    # monthly server-months a year: pretrain 1 server x ceil(2,920 / 8 / 730) = 1 month x 2;
    # finetune 2 servers x ceil(500 / 16 / 730) = 1 month x 4; api 1 server x 6 months
    assert by["monthly"]["total"] == pytest.approx((2 + 8 + 6) * 7_300 * 3, rel=REL)
    # bought: the largest run (16 GPUs) beside the service (8): 3 servers, busy
    # 42,880 / (3 x 8 x 8,760) of their hours
    assert out["servers_owned"] == 3
    assert out["utilisation"] == pytest.approx(yearly / (3 * 8 * 8760), rel=REL)
    fixed = 100_000 * 0.9 * 36 / 60 + (0.12 * 100_000 / 12 + 100 * 5.6) * 36  # 110,160
    assert by["buy"]["total"] == pytest.approx(3 * fixed + useful * 0.21, rel=REL)
    assert out["cheapest"] == "on_demand"
    # payback: 300,000 at month 0; owning runs 3 x 1,560 + 42,880 / 12 x 0.21 a month
    running = 3 * 1_560 + yearly / 12 * 0.21
    for mode in ("on_demand", "monthly"):
        saving = by[mode]["total"] / 36 - running
        assert out["break_even_month"][mode] == math.ceil(300_000 / saving), mode  # 175, 70


def test_projects_file_runs_the_planner_and_checks_its_keys(tmp_path, capsys):
    args = ["--model", "ViT-B-16", "--gpu", "h100", "--gpus", "8", "--micro-batch", "256",
            "--samples", "4e8"]  # fmt: skip
    planned = _own_json(capsys, *args)["time"]["time_to_train_s"] / 3600 * 8
    path = tmp_path / "year.yaml"
    path.write_text(
        "runs:\n"
        "  - {name: clip, model: ViT-B-16, gpus: 8, samples: 4e8, micro_batch: 256}\n"
        "inference:\n"
        "  - {name: api, gpus: 8, months: 12}\n"
    )
    out = _own_json(capsys, "--own", "--projects", str(path), *NO_DEFAULT)
    assert out["jobs"][0]["gpu_hours"] == pytest.approx(planned, rel=1e-5)
    for bad, where in (
        ("runs:\n  - {name: x, gpus: 8, gpu_hours: 10, colour: red}\n", "runs[0].colour"),
        ("runs:\n  - {name: x, gpus: 2.5, gpu_hours: 10}\n", "runs[0].gpus"),
        ("inference:\n  - {name: x, gpus: 8, months: 13}\n", "inference[0].months"),
        ("runs:\n  - {name: x, gpus: 8}\n", "runs[0]"),
    ):
        path.write_text(bad)
        assert main(["plan", "--own", "--projects", str(path), *NO_DEFAULT]) == 2
        assert where in capsys.readouterr().err, bad


def test_sensitivity_to_a_30_percent_residual_value_by_hand():
    i = _inputs(residual_value=0.0)  # the default: no resale
    d = own.compare((own.Job("run", 8, 2920.0, 3),), i)
    # residual 0: capital 100,000 x 36 / 60 = 60,000, + running 1,400 x 36 = 50,400: 110,400
    assert d.break_even_utilisation["on_demand"] == pytest.approx(
        110_400 / (210_240 * 1.85), rel=REL
    )
    # residual 0.3: capital 100,000 x 0.7 x 36 / 60 = 42,000, + 50,400 = 92,400 fixed, over
    # 8 x 730 x 36 = 210,240 fleet hours x (rate - 0.15 energy)
    assert d.sensitivity["residual_value"] == 0.3
    be = d.sensitivity["break_even_utilisation"]
    assert be["on_demand"] == pytest.approx(92_400 / (210_240 * 1.85), rel=REL)  # 23.8%
    assert be["monthly"] == pytest.approx(92_400 / (210_240 * 1.10), rel=REL)  # 40.0%
    assert "with a 30% residual value" not in own.explain(d)  # its own line, not the why


def _b300_expected(purchase: float, residual: float) -> tuple[float, float]:
    """(fixed cost of one B300 server over 36 months, energy per GPU-hour) by the module's
    formula from the catalog's figures; staff 0 (the default)."""
    data = own.ownership_catalog()["defaults"]
    gpu = get_gpu("b300")
    depreciation, hosting = data["depreciation_months"]["value"], data["hosting_per_kw_month"]
    capital = purchase * (1 - residual) * min(36, depreciation) / depreciation
    fixed = capital + hosting["value"] * 8 * gpu.tdp_w / 1000 * 36
    energy = gpu.tdp_w / 1000 * data["pue"]["value"] * data["power_price"]["value"]
    return fixed, energy


def test_b300_without_residual_staff_or_monthly_price_answers_with_the_defaults_named(capsys):
    args = ["plan", "--model", "ViT-B-16", "--gpu", "B300", "--gpus", "8", "--micro-batch",
            "256", "--samples", "4e9", "--own", "--purchase-price", "500000"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for line in ("residual_value = 0 (--residual-value): assumed: no resale",
                 "staff_fraction = 0 (--staff-fraction): assumed: no support or staff",
                 "monthly_server_price: none (--monthly-server-price): the monthly option is "
                 "left out", "with a 30% residual value, buying breaks even at a utilisation "
                 "of: on_demand"):  # fmt: skip
        assert line in out, line
    assert not re.search(r"^\s+monthly\s", out, flags=re.M)  # no row for the monthly option
    assert "against monthly" not in out and "monthly server" not in out
    result = _own_json(capsys, *args[1:])
    assert [o["name"] for o in result["options"]] == ["on_demand", "buy"]
    assert set(result["break_even_utilisation"]) == {"on_demand"}
    assert set(result["break_even_month"]) == {"on_demand"}
    kinds = {f["name"]: (f["kind"], f["value"]) for f in result["defaults_used"]}
    assert kinds["residual_value"] == kinds["staff_fraction"] == ("assumed", 0)
    assert kinds["monthly_server_price"] == ("left out", None)
    assert kinds["pue"][0] == "sourced" and "purchase_price" not in kinds  # the user's
    rate = get_gpu("b300").price_per_gpu_hour
    for residual, be in ((0.0, result["break_even_utilisation"]),
                         (0.3, result["sensitivity"]["break_even_utilisation"])):  # fmt: skip
        fixed, energy = _b300_expected(500_000, residual)
        assert be["on_demand"] == pytest.approx(fixed / (8 * 730 * 36 * (rate - energy)), rel=REL)
    shown = result["sensitivity"]["break_even_utilisation"]["on_demand"]
    assert f"with a 30% residual value, buying breaks even at a utilisation of: on_demand " \
           f"{shown:.1%}" in out  # fmt: skip
    # the flags still override the defaults, and a GPU without a sourced price still says so
    flagged = _own_json(capsys, *args[1:], "--residual-value", "0.3", "--staff-fraction", "0.1")
    assert flagged["inputs"]["residual_value"] == 0.3 and flagged["inputs"]["staff_fraction"] == 0.1
    assert {f["name"] for f in flagged["defaults_used"]}.isdisjoint(
        {"residual_value", "staff_fraction"}
    )
    assert main(args[:-2]) == 2
    assert "error: --purchase-price" in capsys.readouterr().err


def test_report_still_needs_the_monthly_price_it_shows():
    # the report's cost table has a monthly row: without a price it names the flag
    with pytest.raises(FieldError) as err:
        own.price_gpu_hours(100, "h100", own.Given())
    assert err.value.path == "--monthly-server-price"


def _own_help() -> dict[str, str]:
    """--own's flags and their help texts, as `mmtrain plan --help` prints them."""
    from mmtrain.cli import build_parser

    parser = build_parser(["plan"])
    (plan,) = [a for a in parser._subparsers._group_actions[0].choices.values()
               if a.prog.endswith(" plan")]  # fmt: skip
    (group,) = [g for g in plan._action_groups if g.title.startswith("--own")]
    return {a.option_strings[0]: f"{a.metavar or ''} {a.help}" for a in group._group_actions}


def test_help_gives_each_own_flag_its_unit():
    helps = _own_help()
    units = {  # flag: words its help must hold
        "--monthly-server-price": ["--currency", "a month"], "--purchase-price": ["--currency"],
        "--power-price": ["--currency", "kWh"],
        "--hosting-per-kw-month": ["--currency", "kW", "a month"],
        "--depreciation-months": ["months"], "--horizon-months": ["months"],
        "--pue": ["ratio", ">= 1"], "--residual-value": ["share", "0 to 1"],
        "--staff-fraction": ["share", "a year"], "--utilisation": ["share", "0 to 1"],
        "--deadline-days": ["days"], "--currency": ["ISO 4217"],
    }  # fmt: skip
    for name, words in units.items():
        for word in words:
            assert word in helps[name], (name, word, helps[name])
    money = {"--monthly-server-price", "--purchase-price", "--power-price",
             "--hosting-per-kw-month", "--currency"}  # fmt: skip
    for name, text in helps.items():
        if name not in money:
            assert "USD" not in text and "currency" not in text, (name, text)
    assert "default 0" in helps["--residual-value"] and "default 0" in helps["--staff-fraction"]
    assert "leaves the monthly option out" in helps["--monthly-server-price"]
