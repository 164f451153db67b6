"""The log, the progress line and the report speak of the run they show: a vision-language
model's `lr` is its language model's (the towers whose rate differs beside it), the start log
counts trainable beside frozen parameters, and the report names each objective's loss and
leaves out, without a word, what does not apply to the run (a logit scale, a retrieval gallery
or a denoiser's validation beside a language model; a gallery beside a denoiser).

Real runs: the tiny VLM (its image tower at a tenth of the LM's rate, validated with generated
answers) and the tiny DiT (validated at fixed timesteps), two steps each, trained once."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from mmtrain.commands.train import _Progress
from mmtrain.report import build_report
from mmtrain.report.plots import loss_names
from mmtrain.spec import load_spec
from mmtrain.train.loop import Trainer, train
from test_dit import _config as dit_config
from test_dit import shards as dit_shards  # noqa: F401  (a fixture)
from test_dit import tiny
from test_report import parse
from test_train_vlm import _config as vlm_config
from test_train_vlm import shards as vlm_shards  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
LM_LR, IMAGE_LR = 1e-3, 1e-4


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory, vlm_shards):  # noqa: F811  (the fixture imported above)
    """A tiny VLM trained 2 steps at a constant LM_LR, its image tower at IMAGE_LR, validated
    at step 2."""
    out = tmp_path_factory.mktemp("vlm") / "run"
    config = vlm_config(out, vlm_shards, data={"val": str(vlm_shards)},
                        train={"steps": 2, "lr": LM_LR, "schedule": "constant",
                               "towers": {"image": {"lr": IMAGE_LR}}},
                        eval={"every_steps": 2, "batch_size": 8})  # fmt: skip
    return out, train(config).history


@pytest.fixture(scope="module")
def dit_run(tmp_path_factory, dit_shards):  # noqa: F811  (the fixture imported above)
    """A tiny class-conditional DiT trained 2 steps, validated at step 2."""
    folder = tmp_path_factory.mktemp("dit")
    tiny().save(folder / "spec.yaml")
    config = dit_config(folder / "run", dit_shards, folder / "spec.yaml", steps=2)
    config.data.val = config.data.train
    config.eval.every_steps = 2
    train(config)
    return folder / "run"


def test_a_vision_language_models_lr_is_its_language_models(vlm_run):
    _, rows = vlm_run
    for row in rows:
        assert row["lr"] == row["lr/text/decay"] == row["lr/text/no_decay"] == LM_LR
        assert row["lr/image/decay"] == row["lr/image/no_decay"] == IMAGE_LR


def test_the_progress_line_shows_the_lr_and_the_towers_whose_lr_differs(vlm_run, capsys):
    _, rows = vlm_run
    progress = _Progress(total=2, every=1)
    progress.tty = False
    for row in rows:
        progress(row)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert all(f"lr {LM_LR:.2e} (image {IMAGE_LR:.2e})  " in line for line in lines)
    # one rate for every tower: the rate alone
    same = {k: v for k, v in rows[0].items() if not k.startswith("lr/image/")}
    progress(same | {"step": 2})
    assert f"lr {LM_LR:.2e}  " in capsys.readouterr().out


def test_the_start_log_counts_trainable_beside_frozen_parameters(tmp_path, request, caplog):
    shards = request.getfixturevalue("vlm_shards")
    config = vlm_config(tmp_path / "run", shards, train={"towers": {"image": {"freeze": True}}})
    with caplog.at_level(logging.INFO, logger="mmtrain"):
        trainer = Trainer(config)
    params = list(trainer.model.parameters())
    trainer.halt()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    found = re.search(r"\((\d+\.\d)k trainable, (\d+\.\d)k frozen parameters\)", caplog.text)
    assert found, caplog.text
    assert found.groups() == (f"{trainable / 1e3:.1f}", f"{frozen / 1e3:.1f}")


def test_a_language_models_report_names_its_loss_and_leaves_out_what_is_contrastive(vlm_run):
    out, _ = vlm_run
    report = build_report(out)
    page = parse(report.html)
    assert "Next-token loss" in page.captions
    assert "Validation perplexity during training" in page.captions
    assert not {"Logit scale (inverse temperature)", "Denoiser validation",
                "Evaluation during training"} & set(page.captions)  # fmt: skip
    assert "Generation gallery" in page.headings and "Retrieval gallery" not in page.headings
    text = report.html.read_text(encoding="utf-8")
    assert "contrastive" not in text.lower() and "no logit scale" not in text


def test_a_denoisers_report_names_its_loss_and_has_no_gallery(dit_run):
    report = build_report(dit_run)
    page = parse(report.html)
    assert "Flow-matching loss" in page.captions and "Denoiser validation" in page.captions
    assert not {"Logit scale (inverse temperature)", "Evaluation during training"} & set(
        page.captions
    )
    assert not {h for h in page.headings if "gallery" in h.lower()}
    text = report.html.read_text(encoding="utf-8").lower()
    assert "contrastive" not in text and "image-text pair" not in text


@pytest.mark.parametrize(
    ("model", "title"),
    [
        ("tiny-clip", "Contrastive loss"),
        ("configs/specs/siglip-vit-b-16.yaml", "Sigmoid contrastive loss"),
        ("configs/specs/fusion-4modal.yaml", "Contrastive loss + fusion-head loss"),
        ("llava-1.5-7b", "Next-token loss"),
        ("tiny-dit", "Flow-matching loss"),
    ],
)
def test_each_objective_names_its_loss(model, title):
    assert loss_names(load_spec(ROOT / model if "/" in model else model))[0] == title
