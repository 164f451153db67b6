"""docs/PLANNER.md, "Rent or buy": its commands run as written and print what it shows.

test_readme_commands.py runs every documented command but skips those that read a file the
reader brings (`year.yaml`, `runs/clip`) and checks no output. Here the section's YAML block is
the `year.yaml` its commands read, `runs/clip` is a tiny real training run, and each ```text
block must appear, line for line, in the output of the section's plan commands, taken in order:
a number the docs quote is a number the command prints now.
"""

import re
import shlex
from pathlib import Path

import pytest

from micro import make_shards, micro_run
from mmtrain.cli import main

PLANNER = Path(__file__).resolve().parents[1] / "docs" / "PLANNER.md"


def _section() -> str:
    text = PLANNER.read_text(encoding="utf-8")
    start = text.index("## Rent or buy")
    return text[start : text.index("\n## ", start + 1)]


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", _section(), flags=re.S)


def _commands() -> list[list[str]]:
    lines = [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    return [shlex.split(line) for line in lines]


def _run(argv: list[str], files: dict[str, str], capsys) -> str:
    assert argv[0] == "mmtrain", argv
    args = [files.get(a, a) for a in argv[1:]]
    assert main(args) == 0, argv
    return capsys.readouterr().out


def test_the_section_shows_plan_own_projects_deadline_and_report():
    commands = [" ".join(c) for c in _commands()]
    assert sum("plan" in c and "--own" in c for c in commands) == len(_blocks("text")) == 4
    # answers without the figures no source gives: residual and staff assumed, monthly left out
    assert any("--residual-value" not in c and "--staff-fraction" not in c for c in commands)
    assert any("--monthly-server-price" not in c for c in commands)
    assert any("--projects year.yaml" in c and "--deadline-days" in c for c in commands)
    assert any(c.startswith("mmtrain report runs/clip --gpu") for c in commands)
    assert len(_blocks("yaml")) == 1


def test_plan_commands_print_what_the_docs_show(tmp_path, capsys):
    year = tmp_path / "year.yaml"
    year.write_text(_blocks("yaml")[0])
    plans = [c for c in _commands() if c[1] == "plan"]
    for argv, shown in zip(plans, _blocks("text"), strict=True):
        printed = _run(argv, {"year.yaml": str(year)}, capsys).splitlines()
        for line in shown.splitlines():
            assert line in printed, f"{shlex.join(argv)}: docs show {line!r}, not printed"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    from mmtrain.train.loop import train

    root = tmp_path_factory.mktemp("own-docs")
    train(micro_run(root, make_shards(root / "shards", 16), train={"steps": 2}))
    return root / "run"


def test_the_report_command_prices_a_run(tiny_run, capsys):
    (argv,) = [c for c in _commands() if c[1] == "report"]
    out = _run(argv, {"runs/clip": str(tiny_run)}, capsys)
    assert "Cost of the measured GPU-hours (USD)" in out and "on h100" in out
    assert re.search(r"buy: [\d,.]+ \(at 50\.0% utilisation", out)
