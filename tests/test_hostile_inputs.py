"""Hostile inputs, end to end and fast: a shard crafted to hurt, configs that are wrong,
files that try to run code, and a short fuzz of the tar and media readers.

The unit tests of each part (test_shards, test_media, test_ingest, test_config, test_checkpoint)
check each refusal on its own; here the pieces are put together the way a user meets them: one
shard holding every kind of bad sample feeds the training data pipeline, which must yield only
the good samples, say which sample was refused and why, and write nothing anywhere.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from faults.harness import FAULT_SPEC
from mmtrain.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mmtrain.cli import main
from mmtrain.config import config_from_dict
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.tar_index import ShardError, index_shard, read_shard
from mmtrain.data.stream.media import (
    MediaError,
    decode_audio,
    decode_image,
    decode_text,
    decode_timeseries,
)
from mmtrain.spec import ModelSpec
from mmtrain.train.data import TrainData

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same inputs on every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ----------------------------------------------------------------------------- inputs
def png(width: int = 20, height: int = 16, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg(seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (16, 20, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return buffer.getvalue()


def png_bomb(side: int = 60_000) -> bytes:
    """A valid-looking PNG of a few hundred bytes whose header claims side x side pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * (1 + 3 * side) * 4)  # a few rows; the rest never exist
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")
    )


def wav(seconds: float = 0.2, rate: int = 8000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    soundfile.write(buffer, np.sin(2 * np.pi * 440 * t).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def npy() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.arange(24, dtype=np.float32).reshape(3, 8))
    return buffer.getvalue()


class Payload:
    """Unpickling this creates the file `marker`: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    if kind == tarfile.CHRTYPE:
        info.devmajor, info.devminor = 1, 3
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


HOSTILE = {  # key -> (members, the reason the loader gives, or None: a good sample)
    "good0": ({"png": png(seed=0), "txt": b"a red square"}, None),
    "bomb": ({"png": png_bomb(), "txt": b"huge"}, "decompression bomb"),
    "truncated": ({"png": png(seed=1)[:90], "txt": b"cut"}, "image"),
    "flipped": ({"png": None, "txt": b"one bit"}, "image"),
    "liar": ({"png": b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(40), "txt": b"a wav"}, "wav"),
    "latin1": ({"png": png(seed=2), "txt": "caf\xe9".encode("latin-1")}, "UTF-8"),
    "notext": ({"png": png(seed=3)}, "text"),
    "huge_caption": ({"png": png(seed=4), "txt": b"word " * 400_000}, None),  # 2 MB
    "good1": ({"png": jpeg(seed=5), "txt": b"a jpeg saved as png"}, None),
    "good2": ({"png": png(seed=6), "txt": b"a green square"}, None),
}


def flipped_png() -> bytes:
    data = bytearray(png(seed=7))
    data[60] ^= 0x04  # inside the compressed pixels: the chunk CRC no longer matches
    return bytes(data)


@pytest.fixture(scope="module")
def hostile_shard(tmp_path_factory) -> tuple[Path, Path]:
    """One shard with every kind of bad sample and bad member, and the file a pickle would make."""
    folder = tmp_path_factory.mktemp("hostile")
    marker = folder.parent / "pickle-ran"
    shards = folder / "shards"
    shards.mkdir()
    with tarfile.open(shards / "shard-000000.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for key, (members, _) in HOSTILE.items():
            for ext, data in members.items():
                add(tar, f"{key}.{ext}", flipped_png() if data is None else data)
            if key == "good0":  # members a reader must refuse, inside a good sample's run
                add(tar, "good0.pth", pickle.dumps(Payload(marker)))
                add(tar, "../escape.txt", b"outside")
                add(tar, "/etc/absolute.txt", b"absolute")
                add(tar, "good0.lnk", kind=tarfile.SYMTYPE, link="/etc/passwd")
                add(tar, "good0.hard", kind=tarfile.LNKTYPE, link="good2.png")
                add(tar, "good0.dev", kind=tarfile.CHRTYPE)
    return shards, marker


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


# ----------------------------------------------------------------------------- a hostile shard
def test_a_hostile_shard_yields_only_its_good_samples_and_names_each_bad_one(
    hostile_shard, tmp_path, caplog
):
    shards, marker = hostile_shard
    spec = ModelSpec.from_dict(FAULT_SPEC)
    config = config_from_dict(
        {
            "model": "unused",
            "data": {"train": str(shards), "shuffle_window": 1},
            "train": {"steps": 1, "batch_size": 4},
            "out": str(tmp_path / "run"),
        }
    )
    watched = shards.parent.parent
    before = _files(watched)
    with caplog.at_level(logging.WARNING):
        data = TrainData(config, spec, rank=0, world_size=1, micro_batch=4)
        keys = []
        for _ in range(1):  # 4 good samples, then the epoch wraps around
            batch = data.next_batch()
            keys += data.last_keys
        corrupt = data.corrupt_samples()
        data.close()

    good = {key for key, (_, reason) in HOSTILE.items() if reason is None}
    assert set(keys) == good and len(keys) == 4
    assert batch["image"].shape == (4, 3, 16, 16) and batch["text"].shape == (4, 16)
    assert (batch["text"][:, -1] != 0).any()  # the 2 MB caption was cut to the context length
    assert corrupt == len(HOSTILE) - len(good)
    for key, (_, reason) in HOSTILE.items():
        if reason is not None:
            line = next((m for m in caplog.messages if f"'{key}'" in m), "")
            assert "shard-000000.tar" in line and reason in line, (key, caplog.messages)
    for member in ("good0.pth", "../escape.txt", "/etc/absolute.txt", "good0.lnk", "good0.dev"):
        assert any(member in m for m in caplog.messages) or member in str(
            index_shard(shards / "shard-000000.tar").skipped
        )
    assert not marker.exists()  # no pickle was loaded
    assert _files(watched) == before  # nothing extracted or written anywhere


def test_index_of_the_hostile_shard_lists_every_refused_member(hostile_shard):
    shards, _ = hostile_shard
    skipped = {m.member: m.reason for m in index_shard(shards / "shard-000000.tar").skipped}
    assert set(skipped) == {
        "good0.pth", "../escape.txt", "/etc/absolute.txt", "good0.lnk", "good0.hard", "good0.dev",
    }  # fmt: skip
    assert "pickle" in skipped["good0.pth"] and "traversal" in skipped["../escape.txt"]


# ----------------------------------------------------------------------------- configs
def _recipe(tmp_path: Path) -> Path:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(FAULT_SPEC))
    recipe = {
        "model": str(tmp_path / "spec.yaml"),
        "data": {"train": str(tmp_path / "no-shards-needed")},
        "train": {"steps": 4, "batch_size": 8},
        "out": str(tmp_path / "run"),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize(
    ("override", "field", "words"),
    [
        ("train.lrr=1e-3", "train.lrr", "did you mean 'lr'"),
        ("checkpoint.evry_steps=5", "checkpoint.evry_steps", "every_steps"),
        ("train.steps=many", "train.steps", "many"),
        ("train.betas=0.9", "train.betas", "0.9"),
        ("train.lr=-0.001", "train.lr", "at least 0"),
        ("train.steps=0", "train.steps", "at least 1"),
        ("train.micro_batch=3", "train.batch_size", "not divisible"),
        ("checkpoint.keep=0", "checkpoint.keep", "at least 1"),
    ],
)
def test_bad_configs_exit_2_naming_the_field_and_write_nothing(
    tmp_path, capsys, override, field, words
):
    recipe = _recipe(tmp_path)
    assert main(["train", str(recipe), override]) == 2
    err = capsys.readouterr().err
    assert f"{field}:" in err and words in err and str(recipe) in err, err
    assert not (tmp_path / "run").exists()


def test_yaml_tags_that_run_code_are_refused(tmp_path, capsys):
    marker = tmp_path / "yaml-ran"
    recipe = _recipe(tmp_path)
    recipe.write_text(
        recipe.read_text() + f"seed: !!python/object/apply:os.system ['touch {marker}']\n"
    )
    assert main(["train", str(recipe)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert not marker.exists()


# ----------------------------------------------------------------------------- checkpoints
def _resign(folder: Path) -> None:
    """Rewrite the manifest to match the files: an attacker who can write files can do this."""
    from mmtrain.atomic import sha256_file

    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["files"]:
        path = folder / name
        manifest["files"][name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_state_that_carries_code_is_not_unpickled(tmp_path):
    import torch

    marker = tmp_path / "pickle-ran"
    folder = save_checkpoint(tmp_path / "ckpt", 1, {"w": torch.zeros(2)}, {"step": 1})
    torch.save({"payload": Payload(marker)}, folder / "state.pt")  # a full pickle, not weights
    _resign(folder)
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only"):
        load_checkpoint(folder)
    assert not marker.exists()


def test_a_checkpoint_from_a_newer_mmtrain_is_refused_not_skipped(tmp_path, capsys):
    import torch

    root = tmp_path / "run" / "checkpoints"
    save_checkpoint(root, 1, {"w": torch.zeros(2)})
    newer = save_checkpoint(root, 2, {"w": torch.ones(2)})
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (newer / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="upgrade mmtrain"):
        latest_checkpoint(root)  # resuming from step 1 would silently drop the newer work

    recipe = _recipe(tmp_path)
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert str(newer) in err and "upgrade mmtrain" in err
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]


# ----------------------------------------------------------------------------- fuzz
@pytest.fixture(scope="module")
def clean_shard(tmp_path_factory) -> bytes:
    folder = tmp_path_factory.mktemp("clean")
    with ShardWriter(folder, max_samples=100) as writer:
        for i in range(6):
            writer.write({"__key__": f"k{i}", "txt": f"caption {i}" * (i + 1), "png": png(4, 4, i)})
    return (folder / "shard-000000.tar").read_bytes()


mutations = st.lists(
    st.tuples(st.integers(min_value=0, max_value=10**6), st.integers(min_value=1, max_value=255)),
    min_size=1,
    max_size=8,
)


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None = None) -> bytes:
    """XOR bytes at (position mod length) with a non-zero mask, then optionally truncate."""
    out = bytearray(data)
    for position, mask in edits:
        out[position % len(out)] ^= mask
    return bytes(out[:cut] if cut is not None else out)


@FUZZ
@given(edits=mutations, cut=st.one_of(st.none(), st.integers(min_value=0, max_value=8000)))
def test_fuzzed_shards_never_crash_the_reader_nor_read_past_the_file(
    tmp_path, clean_shard, edits, cut
):
    path = tmp_path / "fuzzed.tar"
    path.write_bytes(mutate(clean_shard, edits, cut))
    try:
        index = index_shard(path)
    except ShardError:
        return  # refused as a whole, with a message
    assert all(m.reason for m in index.skipped)
    read = 0
    try:
        for sample in read_shard(path):
            assert isinstance(sample["__key__"], str) and sample["__key__"]
            read += sum(len(v) for k, v in sample.items() if k != "__key__")
    except ShardError as err:
        assert str(path) in str(err)
    assert read <= path.stat().st_size  # nothing invented: memory bounded by the file


@pytest.mark.parametrize(
    ("name", "valid", "decode"),
    [
        ("png", png(12, 10), lambda d: decode_image(d, max_pixels=1 << 20)),
        ("jpeg", jpeg(), lambda d: decode_image(d, max_pixels=1 << 20)),
        ("wav", wav(), lambda d: decode_audio(d, 8000)),
        ("npy", npy(), lambda d: decode_timeseries(d, "npy")),
        ("csv", b"1,2,3\n4,5,6\n", lambda d: decode_timeseries(d, "csv")),
        ("text", "caption \u00e9".encode(), decode_text),
    ],
)
def test_fuzzed_media_decode_or_raise_media_error(name, valid, decode):
    assert decode(valid) is not None  # the unmutated input decodes

    @FUZZ
    @given(edits=mutations, cut=st.one_of(st.none(), st.integers(min_value=0, max_value=4000)))
    def fuzz(edits, cut):
        try:
            out = decode(mutate(valid, edits, cut))
        except MediaError as err:
            assert str(err)  # a reason, never an empty message
            return
        if isinstance(out, np.ndarray):
            assert out.size < 1 << 22  # bounded: no header tricks into huge allocations

    fuzz()
