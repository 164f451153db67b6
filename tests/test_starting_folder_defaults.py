"""Defaults from the starting folder (issue 40, item 4): with `init:` a chat model's Hugging
Face folder (a tokenizer.json and a chat template), `data.tokenizer` and `data.chat_template`
left out are that folder's; the run folder keeps a copy of them. A folder without a chat
template (a CLIP's) does not change the default.

Real parts: a tiny Qwen2 language model and its tokenizer saved by transformers, two steps of
`mmtrain train` from it with neither tokenizer nor template in the config.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from mmtrain.cli import main
from mmtrain.config import load_config
from mmtrain.models.formats.hf import read_hf_model

pytest.importorskip("transformers")
from test_export_hf_folder import conversation_shards, save_lm  # noqa: E402


def test_a_chat_models_folder_gives_the_run_its_tokenizer_and_template(tmp_path):
    hf = tmp_path / "baselines" / "qwen2"
    save_lm(hf)
    spec, _ = read_hf_model(hf)
    spec.save(tmp_path / "spec.json")
    conversation_shards(tmp_path / "shards", images=False)
    config = {
        "model": "spec.json",
        "init": "baselines/qwen2",
        "data": {"train": "shards", "sequence_length": 64},  # no tokenizer, no template
        "train": {"steps": 2, "batch_size": 2, "lr": 1e-3},
        "metrics": {"tensorboard": False},
        "out": "run",
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_config(path)
    assert loaded.data.tokenizer == str(hf)
    assert loaded.data.chat_template is None  # the tokenizer folder's template
    assert main(["train", str(path)]) == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["data"]["tokenizer"] == str(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the run folder keeps its own
        assert (tmp_path / "run" / name).read_bytes() == (hf / name).read_bytes()
    # an explicit value wins
    assert load_config(path, ["data.tokenizer=byte"]).data.tokenizer == "byte"
    # a folder with a tokenizer but no chat template does not decide for the run
    plain = tmp_path / "baselines" / "plain"
    shutil.copytree(hf, plain)
    tokenizer_config = json.loads((plain / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    assert load_config(path, ["init=" + str(plain)]).data.tokenizer == "byte"
