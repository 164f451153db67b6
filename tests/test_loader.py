"""StreamingLoader: deterministic order, rank split, exact resume, corrupt samples, mixing, CLI."""

import itertools
import json
import logging
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmtrain.cli import main
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.loader import (
    NoValidSamples,
    StreamingLoader,
    merge_rank_states,
    planned_samples,
)
from mmtrain.data.stream.order import Segment, epoch_order


def make_dataset(folder, n, per_shard=7, corrupt=(), prefix=""):
    """n samples whose `idx` member holds their number; those in `corrupt` carry a `bad` member."""
    with ShardWriter(folder, max_samples=per_shard) as writer:
        for i in range(n):
            sample = {"__key__": f"{prefix}{i:05d}", "idx": str(i), "txt": f"sample {i}"}
            if i in corrupt:
                sample["bad"] = b"1"
            writer.write(sample)
    write_manifest(folder, writer.shards, modalities=["text"])
    return ShardSet.open(folder)


class DecodeError(ValueError):
    reason = "bad member"


def decode(sample, rng):
    """Test decoder: the sample's number, a random draw (as crops would), and a failure mode."""
    if "bad" in sample:
        raise DecodeError(f"sample {sample['__key__']} is marked bad")
    return {
        "idx": torch.tensor(int(sample["idx"])),
        "draw": torch.tensor(int(rng.integers(1 << 30))),
    }


def take(loader, batches=None):
    """(idx, draw) pairs of the next `batches` batches, across epochs (None: rest of the epoch)."""
    stream = (
        loader
        if batches is None
        else itertools.chain.from_iterable(map(iter, itertools.repeat(loader)))
    )
    out = []
    for batch in itertools.islice(stream, batches):
        out += list(zip(batch["idx"].tolist(), batch["draw"].tolist(), strict=True))
    return out


def ranks(shards, world_size, batch_size, **kwargs):
    return [StreamingLoader(shards, decode, batch_size, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]  # fmt: skip


def global_state(loaders):
    return json.loads(json.dumps(merge_rank_states([lo.rank_state() for lo in loaders])))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), 60)


@pytest.fixture(scope="module")
def dirty(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("dirty"), 60, corrupt={3, 4, 17, 30, 31, 32, 58})


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 40),
    per_shard=st.integers(1, 9),
    world_size=st.integers(1, 5),
    batch_size=st.integers(1, 4),
    drop_tail=st.booleans(),
    seed=st.integers(0, 3),
)
def test_every_sample_once_per_epoch_on_any_world_size(
    tmp_path_factory, n, per_shard, world_size, batch_size, drop_tail, seed
):
    shards = make_dataset(tmp_path_factory.mktemp("any"), n, per_shard)
    per_step = world_size * batch_size
    if drop_tail and n < per_step:
        with pytest.raises(ValueError, match="no batch"):
            ranks(shards, world_size, batch_size, drop_tail=drop_tail, seed=seed)
        return
    loaders = ranks(
        shards, world_size, batch_size, drop_tail=drop_tail, seed=seed, shuffle_window=4
    )
    streams = [[i for i, _ in take(lo)] for lo in loaders]
    steps = n // per_step if drop_tail else -(-n // per_step)
    assert all(len(s) == steps * batch_size for s in streams)  # same batches on every rank
    assert all(len(lo) == steps and lo.epoch == 1 for lo in loaders)
    seen = Counter(i for s in streams for i in s)
    if drop_tail:
        assert max(seen.values()) == 1 and len(seen) == steps * per_step
    else:  # the tail is padded with the first samples of the epoch
        assert set(seen) == set(range(n))
        assert sum(seen.values()) - n == steps * per_step - n
    assert planned_keys(shards, seed, 0, world_size, 0, batch_size, drop_tail) == [
        f"{i:05d}" for i in streams[0]
    ]


def planned_keys(shards, seed, epoch, world_size, rank, batch_size, drop_tail=False, skip=0):
    return [
        key
        for _, _, key in planned_samples(
            shards, seed=seed, epoch=epoch, rank=rank, world_size=world_size, skip=skip,
            batch_size=batch_size, drop_tail=drop_tail, shuffle_window=4,
        )
    ]  # fmt: skip


def test_epochs_and_seeds_change_the_order_and_nothing_else_does(data):
    sizes = [data.sizes()]
    first = epoch_order(sizes, seed=1, epoch=0)
    assert sorted(first.tolist()) == list(range(60))
    assert first.tolist() == epoch_order(sizes, seed=1, epoch=0).tolist()
    assert first.tolist() != epoch_order(sizes, seed=1, epoch=1).tolist()
    assert first.tolist() != epoch_order(sizes, seed=2, epoch=0).tolist()
    loader = StreamingLoader(data, decode, 6, seed=1)
    epoch0, epoch1 = take(loader), take(loader)
    assert [i for i, _ in epoch0] == first.tolist()
    assert [i for i, _ in epoch0] != [i for i, _ in epoch1]
    assert sorted(i for i, _ in epoch1) == list(range(60))


def test_num_workers_never_change_the_stream(dirty):
    runs = {}
    for workers, persistent in ((0, False), (2, False), (2, True)):
        loader = StreamingLoader(
            dirty,
            decode,
            5,
            seed=3,
            num_workers=workers,
            persistent_workers=persistent,
            with_keys=True,
        )
        stream = take(loader) + take(loader, 4)  # a whole epoch, then part of the next
        runs[(workers, persistent)] = (stream, dict(loader.corrupt_counts))
        loader.close()
    assert runs[(0, False)] == runs[(2, False)] == runs[(2, True)]
    assert runs[(0, False)][1]["bad member"] >= 7  # all 7 in epoch 0, then some in epoch 1


def collate_in_worker(outputs):
    """A collate that shows where it ran: the samples' numbers and the process that laid them out
    (a module-level function, so it pickles into worker processes)."""
    import os

    return {
        "idx": torch.stack([o["idx"] for o in outputs]),
        "draw": torch.stack([o["draw"] for o in outputs]),
        "pid": torch.tensor(os.getpid()),
    }


def test_collate_runs_in_the_worker_on_each_tasks_valid_samples_and_resumes_exactly(dirty):
    import os

    def entries(n):  # the stream of valid samples, as the stacking loader hands it out
        return take(StreamingLoader(dirty, decode, 1, seed=2), n)

    loader = StreamingLoader(dirty, decode, 4, seed=2, num_workers=1, collate=collate_in_worker)
    batches = list(itertools.islice(loader, 6))
    assert all(int(b["pid"]) != os.getpid() for b in batches)  # laid out by the worker
    got = [
        pair for b in batches for pair in zip(b["idx"].tolist(), b["draw"].tolist(), strict=True)
    ]
    # A batch is the valid samples of its 4 stream entries: fewer where some were skipped, and
    # together exactly the stream's valid samples, in order, with the same random draws.
    assert all(1 <= len(b["idx"]) <= 4 for b in batches) and any(len(b["idx"]) < 4 for b in batches)
    assert got == entries(len(got))
    state = json.loads(json.dumps(loader.state_dict()))
    rest = [b["idx"].tolist() for b in itertools.islice(loader, 3)]
    loader.close()
    resumed = StreamingLoader(dirty, decode, 4, seed=2, collate=collate_in_worker)
    resumed.load_state_dict(state)
    assert [b["idx"].tolist() for b in itertools.islice(resumed, 3)] == rest


@pytest.mark.parametrize("stop_after", [1, 3, 7, 12])
def test_resume_on_the_same_world_size_continues_exactly(dirty, stop_after):
    reference = [
        take(lo, 16) for lo in ranks(dirty, 2, 4, seed=5)
    ]  # 12 batches per epoch, and more
    first = ranks(dirty, 2, 4, seed=5)
    before = [take(lo, stop_after) for lo in first]
    state = global_state(first)
    resumed = ranks(dirty, 2, 4, seed=5)
    for lo in resumed:
        lo.load_state_dict(state)
    after = [take(lo, 16 - stop_after) for lo in resumed]
    # Same samples, same random draws, same corrupt samples skipped, across the epoch boundary.
    assert [b + a for b, a in zip(before, after, strict=True)] == reference


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    old=st.sampled_from([(1, 12), (2, 6), (3, 4), (4, 3), (6, 2)]),
    new=st.sampled_from([(1, 12), (2, 6), (3, 4), (4, 3), (6, 2)]),
    stop_after=st.integers(0, 4),
)
def test_resume_on_another_world_size_sees_exactly_the_unseen_samples(data, old, new, stop_after):
    # 60 samples, global batch 12: 5 steps per epoch, no tail.
    first = ranks(data, *old, seed=7)
    seen = [i for lo in first for i, _ in take(lo, stop_after)]
    state = global_state(first)
    resumed = ranks(data, *new, seed=7)
    for lo in resumed:
        lo.load_state_dict(state)
    rest = [i for lo in resumed for i, _ in take(lo)]
    assert sorted(seen + rest) == list(range(60))
    assert all(lo.epoch == 1 for lo in resumed)


def test_resume_on_another_world_size_with_corrupt_samples_and_padding(dirty):
    first = ranks(dirty, 3, 4, seed=2)
    seen = [i for lo in first for i, _ in take(lo, 2)]  # ranks consumed different raw counts
    entries = [lo.rank_state()["entries"] for lo in first]
    assert len(set(entries)) > 1
    state = global_state(first)
    resumed = ranks(dirty, 2, 6, seed=2)
    for lo in resumed:
        lo.load_state_dict(state)
    rest = [i for lo in resumed for i, _ in take(lo)]
    valid = set(range(60)) - {3, 4, 17, 30, 31, 32, 58}
    assert set(seen) | set(rest) == valid
    assert set(seen).isdisjoint(rest)  # padding wraps around inside the unseen samples


def test_corrupt_samples_are_counted_and_logged_with_shard_and_key(dirty, caplog):
    loader = StreamingLoader(dirty, decode, 8, seed=0, shuffle=False, drop_tail=True)
    with caplog.at_level(logging.WARNING, logger="mmtrain.data.stream.loader"):
        batches = list(loader)
    # 7 batches of 8 valid samples: the 7 corrupt ones are replaced by the next valid ones.
    assert [b["idx"].tolist() for b in batches][:1] == [[0, 1, 2, 5, 6, 7, 8, 9]]
    assert len(batches) == 7 and all(b["idx"].shape == (8,) for b in batches)
    assert loader.corrupt_counts == {"bad member": 7}
    assert "'00017' of shard-000002.tar" in caplog.text and "marked bad" in caplog.text


def test_all_corrupt_data_fails_clearly(tmp_path):
    shards = make_dataset(tmp_path, 30, corrupt=set(range(30)))
    loader = StreamingLoader(shards, decode, 2, max_consecutive_corrupt=20)
    with pytest.raises(NoValidSamples, match="20 samples in a row on rank 0 could not be"):
        next(iter(loader))
    # under the bound, a whole epoch refused: no batch can ever be filled, so iterating stops
    # after the 30 entries of the epoch (the rank would read them again for ever) instead of
    # cycling through them
    loader = StreamingLoader(shards, decode, 2, max_consecutive_corrupt=1000)
    with pytest.raises(NoValidSamples, match="every sample of a whole epoch") as caught:
        next(iter(loader))
    assert caught.value.in_a_row == {"corrupt": 30}
    assert loader.corrupt_counts == {"bad member": 30}


def test_a_rank_reads_every_sample_it_can_reach_before_it_gives_up(tmp_path):
    """Rank r of 3 reads entries r, r + 3, ... of an epoch of 10, wrapping around: its own 4
    entries, then the others' (all 10 positions before it repeats). With only samples 4 and 7
    valid, every rank finds one instead of stopping after twice its share of 4."""
    shards = make_dataset(tmp_path, 10, corrupt=set(range(10)) - {4, 7})
    for rank in range(3):
        loader = StreamingLoader(shards, decode, 1, rank=rank, world_size=3, shuffle=False)
        assert next(iter(loader))["idx"].item() in (4, 7)


def test_truncated_shard_is_read_up_to_the_damage(tmp_path):
    make_dataset(tmp_path, 20, per_shard=10)
    shard = tmp_path / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    shards = ShardSet.open(tmp_path)
    assert shards.sizes()[0] == 10 and 0 < shards.sizes()[1] < 10
    assert shards.damaged()[0].shard == str(shard)
    seen = sorted(i for i, _ in take(StreamingLoader(shards, decode, 1)))
    assert seen == list(range(10 + shards.sizes()[1]))


def test_mixing_follows_the_weights(tmp_path):
    small = make_dataset(tmp_path / "a", 40, prefix="a")
    large = make_dataset(tmp_path / "b", 200, prefix="b")
    loader = StreamingLoader(
        [small, large], decode, 10, weights=[3, 1], epoch_samples=80, with_keys=True
    )
    epochs = [[k for b in loader for k in b["__key__"]] for _ in range(3)]
    for keys in epochs:
        assert sum(k.startswith("a") for k in keys) == 60
        for lo in range(0, 80, 20):  # every stretch of 20 holds ~15 of source a
            assert abs(sum(k.startswith("a") for k in keys[lo : lo + 20]) - 15) <= 1
    a_draws = [k for keys in epochs for k in keys if k.startswith("a")]
    assert Counter(a_draws[:40]) == Counter(f"a{i:05d}" for i in range(40))  # a full pass first
    b_draws = [k for keys in epochs for k in keys if k.startswith("b")]
    assert len(set(b_draws)) == 60  # b continues where it stopped, no repeats within its pass
    same = StreamingLoader(
        [small, large], decode, 10, weights=[3, 1], epoch_samples=80, with_keys=True
    )
    assert [k for b in same for k in b["__key__"]] == epochs[0]


def test_segment_maps_entries_around_consumed_positions():
    segment = Segment(10, start=2, skip=(3, 6))
    assert segment.size == 6
    assert segment.positions(range(8)).tolist() == [2, 4, 5, 7, 8, 9, 2, 4]
    later = segment.after(2, [2, 1])  # rank 0 took 2 and 5, rank 1 took 4
    assert later == Segment(10, start=7) and later.size == 3


def test_state_is_checked_against_the_data(data, tmp_path):
    loader = StreamingLoader(data, decode, 4, seed=1)
    take(loader, 2)
    state = loader.state_dict()
    assert state["consumed"] == [8] and state["batches"] == 2
    with pytest.raises(ValueError, match="seed"):
        StreamingLoader(data, decode, 4, seed=2).load_state_dict(state)
    other = make_dataset(tmp_path, 61)
    with pytest.raises(ValueError, match="fingerprint"):
        StreamingLoader(other, decode, 4, seed=1).load_state_dict(state)


def test_order_command_prints_what_the_rank_reads(data, capsys):
    folder = data.shards[0].path.parent
    assert main(["data", "order", str(folder), "--seed", "3", "--epoch", "1", "--world-size", "2", "--rank", "1", "--batch-size", "2"]) == 0  # fmt: skip
    printed = capsys.readouterr().out.split()
    loaders = ranks(data, 2, 2, seed=3, with_keys=True)
    for lo in loaders:
        take(lo)  # epoch 0
    keys = [k for b in loaders[1] for k in b["__key__"]]
    assert printed == keys and len(keys) == 30

    # --skip N: after N global samples (3 steps x 2 ranks x 2), as a resumed loader sees them.
    assert main(["data", "order", str(folder), "--seed", "3", "--epoch", "1", "--world-size", "2", "--rank", "1", "--skip", "12", "--limit", "5"]) == 0  # fmt: skip
    assert capsys.readouterr().out.split() == keys[6:11]


def test_inspect_command_reports_and_verifies(tmp_path, capsys):
    make_dataset(tmp_path, 20, per_shard=8)
    assert main(["data", "inspect", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 20 and len(report["shards"]) == 3
    assert report["modalities"] == {"text": 20}
    assert report["extensions"] == {"idx": 20, "txt": 20}
    assert report["problems"] == [] and report["verified"] == "sha256"
    shard = tmp_path / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["data", "inspect", str(tmp_path)]) == 1
    assert "shard-000001.tar: sha256 differs" in capsys.readouterr().out
