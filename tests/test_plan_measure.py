"""`--measure`: the prediction agrees with what the real module holds in one CPU step
(fp32): activations within 10%, model states within 1%."""

import json

import pytest

from mmtrain.cli import main


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "tiny-clip", "--micro-batch", "4", "--ac", "none"],
        ["--model", "tiny-clip", "--micro-batch", "8", "--ac", "selective", "--image-size", "96"],
        ["--model", "tiny-clip", "--micro-batch", "3", "--ac", "full", "--context", "20"],
        ["--model", "tiny-clip", "--micro-batch", "4", "--freeze", "text"],
        ["--model", "tiny-multimodal", "--micro-batch", "8", "--ac", "none"],
        ["--model", "tiny-multimodal", "--micro-batch", "2", "--ac", "full"],
        ["--model", "tiny-fusion", "--micro-batch", "4", "--ac", "none"],
        ["--model", "tiny-fusion", "--micro-batch", "8", "--ac", "selective", "--freeze", "text"],
        ["--model", "tiny-fusion", "--micro-batch", "3", "--ac", "full", "--image-size", "64"],
    ],
)
def test_measure_agrees_with_prediction(capsys, argv):
    assert main(["plan", *argv, "--measure", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert abs(measured["activations_error"]) < 0.10
    assert abs(measured["model_state_error"]) < 0.01
    assert measured["activations_bytes"] > 0


def test_measure_table_prints_both_columns(capsys):
    assert main(["plan", "--model", "tiny-clip", "--micro-batch", "2", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "measured" in out and "saved activations" in out
