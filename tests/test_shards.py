"""WebDataset shards: reading others' tars as they are, refusing unsafe members, atomic writing."""

import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmtrain.data.storage.manifest import read_manifest, verify_manifest, write_manifest
from mmtrain.data.storage.shard_lists import expand_braces, expand_shards
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.storage.tar_index import (
    TruncatedShardError,
    index_shard,
    read_shard,
    split_member_name,
)
from mmtrain.structured import FieldError


def make_tar(path, members, format=tarfile.PAX_FORMAT):
    """Write `members`: (name, bytes) for files, or a prepared TarInfo for anything else."""
    with tarfile.open(path, "w", format=format) as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                name, data = member
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def special(name, kind, linkname=""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def test_member_names_split_like_webdataset():
    assert split_member_name("a/b/0001.seg.JPG") == ("a/b/0001", "seg.jpg")
    assert split_member_name("v1.0/cat.txt") == ("v1.0/cat", "txt")
    assert split_member_name("./0001.json") == ("./0001", "json")
    assert split_member_name("noext") is None
    assert split_member_name("dir/.hidden") is None


def test_reads_webdataset_layout_written_by_tarfile(tmp_path):
    shard = make_tar(
        tmp_path / "wds.tar",
        [
            special("a/", tarfile.DIRTYPE),
            ("a/b/0001.seg.jpg", b"jpeg-bytes"),
            ("a/b/0001.txt", b"a caption"),
            ("a/b/0001.JSON", b"{}"),
            ("v1.0/0002.txt", b"second"),
            ("__meta__", b"skipped silently"),
            ("0003.txt", b"third"),
            ("0004.txt", b"fourth"),
            ("0003.cls", b"7"),  # not adjacent to 0003.txt: a sample of its own, as in webdataset
        ],
    )
    samples = list(read_shard(shard))
    assert samples == [
        {"__key__": "a/b/0001", "seg.jpg": b"jpeg-bytes", "txt": b"a caption", "json": b"{}"},
        {"__key__": "v1.0/0002", "txt": b"second"},
        {"__key__": "0003", "txt": b"third"},
        {"__key__": "0004", "txt": b"fourth"},
        {"__key__": "0003", "cls": b"7"},
    ]
    assert index_shard(shard).skipped == ()


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_long_and_unicode_names_in_every_tar_format(tmp_path, fmt):
    deep = "/".join(["folder"] * 12) + "/sample-0001"  # over 100 characters
    name = "ünïcode/0002" if fmt != tarfile.USTAR_FORMAT else "plain/0002"
    shard = make_tar(
        tmp_path / "long.tar", [(deep + ".txt", b"x" * 700), (name + ".txt", b"y")], fmt
    )
    assert [(s["__key__"], s["txt"]) for s in read_shard(shard)] == [
        (deep, b"x" * 700),
        (name, b"y"),
    ]


def test_unsafe_members_are_refused_and_reported(tmp_path):
    marker = tmp_path / "unpickled"

    class Payload:  # unpickling this would create `marker`
        def __reduce__(self):
            return (Path.touch, (marker,))

    device = special("0001.dev", tarfile.CHRTYPE)
    device.devmajor, device.devminor = 1, 3
    shard = make_tar(
        tmp_path / "evil.tar",
        [
            ("0001.txt", b"safe"),
            ("0001.pth", pickle.dumps(Payload())),
            ("0001.pickle", pickle.dumps(Payload())),
            ("0001.pyd", pickle.dumps(Payload())),
            ("0001.jpg", b"also safe"),
            ("../escape.txt", b"outside"),
            ("/etc/abs.txt", b"absolute"),
            special("link.txt", tarfile.SYMTYPE, "/etc/passwd"),
            special("hard.txt", tarfile.LNKTYPE, "0001.txt"),
            device,
            special("0002.fifo", tarfile.FIFOTYPE),
            ("0003.txt", b"last"),
        ],
    )
    samples = list(read_shard(shard))
    assert samples == [
        {"__key__": "0001", "txt": b"safe", "jpg": b"also safe"},
        {"__key__": "0003", "txt": b"last"},
    ]
    skipped = {m.member: m for m in index_shard(shard).skipped}
    assert set(skipped) == {
        "0001.pth", "0001.pickle", "0001.pyd", "../escape.txt", "/etc/abs.txt", "link.txt",
        "hard.txt", "0001.dev", "0002.fifo",
    }  # fmt: skip
    assert all(m.shard == str(shard) for m in skipped.values())
    assert "pickle" in skipped["0001.pth"].reason
    assert "traversal" in skipped["../escape.txt"].reason
    assert "absolute" in skipped["/etc/abs.txt"].reason
    assert "link" in skipped["link.txt"].reason and "link" in skipped["hard.txt"].reason
    assert "device" in skipped["0001.dev"].reason
    assert not marker.exists()


def write_samples(folder, n, **writer_args):
    samples = [
        {"__key__": f"{i:05d}", "txt": f"caption {i}" * (i % 5), "cls": str(i)} for i in range(n)
    ]
    with ShardWriter(folder, **writer_args) as writer:
        for sample in samples:
            writer.write(sample)
    return samples, writer.shards


def as_bytes(sample):
    return {k: v.encode() if k != "__key__" else v for k, v in sample.items()}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(min_value=0, max_value=10_000))
def test_truncated_shard_yields_the_samples_before_the_damage(tmp_path, cut):
    folder = tmp_path / f"cut{cut}"
    samples, shards = write_samples(folder, 12, max_samples=100)
    shard = folder / shards[0]["name"]
    data = shard.read_bytes()
    index = index_shard(shard)
    end_marker = index.offsets[-1] + -(-index.sizes[-1] // 512) * 512
    cut = cut % (len(data) + 1)
    shard.write_bytes(data[:cut])
    got = []
    if cut < end_marker + 512:
        with pytest.raises(TruncatedShardError) as err:
            for sample in read_shard(shard):
                got.append(sample)
        assert str(shard) in str(err.value) and f"byte {err.value.offset}" in str(err.value)
        assert err.value.offset <= cut
        assert index_shard(shard).damage is not None
    else:  # part of the end-of-archive blocks or the record padding is missing: nothing is lost
        got = list(read_shard(shard))
    assert got == [as_bytes(s) for s in samples[: len(got)]]
    # Every sample whose members all lie before the cut, but the last (it may have had more parts).
    complete = len([end for end in _data_ends(data) if end <= cut])
    assert len(got) >= complete - 1


def _data_ends(data):
    """End byte of each sample's last member in an intact shard (parsed with tarfile)."""
    ends = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar:
            ends[member.name.split(".")[0]] = member.offset_data + member.size
    return sorted(ends.values())


def test_garbage_in_the_middle_is_damage_with_its_offset(tmp_path):
    samples, shards = write_samples(tmp_path, 6)
    shard = tmp_path / shards[0]["name"]
    index = index_shard(shard)
    header = int(index.offsets[index.bounds[3]]) - 512  # header of sample 3's first member
    data = bytearray(shard.read_bytes())
    data[header : header + 512] = b"\xff" * 512
    shard.write_bytes(bytes(data))
    damaged = index_shard(shard)
    assert damaged.damage.offset == header
    # Sample 2 is dropped too: whether more of its members followed is unknown.
    assert damaged.keys == ["00000", "00001"]


def test_empty_file_is_reported(tmp_path):
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(TruncatedShardError, match="empty file"):
        list(read_shard(tmp_path / "empty.tar"))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=30),
    max_samples=st.integers(1, 8),
    max_bytes=st.integers(1024, 12_000),
)
def test_writer_bounds_shards_and_round_trips(tmp_path, sizes, max_samples, max_bytes):
    folder = tmp_path / f"w{len(os.listdir(tmp_path))}"
    samples = [
        {"__key__": f"dir/{i:04d}", "bin": os.urandom(n), "txt": "é"} for i, n in enumerate(sizes)
    ]
    with ShardWriter(folder, prefix="part", max_samples=max_samples, max_bytes=max_bytes) as writer:
        for sample in samples:
            writer.write(sample)
    shards = writer.shards
    read = []
    for entry in shards:
        path = folder / entry["name"]
        got = list(read_shard(path))
        assert 1 <= len(got) == entry["samples"] <= max_samples
        member_bytes = sum(
            512 + -(-len(v) // 512) * 512 for s in got for k, v in s.items() if k != "__key__"
        )
        assert member_bytes <= max_bytes or len(got) == 1  # a big sample gets a shard of its own
        assert entry["bytes"] == path.stat().st_size
        with tarfile.open(path) as tar:  # standard tools read it too
            assert len(tar.getnames()) == 2 * len(got)
        read += got
    assert read == [{**s, "txt": "é".encode()} for s in samples]
    assert [e["name"] for e in shards] == [f"part-{i:06d}.tar" for i in range(len(shards))]
    write_manifest(folder, shards)
    assert verify_manifest(folder) == []


def test_writer_is_atomic(tmp_path):
    writer = ShardWriter(tmp_path, max_samples=3)
    for i in range(4):
        writer.write({"__key__": f"{i}", "txt": "x"})
    # One shard finished; the second is still being written under a temporary name.
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["shard-000000.tar"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == [
        ".shard-000001.tar.tmp"
    ]
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.tar", "shard-000001.tar"]

    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError), ShardWriter(failed, max_samples=3) as writer:
        for i in range(5):
            writer.write({"__key__": f"{i}", "txt": "x"})
        raise RuntimeError("the build crashed")
    assert sorted(p.name for p in failed.iterdir()) == ["shard-000000.tar"]  # no partial file
    assert len(list(read_shard(failed / "shard-000000.tar"))) == 3


def test_writer_refuses_unsafe_samples(tmp_path):
    with ShardWriter(tmp_path) as writer:
        for bad in (
            {"__key__": "../up", "txt": "x"},
            {"__key__": "a.b", "txt": "x"},
            {"__key__": "ok", "TXT": "x"},
            {"__key__": "ok", "pth": b"x"},
            {"__key__": "ok", "txt": 3},
        ):
            with pytest.raises(FieldError):
                writer.write(bad)


def test_manifest_verification_reports_each_bad_shard(tmp_path):
    _, shards = write_samples(tmp_path, 10, max_samples=3)
    write_manifest(tmp_path, shards, modalities=["text"], command="mmtrain data build src --out x")
    manifest = read_manifest(tmp_path)
    assert manifest["schema_version"] == 1 and manifest["modalities"] == ["text"]
    assert manifest["counts"]["samples"] == 10
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert verify_manifest(tmp_path) == []

    names = [s["name"] for s in shards]
    flipped = bytearray((tmp_path / names[0]).read_bytes())
    flipped[600] ^= 1
    (tmp_path / names[0]).write_bytes(bytes(flipped))
    (tmp_path / names[1]).write_bytes((tmp_path / names[1]).read_bytes()[:-512])
    (tmp_path / names[2]).unlink()
    problems = {p.name: p.problem for p in verify_manifest(tmp_path)}
    assert set(problems) == set(names[:3])
    assert "sha256" in problems[names[0]]
    assert "bytes" in problems[names[1]]
    assert problems[names[2]] == "missing"
    assert [p.name for p in verify_manifest(tmp_path, check_hash=False)] == names[1:3]


def test_bad_manifest_names_the_field(tmp_path):
    (tmp_path / "manifest.json").write_text(
        json.dumps({"schema_version": 1, "shards": [{"name": "../x.tar"}]})
    )
    with pytest.raises(FieldError, match=r"shards\[0\]"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 99, "shards": []}))
    with pytest.raises(FieldError, match="schema_version"):
        read_manifest(tmp_path)


def test_shard_lists_from_folder_list_glob_and_braces(tmp_path):
    _, shards = write_samples(tmp_path, 9, max_samples=2)
    names = [tmp_path / s["name"] for s in shards]
    assert expand_shards(tmp_path) == names  # no manifest: sorted *.tar
    assert expand_shards(str(tmp_path / "*.tar")) == names
    assert expand_shards(str(tmp_path / "shard-{000001..000003}.tar")) == names[1:4]
    assert expand_shards([names[3], str(tmp_path / "shard-00000{0,2}.tar")]) == [
        names[3],
        names[0],
        names[2],
    ]
    write_manifest(tmp_path, list(reversed(shards)))
    assert expand_shards(tmp_path) == list(reversed(names))  # the manifest's order
    with pytest.raises(FileNotFoundError, match=r"shard-000005.tar \(and 1 more\)"):
        expand_shards(str(tmp_path / "shard-{000003..000006}.tar"))
    with pytest.raises(FileNotFoundError):
        expand_shards(str(tmp_path / "nothing-*.tar"))
    assert expand_braces("a{1..3}b{x,y}") == ["a1bx", "a1by", "a2bx", "a2by", "a3bx", "a3by"]
    assert expand_braces("{08..10}") == ["08", "09", "10"]


def test_shard_set_addresses_samples_across_shards(tmp_path):
    samples, _ = write_samples(tmp_path, 11, max_samples=4)
    shards = ShardSet.open(tmp_path)
    assert shards.sizes() == [4, 4, 3] and len(shards) == 11
    assert [shards.read(i) for i in range(11)] == [as_bytes(s) for s in samples]
    assert shards.locate(9) == (2, 1) and shards.key(9) == "00009"
    before = shards.fingerprint()
    write_samples(tmp_path / "other", 12, max_samples=4)
    assert ShardSet.open(tmp_path / "other").fingerprint() != before
