"""`mmtrain data build`: sources, per-modality processing, rejects, filters, resume, workers."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image, ImageFilter

from micro import BuildCrash, crash_at_write
from mmtrain.commands._data_args import add_build_arguments
from mmtrain.commands.data import run_build
from mmtrain.data.storage.manifest import read_manifest
from mmtrain.data.storage.tar_index import read_shard
from mmtrain.structured import FieldError


# ----------------------------------------------------------------------------- helpers
def picture(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    """A random picture: smooth shapes (distinct per seed) plus fine grain, so it is sharp."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    smooth = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)
    grain = rng.integers(-25, 26, (height, width, 1))
    return Image.fromarray(np.clip(np.asarray(smooth) + grain, 0, 255).astype(np.uint8))


def jpeg(seed: int, **kwargs) -> bytes:
    buffer = io.BytesIO()
    picture(seed, **kwargs).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def wav(seconds: float = 0.5, rate: int = 22050, amplitude: float = 0.3) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    soundfile.write(buffer, amplitude * np.sin(2 * np.pi * 440 * t), rate, format="WAV")
    return buffer.getvalue()


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def mp4(frames: int, fps: int = 10) -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            image = np.full((32, 32, 3), (i * 20) % 256, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def write_files(root: Path, files: dict[str, bytes | str]) -> Path:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return root


def image_text_folder(root: Path, n: int = 6) -> Path:
    files: dict[str, bytes | str] = {}
    for i in range(n):
        folder = "a" if i % 2 else "b/c"
        files[f"{folder}/item{i}.jpg"] = jpeg(i)
        files[f"{folder}/item{i}.txt"] = f"a picture   number {i}\n"
    return write_files(root, files)


def build(*argv: str | Path) -> int:
    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    args = parser.parse_args([str(a) for a in argv])
    return run_build(args)


def samples(out: Path) -> list[dict]:
    return [s for shard in read_manifest(out)["shards"] for s in read_shard(out / shard["name"])]


def rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))}


# ----------------------------------------------------------------------------- sources
def test_folder_build_stores_every_modality_normalised(tmp_path):
    files: dict[str, bytes | str] = {}
    for i in range(3):
        files[f"s{i}.png"] = png(picture(i, 80, 40))
        files[f"s{i}.txt"] = f"  cafe\u0301   au lait {i}\n"
        files[f"s{i}.wav"] = wav(rate=22050)
        files[f"s{i}.npy"] = npy(np.arange(2 * 50, dtype=np.float64).reshape(2, 50) + i)
    src = write_files(tmp_path / "src", files)
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1, "--audio-rate", 8000) == 0

    manifest = read_manifest(out)
    assert manifest["modalities"] == ["image", "audio", "timeseries", "text"]
    assert manifest["counts"]["samples"] == 3 and manifest["counts"]["rejected"] == 0
    assert "--audio-rate 8000" in manifest["command"]
    got = samples(out)
    assert [s["__key__"] for s in got] == ["000000000", "000000001", "000000002"]
    first = got[0]
    assert set(first) == {"__key__", "png", "txt", "flac", "npy", "json"}
    assert first["png"] == files["s0.png"]  # stored as is
    assert first["txt"].decode() == "caf\u00e9 au lait 0"  # NFC, whitespace collapsed
    wave, rate = soundfile.read(io.BytesIO(first["flac"]))
    assert rate == 8000 and len(wave) == 4000
    series = np.load(io.BytesIO(first["npy"]))
    assert series.dtype == np.float32 and series.shape == (2, 50)
    meta = json.loads(first["json"])
    assert meta["source"] == "s0" and (meta["width"], meta["height"]) == (80, 40)
    assert meta["sample_rate"] == 8000 and meta["seconds"] == 0.5
    assert (meta["channels"], meta["length"]) == (2, 50)
    assert len(meta["sha256"]) == 64


def test_image_reencoded_at_max_side(tmp_path):
    src = write_files(tmp_path / "src", {"big.jpg": jpeg(1, width=200, height=100), "big.txt": "x"})
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1, "--image-max-side", 50) == 0
    (sample,) = samples(out)
    assert Image.open(io.BytesIO(sample["jpg"])).size == (50, 25)
    assert (json.loads(sample["json"])["width"], json.loads(sample["json"])["height"]) == (50, 25)


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "parquet"])
def test_table_build(tmp_path, kind):
    src = tmp_path / "data"
    rows = []
    for i in range(4):
        write_files(src / "images", {f"p{i}.jpg": jpeg(i)})
        rows.append({"filepath": f"images/p{i}.jpg", "caption": f"caption {i}", "license": "cc"})
    table = src / f"table.{kind}"
    if kind == "jsonl":
        table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), table)
    else:
        with open(table, "w", newline="") as f:
            writer = csv.DictWriter(f, list(rows[0]), delimiter="\t" if kind == "tsv" else ",")
            writer.writeheader()
            writer.writerows(rows)
    out = tmp_path / "out"
    code = build(table, "--out", out, "--columns", "image=filepath,text=caption", "--workers", 1)
    assert code == 0
    got = samples(out)
    assert [s["txt"].decode() for s in got] == [f"caption {i}" for i in range(4)]
    assert got[2]["jpg"] == (src / "images/p2.jpg").read_bytes()
    assert json.loads(got[0]["json"])["meta"] == {"license": "cc"}


def test_table_without_known_columns_names_the_columns(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("file,words\na.jpg,hello\n")
    with pytest.raises(FieldError, match="columns are file, words"):
        build(table, "--out", tmp_path / "out")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    table = tmp_path / "t.parquet"
    table.write_bytes(b"PAR1")
    if importlib.util.find_spec("pyarrow") is not None:
        with pytest.raises(FieldError, match="t.parquet: not a readable parquet file"):
            build(table, "--out", tmp_path / "out")
    # As without pyarrow installed: a None in sys.modules makes the import fail.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(FieldError, match=r"t.parquet: reading parquet needs .*mmtrain\[parquet\]"):
        build(table, "--out", tmp_path / "out")


@pytest.mark.skipif(importlib.util.find_spec("ftfy") is not None, reason="ftfy installed")
def test_fix_text_without_ftfy_says_what_to_install(tmp_path):
    src = image_text_folder(tmp_path / "src", 1)
    with pytest.raises(FieldError, match="ftfy"):
        build(src, "--out", tmp_path / "out", "--fix-text")


def test_reshard_existing_shards_with_a_filter(tmp_path):
    src = image_text_folder(tmp_path / "src", 4)
    write_files(
        src, {"dup.jpg": (src / "b/c/item0.jpg").read_bytes(), "dup.txt": "a picture number 0"}
    )
    first = tmp_path / "first"
    assert build(src, "--out", first, "--workers", 1, "--max-samples-per-shard", 2) == 0
    assert read_manifest(first)["counts"]["samples"] == 5
    second = tmp_path / "second"
    assert build(first, "--out", second, "--workers", 1, "--dedup") == 0
    manifest = read_manifest(second)
    assert manifest["counts"]["samples"] == 4 and manifest["filters"]["removed"] == {
        "exact_duplicate": 1
    }
    assert len(manifest["shards"]) == 1
    assert json.loads(samples(second)[0]["json"])["source"] == "shard-000000.tar:000000000"


def test_timeseries_windows(tmp_path):
    src = write_files(
        tmp_path / "src",
        {"walk.csv": "t,x,y\n" + "".join(f"{i},{i},{-i}\n" for i in range(100)), "walk.txt": "w"},
    )
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1, "--timeseries-window", 30) == 0
    got = samples(out)
    assert [s["__key__"] for s in got] == [f"000000000_{w:05d}" for w in range(3)]
    second = np.load(io.BytesIO(got[1]["npy"]))
    assert second.shape == (3, 30)  # t, x, y columns as channels
    assert second[1, 0] == 30.0 and json.loads(got[1]["json"])["window"] == 1


# ----------------------------------------------------------------------------- rejects
def test_each_bad_kind_is_rejected_with_its_path_and_reason(tmp_path):
    good = jpeg(0)
    src = write_files(
        tmp_path / "src",
        {
            "ok.jpg": good,
            "ok.txt": "fine",
            "nocaption.jpg": jpeg(1),
            "empty.jpg": b"",
            "empty.txt": "caption",
            "truncated.jpg": good[: len(good) // 2],
            "truncated.txt": "caption",
            "garbage.png": b"\x89PNG\r\n\x1a\n" + os.urandom(200),
            "garbage.txt": "caption",
            "bomb.png": png(Image.new("RGB", (1200, 1000))),
            "bomb.txt": "caption",
            "mislabelled.jpg": png(picture(2)),
            "mislabelled.txt": "caption",
            "latin1.jpg": jpeg(3),
            "latin1.txt": "caf\xe9".encode("latin-1"),
        },
    )
    out = tmp_path / "out"
    args = ("--out", out, "--workers", 1, "--max-reject-rate", 1.0, "--max-pixels", 1_000_000)
    assert build(src, *args) == 0
    by_name = {Path(r["path"]).stem: r for r in rejects(out)}
    assert set(by_name) == {
        "nocaption",
        "empty",
        "truncated",
        "garbage",
        "bomb",
        "mislabelled",
        "latin1",
    }
    assert by_name["nocaption"]["kind"] == "missing_modality"
    assert "no text file" in by_name["nocaption"]["reason"]
    assert by_name["empty"]["kind"] == "empty"
    assert by_name["empty"]["path"] == str(src / "empty.jpg")
    assert "truncated" in by_name["truncated"]["reason"]
    assert by_name["garbage"]["kind"] == "undecodable"
    assert "decompression bomb" in by_name["bomb"]["reason"]
    assert by_name["mislabelled"]["kind"] == "mislabelled"
    assert "does not match" in by_name["mislabelled"]["reason"]
    assert "UTF-8" in by_name["latin1"]["reason"]
    manifest = read_manifest(out)
    assert manifest["counts"]["samples"] == 1
    assert manifest["counts"]["rejected"] == 7
    assert manifest["counts"]["rejected_by_kind"]["undecodable"] == 4


def test_reject_rate_above_threshold_exits_2_without_manifest(tmp_path, capsys):
    src = image_text_folder(tmp_path / "src", 3)
    write_files(src, {"x.jpg": b"", "x.txt": "bad", "y.jpg": jpeg(9)})  # 2 rejects of 5
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1, "--max-reject-rate", 0.3) == 2
    assert "reject rate 40.0% is above --max-reject-rate 30.0%" in capsys.readouterr().err
    assert not (out / "manifest.json").exists()
    assert len(rejects(out)) == 2
    # A higher threshold accepts the same build without redoing it.
    shards = shard_bytes(out)
    assert build(src, "--out", out, "--workers", 1, "--max-reject-rate", 0.5) == 0
    assert "already built" in capsys.readouterr().out
    assert shard_bytes(out) == shards and read_manifest(out)["counts"]["rejected"] == 2


# ----------------------------------------------------------------------------- filters
def test_image_and_caption_filters_remove_and_count(tmp_path):
    base = picture(0, 96, 96)
    files: dict[str, bytes | str] = {
        "a0.png": png(base),
        "a0.txt": "a good caption",
        "a1.png": png(base),  # exact copy, same caption
        "a1.txt": "a good caption",
        "a2.png": png(base.resize((90, 90))),  # near duplicate
        "a2.txt": "another caption",
        "a3.png": png(picture(3, 16, 16)),  # too small
        "a3.txt": "small one here",
        "a4.png": png(picture(4, 96, 20)),  # too elongated
        "a4.txt": "long thin image",
        "a5.png": png(picture(5, 96, 96).filter(ImageFilter.GaussianBlur(6))),
        "a5.txt": "blurry image here",
        "a6.png": png(picture(6, 96, 96)),
        "a6.txt": "hi",  # caption too short
        "a7.png": png(picture(7, 96, 96)),
        "a7.txt": "a perfectly fine caption",
    }
    src = write_files(tmp_path / "src", files)
    out = tmp_path / "out"
    flags = ["--dedup", "--near-dup-bits", 6, "--min-side", 32, "--max-aspect", 3]
    flags += ["--min-sharpness", 100, "--min-caption-chars", 5]
    assert build(src, "--out", out, "--workers", 1, *flags) == 0
    manifest = read_manifest(out)
    assert manifest["filters"]["removed"] == {
        "blur": 1,
        "caption_length": 1,
        "exact_duplicate": 1,
        "near_duplicate": 1,
        "resolution": 2,
    }
    assert manifest["filters"]["settings"]["near_duplicate_bits"] == 6
    assert [json.loads(s["json"])["source"] for s in samples(out)] == ["a0", "a7"]
    logged = [json.loads(x) for x in (out / "filtered.jsonl").read_text().splitlines()]
    assert [(r["path"], r["filter"]) for r in logged][:2] == [
        ("a1", "exact_duplicate"),
        ("a2", "near_duplicate"),
    ]


def test_audio_and_video_filters(tmp_path):
    src = write_files(
        tmp_path / "audio",
        {
            "loud.wav": wav(amplitude=0.3),
            "loud.txt": "a tone",
            "quiet.wav": wav(amplitude=1e-5),
            "quiet.txt": "near silence",
        },
    )
    out = tmp_path / "audio_out"
    assert build(src, "--out", out, "--workers", 1, "--min-audio-dbfs", -50) == 0
    assert read_manifest(out)["filters"]["removed"] == {"silent_audio": 1}
    assert [json.loads(s["json"])["source"] for s in samples(out)] == ["loud"]

    src = write_files(
        tmp_path / "video",
        {"long.mp4": mp4(20), "long.txt": "two seconds", "short.mp4": mp4(4), "short.txt": "x"},
    )
    out = tmp_path / "video_out"
    assert build(src, "--out", out, "--workers", 1, "--min-video-seconds", 1.0) == 0
    assert read_manifest(out)["filters"]["removed"] == {"short_video": 1}
    (sample,) = samples(out)
    meta = json.loads(sample["json"])
    assert meta["fps"] == 10 and meta["frames"] == 20 and meta["duration_s"] == pytest.approx(2.0)
    assert sample["mp4"] == (src / "long.mp4").read_bytes()


@pytest.mark.slow  # imports torch and builds a model: seconds on a busy machine
def test_relevance_filter_keeps_top_fraction_or_drops_below_threshold(tmp_path):
    import mmtrain

    model_dir = mmtrain.save_model(mmtrain.create_model("tiny-clip", seed=3), tmp_path / "model")
    src = image_text_folder(tmp_path / "src", 8)
    out = tmp_path / "top"
    flags = ("--relevance-model", model_dir, "--workers", 1)
    assert build(src, "--out", out, *flags, "--relevance-top-fraction", 0.5) == 0
    manifest = read_manifest(out)
    kept = [json.loads(s["json"])["relevance"] for s in samples(out)]
    assert len(kept) == 4 and manifest["filters"]["removed"] == {"relevance": 4}
    cutoff = manifest["filters"]["relevance_cutoff"]
    assert min(kept) == pytest.approx(cutoff, abs=1e-3)
    dropped = [json.loads(x) for x in (out / "filtered.jsonl").read_text().splitlines()]
    assert all(r["filter"] == "relevance" for r in dropped)
    # A threshold between the scores: exactly the samples at or above it stay.
    out = tmp_path / "threshold"
    assert build(src, "--out", out, *flags, "--relevance-threshold", cutoff - 1e-3) == 0
    assert sorted(json.loads(s["json"])["relevance"] for s in samples(out)) == sorted(kept)


# ----------------------------------------------------------------------------- resume
def test_rerun_touches_nothing_and_rebuilds_only_from_a_missing_shard(tmp_path, capsys):
    src = image_text_folder(tmp_path / "src", 7)
    out = tmp_path / "out"
    args = (src, "--out", out, "--workers", 1, "--max-samples-per-shard", 2, "--dedup")
    assert build(*args) == 0
    before = shard_bytes(out)
    assert list(before) == [f"shard-{i:06d}.tar" for i in range(4)]
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    assert build(*args) == 0
    assert "already built" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps

    (out / "shard-000002.tar").unlink()
    (out / "shard-000001.tar").write_bytes(b"changed")
    assert build(*args) == 0
    assert "resumed: 1 finished shard(s)" in capsys.readouterr().out
    assert shard_bytes(out) == before
    assert (out / "shard-000000.tar").stat().st_mtime_ns == stamps["shard-000000.tar"]


def test_interrupted_build_resumes_to_identical_output(tmp_path, monkeypatch):
    src = image_text_folder(tmp_path / "src", 9)
    write_files(src, {"bad.jpg": b"junk", "bad.txt": "x", "dup.jpg": jpeg(1), "dup.txt": "a"})
    flags = ("--workers", 1, "--max-samples-per-shard", 2, "--dedup", "--max-reject-rate", 0.5)
    clean = tmp_path / "clean"
    assert build(src, "--out", clean, *flags) == 0

    out = tmp_path / "out"
    end_crash = crash_at_write(monkeypatch, 6)  # in the middle of the third shard
    with pytest.raises(BuildCrash):
        build(src, "--out", out, *flags)
    end_crash()
    assert sorted(p.name for p in out.glob("*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    assert not (out / "manifest.json").exists()

    assert build(src, "--out", out, *flags) == 0
    assert shard_bytes(out) == shard_bytes(clean)
    assert (out / "rejects.jsonl").read_bytes() == (clean / "rejects.jsonl").read_bytes()
    assert (out / "filtered.jsonl").read_bytes() == (clean / "filtered.jsonl").read_bytes()
    assert read_manifest(out)["counts"] == read_manifest(clean)["counts"]


def test_windowed_item_split_across_shards_resumes_exactly(tmp_path):
    files: dict[str, bytes | str] = {}
    for i in range(3):
        files[f"t{i}.npy"] = npy(np.random.default_rng(i).normal(size=(2, 50)))
    src = write_files(tmp_path / "src", files)
    flags = ("--workers", 1, "--max-samples-per-shard", 3, "--timeseries-window", 10)
    clean = tmp_path / "clean"
    assert build(src, "--out", clean, *flags) == 0
    assert read_manifest(clean)["counts"]["samples"] == 15  # 5 windows per series
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    for name in ("shard-000002.tar", "shard-000003.tar", "shard-000004.tar"):
        (out / name).unlink()  # shard 1 ends inside t1's windows
    assert build(src, "--out", out, *flags) == 0
    assert shard_bytes(out) == shard_bytes(clean)


def test_a_different_command_on_the_same_folder_is_refused(tmp_path):
    src = image_text_folder(tmp_path / "src", 2)
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1) == 0
    with pytest.raises(FieldError, match="different command"):
        build(src, "--out", out, "--workers", 1, "--dedup")


# ----------------------------------------------------------------------------- determinism
def test_worker_count_does_not_change_the_output(tmp_path):
    src = image_text_folder(tmp_path / "src", 10)
    write_files(src, {"bad.jpg": b"junk", "bad.txt": "x", "dup.jpg": jpeg(2), "dup.txt": "a"})
    flags = ("--max-samples-per-shard", 3, "--near-dup-bits", 4, "--max-reject-rate", 0.5)
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        assert build(src, "--out", out, "--workers", workers, *flags) == 0
        outs.append(out)
    assert shard_bytes(outs[0]) == shard_bytes(outs[1])
    for name in ("rejects.jsonl", "filtered.jsonl"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()


def test_nothing_is_written_outside_out(tmp_path, monkeypatch):
    src = image_text_folder(tmp_path / "src", 3)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)

    def tree() -> dict[str, tuple[int, int]]:
        return {
            str(p.relative_to(tmp_path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in tmp_path.rglob("*")
            if "out" not in p.relative_to(tmp_path).parts
        }

    before = tree()
    assert build(src, "--out", tmp_path / "out", "--workers", 1, "--dedup") == 0
    assert tree() == before
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_out_inside_the_source_folder_is_skipped_when_listing(tmp_path):
    src = image_text_folder(tmp_path / "src", 2)
    out = src / "shards"
    assert build(src, "--out", out, "--workers", 1) == 0
    assert build(src, "--out", out, "--workers", 1) == 0  # the shards are not read as input
    assert read_manifest(out)["counts"]["source_items"] == 2


def test_command_line_entry_point(tmp_path, capsys):
    from mmtrain.cli import main

    src = image_text_folder(tmp_path / "src", 2)
    out = tmp_path / "out"
    assert main(["data", "build", str(src), "--out", str(out), "--workers", "1"]) == 0
    assert "2 samples in 1 shard(s)" in capsys.readouterr().out
    assert read_manifest(out)["command"].startswith(f"mmtrain data build {src} --out {out}")
    bad = ["data", "build", str(src), "--out", str(tmp_path / "o2"), "--modalities", "smell"]
    assert main(bad) == 2
    assert "--modalities: smell: not one of" in capsys.readouterr().err


def test_flags_are_the_build_options_and_record_the_same_command(tmp_path):
    """Each flag is a `BuildOptions` field (same name, same default, same order): the CLI and
    the in-process build (quickstart) record the same command and fingerprint."""
    import dataclasses

    from mmtrain.commands._data_args import options_from_args
    from mmtrain.data.ingest.options import BuildOptions, command_line, flag, option_defaults

    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    actions = [a for a in parser._actions if a.dest != "help"]
    assert [a.dest for a in actions] == [f.name for f in dataclasses.fields(BuildOptions)]
    defaults = option_defaults()
    for action in actions[1:]:  # SRC has no flag
        assert action.option_strings[0] == flag(action.dest)
        assert action.default == defaults.get(action.dest), action.dest
    argv = [str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--dedup", "--no-progress"]
    argv += ["--min-side", "32", "--max-reject-rate", "0"]
    from_flags = command_line(options_from_args(parser.parse_args(argv)))
    options = BuildOptions(
        src=str(tmp_path / "src"),
        out=tmp_path / "out",
        dedup=True,
        progress=False,
        min_side=32,
        max_reject_rate=0.0,
    )
    assert command_line(options) == from_flags
    assert from_flags[0] == (
        f"mmtrain data build {tmp_path / 'src'} --out {tmp_path / 'out'} --dedup --min-side 32 "
        "--max-reject-rate 0.0 --no-progress"
    )
