"""The planner for any transformers folder (issue 42 item 5): a hub model's trace on the meta
device against one real CPU step, its plan through `mmtrain plan --model FOLDER`, the presets
by the published configs, and `mmtrain spec FOLDER`.

Tolerances. The trace and the measured step run the same module class at the same row, in
float32: forward FLOPs (torch's counter) and the float elements autograd keeps must be equal.
The integer bytes may differ by one boolean mask of the row (`positions` bytes): on the meta
device a boolean index is kept as given where the CPU kernel keeps the positions it selects
(models/hub/trace.py). Preset parameters: exact against transformers' own meta build of each
config, and within the rounding of the model card's published total (e.g. 8.77B: +-0.005B).
"""

import json
from pathlib import Path

import pytest

from hub_folders import hub_cache, make_folder
from mmtrain.cli import main
from mmtrain.hub_spec import HubShape
from mmtrain.models.hub import trace as hub_trace
from mmtrain.models.hub.model import build_hub_module
from mmtrain.models.hub.towers import find_towers
from mmtrain.plan.hub import HUB_PRESETS

SHAPE = HubShape(positions=64, images=1, image_height=32, image_width=32)
# Published totals on the model cards (billions, as rounded there).
PUBLISHED = {"Qwen3-VL-4B": (4.44, 0.005), "Qwen3-VL-8B": (8.77, 0.005),
             "Qwen3-VL-32B": (33.4, 0.05), "Gemma-3-27B": (27.4, 0.05)}  # fmt: skip


@pytest.fixture(autouse=True)
def _trace_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(hub_trace.CACHE_ENV, str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return {family: make_folder(family, root) for family in ("qwen3_vl", "gemma3")}


def _saved_total(trace):
    floats = sum(sum(s.floats for s in t.block_saved) + t.outside.floats for t in trace.towers)
    other = sum(sum(s.other_bytes for s in t.block_saved) + t.outside.other_bytes
                for t in trace.towers)  # fmt: skip
    return floats, other


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_trace_on_meta_equals_a_real_cpu_step(folders, family):
    traced = hub_trace.trace_hub(folders[family], SHAPE, cache=False)
    measured = hub_trace.measure_hub_step(folders[family], SHAPE)
    floats, other = _saved_total(traced)
    assert traced.forward_flops() == measured["forward_flops"]
    assert floats == measured["float_elements"]
    assert abs(other - measured["other_bytes"]) <= SHAPE.positions
    assert traced.image_tokens > 0
    assert traced.tower("text").tokens == SHAPE.positions


def test_a_frozen_tower_keeps_nothing_and_the_trace_is_cached(folders, monkeypatch):
    frozen = hub_trace.trace_hub(folders["qwen3_vl"], SHAPE, ("vision",))
    vision = frozen.tower("vision")
    assert all(s.floats == 0 for s in vision.block_saved) and vision.outside.floats == 0
    assert frozen.tower("text").forward_flops > 0

    def no_second_trace(*_args):
        raise AssertionError("traced again instead of reading the cache")

    monkeypatch.setattr(hub_trace, "_trace", no_second_trace)
    assert hub_trace.trace_hub(folders["qwen3_vl"], SHAPE, ("vision",)) == frozen


def _plan(argv, capsys):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_measure_of_a_folder_agrees(folders, capsys):
    folder = str(folders["gemma3"])
    d = _plan(["--model", folder, "--context", "64", "--image-size", "32", "--measure"], capsys)
    m = d["measured"]
    assert (
        m["forward_flops"] == m["predicted_forward_flops"] == d["model"]["forward_flops_per_sample"]
    )
    assert abs(m["predicted_activations_bytes"] - m["activations_bytes"]) <= SHAPE.positions
    assert m["model_state_error"] == 0
    assert m["trainable_params"] == m["optimizer_state_params"] == m["predicted_trainable_params"]
    # the tiny SigLIP's pooling head runs but no loss reads it: weights only, no gradient
    built = build_hub_module(folders["gemma3"], device="meta")
    assert d["model"]["params"] == sum(p.numel() for p in built.parameters())
    assert d["model"]["params"] > m["trainable_params"]


def test_plan_of_a_folder_freezes_and_adapts_towers(folders, capsys):
    folder = str(folders["qwen3_vl"])
    base = ["--model", folder, "--context", "64", "--image-size", "32"]
    full = _plan(base, capsys)
    frozen = _plan([*base, "--freeze", "vision"], capsys)
    lora = _plan([*base, "--freeze", "vision", "--lora", "text", "--lora-rank", "4"], capsys)
    towers = full["model"]["towers"]
    assert (
        full["model"]["trainable_params"] == towers["vision"]["params"] + towers["text"]["params"]
    )
    assert frozen["model"]["trainable_params"] == towers["text"]["params"]
    assert frozen["memory"]["activations_by_tower"]["vision"] == 0
    assert 0 < lora["model"]["trainable_params"] < frozen["model"]["trainable_params"]


def test_sequence_parallelism_is_native_only(folders, capsys):
    argv = ["plan", "--model", str(folders["qwen3_vl"]), "--context", "64", "--image-size", "32"]
    assert main([*argv, "--sequence-parallel", "2"]) == 2
    assert "native-only (LLaVA, Qwen2/2.5-VL, Llama/Qwen2 families)" in capsys.readouterr().err
    rec = _plan([*argv[1:], "--recommend", "--gpu", "h100", "--max-gpus", "8"], capsys)
    assert rec["ranked"] and all(p["inputs"]["sequence_parallel"] == 1 for p in rec["ranked"])


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_configs(name):
    import transformers

    folder = HUB_PRESETS / name
    config = transformers.AutoConfig.from_pretrained(str(folder))
    hf = hub_trace.meta_module(folder, preset=True)
    exact = sum(p.numel() for p in hf.parameters())
    towers = find_towers(hf)
    assert sum(sum(p.numel() for p in t.parameters()) for t in towers.values()) == exact
    cls = type(hf)
    assert cls.__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert config.model_type in ("qwen3_vl", "gemma3")
    published, rounding = PUBLISHED[name]
    assert abs(exact / 1e9 - published) <= rounding


def test_spec_of_a_hub_preset_and_a_folder(folders, capsys):
    assert main(["spec", "Qwen3-VL-8B", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["architecture"] == "Qwen3VLForConditionalGeneration"
    assert d["params"] == sum(d["tower_params"].values())
    assert d["towers"]["text"]["blocks"] == 36 and d["towers"]["vision"]["blocks"] == 27
    assert d["forward_flops_per_sample"] == sum(t["forward_flops"] for t in d["towers"].values())
    assert main(["spec", str(folders["gemma3"])]) == 0
    out = capsys.readouterr().out
    assert "Gemma3ForConditionalGeneration" in out and "blocks" in out


def test_the_docs_hub_command_runs(capsys):
    docs = (Path(__file__).resolve().parents[1] / "docs" / "PLANNER.md").read_text()
    section = docs[docs.index("## Any Hugging Face model") :]
    command = "mmtrain plan --model Qwen3-VL-8B --gpu h100 --gpus 8"
    assert command in section
    assert main(command.split()[1:]) == 0
    assert "Qwen3-VL-8B: 8,767.1M params" in capsys.readouterr().out


def test_plan_of_a_hub_name_reads_the_hugging_face_cache(folders, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "hf"
    hub_cache(folders["qwen3_vl"], "tiny-org/tiny-qwen3-vl", cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ["--context", "64", "--image-size", "32"]
    by_name = _plan(["--model", "tiny-org/tiny-qwen3-vl", *base], capsys)
    by_folder = _plan(["--model", str(folders["qwen3_vl"]), *base], capsys)
    assert by_name["model"]["params"] == by_folder["model"]["params"]
    assert by_name["memory"]["total_bytes"] == by_folder["memory"]["total_bytes"]
    assert main(["plan", "--model", "tiny-org/not-there", *base]) == 2
    assert str(cache) in capsys.readouterr().err
