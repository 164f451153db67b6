"""Shards in object storage, read through the local cache: a real S3 server (moto's) on 127.0.0.1.

Training from s3:// equals training from the local disk bit for bit; the cache stays within its
bound by evicting, prefetches the next shards in the epoch's order, detects a corrupt download
and fetches it again; `data order`, `data inspect` and `data build --out s3://` work on URLs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from moto.server import ThreadedMotoServer

from micro import BuildCrash, crash_at_write, make_shards, micro_run
from mmtrain.atomic import sha256_file
from mmtrain.cli import main as cli
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.prefetch import Prefetcher
from mmtrain.data.storage.remote_cache import ShardCache
from mmtrain.data.storage.s3 import RemoteError, split_url
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.storage.tar_index import index_shard
from mmtrain.data.stream.loader import StreamingLoader, planned_samples
from mmtrain.train.loop import train
from s3_server import ServerProcess, client, free_port, upload_folder, use_endpoint

SHARD_SAMPLES = 16  # make_shards writes 16 samples per shard


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws(endpoint, monkeypatch, tmp_path):
    """The standard AWS variables for the server; the default cache inside this test."""
    use_endpoint(monkeypatch, endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return endpoint


def with_manifest(folder: Path) -> Path:
    shards = [
        {"name": p.name, "samples": len(index_shard(p)), "bytes": p.stat().st_size,
         "sha256": sha256_file(p)}
        for p in sorted(folder.glob("*.tar"))
    ]  # fmt: skip
    write_manifest(folder, shards)
    return folder


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory) -> Path:
    """8 shards of 16 micro image-text samples, with a manifest."""
    folder = tmp_path_factory.mktemp("micro") / "shards"
    make_shards(folder, 8 * SHARD_SAMPLES)
    return with_manifest(folder)


def objects_bytes(cache: ShardCache) -> int:
    """Bytes the cache holds now; a file evicted between the listing and its stat (the
    prefetch thread runs beside the test) is no longer held and counts nothing."""
    total = 0
    for path in (cache.root / "objects").rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except FileNotFoundError:
            pass
    return total


def leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*.part.*")] + [p.name for p in root.rglob("*.tmp*")]


def text_decode(sample, rng):
    text = sample["txt"].ljust(16, b" ")[:16]
    return {"txt": torch.frombuffer(bytearray(text), dtype=torch.uint8)}


# ----------------------------------------------------------------------------- training
STEPS = 6  # 48 samples: three of the eight shards


def run_config(folder: Path, shards: str):
    return micro_run(folder, shards, seed=3, train={"steps": STEPS, "micro_batch": 4})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, local_shards) -> bytes:
    """The weights of the run trained from the local disk."""
    folder = tmp_path_factory.mktemp("reference")
    assert train(run_config(folder, str(local_shards))).step == STEPS
    return (folder / "run" / "model.safetensors").read_bytes()


def test_training_from_s3_is_bitwise_identical_to_local_disk(
    aws, local_shards, reference, tmp_path, capsys
):
    url = upload_folder(aws, local_shards, "train-bkt", "micro")
    config = run_config(tmp_path / "remote", url)
    config.data.cache_dir = str(tmp_path / "run-cache")  # the run's own cache, not the default
    result = train(config)
    assert result.step == STEPS
    weights = (tmp_path / "remote" / "run" / "model.safetensors").read_bytes()
    assert weights == reference, "the same shards from object storage must train the same weights"
    assert sorted(p.name for p in (tmp_path / "run-cache").rglob("shard-*.tar")) == [
        f"shard-{i:06d}.tar" for i in range(8)
    ]
    # every step's metrics row carries the cache's counters
    last = result.history[-1]
    assert last["cache_hits"] + last["cache_misses"] > 0 and 0.0 <= last["cache_hit_rate"] <= 1.0

    # `mmtrain eval` reads the same URL and scores exactly what it scores on the local copy.
    run = tmp_path / "remote" / "run"
    reports = []
    for data in (str(local_shards), url):
        assert (
            cli(["eval", str(run), "--data", data, "--json", "--out", str(tmp_path / "e.json")])
            == 0
        )
        report = json.loads(capsys.readouterr().out)
        reports.append({k: report[k] for k in ("n_samples", "retrieval")})
    assert reports[0] == reports[1] and reports[0]["n_samples"] == 8 * SHARD_SAMPLES
    # `mmtrain eval` has no cache setting: the default one ($XDG_CACHE_HOME/mmtrain/shards)
    cached = tmp_path / "xdg" / "mmtrain" / "shards" / "objects" / "train-bkt" / "micro"
    assert sorted(p.name for p in cached.glob("*.tar")) == [f"shard-{i:06d}.tar" for i in range(8)]


# ----------------------------------------------------------------------------- the cache
def test_small_cache_evicts_within_its_bound_and_feeds_the_same_batches(
    aws, local_shards, tmp_path
):
    url = upload_folder(aws, local_shards, "loader-bkt", "micro")
    shard_bytes = (local_shards / "shard-000000.tar").stat().st_size
    cache = ShardCache(tmp_path / "cache", int(2.5 * shard_bytes))  # 2 shards fit, not 3
    remote = ShardSet.open(url, cache=cache)
    local = ShardSet.open(local_shards)
    assert remote.fingerprint() == local.fingerprint() and remote.sizes() == local.sizes()
    options = dict(seed=5, with_keys=True, shuffle_window=8)
    a = StreamingLoader(remote, text_decode, 8, **options)
    b = StreamingLoader(local, text_decode, 8, **options)
    batches = 0
    for _ in range(2):  # two epochs: every shard is evicted and fetched again
        for x, y in zip(a, b, strict=True):
            assert x["__key__"] == y["__key__"] and torch.equal(x["txt"], y["txt"])
            assert objects_bytes(cache) <= cache.max_bytes
            batches += 1
    assert batches == 2 * len(local) // 8
    stats = a.cache_stats()
    # 8 shards read once per epoch (a shard visit may be split by the shuffle window).
    assert stats["cache_hits"] + stats["cache_misses"] == 16
    # At most 2 shards are cached when an epoch starts: 6 or more downloads per epoch, on top
    # of the 8 that indexed the shards; every download but the ones still cached evicted one.
    assert stats["cache_downloads"] >= 8 + 2 * 6
    still = len(list((cache.root / "objects").rglob("*.tar")))
    assert stats["cache_evictions"] == stats["cache_downloads"] - still
    assert stats["cache_retries"] == 0 and leftovers(cache.root) == []

    # A DataLoader worker process reads through its own copy of the cache: the same batches.
    c = StreamingLoader(remote, text_decode, 8, num_workers=1, **options)
    for x, y in zip(c, StreamingLoader(local, text_decode, 8, **options), strict=True):
        assert x["__key__"] == y["__key__"] and torch.equal(x["txt"], y["txt"])
        assert objects_bytes(cache) <= cache.max_bytes


def test_prefetch_fetches_the_next_shards_in_epoch_order_and_no_further(
    aws, local_shards, tmp_path
):
    url = upload_folder(aws, local_shards, "prefetch-bkt", "micro")
    cache = ShardCache(tmp_path / "cache", 10**9)
    sources = ShardSet.open(url, cache=cache)
    for path in (cache.root / "objects").rglob("*.tar"):
        path.unlink()  # the indexes stay: a second run of the job, on a fresh node disk
    loader = StreamingLoader(sources, text_decode, 8, seed=2, shuffle_window=8)
    visits = []  # shards in the order rank 0 reads them in epoch 0
    for _, shard, _ in planned_samples(sources, seed=2, epoch=0, batch_size=8, shuffle_window=8):
        if Path(shard).name not in visits:
            visits.append(Path(shard).name)

    def tasks():
        from mmtrain.data.stream.loader import _tasks

        return _tasks(loader.plan, 0, loader._segment, 0, 1, 8, 0)

    def cached() -> list[str]:
        return sorted(p.name for p in (cache.root / "objects").rglob("*.tar"))

    def wait_until(count: int) -> None:
        deadline = time.monotonic() + 120
        while cache.stats.prefetched < count and time.monotonic() < deadline:
            time.sleep(0.01)

    prefetcher = Prefetcher(loader.plan.remote_shard, tasks(), depth=2)
    try:
        wait_until(3)  # before the reader starts: the shard it needs first and the 2 after it
        assert cached() == sorted(visits[:3])
        gate = prefetcher.gate(tasks())
        for _ in range(SHARD_SAMPLES // 8 + 1):  # the reader enters the second shard
            next(gate)
        wait_until(4)
        assert cache.stats.hits == 2 and cache.stats.misses == 0  # both were on disk in time
    finally:
        prefetcher.close()
    assert cache.stats.prefetched == 4 and cached() == sorted(visits[:4])


def test_corrupt_download_is_detected_and_fetched_again(aws, local_shards, tmp_path):
    url = upload_folder(aws, local_shards, "corrupt-bkt", "micro")
    cache = ShardCache(tmp_path / "cache", 10**9)
    bucket, key = split_url(url + "shard-000003.tar")
    good = (local_shards / "shard-000003.tar").read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF  # same size: only the manifest's sha256 can tell
    s3 = client(aws)
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(bad))

    class RepairOnRetry(logging.Handler):  # runs in the downloading thread, before its backoff
        def emit(self, record):
            if "shard-000003.tar" in record.getMessage():
                s3.put_object(Bucket=bucket, Key=key, Body=good)

    handler = RepairOnRetry()
    logging.getLogger("mmtrain.data.storage.s3").addHandler(handler)
    try:
        sources = ShardSet.open(url, cache=cache)
    finally:
        logging.getLogger("mmtrain.data.storage.s3").removeHandler(handler)
    assert cache.stats.retries == 1 and cache.stats.downloads == 8
    path = cache.root / "objects" / bucket / key
    assert path.read_bytes() == good and leftovers(cache.root) == []
    assert sources.key(3 * SHARD_SAMPLES) == index_shard(local_shards / "shard-000003.tar").keys[0]

    # Corrupt for good: the error names the shard, the endpoint and the check that failed, and
    # nothing of it stays in the cache.
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    other = ShardCache(tmp_path / "other", 10**9)
    with pytest.raises(RemoteError) as caught:
        ShardSet.open(url + "shard-000003.tar", cache=other)
    message = str(caught.value)
    assert f"{url}shard-000003.tar" in message and aws in message and "sha256" in message
    assert not (other.root / "objects" / bucket / key).exists() and leftovers(other.root) == []


def test_a_killed_download_leaves_nothing_behind(aws, local_shards, tmp_path):
    url = upload_folder(aws, local_shards, "orphan-bkt", "micro")
    cache = ShardCache(tmp_path / "cache", 10**9)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    size = (local_shards / "shard-000000.tar").stat().st_size
    folder = cache.root / "objects" / "orphan-bkt" / "micro"
    folder.mkdir(parents=True)
    part = folder / f".shard-000000.tar.part.{gone.stdout.strip()}.1.{size}"
    part.write_bytes(b"half a shard")  # what a process killed mid-download leaves
    sources = ShardSet.open(url, cache=cache)
    assert not part.exists() and leftovers(cache.root) == []
    assert len(sources) == 8 * SHARD_SAMPLES


def test_shard_larger_than_the_cache_names_the_setting(aws, local_shards, tmp_path):
    url = upload_folder(aws, local_shards, "tiny-bkt", "micro")
    with pytest.raises(Exception, match="data.cache_max_gb"):
        ShardSet.open(url, cache=ShardCache(tmp_path / "cache", 1000))


# ----------------------------------------------------------------------------- commands
def test_data_order_and_inspect_accept_s3_urls(aws, local_shards, capsys):
    url = upload_folder(aws, local_shards, "cli-bkt", "micro")
    pattern = url + "shard-{000000..000007}.tar"
    order = ["data", "order", "--seed", "4", "--epoch", "1", "--world-size", "2", "--rank", "1"]
    assert cli([*order, str(local_shards)]) == 0
    expected = capsys.readouterr().out
    assert cli([*order, pattern]) == 0
    assert capsys.readouterr().out == expected and len(expected.splitlines()) == 64

    assert cli(["data", "inspect", "--json", str(local_shards)]) == 0
    local = json.loads(capsys.readouterr().out)
    assert cli(["data", "inspect", "--json", "--verify", url]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert remote["manifest"] and remote["problems"] == []
    for field in ("samples", "bytes", "extensions", "modalities", "shards"):
        assert remote[field] == local[field], field
    assert remote["decoded"] == 8 * SHARD_SAMPLES

    assert cli(["data", "order", "--seed", "1", "--epoch", "0", url + "missing-{0..1}.tar"]) == 2
    assert "shard not found: " + url + "missing-0.tar" in capsys.readouterr().err


def test_build_to_s3_uploads_each_shard_then_the_manifest_and_resumes(
    aws, tmp_path, monkeypatch, capsys
):
    from test_ingest import build, image_text_folder

    src = image_text_folder(tmp_path / "src", 7)
    flags = ("--workers", 1, "--max-samples-per-shard", 2)
    assert build(src, "--out", tmp_path / "local", *flags) == 0
    s3 = client(aws)
    s3.create_bucket(Bucket="build-bkt")
    url = "s3://build-bkt/sets/pics/"

    def remote() -> dict[str, bytes]:
        listing = s3.list_objects_v2(Bucket="build-bkt", Prefix="sets/pics/").get("Contents", [])
        return {
            o["Key"].rsplit("/", 1)[1]: s3.get_object(Bucket="build-bkt", Key=o["Key"])[
                "Body"
            ].read()
            for o in listing
        }

    end_crash = crash_at_write(monkeypatch, 6)  # in the middle of the third shard
    with pytest.raises(BuildCrash):
        build(src, "--out", url, *flags)
    end_crash()
    # Each shard went up when it was complete; no manifest names shards that are not there.
    assert sorted(remote()) == ["shard-000000.tar", "shard-000001.tar"]

    capsys.readouterr()
    assert build(src, "--out", url, *flags) == 0
    assert "uploaded 4 shard(s) and the manifest to " + url in capsys.readouterr().out
    local = {p.name: p.read_bytes() for p in (tmp_path / "local").glob("*.tar")}
    uploaded = remote()
    manifest = json.loads(uploaded.pop("manifest.json"))
    assert uploaded == local, "a resumed upload ends with the bytes of an uninterrupted build"
    for shard in manifest["shards"]:
        assert hashlib.sha256(uploaded[shard["name"]]).hexdigest() == shard["sha256"]

    # A shard lost on the server is uploaded again by a rerun; the manifest goes up last.
    s3.delete_object(Bucket="build-bkt", Key="sets/pics/shard-000002.tar")
    s3.delete_object(Bucket="build-bkt", Key="sets/pics/manifest.json")
    assert build(src, "--out", url, *flags) == 0
    assert "already built" in capsys.readouterr().out
    again = remote()
    assert json.loads(again.pop("manifest.json")) == manifest and again == local

    # Training data reads it straight back.
    assert len(ShardSet.open(url)) == manifest["counts"]["samples"]


# ----------------------------------------------------------------------------- faults
@pytest.mark.slow
def test_server_killed_mid_epoch_fails_clearly_and_the_rerun_resumes_exactly(
    aws, local_shards, reference, tmp_path, monkeypatch
):
    # The shards were indexed once (a previous run); this node's disk holds none of them.
    url = upload_folder(aws, local_shards, "kill-bkt", "micro")
    ShardSet.open(url)
    cache = tmp_path / "xdg" / "mmtrain" / "shards"
    for path in (cache / "objects").rglob("*.tar"):
        path.unlink()

    port = free_port()
    server = ServerProcess(port, "--exit-after-gets", "1")  # dies when a 2nd shard is asked for
    try:
        upload_folder(server.endpoint, local_shards, "kill-bkt", "micro")
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        with pytest.raises(RemoteError) as caught:
            train(run_config(tmp_path, url))
        assert server.proc.wait(timeout=60) == 3  # it did die, as asked
    finally:
        server.stop()
    message = str(caught.value)
    assert url + "shard-0000" in message and server.endpoint in message
    assert "failed 2 times" in message  # AWS_MAX_ATTEMPTS=2: retried once, after a backoff
    run = tmp_path / "run"
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == ["step_00000002"], "trained on the cached shard, stopped at the next one"
    assert not (run / "model.safetensors").exists()
    assert leftovers(cache) == []  # nothing half-downloaded stays

    server = ServerProcess(port)  # started again, with the same objects
    try:
        upload_folder(server.endpoint, local_shards, "kill-bkt", "micro")
        resumed = train(run_config(tmp_path, url))
    finally:
        server.stop()
    assert resumed.resumed_from == 2 and resumed.step == STEPS
    assert (run / "model.safetensors").read_bytes() == reference
