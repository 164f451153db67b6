"""The data formats the docs show: README's parquet example runs as written, and docs/VLM.md's
one conversation in four forms builds four equal samples.

test_readme_commands.py skips `mmtrain data build table.parquet --out shards` (it reads a file
the reader brings and writes into the repository). Here the README's python block is that
reader: it runs as written in an empty folder, then the command, and the shards hold its rows.
"""

import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from PIL import Image

from mmtrain.data.storage.manifest import read_manifest
from mmtrain.data.storage.tar_index import read_shard
from mmtrain.data.stream.conversations import parse_conversation

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = {"mmtrain", "scripts/mmtrain"}


def blocks(path: Path, kind: str, section: str) -> list[str]:
    """The ```kind blocks of the `## section...` of a markdown file."""
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}")
    end = text.find("\n## ", start + 1)
    return re.findall(rf"```{kind}\n(.*?)```", text[start : end if end > 0 else None], re.S)


def run_documented(line: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(line, comments=True)
    assert argv[0] in LAUNCHERS, line
    return subprocess.run(
        [sys.executable, "-m", "mmtrain", *argv[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def samples(out: Path) -> list[dict]:
    return [s for shard in read_manifest(out)["shards"] for s in read_shard(out / shard["name"])]


def test_readme_parquet_example_runs_as_written(tmp_path):
    (snippet,) = [b for b in blocks(ROOT / "README.md", "python", "Data") if "parquet" in b]
    commands = [
        line
        for block in blocks(ROOT / "README.md", "bash", "Data")
        for line in block.splitlines()
        if "table.parquet" in line
    ]
    assert commands == ["scripts/mmtrain data build table.parquet --out shards"]
    done = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_documented(commands[0], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    built = samples(tmp_path / "shards")
    assert [s["txt"].decode() for s in built] == ["a red square", "a blue square"]
    for sample, name in zip(built, ["red.jpg", "blue.jpg"], strict=True):
        assert sample["jpg"] == (tmp_path / name).read_bytes()  # stored as it is
        assert Image.open(io.BytesIO(sample["jpg"])).size == (64, 48)


def test_vlm_doc_shows_one_conversation_in_four_forms(tmp_path):
    records = [json.loads(b) for b in blocks(ROOT / "docs" / "VLM.md", "json", "Data")]
    assert len(records) == 4
    parsed = [parse_conversation(r) for r in records]
    assert all(p == parsed[0] for p in parsed)
    assert parsed[0].images == ["cat.jpg"] and parsed[0].turns[0].text == "<image>\nWhat is it?"

    # "the four build the same sample": one JSONL of the four records, built.
    Image.new("RGB", (32, 24), (90, 120, 30)).save(tmp_path / "cat.jpg")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    done = run_documented("mmtrain data build chat.jsonl --out shards --workers 1", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    built = samples(tmp_path / "shards")
    assert len(built) == 4
    metas = [json.loads(s["json"]) for s in built]
    assert all(m["messages"] == metas[0]["messages"] for m in metas)
    assert all(s["0.jpg"] == (tmp_path / "cat.jpg").read_bytes() for s in built)
