"""The streaming, sharded safetensors writer and the lazy reader: files safetensors itself
reads (byte-identical to its own writer for one file), HF's shard and index convention, refusal
of tensors out of plan, and no new file left behind by a writer that fails."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from mmtrain.models.safetensors_files import (
    DTYPE_NAMES,
    INDEX_FILE,
    WEIGHTS_FILE,
    ShardedWriter,
    TensorEntry,
    WeightsFileError,
    entries_of,
    open_weights,
    plan_shards,
    read_weights,
    write_state_dict,
)


def every_dtype() -> dict[str, torch.Tensor]:
    """One tensor of each dtype safetensors stores, odd sizes so that a wrong layout would
    misalign, given in an order unlike safetensors' own (by dtype, then name)."""
    g = torch.Generator().manual_seed(0)
    state = {}
    for i, dtype in enumerate(reversed(list(DTYPE_NAMES))):
        raw = torch.randint(0, 256, (3 + 2 * i,), generator=g, dtype=torch.uint8)
        size = dtype.itemsize
        raw = raw[: (raw.numel() // size) * size] if size > 1 else raw
        if raw.numel() < size:
            raw = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8)
        state[f"t{len(DTYPE_NAMES) - i:02d}.{dtype}".replace("torch.", "")] = raw.view(dtype)
    state["z.scalar"] = torch.tensor(1.5)
    state["a.empty"] = torch.zeros(0, 4)
    state["m.matrix"] = torch.randn(5, 3, generator=g).t()  # not contiguous
    return state


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    flat = want.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), flat)


def test_one_file_is_byte_identical_to_safetensors_own(tmp_path):
    state = every_dtype()
    write_state_dict(tmp_path / "ours", state)
    reference = tmp_path / "reference.safetensors"
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in state.items()}, reference, metadata={"format": "pt"}
    )
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == [WEIGHTS_FILE]
    assert (tmp_path / "ours" / WEIGHTS_FILE).read_bytes() == reference.read_bytes()
    loaded = safetensors.torch.load_file(tmp_path / "ours" / WEIGHTS_FILE)
    for name, tensor in state.items():
        assert_bitwise(loaded[name], tensor)


def test_shards_follow_hf_convention_and_read_back(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {f"layer.{i}.weight": torch.randn(8, 4, generator=g) for i in range(5)}  # 128 B each
    state["big"] = torch.randn(100, generator=g).to(torch.bfloat16)  # 200 B: a file of its own
    state["tail"] = torch.arange(3)
    files = write_state_dict(tmp_path, state, max_shard_bytes=300)
    names = [p.name for p in files]
    # 128 + 128 fit 300; the third starts a file; the bigger-than-max tensor is alone
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert not (tmp_path / WEIGHTS_FILE).exists()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.itemsize for t in state.values())
    assert index["weight_map"] == {
        "layer.0.weight": names[0],
        "layer.1.weight": names[0],
        "layer.2.weight": names[1],
        "layer.3.weight": names[1],
        "layer.4.weight": names[2],
        "big": names[3],
        "tail": names[3],
    }
    for path in files:  # each shard is a file safetensors reads on its own
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == path.name
                assert_bitwise(f.get_tensor(name), state[name])
    reader = open_weights(tmp_path)
    assert set(reader) == set(state)
    assert reader.entry("big") == TensorEntry("big", torch.bfloat16, (100,))
    for name, tensor in read_weights(tmp_path).items():
        assert_bitwise(tensor, state[name])


def test_plan_puts_everything_in_one_file_when_it_fits():
    entries = [TensorEntry("a", torch.float32, (10,)), TensorEntry("b", torch.float16, (4, 5))]
    (plan,) = plan_shards(entries, max_shard_bytes=80)
    assert plan.file == WEIGHTS_FILE and plan.size % 8 == 0
    assert [p.file for p in plan_shards(entries, max_shard_bytes=79)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_tensors_out_of_plan_are_refused_and_leave_nothing(tmp_path):
    state = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    cases = [
        ("b", torch.zeros(4), "expected tensor #0 'a' F32 \\[2, 3\\], got 'b'"),
        ("a", torch.zeros(3, 2), "got 'a' F32 \\[3, 2\\]"),
        ("a", torch.zeros(2, 3, dtype=torch.float64), "got 'a' F64"),
    ]
    for name, tensor, message in cases:
        with pytest.raises(ValueError, match=message):
            with ShardedWriter(tmp_path, entries_of(state)) as writer:
                writer.write(name, tensor)
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="1 planned tensors were never written, from 'b'"):
        with ShardedWriter(tmp_path, entries_of(state)) as writer:
            writer.write("a", state["a"])
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_fails_midway_keeps_the_old_folder(tmp_path):
    old = {"x": torch.ones(3)}
    write_state_dict(tmp_path, old)
    before = (tmp_path / WEIGHTS_FILE).read_bytes()
    state = {f"w{i}": torch.full((16,), float(i)) for i in range(4)}

    def tensors():
        yield "w0", state["w0"]
        yield "w1", state["w1"]  # completes the first shard
        yield "w2", state["w2"]
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        with ShardedWriter(tmp_path, entries_of(state), max_shard_bytes=128) as writer:
            for name, tensor in tensors():
                writer.write(name, tensor)
    assert [p.name for p in tmp_path.iterdir()] == [WEIGHTS_FILE]
    assert (tmp_path / WEIGHTS_FILE).read_bytes() == before


def test_rewriting_a_folder_replaces_files_of_the_other_layout(tmp_path):
    state = {f"w{i}": torch.full((16,), float(i)) for i in range(4)}
    write_state_dict(tmp_path, state, max_shard_bytes=64)  # four shards
    write_state_dict(tmp_path, state, max_shard_bytes=128)  # two
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        INDEX_FILE,
    ]
    write_state_dict(tmp_path, state)  # one file
    assert [p.name for p in tmp_path.iterdir()] == [WEIGHTS_FILE]
    assert all(torch.equal(read_weights(tmp_path)[k], v) for k, v in state.items())


def test_bad_folders_name_the_file(tmp_path):
    with pytest.raises(WeightsFileError, match=f"has no {WEIGHTS_FILE} or {INDEX_FILE}"):
        open_weights(tmp_path)
    state = {f"w{i}": torch.zeros(16) for i in range(2)}
    write_state_dict(tmp_path, state, max_shard_bytes=64)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsFileError, match="model-00002-of-00002.safetensors: is missing"):
        open_weights(tmp_path)
    write_state_dict(tmp_path, state)
    data = (tmp_path / WEIGHTS_FILE).read_bytes()
    (tmp_path / WEIGHTS_FILE).write_bytes(data[:-10])  # truncated
    with pytest.raises(WeightsFileError, match="model.safetensors: is not a readable"):
        open_weights(tmp_path)


def test_write_model_folder_takes_tensors_as_they_arrive(tmp_path):
    # What the trainer does under FSDP: the layout up front, then one gathered tensor at a time.
    import mmtrain
    from mmtrain.models.build import write_model_folder

    model = mmtrain.create_model("tiny-clip", seed=3)
    state = model.state_dict()
    layout = [TensorEntry.of(name, t.to("meta")) for name, t in state.items()]
    arrived = []

    def gathered():
        for name, tensor in state.items():
            arrived.append(name)
            yield name, tensor.clone()

    write_model_folder(tmp_path / "m", model.spec, layout, gathered(), max_shard_bytes=50_000)
    assert arrived == list(state)
    assert (tmp_path / "m" / INDEX_FILE).exists() and (tmp_path / "m" / "spec.yaml").exists()
    loaded = mmtrain.load_model(tmp_path / "m")
    assert loaded.spec == model.spec
    for name, tensor in state.items():
        assert_bitwise(loaded.state_dict()[name], tensor)
