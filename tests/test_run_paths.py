"""Paths of a run (issue 40, item 3): a config's relative paths are relative to the config
file, its run folder records them absolute, and `train`, `eval`, `generate`, `report` and
`doctor` work the same from any directory.

Real parts: a small vision-language model (tiny-vlm with 16-token images) trained on JPEG
conversations through the CLI, run from one directory and read from another.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from mmtrain.cli import main
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.tokenizer import train_bpe
from mmtrain.spec import load_spec

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 220)}


def _jpeg(rgb: tuple[int, int, int], seed: int) -> bytes:
    image = Image.new("RGB", (40, 40), rgb)
    image.putpixel((seed % 40, (7 * seed) % 40), (255, 255, 255))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """project/{data/shards (conversations, tokenizer, spec), configs/run.yaml (relative
    paths), pages/red.jpg}."""
    root = tmp_path_factory.mktemp("project")
    shards = root / "data" / "shards"
    shards.mkdir(parents=True)
    words = [f"What colour? a {name} square" for name in COLOURS] * 4
    image_id = train_bpe(words, vocab_size=270, out_path=shards / "tokenizer.json").vocab_size
    spec = load_spec("tiny-vlm").to_dict()
    spec.update(embed_dim=32)
    spec["towers"]["image"].update(stem={"image_size": 32, "patch_size": 8}, width=32, layers=1)
    spec["decoder"].update(vocab_size=image_id + 1, width=32, mlp_hidden=64, layers=1,
                           bos_id=None, eos_ids=[])  # fmt: skip
    spec["projector"]["image_token_id"] = image_id
    (shards / "spec.json").write_text(json.dumps(spec))
    with ShardWriter(shards, max_samples=8) as writer:
        for i in range(12):
            name = list(COLOURS)[i % len(COLOURS)]
            record = {"id": str(i), "images": ["0.jpg"], "messages": [
                {"role": "user", "content": "<image>What colour?"},
                {"role": "assistant", "content": f"a {name} square"},
            ]}  # fmt: skip
            writer.write({"__key__": f"{i:05d}", "json": json.dumps(record),
                          "0.jpg": _jpeg(COLOURS[name], i)})  # fmt: skip
    write_manifest(shards, writer.shards, modalities=["image", "text"])
    (root / "pages").mkdir()
    (root / "pages" / "red.jpg").write_bytes(_jpeg(COLOURS["red"], 99))
    (root / "configs").mkdir()
    config = {
        "model": "../data/shards/spec.json",
        "data": {"train": "../data/shards", "val": "../data/shards",
                 "tokenizer": "../data/shards/tokenizer.json", "chat_template": "plain",
                 "sequence_length": 64},
        "train": {"steps": 2, "batch_size": 4, "lr": 1e-3},
        "eval": {"batch_size": 4},
        "metrics": {"tensorboard": False},
        "out": "../runs/vlm",
    }  # fmt: skip
    (root / "configs" / "run.yaml").write_text(yaml.safe_dump(config))
    return root


def test_a_run_and_its_folder_read_the_same_files_from_any_directory(
    project, tmp_path, monkeypatch, capsys
):
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")  # neither the project nor the configs folder
    assert main(["train", str(project / "configs" / "run.yaml")]) == 0
    run = project / "runs" / "vlm"
    assert (run / "model.safetensors").exists()  # `out` beside configs/, as the file says
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["train"][0]["path"] == str(project / "data" / "shards")
    assert saved["data"]["tokenizer"] == str(project / "data" / "shards" / "tokenizer.json")
    assert saved["model"] == str(project / "data" / "shards" / "spec.json")
    assert saved["out"] == str(run)

    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")  # every later command from yet another directory
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(project / "data" / "shards"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["generation"]["n"] == 12
    assert main(["generate", str(run), "--image", str(project / "pages" / "red.jpg"),
                 "--prompt", "What colour?", "--max-new-tokens", "3"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip()  # an answer, in the run's tokenizer
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").exists()
    assert main(["doctor", str(run)]) == 0
