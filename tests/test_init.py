"""`init` (start a run from a baseline's weights) and `mmtrain merge` (WiSE-FT).

With train.lr=0 a run changes no weight (AdamW's decoupled decay is scaled by the learning rate
too), so its final model.safetensors must equal the source it started from, bit for bit.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml

from micro import make_shards, micro_run, micro_spec
from mmtrain.checkpoint import latest_checkpoint
from mmtrain.cli import main
from mmtrain.config import apply_override, load_config
from mmtrain.models import create_model, load_model, save_model
from mmtrain.models.formats.openclip import mmtrain_to_openclip
from mmtrain.spec import ModelSpec, with_tower
from mmtrain.structured import FieldError
from mmtrain.train.init import InitError, InitMismatch, read_source
from mmtrain.train.init_start import load_init
from mmtrain.train.loop import train
from mmtrain.train.resolution import resize_pos_embed

SPEC = ModelSpec.from_dict(micro_spec())  # OpenCLIP-shaped: cls image tower, eot text tower


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"), 16)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict[str, Path]:
    """One random model (seed 7) as an mmtrain folder and as an OpenCLIP training checkpoint."""
    root = tmp_path_factory.mktemp("baseline")
    model = create_model(SPEC, seed=7)
    save_model(model, root / "folder")
    openclip = mmtrain_to_openclip(model.state_dict(), SPEC)
    checkpoint = {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in openclip.items()}}
    torch.save(checkpoint, root / "epoch_3.pt")
    return {"folder": root / "folder", "openclip": root / "epoch_3.pt"}


def weights(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path / "model.safetensors"))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "") -> None:
    keys = [k for k in a if k.startswith(prefix)]
    assert keys
    for key in keys:
        assert torch.equal(a[key], b[key]), key


def frozen_run(folder: Path, shards: str, init, spec=None, **top):
    """2 steps at learning rate 0 (the weights cannot move) starting from `init`; `top` sets
    other top-level keys (init_strict, init_sha256)."""
    train_ = {"steps": 2, "lr": 0.0, "warmup_steps": 0}
    config = micro_run(folder, shards, spec=spec or micro_spec(), train=train_)
    config.init = init
    for key, value in top.items():
        setattr(config, key, value)
    return config, train(config)


# ----------------------------------------------------------------------------- whole model
@pytest.mark.parametrize("kind", ["folder", "openclip"])
def test_run_starts_from_the_source_exactly(tmp_path, shards, baseline, kind):
    config, result = frozen_run(tmp_path, shards, str(baseline[kind]))
    assert_same(weights(result.out), weights(baseline["folder"]))
    resolved = yaml.safe_load((result.out / "config.yaml").read_text())
    assert resolved["init"] == str(baseline[kind])
    (file, digest), *rest = resolved["init_sha256"].items()
    assert not rest and Path(file).name in ("model.safetensors", "epoch_3.pt")
    assert len(digest) == 64


def test_run_starts_from_a_run_folder_and_resume_ignores_init(tmp_path, shards, baseline):
    first = train(micro_run(tmp_path / "first", shards, train={"steps": 2}))  # lr 2e-3: it moved
    trained = weights(first.out)
    assert not torch.equal(trained["logit_scale"], weights(baseline["folder"])["logit_scale"])
    # Its last checkpoint folder is a source too (the manifest verified, spec from meta.json).
    last = read_source(latest_checkpoint(first.out / "checkpoints"))
    assert last.kind == "checkpoint" and last.spec == SPEC
    assert_same(last.state, trained)

    config = micro_run(
        tmp_path / "second", shards, train={"steps": 3, "lr": 0.0}, checkpoint={"every_steps": 1}
    )
    config.init = str(first.out)
    halted = train(config, halt_after_step=2)  # as a crash after step 2: checkpoint of step 1
    assert halted.step == 2 and not (halted.out / "model.safetensors").exists()
    # The resume names another baseline: it restores its checkpoint and ignores `init`.
    config.init = str(baseline["folder"])
    resumed = train(config)
    assert resumed.resumed_from == 1
    assert_same(weights(resumed.out), trained)
    assert yaml.safe_load((resumed.out / "config.yaml").read_text())["init"] == str(first.out)


# ----------------------------------------------------------------------------- per tower
def test_towers_from_different_sources(tmp_path, shards, baseline):
    other = create_model(SPEC, seed=11)
    save_model(other, tmp_path / "other")
    init = {"image": str(baseline["openclip"]), "text": str(tmp_path / "other")}
    _, result = frozen_run(tmp_path, shards, init)
    final = weights(result.out)
    assert_same(final, weights(baseline["folder"]), "towers.image.")
    assert_same(final, other.state_dict(), "towers.text.")
    # Two sources: the temperature is the spec's, not either source's.
    assert final["logit_scale"].item() == pytest.approx(SPEC.logit_scale_init)


def test_tower_found_by_modality_under_another_name(baseline):
    spec = ModelSpec.from_dict(
        {**micro_spec(), "towers": {"vision": micro_spec()["towers"]["image"]},
         "pairs": [], "fusion": {"num_outputs": 2, "heads": 2}}
    )  # fmt: skip
    model = create_model(spec, seed=1)
    load_init(model, {"vision": str(baseline["openclip"])})
    source = weights(baseline["folder"])
    for key, value in model.state_dict().items():
        if key.startswith("towers.vision."):
            assert torch.equal(value, source[key.replace("vision", "image", 1)]), key


def test_a_tower_the_source_lacks(baseline):
    spec = micro_spec()
    spec["towers"]["series"] = {"modality": "timeseries", "width": 32, "layers": 1, "heads": 2,
                                "stem": {"channels": 2, "length": 8, "patch": 4}}  # fmt: skip
    spec["pairs"].append(["series", "text"])
    with pytest.raises(InitMismatch, match="has no timeseries tower for tower 'series'"):
        load_init(create_model(ModelSpec.from_dict(spec)), str(baseline["openclip"]))
    model = create_model(ModelSpec.from_dict(spec))
    report = load_init(model, str(baseline["openclip"]), strict=False)
    assert_same(model.state_dict(), weights(baseline["folder"]), "towers.text.")
    assert report.random and all(key.startswith("towers.series.") for key in report.random)


def test_unknown_tower_names_the_field(baseline):
    with pytest.raises(FieldError, match=r"init\.audio: the model has no tower 'audio'"):
        load_init(create_model(SPEC), {"audio": str(baseline["folder"])})


# ----------------------------------------------------------------------------- mismatches
def test_mismatch_names_file_keys_shapes_and_counts(baseline):
    deeper = create_model(ModelSpec.from_dict(micro_spec(layers=3)), seed=1)
    with pytest.raises(InitMismatch) as err:
        load_init(deeper, str(baseline["openclip"]))
    text = str(err.value)
    assert text.startswith("init: ") and str(baseline["openclip"]) in text
    assert "24 missing in the source" in text and "towers.image.blocks.2.norm1.weight [32]" in text
    assert "init_strict: false" in text

    wider = create_model(ModelSpec.from_dict(micro_spec(embed_dim=16)), seed=1)
    with pytest.raises(
        InitMismatch, match=r"towers\.image\.proj\.weight \[32, 32\] \(model: \[16, 32\]\)"
    ):
        load_init(wider, str(baseline["folder"]))


def test_not_strict_loads_what_fits_and_logs_the_rest(baseline, caplog):
    spec = ModelSpec.from_dict(micro_spec(layers=3))
    model, fresh = create_model(spec, seed=1), create_model(spec, seed=1).state_dict()
    with caplog.at_level(logging.WARNING, logger="mmtrain.train.init"):
        report = load_init(model, str(baseline["folder"]), strict=False)
    state, source = model.state_dict(), weights(baseline["folder"])
    assert_same(state, source, "towers.image.blocks.1.")
    assert_same(state, fresh, "towers.image.blocks.2.")
    assert len(report.random) == 24 and "towers.text.blocks.2.mlp.fc2.bias" in report.random
    assert "24 tensors keep their random init" in caplog.text


def test_strict_false_through_the_config(tmp_path, shards, baseline):
    _, result = frozen_run(
        tmp_path, shards, str(baseline["folder"]), spec=micro_spec(layers=3), init_strict=False
    )
    assert_same(weights(result.out), weights(baseline["folder"]), "towers.text.blocks.1.")


# ----------------------------------------------------------------------------- sizes
def test_position_embeddings_follow_a_new_image_size_and_context(baseline):
    spec = with_tower(
        ModelSpec.from_dict(micro_spec(context_length=24)), "image", stem={"image_size": 32}
    )
    model = create_model(spec, seed=1)
    fresh = model.state_dict()["towers.text.stem.pos_embed"].clone()
    report = load_init(model, str(baseline["openclip"]))
    source = weights(baseline["folder"])
    pos = model.state_dict()["towers.image.stem.pos_embed"]
    assert pos.shape == (1 + 16, 32)  # class token + a 4x4 grid (was 2x2)
    assert torch.equal(pos[0], source["towers.image.stem.pos_embed"][0])
    text = model.state_dict()["towers.text.stem.pos_embed"]
    assert torch.equal(text[:16], source["towers.text.stem.pos_embed"])
    assert torch.equal(text[16:], fresh[16:])  # extended rows keep their random init
    assert any("2x2 to a 4x4" in n for n in report.notes)
    assert any("16 -> 24" in n for n in report.notes)

    shorter = create_model(ModelSpec.from_dict(micro_spec(context_length=8)))
    load_init(shorter, str(baseline["folder"]))
    assert torch.equal(
        shorter.state_dict()["towers.text.stem.pos_embed"], source["towers.text.stem.pos_embed"][:8]
    )


def test_resize_pos_embed_keeps_the_class_row_and_constants():
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(1 + 9, 8, generator=g)
    assert resize_pos_embed(pos, 3, 1) is not None and torch.equal(resize_pos_embed(pos, 3, 1), pos)
    bigger = resize_pos_embed(pos, 6, 1)
    assert bigger.shape == (37, 8) and torch.equal(bigger[0], pos[0])
    constant = torch.full((1 + 16, 4), 0.25, dtype=torch.float64)
    for grid in (2, 8):  # bicubic weights sum to one, antialiased or not
        resized = resize_pos_embed(constant, grid, 1)
        torch.testing.assert_close(resized, torch.full_like(resized, 0.25))


# ----------------------------------------------------------------------------- safety
class _Payload:
    """Unpickling it would create a file: proof that it ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_with_objects_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "was-executed"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "hook": _Payload(marker)}, tmp_path / "x.pt")
    with pytest.raises(InitError, match="not unpickled"):
        read_source(tmp_path / "x.pt")
    assert not marker.exists()


def test_unreadable_sources_name_the_file(tmp_path):
    with pytest.raises(InitError, match="does not exist"):
        read_source(tmp_path / "nothing")
    (tmp_path / "weights.ckpt").write_bytes(b"\x80\x04")
    with pytest.raises(InitError, match=r"weights\.ckpt: weights files are read as"):
        read_source(tmp_path / "weights.ckpt")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(InitError, match="has not finished"):
        read_source(tmp_path / "run")


# ----------------------------------------------------------------------------- config
def test_init_overrides_and_relative_paths(tmp_path, baseline):
    config = {
        "model": "spec.yaml",
        "data": {"train": "shards"},
        "train": {"steps": 1, "batch_size": 2},
        "init": "folder",
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(micro_spec()))
    (tmp_path / "folder").mkdir()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert load_config(tmp_path / "run.yaml").init == str(tmp_path / "folder")
    # an override is text (not the number 123), a path from the current directory
    assert load_config(tmp_path / "run.yaml", ["init=123"]).init == str(Path.cwd() / "123")
    tree: dict = {}
    apply_override(tree, "init.image=007")
    assert tree == {"init": {"image": "007"}}
    loaded = load_config(
        tmp_path / "run.yaml", ["init=null", "init.image=a/b", "init_strict=false"]
    )
    assert loaded.init == {"image": str(Path.cwd() / "a/b")} and loaded.init_strict is False
    with pytest.raises(FieldError, match=r"init_sha256\.\S*x: not a sha256"):
        load_config(tmp_path / "run.yaml", ["init_sha256={x: abc}"])


def test_a_pinned_sha256_must_match(tmp_path, shards, baseline):
    file = str(baseline["folder"] / "model.safetensors")
    with pytest.raises(InitError, match="the baseline changed"):
        frozen_run(tmp_path, shards, str(baseline["folder"]), init_sha256={file: "0" * 64})


# ----------------------------------------------------------------------------- merge
def test_merge_interpolates_per_tensor(tmp_path, baseline, capsys):
    finetuned = create_model(SPEC, seed=3)
    save_model(finetuned, tmp_path / "ft")
    base = weights(baseline["folder"])
    ends = {}
    for alpha in (0.0, 1.0, 0.5):
        out = tmp_path / f"merged-{alpha}"
        # BASE as an OpenCLIP checkpoint, FINETUNED as an mmtrain folder: the formats may differ.
        argv = ["merge", str(baseline["openclip"]), str(tmp_path / "ft"), "--alpha", str(alpha)]
        assert main([*argv, "--out", str(out)]) == 0
        ends[alpha] = load_model(out).state_dict()
    assert_same(ends[0.0], base)
    assert_same(ends[1.0], finetuned.state_dict())
    for key, value in ends[0.5].items():
        mean = (base[key].double() + finetuned.state_dict()[key].double()) / 2
        torch.testing.assert_close(value.double(), mean, rtol=0, atol=1e-7, msg=key)


def test_merge_refuses_different_models(tmp_path, baseline, capsys):
    save_model(create_model(ModelSpec.from_dict(micro_spec(layers=3))), tmp_path / "deeper")
    argv = ["merge", str(baseline["folder"]), str(tmp_path / "deeper"), "--alpha", "0.5"]
    assert main([*argv, "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "towers.image.blocks.2.attn.out.bias: absent vs [32]" in err
    assert str(tmp_path / "deeper") in err
    assert main(["merge", str(tmp_path / "nope"), str(baseline["folder"]), "--alpha", "1",
                 "--out", str(tmp_path / "m")]) == 2  # fmt: skip
    assert "nope does not exist" in capsys.readouterr().err
    # Same tensors, another head count: the specs tell.
    heads = micro_spec()
    heads["towers"]["image"]["heads"] = 4
    save_model(create_model(ModelSpec.from_dict(heads)), tmp_path / "heads")
    argv = ["merge", str(baseline["folder"]), str(tmp_path / "heads"), "--alpha", "0.5"]
    assert main([*argv, "--out", str(tmp_path / "m")]) == 2
    assert "towers.image.heads" in capsys.readouterr().err
    # Two OpenCLIP files say nothing of heads: --model must.
    argv = ["merge", str(baseline["openclip"]), str(baseline["openclip"]), "--alpha", "0.5"]
    assert main([*argv, "--out", str(tmp_path / "m")]) == 2
    assert "give --model" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


# ----------------------------------------------------------------------------- Hugging Face
def tiny_hf_clip(folder: Path) -> Path:
    """transformers' CLIPModel at the micro spec's sizes, random, saved with save_pretrained."""
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 258, "hidden_size": 32, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 2,
                     "max_position_embeddings": 16, "eos_token_id": 2},
        vision_config={"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
        projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.CLIPModel(config).save_pretrained(folder)
    return folder


def test_run_starts_from_a_hugging_face_folder(tmp_path, shards):
    hf_clip = pytest.importorskip("mmtrain.models.formats.hf_clip")
    folder = tiny_hf_clip(tmp_path / "hf")
    spec, state = hf_clip.read_hf_folder(folder)
    # The whole model: a run of the HF model's own spec ends where it started.
    _, result = frozen_run(tmp_path / "whole", shards, str(folder), spec=spec.to_dict())
    assert_same(weights(result.out), state)
    # One tower: the HF image tower into our micro spec, found by modality.
    hf_image = next(n for n, t in spec.towers.items() if t.modality == "image")
    _, result = frozen_run(tmp_path / "tower", shards, {"image": str(folder)})
    final = weights(result.out)
    for key, value in final.items():
        if key.startswith("towers.image."):
            assert torch.equal(value, state[key.replace("image", hf_image, 1)]), key
