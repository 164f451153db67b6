"""`mmtrain report --gpu NAME [prices]`: a finished run's measured GPU-hours priced on demand,
by the month and bought, with plan/ownership.py's arithmetic (docs/PLANNER.md, Rent or buy).

Expected values are derived by hand from round inputs: 8 rows of 450 s on 8 ranks are 8
GPU-hours; on h100 (700 W in the catalog) at the round figures of test_plan_own.py."""

import json

import pytest

from micro import make_shards, micro_run
from mmtrain.cli import main
from mmtrain.plan.ownership import Given
from mmtrain.report import cost_tables
from mmtrain.report.rundata import RunData, load_run
from mmtrain.structured import FieldError

PRICES = dict(
    price_per_gpu_hour=2.0, monthly_server_price=7300, purchase_price=100_000,
    depreciation_months=60, residual_value=0.1, pue=1.5, power_price=0.2,
    hosting_per_kw_month=100, staff_fraction=0.12,
)  # fmt: skip
FLAGS = [x for k, v in PRICES.items() for x in ("--" + k.replace("_", "-"), str(v))]


def _run(tmp_path, device: str = "NVIDIA H100 80GB HBM3", ranks: int = 8) -> RunData:
    """8 training rows of 450 s (an hour in all) on `ranks` ranks, as rundata reads them."""
    rows = [{"step": s, "loss": 1.0, "step_s": 450.0} for s in range(1, 9)]
    layout = {"kind": "layout", "step": 0, "world_size": ranks, "device": device}
    return RunData(run_dir=tmp_path, train_rows=rows, events={"layout": [layout]})


def test_measured_gpu_hours_priced_three_ways_by_hand(tmp_path):
    run = _run(tmp_path)
    (cost,) = cost_tables(run, "h100", Given(**PRICES, utilisation=0.5))  # no defaults table
    assert "8.00 GPU-hours = 1 h 00 min x 8 rank(s) on h100" in cost.title
    rows = {r[0]: r for r in cost.rows}
    assert rows["on_demand"][1] == f"{8 * 2.0:,.2f}"  # 16.00
    assert rows["monthly"][1] == f"{8 * 7300 / (8 * 730):,.2f}"  # at full use: 10.00
    # owned at 0.5: fixed 54,000 + 36 x (1,000 staff + 100 x 5.6 kW) = 110,160 over
    # 8 x 730 x 36 x 0.5 = 105,120 useful hours, plus 0.7 kW x 1.5 x 0.2 = 0.21 energy
    assert rows["buy"][1] == f"{8 * (110_160 / 105_120 + 0.21):,.2f}"  # 10.06
    # break-even against on demand: 110,160 / (210,240 x (2.0 - 0.21))
    assert f"on demand at {110_160 / (210_240 * 1.79):.1%}" in rows["buy"][2]


def test_catalog_defaults_are_listed_and_buying_needs_a_utilisation(tmp_path):
    run = _run(tmp_path, ranks=1)
    given = Given(monthly_server_price=7300, residual_value=0.1, staff_fraction=0.12)
    cost, defaults = cost_tables(run, "h100", given)
    assert "1.00 GPU-hours" in cost.title
    buy = {r[0]: r for r in cost.rows}["buy"]
    assert buy[1] == "-" and "--utilisation" in buy[2]
    named = {r[0]: r for r in defaults.rows}
    assert named["purchase_price"][1:3] == ["255237", "--purchase-price"]
    assert "Epoch AI" in named["purchase_price"][3] and named["pue"][4] == "2023-11-23"
    with pytest.raises(FieldError) as err:  # no catalog default for a monthly rental
        cost_tables(run, "h100", Given())
    assert err.value.path == "--monthly-server-price"
    with pytest.raises(FieldError) as err:
        cost_tables(run, "h100", Given(**PRICES, utilisation=1.5))
    assert err.value.path == "--utilisation"


def test_without_a_gpu_the_cost_is_a_note_naming_the_flag(tmp_path):
    run = _run(tmp_path, device="cpu", ranks=1)
    assert cost_tables(run, None, Given()) == []
    assert "a CPU run" in run.notes[-1] and "--gpu NAME" in run.notes[-1]
    run = _run(tmp_path)  # a GPU run: the note names the catalog key of the GPU it recorded
    assert cost_tables(run, None, Given()) == []
    assert "ran on NVIDIA H100 80GB HBM3: --gpu h100" in run.notes[-1]
    empty = RunData(run_dir=tmp_path)
    assert cost_tables(empty, None, Given()) == [] and empty.notes == []


def test_report_of_a_real_tiny_run_prices_its_step_times(tmp_path, capsys):
    from mmtrain.train.loop import train

    shards = make_shards(tmp_path / "shards", 16)
    train(micro_run(tmp_path, shards, train={"steps": 2}))
    folder = tmp_path / "run"
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(r["step_s"] for r in rows if "step_s" in r)
    seconds += max(r.get("checkpoint_s_total", 0) for r in rows)
    hours = seconds / 3600 * 1  # one rank (the layout record says so)
    assert load_run(folder).events["layout"][-1]["world_size"] == 1

    assert main(["report", str(folder), "--no-gallery"]) == 0  # a CPU run: a note, no table
    assert "cost left out (a CPU run" in capsys.readouterr().out
    assert main(["report", str(folder), "--no-gallery", "--gpu", "h100", *FLAGS]) == 0
    html = (folder / "report.html").read_text(encoding="utf-8")
    assert f"{hours:,.2f} GPU-hours" in html and f"{hours * 2.0:,.2f}" in html
    assert main(["report", str(folder), "--no-gallery", "--pue", "1.2"]) == 2  # no --gpu
    assert "--gpu" in capsys.readouterr().err
    assert main(["report", str(folder), "--no-gallery", "--gpu", "h100"]) == 2
    assert "error: --monthly-server-price" in capsys.readouterr().err
