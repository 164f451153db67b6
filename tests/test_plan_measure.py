"""`--measure`: the prediction agrees with what the real module holds in one CPU step
(fp32): activations within 10%, model states within 1%."""

import json
from pathlib import Path

import pytest

from mmtrain.cli import main
from mmtrain.config import load_config
from mmtrain.plan.workloads import load_model
from mmtrain.spec import load_spec


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


# ----------------------------------------------------------------------------- recipes
CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
# The tiny model of each family the recipes train, and the rows it is measured on.
TINY_ROWS = {
    "tiny-qwen2-vl": ["--context", "256", "--visual", "64x64"],
    "tiny-vlm": ["--context", "160", "--micro-batch", "2"],
    "tiny-fusion": ["--micro-batch", "4"],
    "tiny-clip": ["--micro-batch", "4"],
    "tiny-multimodal": ["--micro-batch", "2"],
}


def _tiny_of(spec) -> str:
    """The tiny preset with the recipe's structure (its towers under the same names)."""
    if spec.vision is not None:
        return "tiny-qwen2-vl"
    if spec.projector is not None:
        return "tiny-vlm"
    if spec.fusion is not None:
        return "tiny-fusion"
    return "tiny-clip" if set(spec.towers) == {"image", "text"} else "tiny-multimodal"


def _flags(name: str, tower, layers: int) -> list[str]:
    """`mmtrain plan` flags training tower `name` as the recipe's `train.towers.NAME` does,
    on a tiny model of `layers` blocks (a count of blocks keeps some frozen and some not)."""
    if tower.freeze:
        return ["--freeze", name]
    if tower.lora is not None:
        targets = ",".join(tower.lora.targets)
        rank = str(min(tower.lora.rank, 16))
        return ["--lora", name, "--lora-targets", targets, "--lora-rank", rank]
    if tower.unlocked_blocks is not None:
        return ["--unlocked-blocks", f"{name}={min(tower.unlocked_blocks, layers - 1)}"]
    if tower.freeze_blocks:
        return ["--freeze-blocks", f"{name}={min(tower.freeze_blocks, layers - 1)}"]
    return []


def recipe_patterns() -> dict[tuple[str, ...], list[str]]:
    """Each way the shipped recipes train their towers (frozen, LoRA, partly frozen, trained;
    recomputed or not), as `mmtrain plan` flags on the tiny model of the recipe's family, with
    the recipes that use it."""
    patterns: dict[tuple[str, ...], list[str]] = {}
    for path in CONFIGS:
        config = load_config(path)
        tiny = _tiny_of(load_spec(config.model))
        model = load_model(tiny)
        flags = ["--model", tiny, *TINY_ROWS[tiny]]
        for name, tower in sorted(config.train.towers.items()):
            flags += _flags(name, tower, model.stack(name).layers)  # FieldError: no such tiny tower
        recomputed = any(t.activation_checkpointing for t in config.train.towers.values())
        flags += ["--ac", "full" if recomputed else "none"]
        patterns.setdefault(tuple(flags), []).append(path.stem)
    return patterns


PATTERNS = recipe_patterns()
STAGE_1 = ("--freeze", "image", "--freeze", "text")  # the projector trains through the frozen LM


def test_the_recipes_patterns_include_llava_stage_1():
    stage_1 = [p for p, recipes in PATTERNS.items() if "vlm-stage1" in recipes]
    assert len(stage_1) == 1 and " ".join(STAGE_1) in " ".join(stage_1[0])


@pytest.mark.parametrize("argv", sorted(PATTERNS), ids=lambda p: "+".join(PATTERNS[p]))
def test_measure_agrees_for_every_freeze_pattern_of_the_recipes(capsys, argv):
    _check(capsys, list(argv))


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_a_frozen_lm_behind_a_trained_projector_keeps_its_activations(capsys, ac):
    """LLaVA's stage 1: the gradient reaches the projector through the frozen decoder, whose
    blocks keep what it needs (they were planned as keeping nothing: -96% against the step)."""
    argv = ["--model", "tiny-vlm", *TINY_ROWS["tiny-vlm"], *STAGE_1, "--ac", ac]
    measured = _check(capsys, argv)
    spec = load_spec("tiny-vlm")
    projector = spec.projector.params(spec.towers["image"].width, spec.decoder.width)
    assert measured["trainable_params"] == projector  # the projector alone trains


def test_a_frozen_lm_split_over_two_ranks_keeps_its_share(capsys):
    """The same under sequence parallelism (all-to-all, 2 gloo ranks): each rank keeps the
    exchanged q, k and v, and nothing else of attention's inputs."""
    argv = ["--model", "tiny-vlm", *TINY_ROWS["tiny-vlm"], *STAGE_1, "--gpus", "2",
            "--sequence-parallel", "2"]  # fmt: skip
    _check(capsys, argv)


def _check(capsys, argv: list[str]) -> dict:
    assert main(["plan", *argv, "--measure", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert abs(measured["activations_error"]) < 0.10
    assert abs(measured["model_state_error"]) < 0.01
    assert measured["trainable_params"] == measured["predicted_trainable_params"]
    assert measured["activations_bytes"] > 0
    return measured
