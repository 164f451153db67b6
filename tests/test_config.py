"""The run config: YAML into typed dataclasses, dotted overrides, errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmtrain.cli import main
from mmtrain.config import RunConfig, apply_override, config_from_dict, diff_configs, load_config
from mmtrain.structured import FieldError

REPO = Path(__file__).resolve().parents[1]

BASE = """
model: tiny-clip
data:
  train: shards/
train:
  steps: 100
  batch_size: 32
  lr: 5e-4
"""


def write(tmp_path, text: str = BASE) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_becomes_typed_config_with_defaults(tmp_path):
    config = load_config(write(tmp_path))
    assert isinstance(config, RunConfig)
    assert config.train.lr == 5e-4  # YAML 1.1 would read "5e-4" as a string
    assert config.train.precision == "fp32" and config.checkpoint.keep == 3
    assert config.data.train[0].path == str(tmp_path / "shards")  # beside the config
    assert config.data.train[0].weight == 1.0
    assert config.micro_batch_for(4) == 8 and config.accumulation_steps(4) == 1


def test_overrides_are_yaml_typed_except_for_string_fields(tmp_path):
    config = load_config(
        write(tmp_path),
        [
            "train.lr=1e-3",
            "train.compile=true",
            "train.betas=[0.9, 0.95]",
            "train.grad_clip=null",
            "out=1e3",
            "seed=7",
            "train.towers.image.lr=1e-5",
            "train.towers.image.freeze_blocks=2",
            "checkpoint.every_minutes=30",
        ],
    )
    assert config.train.lr == 1e-3 and config.train.compile is True
    assert config.train.betas == (0.9, 0.95) and config.train.grad_clip is None
    assert config.out == str(Path.cwd() / "1e3") and config.seed == 7  # text, then a path
    assert (
        config.train.towers["image"].lr == 1e-5 and config.train.towers["image"].freeze_blocks == 2
    )
    assert config.checkpoint.every_minutes == 30.0


def test_data_sources_as_path_list_or_weighted_mapping(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths are taken from the current directory

    def sources(value):
        config = config_from_dict(
            {"model": "m", "data": {"train": value}, "train": {"steps": 1, "batch_size": 1}}
        )
        return [(s.path, s.weight) for s in config.data.train]

    a, b = str(tmp_path / "a"), str(tmp_path / "b/{0..3}.tar")
    assert sources("a/") == [(a, 1.0)]
    assert sources(["a/", "b/{0..3}.tar"]) == [(a, 1.0), (b, 1.0)]
    assert sources([{"path": "a/", "weight": 3}, {"path": ["x.tar", "/y.tar"]}]) == [
        (a, 3.0),
        ([str(tmp_path / "x.tar"), "/y.tar"], 1.0),
    ]


@pytest.mark.parametrize(
    ("override", "field", "message"),
    [
        ("train.lrr=1", "train.lrr", "did you mean 'lr'"),
        ("trian.lr=1", "trian", "did you mean 'train'"),
        ("train.lr=-0.1", "train.lr", "must be at least 0"),
        ("train.precision=bf61", "train.precision", "did you mean 'bf16'"),
        ("train.steps=0", "train.steps", "must be at least 1"),
        ("train.warmup_steps=500", "train.warmup_steps", "more than train.steps"),
        ("train.batch_size=many", "train.batch_size", "expected an integer"),
        ("train.micro_batch=5", "train.batch_size", "ranks x micro_batch = 1 x 5"),
        ("checkpoint.keep=0", "checkpoint.keep", "at least 1"),
        ("train.towers.image.lr=-1", "train.towers.image.lr", "at least 0"),
        ("train.betas=[0.9, 1.5]", "train.betas[1]", "[0, 1)"),
    ],
)
def test_bad_values_name_the_field(tmp_path, override, field, message):
    with pytest.raises(FieldError) as err:
        load_config(write(tmp_path), [override])
    assert err.value.path == field
    assert message in str(err.value) and "run.yaml" in str(err.value)


def test_batch_must_split_over_ranks_and_micro_batches(tmp_path):
    config = load_config(write(tmp_path), ["train.micro_batch=4"])
    config.validate(world_size=4)  # 32 = 4 ranks x 4 x 2 accumulation steps
    assert config.accumulation_steps(4) == 2
    with pytest.raises(FieldError, match=r"batch_size: 32 is not divisible by the 3 data-parallel"):
        config.validate(world_size=3)
    config.train.batch_size = 24
    with pytest.raises(FieldError, match=r"24 is not divisible by ranks x micro_batch = 4 x 4"):
        config.validate(world_size=4)


def test_malformed_overrides_and_files(tmp_path):
    with pytest.raises(FieldError, match="not key=value"):
        apply_override({}, "train.lr")
    with pytest.raises(FieldError, match="not a mapping"):
        apply_override({"train": 3}, "train.lr=1")
    with pytest.raises(FieldError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(FieldError, match="not valid YAML"):
        load_config(write(tmp_path, "train: [1, 2"))
    with pytest.raises(FieldError, match="missing required key"):
        load_config(write(tmp_path, "model: tiny-clip\n"))


def test_model_spec_next_to_the_config_is_found(tmp_path):
    (tmp_path / "my-spec.yaml").write_text("name: x\n")
    config = load_config(write(tmp_path, BASE.replace("tiny-clip", "my-spec.yaml")))
    assert config.model == str(tmp_path / "my-spec.yaml")


def test_resolved_config_round_trips_and_diffs(tmp_path):
    config = load_config(write(tmp_path))
    again = config_from_dict(config.to_dict())
    assert again == config
    changed = load_config(write(tmp_path), ["train.steps=200", "train.towers.text.lr=1e-4"])
    assert diff_configs(config.to_dict(), changed.to_dict()) == ["train.steps", "train.towers.text"]


def test_shipped_recipe_is_valid():
    config = load_config(REPO / "configs" / "tiny-clip.yaml")
    config.validate(world_size=1)
    assert config.model == "tiny-clip"


def test_cli_reports_a_bad_key_with_exit_code_2(tmp_path, capsys):
    code = main(["train", str(write(tmp_path)), "train.lrr=1e-3"])
    assert code == 2
    assert "train.lrr: unknown key (did you mean 'lr'?)" in capsys.readouterr().err


def test_guards_eval_and_schedules_are_checked(tmp_path):
    config = load_config(write(tmp_path))
    assert config.guards.max_nonfinite_in_a_row == 3 and config.eval.every_steps is None
    assert config.data.label_field == "label" and config.train.resolution_schedule == []
    config = load_config(write(tmp_path), ["train.resolution_schedule=[[0, 48], [100, 64]]"])
    assert config.train.resolution_schedule == [(0, 48), (100, 64)]
    for override, field in (
        ("train.resolution_schedule=[[10, 48], [5, 64]]", r"train.resolution_schedule\[1\]"),
        ("train.frames_schedule=[[0, 0]]", r"train.frames_schedule\[0\]\[1\]"),
        ("guards.rollback_lr_factor=0", "guards.rollback_lr_factor"),
        ("eval.every_steps=10", "eval.every_steps"),  # no data.val
    ):
        with pytest.raises(FieldError, match=field):
            load_config(write(tmp_path), [override])


def test_paths_in_a_config_are_relative_to_it_and_overrides_to_the_current_directory(
    tmp_path, monkeypatch
):
    """Every path of a config file is taken from the file's folder, every path of an override
    from the current directory, and the typed config holds them absolute; names (a preset,
    the byte tokenizer, a chat template) stay names."""
    folder = tmp_path / "project" / "configs"
    folder.mkdir(parents=True)
    (folder / "spec.yaml").write_text("name: x\n")
    path = folder / "run.yaml"
    path.write_text(
        "model: spec.yaml\n"
        "init: {image: ../baselines/clip, text: ~/text.safetensors}\n"
        f"init_sha256: {{../baselines/clip/model.safetensors: {'ab' * 32}}}\n"
        "data:\n"
        "  train: [{path: ../shards/a, weight: 2}, '../shards/b-{000..003}.tar', s3://bucket/c]\n"
        "  val: ../shards/val\n"
        "  tokenizer: ../tok/tokenizer.json\n"
        "  chat_template: chatml\n"
        "  cache_dir: ../cache\n"
        "train: {steps: 10, batch_size: 4}\n"
        "eval: {extractor: ../runs/clip, extractor_tokenizer: byte}\n"
        "out: ../runs/one\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(path)
    project = tmp_path / "project"
    assert config.model == str(folder / "spec.yaml")
    assert config.init == {"image": str(project / "baselines/clip"),
                           "text": str(Path.home() / "text.safetensors")}  # fmt: skip
    assert [s.path for s in config.data.train] == [
        str(project / "shards/a"), str(project / "shards/b-{000..003}.tar"), "s3://bucket/c"
    ]  # fmt: skip
    assert config.data.train[0].weight == 2
    # a pinned file is the one `init` reads, by the same absolute path
    assert config.init_sha256 == {str(project / "baselines/clip/model.safetensors"): "ab" * 32}
    assert config.data.val[0].path == str(project / "shards/val")
    assert config.data.tokenizer == str(project / "tok/tokenizer.json")
    assert config.data.chat_template == "chatml"
    assert config.data.cache_dir == str(project / "cache")
    assert config.eval.extractor == str(project / "runs/clip")
    assert config.eval.extractor_tokenizer == "byte"
    assert config.out == str(project / "runs/one")
    # overrides: from the current directory, as a shell's paths are
    again = load_config(path, ["data.train=shards", "out=runs/two", "data.tokenizer=byte",
                               "model=tiny-clip", "data.chat_template=my/template.jinja"])  # fmt: skip
    assert again.data.train[0].path == str(elsewhere / "shards")
    assert again.out == str(elsewhere / "runs/two")
    assert (again.data.tokenizer, again.model) == ("byte", "tiny-clip")
    # names in any case, and a mistyped preset (its error then suggests the closest one)
    names = load_config(path, ["data.tokenizer=Byte", "model=tiny-clipp"])
    assert (names.data.tokenizer, names.model) == ("Byte", "tiny-clipp")
    assert again.data.chat_template == str(elsewhere / "my/template.jinja")
    # the saved config reads the same from anywhere: loading it again changes nothing
    assert config_from_dict(config.to_dict()) == config
