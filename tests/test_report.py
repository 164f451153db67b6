"""`mmtrain report`: a self-contained HTML page (PNG data URIs, no external URL) with the training
charts, the summary, eval.json's metrics and a retrieval gallery, robust to missing parts."""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import mmtrain
from micro import micro_spec
from mmtrain.checkpoint import save_checkpoint
from mmtrain.cli import main
from mmtrain.config import config_from_dict
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.report import build_report
from mmtrain.report.gallery import top_matches
from mmtrain.spec import ModelSpec
from mmtrain.train.metrics import MetricsWriter, memory_gib, throughput
from mmtrain.train.optim import resolve_optimizer_defaults

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SPEC = micro_spec(embed_dim=16, layers=1)
COLORS = ("red", "green", "blue", "yellow", "cyan", "magenta")


# ----------------------------------------------------------------------------- helpers
def make_shards(folder: Path, samples: int) -> str:
    """PNG + caption shards: coloured squares, a different caption per sample."""
    rng = np.random.default_rng(1)
    palette = {"red": (200, 30, 30), "green": (30, 190, 40), "blue": (30, 40, 210)}
    palette |= {"yellow": (220, 210, 30), "cyan": (30, 200, 210), "magenta": (200, 40, 200)}
    with ShardWriter(folder, max_samples=16) as writer:
        for i in range(samples):
            name = COLORS[i % len(COLORS)]
            pixels = np.broadcast_to(np.array(palette[name], np.uint8), (20, 20, 3))
            pixels = np.clip(pixels + rng.integers(-20, 20, pixels.shape), 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            caption = f"a {name} square, number {i}"
            writer.write(
                {"__key__": f"v{i:04d}", "png": buffer.getvalue(), "txt": caption.encode()}
            )
    return str(folder)


def write_run(
    root: Path,
    steps: int = 12,
    *,
    val: bool = True,
    plan: bool = True,
    evals: bool = True,
    eval_json: bool = True,
    weights: bool = True,
) -> Path:
    """A run folder as the training loop writes it: config.yaml, metrics.jsonl (through the
    loop's own MetricsWriter and throughput/memory helpers), checkpoints, final weights, and
    eval.json as `mmtrain eval` writes it. The numbers are made up but shaped like a real run."""
    run = root / "run"
    run.mkdir(parents=True)
    spec_file = root / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    data: dict = {"train": make_shards(root / "train", 8)}
    if val:
        data["val"] = make_shards(root / "val", 24)
    config = config_from_dict(
        {
            "model": str(spec_file),
            "data": data,
            "train": {"steps": steps, "batch_size": 8, "lr": 1e-3, "warmup_steps": 2},
            "checkpoint": {"every_steps": 5, "keep": 2},
            "out": str(run),
        }
    )
    spec = ModelSpec.from_dict(SPEC)
    resolve_optimizer_defaults(config.train, spec)  # as the loop does before writing it
    (run / "config.yaml").write_text(config.to_yaml())
    model = mmtrain.create_model(spec, seed=0)
    writer = MetricsWriter(run, tensorboard=False)
    if plan:
        writer.record(
            "plan",
            0,
            {"predicted_allocated_bytes": 300 * 2**20, "predicted_total_bytes": 300 * 2**20},
        )
    for step in range(1, steps + 1):
        times = {"data": 0.01 + 0.002 * (step % 3), "compute": 0.08, "optimizer": 0.01}
        loss = 2.1 * math.exp(-step / 6) + 0.2
        row = {
            "loss": loss,
            "loss/image-text": loss,
            "lr": 1e-3 * min(1.0, step / 2),
            "lr/image": 1e-3 * min(1.0, step / 2),
            "lr/text": 1e-3 * min(1.0, step / 2),
            "logit_scale": 14.3 + 0.1 * step,
            "grad_norm": 1.0,
            "samples_seen": 8 * step,
            "skipped_steps": 0,
            "corrupt_samples": 0,
            "checkpoint_s_total": 0.05 * (step // 5),
            **throughput(8, times, flops_per_sample=10**8, peak_flops=1e12, world_size=1),
            **memory_gib(torch.device("cpu")),
        }
        writer.write(step, row)
        if evals and step % 4 == 0:
            level = {"image->text": 0.1 * step / 4, "text->image": 0.08 * step / 4}
            recall = {"R@1": 1.0, "R@5": 2.0, "R@10": 3.0}
            row = {
                f"retrieval/{d}/{k}": scale * x
                for d, x in level.items()
                for k, scale in recall.items()
            }
            writer.record("eval", step, row)
        if step % 5 == 0 or step == steps:
            state = {"counters": {"step": step}}
            save_checkpoint(run / "checkpoints", step, model.state_dict(), state, {}, keep=2)
    writer.close()
    if weights:
        mmtrain.save_model(model, run)
    if eval_json:
        report = {
            "schema_version": 1,
            "model_name": spec.name,
            "data": data.get("val", "val"),
            "n_samples": 24,
            "retrieval": {
                "image->text": {"R@1": 0.25, "R@5": 0.625, "R@10": 0.875, "mean_rank": 3.1, "median_rank": 2.0, "n_queries": 24},
                "text->image": {"R@1": 0.2083, "R@5": 0.5, "R@10": 0.8333, "mean_rank": 3.9, "median_rank": 3.0, "n_queries": 24},
            },
            "clip_score": {"image-text": {"mean": 21.5, "std": 3.2}},
        }  # fmt: skip
        (run / "eval.json").write_text(json.dumps(report, indent=2))
    return run


class PageParser(HTMLParser):
    """Collects what the tests check: img sources, every URL-bearing attribute, headings, text."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.urls: list[str] = []
        self.headings: list[str] = []
        self.captions: list[str] = []
        self.scripts = 0
        self.title = ""
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        for name in ("src", "href", "srcset", "action", "data"):
            if name in attrs:
                self.urls.append(attrs[name] or "")
        if tag in ("script", "link", "iframe"):
            self.scripts += 1
        if tag in ("h1", "h2", "figcaption", "title"):
            self._in = tag

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in in ("h1", "h2"):
            self.headings.append(data)
        elif self._in == "figcaption":
            self.captions.append(data)
        elif self._in == "title":
            self.title += data


def parse(path: Path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def decode_png(uri: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert uri.startswith(prefix)
    data = base64.b64decode(uri[len(prefix) :], validate=True)
    assert data.startswith(PNG_MAGIC)
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """A finished run with every part: plan record, eval rows, eval.json, val shards, weights."""
    return write_run(tmp_path_factory.mktemp("full"))


def copy_run(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for old in copy.glob("report*"):
        old.unlink()
    return copy


def test_full_run_gives_a_self_contained_page_with_every_chart(full_run, tmp_path, capsys):
    run = copy_run(full_run, tmp_path)
    assert main(["report", str(run)]) == 0
    html = run / "report.html"
    assert str(html) in capsys.readouterr().out
    page = parse(html)
    text = html.read_text(encoding="utf-8")

    # self-contained: every image is an embedded PNG, no script, no external URL anywhere
    assert page.images and page.scripts == 0
    for uri in page.images:
        image = decode_png(uri)
        assert image.format == "PNG" and image.width >= 300 and image.height >= 150
    assert all(u.startswith("data:image/png;base64,") for u in page.urls)
    assert "http://" not in text and "https://" not in text and "url(" not in text

    # titles and charts
    assert "micro-clip" in page.title
    assert {"Summary", "Training", "Retrieval gallery"} <= set(page.headings)
    expected = {
        "Contrastive loss", "Learning rate", "Logit scale (inverse temperature)",
        "Throughput", "Time waiting for data", "Model FLOPs utilisation",
        "Memory: measured vs planned", "Evaluation during training",
        "Retrieval gallery: image \u2192 captions", "Retrieval gallery: caption \u2192 images",
    }  # fmt: skip
    assert expected <= set(page.captions)
    assert len(page.images) == len(expected)  # every chart drawn: the run has all the data

    # the PNGs beside the page are the embedded ones
    files = sorted(run.glob("report_*.png"))
    assert len(files) == len(page.images)
    embedded = {base64.b64decode(u.split(",", 1)[1]) for u in page.images}
    assert {f.read_bytes() for f in files} == embedded

    # summary: model, parameters, steps, samples, losses, recalls, checkpoints, plan
    params = ModelSpec.from_dict(SPEC).params()
    for fragment in (
        f"{params:,}", "12 of 12", "96 (batch 8)", "R@k image-&gt;text", "R@5 62.5%",
        "best R@k text-&gt;image", "R@10 90.0% (step 12)", "steps 10, 12", "planned 0.293 GiB",
        "clip_score/image-text/mean",
    ):  # fmt: skip
        assert fragment in text, fragment


def test_gallery_ranks_and_marks_the_true_match():
    scores = torch.tensor([[0.1, 0.9, 0.1, 0.5], [0.2, 0.8, 0.3, 0.1], [0.4, 0.4, 0.4, 0.4]])
    first, second, third = top_matches(scores, [0, 1, 2], k=2)
    assert first.top == [1, 3] and first.rank == 2  # missed the top 2: its rank is reported
    assert second.top == [1, 2] and second.rank == 0 and second.scores == pytest.approx([0.8, 0.3])
    assert third.top == [0, 1] and third.rank == 2  # ties keep candidate order


def test_missing_parts_are_left_out_with_a_note_not_an_error(tmp_path):
    """A general chart without data keeps a note; a run without validation has no evaluation
    chart and no gallery at all (no stub saying they are not available)."""
    run = write_run(tmp_path, steps=3, val=False, plan=False, evals=False, eval_json=False)
    report = build_report(run)
    by_name = {p.name: p for p in report.plots}
    assert not {"eval", "gallery", "gallery_image_text"} & set(by_name)
    assert by_name["memory"].png is not None and "no planner record" in by_name["memory"].note
    assert by_name["loss"].png is not None
    page = parse(report.html)
    assert len(page.images) == len(report.pngs) == sum(p.png is not None for p in report.plots)
    assert "Retrieval gallery" not in page.headings
    assert "Evaluation during training" not in page.captions
    text = report.html.read_text(encoding="utf-8")
    assert "no periodic evaluation rows" not in text and "Final retrieval" not in text


def test_a_crashed_run_still_reports(full_run, tmp_path):
    """No final weights, a line cut short by the crash, no MFU (unknown peak): still a report,
    the gallery drawn from the newest checkpoint, and notes saying what is missing."""
    run = copy_run(full_run, tmp_path)
    (run / "model.safetensors").unlink()
    (run / "spec.yaml").unlink()
    metrics = run / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    for row in rows:
        row.pop("mfu", None)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 13, "loss": 1.')
    report = build_report(run, tmp_path / "elsewhere" / "crash.html")
    assert report.html == tmp_path / "elsewhere" / "crash.html"
    assert all(p.parent == report.html.parent and p.name.startswith("crash_") for p in report.pngs)
    by_name = {p.name: p for p in report.plots}
    assert by_name["mfu"].png is None and "peak" in by_name["mfu"].note
    assert by_name["gallery_image_text"].png is not None  # from checkpoints/step_00000012
    assert any("unreadable line" in n for n in report.notes)
    assert "12 of 12" in report.html.read_text(encoding="utf-8")


def test_nothing_to_report_and_bad_arguments(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    report = build_report(empty, gallery=False)
    assert report.pngs == [] and all(p.png is None for p in report.plots)
    assert any("metrics.jsonl" in n for n in report.notes)
    assert parse(report.html).images == []
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["report", str(empty), "--out", str(tmp_path / "r.png")]) == 2
    assert "html" in capsys.readouterr().err


def test_a_new_report_removes_a_chart_it_no_longer_draws(full_run, tmp_path):
    run = copy_run(full_run, tmp_path)
    stale = run / "report_gallery_image_text.png"
    stale.write_bytes(PNG_MAGIC)  # left by an earlier report, when data.val was set
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"]["val"] = []
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    report = build_report(run)
    assert not stale.exists()
    assert sorted(run.glob("report_*.png")) == sorted(report.pngs)
    assert len(report.pngs) == 8


@pytest.mark.slow
def test_report_of_a_real_tiny_training_run(tmp_path):
    from mmtrain.train.loop import train

    train_shards = make_shards(tmp_path / "train", 24)
    val_shards = make_shards(tmp_path / "val", 12)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    config = config_from_dict(
        {
            "model": str(spec_file),
            "data": {"train": train_shards, "val": val_shards, "shuffle_window": 8},
            "train": {"steps": 3, "batch_size": 8, "lr": 1e-3},
            "eval": {"every_steps": 2},
            "checkpoint": {"every_steps": 2, "keep": 2},
            "metrics": {"tensorboard": False, "peak_tflops": 1.0},
            "out": str(tmp_path / "run"),
        }
    )
    train(config)
    report = build_report(tmp_path / "run")
    drawn = {p.name for p in report.plots if p.png is not None}
    expected = {"loss", "lr", "logit_scale", "throughput", "data_wait", "mfu", "memory", "eval"}
    assert expected | {"gallery_image_text", "gallery_text_image"} <= drawn
    memory = next(p for p in report.plots if p.name == "memory")
    assert "measured / planned" in memory.note  # the loop's plan record was read
    text = report.html.read_text(encoding="utf-8")
    assert "3 of 3" in text and "24 (batch 8)" in text
    assert "Final retrieval (eval.json" in text and "best R@k image-&gt;text" in text
    for uri in parse(report.html).images:
        decode_png(uri)
