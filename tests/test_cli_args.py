"""Counts on the command line (`--samples 4e8`) and who gets to log to the console."""

import argparse
import json
import logging

import pytest

from mmtrain.cli import configure_logging, main
from mmtrain.commands._args import count


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("400000000", 400_000_000),
        ("4e8", 400_000_000),
        ("4E+8", 400_000_000),
        ("1_000_000", 1_000_000),
        ("1,000,000", 1_000_000),
        ("12345678901234567e0", 12345678901234567),  # no float rounding
        ("0", 0),
    ],
)
def test_count_accepts_how_people_write_counts(text, value):
    assert count(text) == value


@pytest.mark.parametrize("text", ["2.5", "1e-3", "1,00", "1__0", "ten", "", "nan", "1e99999"])
def test_count_refuses_what_is_not_a_whole_number(text):
    with pytest.raises(argparse.ArgumentTypeError, match="whole number"):
        count(text)


def test_plan_reads_samples_in_scientific_notation(capsys):
    argv = ["plan", "--model", "tiny-clip", "--gpu", "h100", "--global-batch", "1_024", "--json"]
    assert main([*argv, "--samples", "4e8"]) == 0
    time = json.loads(capsys.readouterr().out)["time"]
    assert main([*argv, "--samples", "400000000"]) == 0
    assert json.loads(capsys.readouterr().out)["time"] == time


def test_a_fractional_count_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "tiny-clip", "--gpu", "h100", "--samples", "2.5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --samples" in err and "'2.5'" in err


@pytest.fixture
def restore_levels():
    loggers = [logging.getLogger(), logging.getLogger("mmtrain")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


def test_other_libraries_info_lines_stay_off_the_console(restore_levels):
    ours, theirs = logging.getLogger("mmtrain.plan.x"), logging.getLogger("botocore.credentials")
    configure_logging(verbose=False)
    assert ours.isEnabledFor(logging.INFO) and not ours.isEnabledFor(logging.DEBUG)
    assert theirs.isEnabledFor(logging.WARNING) and not theirs.isEnabledFor(logging.INFO)
    configure_logging(verbose=True)
    assert ours.isEnabledFor(logging.DEBUG) and theirs.isEnabledFor(logging.INFO)
