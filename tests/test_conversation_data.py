"""Conversation data end to end: LLaVA / ShareGPT files -> shards -> decoder-LM batches.

Real JPEG/PNG files (Pillow), real tar shards, a real byte-level BPE with the chat template's
special tokens, the real streaming loader (also with a worker process) and a tiny VLM spec.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer as RawTokenizer

import mmtrain
from micro import BuildCrash, crash_at_write
from mmtrain.config import config_from_dict
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.chat_templates import IGNORE_INDEX, get_template
from mmtrain.data.stream.conversation_batches import (
    ConversationDecoder,
    ConversationSample,
    conversation_batch,
)
from mmtrain.data.stream.packing import PAD_DOCUMENT
from mmtrain.data.stream.tokenizer import get_tokenizer, train_bpe
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.spec import ImageStem, ModelSpec, ProjectorSpec, TowerSpec
from mmtrain.structured import FieldError
from mmtrain.train.data import TrainData

SPECIALS = ["<|im_start|>", "<|im_end|>", "<image>"]
ANSWERS = ["A red square.", "Two dogs.", "It is blue.", "Yes.", "A cat on a sofa.", "No."]
QUESTIONS = ["What is this?", "How many?", "What colour is it?", "Is it big?", "Describe it."]
CORPUS = [*ANSWERS, *QUESTIONS, "system user assistant", "You are a helpful assistant."] * 8
SEQUENCE = 160  # LM positions per row
IMAGE_SIDE = 16  # the tower's input size; one image = (16 / 8)^2 = 4 LM positions


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    path = folder / "tokenizer.json"
    train_bpe(CORPUS, vocab_size=300, out_path=path)
    raw = RawTokenizer.from_file(str(path))
    raw.add_special_tokens(SPECIALS)
    raw.save(str(path))
    return folder


@pytest.fixture(scope="module")
def raw(tok_dir) -> RawTokenizer:
    return RawTokenizer.from_file(str(tok_dir / "tokenizer.json"))


def tiny_vlm(raw: RawTokenizer) -> ModelSpec:
    tower = TowerSpec(
        modality="image",
        stem=ImageStem(image_size=IMAGE_SIDE, patch_size=8),
        width=16,
        layers=2,
        heads=2,
        output_proj=False,
    )
    decoder = DecoderSpec(
        vocab_size=raw.get_vocab_size(), width=16, layers=1, heads=2, mlp_hidden=32
    )
    return ModelSpec(
        name="tiny-vlm",
        embed_dim=16,
        towers={"image": tower},
        objective="next_token",
        decoder=decoder,
        projector=ProjectorSpec(image_token_id=raw.token_to_id("<image>")),
    )


def image_bytes(seed: int, fmt: str = "JPEG", size: tuple[int, int] = (24, 20)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def chat(key: str, turns: list[tuple[str, str]], images: int) -> dict:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": text}
        for i, (_, text) in enumerate(turns)
    ]
    return {"id": key, "messages": messages, "images": [f"{n}.jpg" for n in range(images)]}


def good_records() -> list[tuple[dict, list[bytes]]]:
    """Conversations of 0, 1 and 2 images and one and two rounds."""
    out = []
    for i in range(14):
        images = i % 3
        question = "<image>" * images + "\n" + QUESTIONS[i % len(QUESTIONS)]
        turns = [("user", question), ("assistant", ANSWERS[i % len(ANSWERS)])]
        if i % 4 == 1:
            turns += [("user", QUESTIONS[(i + 1) % len(QUESTIONS)]), ("assistant", "Yes.")]
        out.append(
            (
                chat(f"good{i}", turns, images),
                [image_bytes(100 + 10 * i + n) for n in range(images)],
            )
        )
    return out


def refused_records() -> list[tuple[dict, list[bytes], str]]:
    """(record, images, the kind the loader counts it under)."""
    long_prompt = " ".join(QUESTIONS * 12)
    return [
        # truncation to SEQUENCE positions leaves no answer
        (
            chat("long", [("user", long_prompt), ("assistant", "Yes.")], 0),
            [],
            "truncated_no_targets",
        ),
        # the image sits after the cut
        (
            chat("cut", [("user", long_prompt + "<image>"), ("assistant", "No.")], 1),
            [image_bytes(7)],
            "image_cut",
        ),
        # two tags, one image
        (
            chat("tags", [("user", "<image><image>Hi"), ("assistant", "No.")], 1),
            [image_bytes(8)],
            "image_count",
        ),
        # bytes that are no image
        (
            chat("broken", [("user", "<image>What?"), ("assistant", "No.")], 1),
            [b"not a jpeg"],
            "MediaError",
        ),
    ]


def write_shards(folder: Path, records: list[tuple[dict, list[bytes]]], per_shard: int = 5) -> Path:
    """Shards in the contract's layout: `{key}.json` and `{key}.N.jpg` members."""
    with ShardWriter(folder, max_samples=per_shard) as writer:
        for i, (record, images) in enumerate(records):
            sample = {"__key__": f"{i:09d}", "json": json.dumps(record)}
            sample |= {f"{n}.jpg": data for n, data in enumerate(images)}
            writer.write(sample)
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return folder


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, dict[str, dict], dict[str, str]]:
    """Shards of good and refused conversations interleaved; key -> record, key -> kind."""
    good, bad = good_records(), refused_records()
    records, kinds = [], {}
    for i, item in enumerate(good):
        records.append(item)
        if i % 3 == 2 and bad:
            record, images, kind = bad.pop(0)
            kinds[f"{len(records):09d}"] = kind
            records.append((record, images))
    folder = write_shards(tmp_path_factory.mktemp("conv"), records)
    by_key = {f"{i:09d}": record for i, (record, _) in enumerate(records)}
    return folder, by_key, kinds


def run_config(tmp_path: Path, shard_dir: Path, tok_dir: Path, **data):
    return config_from_dict(
        {
            "model": "unused",
            "data": {
                "train": str(shard_dir),
                "tokenizer": str(tok_dir / "tokenizer.json"),
                "chat_template": "chatml",
                "sequence_length": SEQUENCE,
                "shuffle_window": 4,
                **data,
            },
            "train": {"steps": 10, "batch_size": 4},
            "out": str(tmp_path / "run"),
        }
    )


def take(data: TrainData, n: int) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
    return [(data.next_batch(), list(data.last_keys))[::-1] for _ in range(n)]


def same(a, b) -> bool:
    """Equal batch values: tensors element by element, host values ("splice_sizes") as values."""
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def take_samples(data: TrainData, n: int) -> list[str]:
    """Keys of the micro-batches handed out until they hold `n` samples (a micro-batch holds the
    valid samples of its `micro_batch` stream entries: fewer where some were skipped)."""
    keys: list[str] = []
    while len(keys) < n:
        data.next_batch()
        assert 0 < len(data.last_keys) <= data.micro_batch
        keys += data.last_keys
    return keys


def trained_text(raw: RawTokenizer, ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """The runs of target labels, decoded (each must be one assistant answer + end of turn)."""
    spans: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in labels.tolist():
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                spans.append([])
            spans[-1].append(label)
        previous = label
    return [raw.decode(span, skip_special_tokens=False) for span in spans]


def answers(record: dict) -> list[str]:
    return [m["content"] + "<|im_end|>" for m in record["messages"] if m["role"] == "assistant"]


def positions(ids: list[int], image_id: int, image_tokens: int) -> list[int]:
    out, position = [], 0
    for token in ids:
        out.append(position)
        position += image_tokens if token == image_id else 1
    return out


# ----------------------------------------------------------------------------- batches
def test_padded_and_packed_batches_hold_the_same_samples_and_targets(
    tmp_path, shards, tok_dir, raw
):
    folder, records, _ = shards
    spec = tiny_vlm(raw)
    image_id, image_tokens = spec.projector.image_token_id, spec.image_tokens()
    padded = TrainData(
        run_config(tmp_path, folder, tok_dir), spec, rank=0, world_size=1, micro_batch=4
    )
    packed = TrainData(
        run_config(tmp_path, folder, tok_dir, pack=True), spec, rank=0, world_size=1, micro_batch=4
    )
    model = mmtrain.create_model(spec, seed=0)
    fewer_rows = 0
    for (keys, a), (packed_keys, b) in zip(take(padded, 5), take(packed, 5), strict=True):
        # the same samples of the stream: the valid ones of its next 4 entries
        assert keys == packed_keys and 0 < len(keys) <= 4
        common = {"text", "labels", "image", "position_ids", "splice_sizes"}
        assert set(a) == common | {"attention_mask"} and set(b) == common | {"document_ids"}
        for batch in (a, b):  # the host's sizes are those the model reads without them
            with torch.no_grad():
                given = model(batch)["nll_sum"]
                read = model({k: v for k, v in batch.items() if k != "splice_sizes"})["nll_sum"]
            assert torch.equal(given, read)
        assert (a["labels"] != IGNORE_INDEX).sum() == (b["labels"] != IGNORE_INDEX).sum() > 0
        for batch in (a, b):
            assert (batch["text"] == image_id).sum() == batch["image"].shape[0]
            assert batch["image"].shape[1:] == (3, IMAGE_SIDE, IMAGE_SIDE)
        # Padded: row r is sample r; targets are exactly its assistant answers.
        per_sample_images = []
        start = 0
        for r, key in enumerate(keys):
            ids, labels, mask = a["text"][r], a["labels"][r], a["attention_mask"][r]
            assert trained_text(raw, ids, labels) == answers(records[key])
            assert (labels[~mask] == IGNORE_INDEX).all()
            n = int((ids[mask] == image_id).sum())
            assert n == len(records[key]["images"])
            per_sample_images.append(a["image"][start : start + n])
            start += n
            real = ids[mask].tolist()
            assert a["position_ids"][r][mask].tolist() == positions(real, image_id, image_tokens)
        # Packed: each sample in one row, contiguous, whole with its images, positions from 0.
        start = 0
        seen = []
        for r in range(b["text"].shape[0]):
            docs = b["document_ids"][r].tolist()
            used = 0
            for doc in dict.fromkeys(d for d in docs if d != PAD_DOCUMENT):
                span = [i for i, d in enumerate(docs) if d == doc]
                assert span == list(range(span[0], span[-1] + 1))
                ids = b["text"][r, span].tolist()
                assert b["position_ids"][r, span].tolist() == positions(ids, image_id, image_tokens)
                assert ids == a["text"][doc][a["attention_mask"][doc]].tolist()
                labels = b["labels"][r, span]
                assert trained_text(raw, b["text"][r, span], labels) == answers(records[keys[doc]])
                n = ids.count(image_id)
                assert torch.equal(b["image"][start : start + n], per_sample_images[doc])
                start += n
                used += len(ids) + n * (image_tokens - 1)
                seen.append(doc)
            assert used <= SEQUENCE
        assert sorted(seen) == list(range(len(keys)))
        fewer_rows += b["text"].shape[0] < 4
    assert fewer_rows > 0  # packing did put several samples in one row
    padded.close()
    packed.close()


def test_refused_samples_are_skipped_and_counted_by_kind(tmp_path, shards, tok_dir, raw):
    """Refused conversations are skipped; those the row cannot hold (an image cut, no answer
    left) count as too long, the others (a tag without its image, a broken image) corrupt."""
    folder, records, kinds = shards
    spec = tiny_vlm(raw)
    data = TrainData(
        run_config(tmp_path, folder, tok_dir), spec, rank=0, world_size=1, micro_batch=2
    )
    good = len(records) - len(kinds)
    keys = take_samples(data, good)
    assert sorted(keys) == sorted(k for k in records if k not in kinds)  # one epoch, each once
    too_long = {"image_cut", "truncated_no_targets"}
    assert data.too_long_samples() == sum(k in too_long for k in kinds.values())
    assert data.corrupt_samples() == sum(k not in too_long for k in kinds.values())
    counted = Counter(data.loader.corrupt_counts) + Counter(data.loader.too_long_counts)
    assert counted == Counter(kinds.values())
    assert set(data.loader.too_long_counts) == too_long
    data.close()


def test_resume_mid_epoch_gives_the_same_next_batches(tmp_path, shards, tok_dir, raw):
    folder, _, _ = shards
    spec = tiny_vlm(raw)
    config = run_config(tmp_path, folder, tok_dir, pack=True)
    data = TrainData(config, spec, rank=0, world_size=1, micro_batch=3)
    take(data, 2)
    state = data.state_dict()
    expected = take(data, 5)  # crosses the end of the epoch
    data.close()
    # A worker process decodes now: the stream must not change.
    config = run_config(tmp_path, folder, tok_dir, pack=True, workers=1)
    resumed = TrainData(config, spec, rank=0, world_size=1, micro_batch=3)
    resumed.load_state_dict(state)
    got = take(resumed, 5)
    resumed.load_state_dict(state)  # a rollback, mid-stream, with the worker still running
    again = take(resumed, 5)
    resumed.close()
    for (keys, a), (keys_got, b), (keys_again, c) in zip(expected, got, again, strict=True):
        assert keys == keys_got == keys_again
        assert a.keys() == b.keys() == c.keys()
        assert all(same(a[name], b[name]) and same(a[name], c[name]) for name in a)


def test_text_only_lm_skips_conversations_with_images(tmp_path, shards, tok_dir, raw):
    folder, records, kinds = shards
    spec = tiny_vlm(raw)
    lm = ModelSpec(
        name="tiny-lm", embed_dim=16, towers={}, objective="next_token", decoder=spec.decoder
    )
    data = TrainData(
        run_config(tmp_path, folder, tok_dir, pack=True), lm, rank=0, world_size=1, micro_batch=2
    )
    text_only = [k for k, r in records.items() if not r["images"] and k not in kinds]
    got = take(data, 2)
    first = [key for batch_keys, _ in got for key in batch_keys]
    keys = first + take_samples(data, len(text_only) - len(first))
    data.close()
    assert len(set(keys)) == len(keys) == len(text_only) and set(keys) == set(text_only)
    expected = {"text", "labels", "position_ids", "document_ids", "splice_sizes"}
    assert all(set(batch) == expected for _, batch in got)
    assert data.loader.corrupt_counts["images_without_tower"] > 0


def test_conversation_settings_are_checked_by_field(tmp_path, shards, tok_dir, raw):
    folder, _, _ = shards
    spec = tiny_vlm(raw)
    cases = [
        ({"sequence_length": 4096}, "data.sequence_length", "max_positions"),
        ({"sequence_length": 4}, "data.sequence_length", "no room"),
        ({"chat_template": None}, "data.chat_template", "no chat template"),
        ({"chat_template": "chatm"}, "data.chat_template", "did you mean"),
        ({"chat_template": "llama-3"}, "data.chat_template", "as one token"),
    ]
    for settings, field, words in cases:
        with pytest.raises(FieldError, match=words) as err:
            TrainData(
                run_config(tmp_path, folder, tok_dir, **settings),
                spec,
                rank=0,
                world_size=1,
                micro_batch=2,
            )
        assert err.value.path == field


# ----------------------------------------------------------------------------- the batch function
def test_conversation_batch_packs_first_fit_and_pads_to_the_longest(tok_dir, raw):
    """The function the evaluator calls, on hand-made samples: 3 images of 4 positions."""
    image_id = raw.token_to_id("<image>")
    images = torch.arange(3 * 3 * 2 * 2, dtype=torch.float32).reshape(3, 3, 2, 2)

    def sample(ids: list[int], n_images: int, first: int = 0) -> ConversationSample:
        return ConversationSample(
            ids, [IGNORE_INDEX] + ids[1:], images=images[first : first + n_images]
        )

    samples = [
        sample([image_id, 5, 6, 7], 1, 0),  # 7 positions
        sample([8, 9, 10, 11, 12, 13], 0),  # 6
        sample([image_id, image_id, 14], 2, 1),  # 9
    ]
    packed = conversation_batch(
        samples, pack=True, row_length=13, image_token_id=image_id, image_tokens=4
    )
    # First-fit: sample 0 (7) opens row 0, sample 1 (6) fills it, sample 2 (9) opens row 1.
    assert packed["document_ids"].tolist() == [
        [0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
        [2, 2, 2, -1, -1, -1, -1, -1, -1, -1],
    ]
    assert packed["position_ids"][0].tolist() == [0, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    assert packed["position_ids"][1, :3].tolist() == [0, 4, 8]
    assert packed["labels"][0, 4] == IGNORE_INDEX  # no target across the boundary
    assert torch.equal(packed["image"], images)
    padded = conversation_batch(
        samples, pack=False, row_length=13, image_token_id=image_id, image_tokens=4
    )
    assert padded["text"].shape == (3, 6) and padded["attention_mask"].sum(1).tolist() == [4, 6, 3]
    assert torch.equal(padded["image"], images)
    assert (padded["labels"] != IGNORE_INDEX).sum() == (packed["labels"] != IGNORE_INDEX).sum()
    with pytest.raises(ValueError, match="more than a row"):
        conversation_batch(
            samples, pack=False, row_length=8, image_token_id=image_id, image_tokens=4
        )


def test_decoder_outside_training_uses_the_eval_transform(tok_dir, raw, shards):
    """The decoder the evaluator builds: centre crop (no randomness), same ids as training."""
    folder, _, _ = shards
    spec = tiny_vlm(raw)
    tokenizer = get_tokenizer(tok_dir / "tokenizer.json")
    template = get_template("chatml")
    evaluate = ConversationDecoder.for_spec(spec, tokenizer, template, SEQUENCE, train=False)
    train = ConversationDecoder.for_spec(spec, tokenizer, template, SEQUENCE)
    record, images = good_records()[2]
    sample = {"__key__": "x", "json": json.dumps(record).encode()}
    sample |= {f"{n}.jpg": data for n, data in enumerate(images)}
    a, b = evaluate.encode(sample, None), evaluate.encode(sample, None)
    assert torch.equal(a.images, b.images) and a.images.shape == (2, 3, IMAGE_SIDE, IMAGE_SIDE)
    c = train.encode(sample, np.random.default_rng(0))
    assert c.input_ids == a.input_ids and c.labels == a.labels


# ----------------------------------------------------------------------------- data build
def build(*argv: str | Path) -> int:
    import argparse

    from mmtrain.commands._data_args import add_build_arguments
    from mmtrain.commands.data import run_build

    parser = argparse.ArgumentParser()
    add_build_arguments(parser)
    return run_build(parser.parse_args([str(a) for a in argv]))


def built_samples(out: Path) -> list[dict]:
    from mmtrain.data.storage.manifest import read_manifest
    from mmtrain.data.storage.tar_index import read_shard

    return [s for shard in read_manifest(out)["shards"] for s in read_shard(out / shard["name"])]


def build_rejects(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


def image_folder(root: Path) -> dict[str, bytes]:
    files = {
        "coco/a.jpg": image_bytes(1),
        "coco/b.jpg": image_bytes(2),
        "web/c.png": image_bytes(3, "PNG"),
        "web/broken.jpg": b"\xff\xd8\xff\xe0 truncated",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


LLAVA_RECORDS = [
    {
        "id": "one",
        "image": "coco/a.jpg",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"},
            {"from": "gpt", "value": "A red square."},
        ],
    },
    {
        "id": "two",
        "image": ["coco/b.jpg", "web/c.png"],
        "conversations": [
            {"from": "human", "value": "<image> and <image>: how many?"},
            {"from": "gpt", "value": "Two dogs."},
        ],
    },
    {
        "id": "text",
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "No."}],
    },
    {
        "id": "mismatch",
        "image": "coco/a.jpg",
        "conversations": [
            {"from": "human", "value": "No tag here"},
            {"from": "gpt", "value": "No."},
        ],
    },
    {
        "id": "missing",
        "image": "coco/nowhere.jpg",
        "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "No."}],
    },
    {
        "id": "broken",
        "image": "web/broken.jpg",
        "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "No."}],
    },
]


def messages_records() -> list[dict]:
    return [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<image>Describe it."},
                {"role": "assistant", "content": "A cat on a sofa."},
                {"role": "user", "content": "Is it big?"},
                {"role": "assistant", "content": "Yes."},
            ],
            "images": ["coco/a.jpg"],
        },
        {
            "messages": [
                {"role": "user", "content": "<image><image>Which?"},
                {"role": "assistant", "content": "No."},
            ],
            "images": ["web/c.png"],
        },
    ]


def test_llava_json_builds_conversation_shards_and_rejects_with_reasons(tmp_path):
    files = image_folder(tmp_path / "images")
    src = tmp_path / "llava.json"
    src.write_text(json.dumps(LLAVA_RECORDS))
    out = tmp_path / "out"
    flags = ("--workers", 1, "--max-reject-rate", 0.6)
    assert build(src, "--out", out, "--image-root", tmp_path / "images", *flags) == 0
    samples = built_samples(out)
    metas = [json.loads(s["json"]) for s in samples]
    assert [m["id"] for m in metas] == ["one", "two", "text"]
    assert metas[0]["messages"] == [
        {"role": "user", "content": "<image>\nWhat is this?"},
        {"role": "assistant", "content": "A red square."},
    ]
    assert [m["images"] for m in metas] == [["0.jpg"], ["0.jpg", "1.png"], []]
    # Stored as they are (no --image-max-side): the same bytes, in tag order.
    assert samples[0]["0.jpg"] == files["coco/a.jpg"]
    assert samples[1]["0.jpg"] == files["coco/b.jpg"] and samples[1]["1.png"] == files["web/c.png"]
    assert set(samples[2]) == {"__key__", "json"}
    rejected = build_rejects(out)
    assert [(r["kind"], r["index"]) for r in rejected] == [
        ("image_count", 3),
        ("missing_image", 4),
        ("undecodable", 5),
    ]
    by_kind = {r["kind"]: r for r in rejected}
    assert "0 <image> tag(s) in the text but 1 image(s)" in by_kind["image_count"]["reason"]
    assert by_kind["image_count"]["path"] == "llava.json[3]"
    assert by_kind["missing_image"]["path"].endswith("coco/nowhere.jpg")
    assert "--image-root" in by_kind["missing_image"]["reason"]
    assert by_kind["undecodable"]["path"].endswith("web/broken.jpg")
    from mmtrain.data.storage.manifest import read_manifest

    counts = read_manifest(out)["counts"]
    assert counts["samples"] == 3 and counts["rejected"] == 3
    with pytest.raises(FieldError, match="--near-dup-bits: does not apply to chat data"):
        build(src, "--out", tmp_path / "o2", "--near-dup-bits", 4, *flags)
    assert read_manifest(out)["modalities"] == ["image", "text"]


def test_messages_jsonl_builds_and_trains(tmp_path, tok_dir, raw):
    """ShareGPT `messages` + `images` (paths relative to the file) -> shards -> VLM batches."""
    image_folder(tmp_path)
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in messages_records()))
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1, "--max-reject-rate", 0.5) == 0
    (sample,) = built_samples(out)
    meta = json.loads(sample["json"])
    assert meta["messages"][0] == {"role": "system", "content": "Be brief."}
    assert meta["images"] == ["0.jpg"] and meta["image_sizes"] == [[24, 20]]
    (reject,) = build_rejects(out)
    assert reject["kind"] == "image_count" and reject["path"] == "chat.jsonl:2"
    spec = tiny_vlm(raw)
    config = run_config(tmp_path, out, tok_dir, shuffle_window=1)
    data = TrainData(config, spec, rank=0, world_size=1, micro_batch=1)
    batch = data.next_batch()
    data.close()
    assert batch["image"].shape == (1, 3, IMAGE_SIDE, IMAGE_SIDE)
    assert trained_text(raw, batch["text"][0], batch["labels"][0]) == [
        "A cat on a sofa.<|im_end|>",
        "Yes.<|im_end|>",
    ]
    text = raw.decode(batch["text"][0].tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_conversation_build_resumes_to_identical_output_and_dedups(tmp_path, monkeypatch):
    from mmtrain.data.storage.manifest import read_manifest

    image_folder(tmp_path)
    records = [dict(r, id=f"{r['id']}-{n}") for n in range(3) for r in LLAVA_RECORDS[:3]]
    records.append(dict(LLAVA_RECORDS[0]))  # the first conversation again: an exact duplicate
    src = tmp_path / "llava.json"
    src.write_text(json.dumps(records))
    flags = ("--workers", 1, "--max-samples-per-shard", 2, "--dedup", "--image-max-side", 16)
    clean = tmp_path / "clean"
    assert build(src, "--out", clean, *flags) == 0
    metas = [json.loads(s["json"]) for s in built_samples(clean)]
    # Same images and text under another id are duplicates too: the id is no content.
    assert len(metas) == 3 and read_manifest(clean)["counts"]["filtered"] == 7
    assert metas[0]["image_sizes"] == [[16, 13]]  # re-encoded at the maximum side

    out = tmp_path / "out"
    end_crash = crash_at_write(monkeypatch, 3)  # the first sample of the second shard
    with pytest.raises(BuildCrash):
        build(src, "--out", out, *flags)
    end_crash()
    assert build(src, "--out", out, *flags) == 0
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == {
        p.name: p.read_bytes() for p in clean.glob("*.tar")
    }
    assert (out / "filtered.jsonl").read_bytes() == (clean / "filtered.jsonl").read_bytes()
    assert read_manifest(out)["counts"] == read_manifest(clean)["counts"]


def test_data_inspect_counts_tokens_per_conversation(shards, tok_dir, capsys):
    """`mmtrain data inspect --tokenizer --chat-template` prints the distribution of LM
    positions (text ids + images x --image-tokens) and the refused samples by reason."""
    from mmtrain.cli import main

    shard_dir, records, refused = shards
    argv = ["data", "inspect", str(shard_dir), "--no-hash", "--image-tokens", "4"]
    tools = ["--tokenizer", str(tok_dir), "--chat-template", "chatml"]
    assert main([*argv, *tools, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["conversations"]
    assert report["samples"] + sum(report["refused"].values()) == len(records)
    assert report["positions"]["max"] >= report["text_ids"]["max"]
    assert main([*argv, *tools]) == 0
    assert "positions" in capsys.readouterr().out
    assert main([*argv, "--tokenizer", str(tok_dir)]) == 2  # a tokenizer needs its template


# ----------------------------------------------------------------------------- videos
def video_bytes(seed: int, frames: int, size: tuple[int, int]) -> bytes:
    """A real MP4 (PyAV) of `frames` random frames of `size` (width, height) at 8 fps."""
    from mmtrain.data.stream.media import encode_video

    shape = (frames, size[1], size[0], 3)
    return encode_video(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8), fps=8)


def video_folder(root: Path) -> dict[str, bytes]:
    files = {
        "clips/a.mp4": video_bytes(1, 6, (22, 18)),
        "clips/b.mp4": video_bytes(2, 4, (16, 12)),
        "clips/fake.mp4": image_bytes(9),  # a JPEG under a video's name
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def video_chat(videos: list[str], images: list[str], question: str, answer: str) -> dict:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "images": images, "videos": videos}


def test_chat_with_videos_stores_them_as_they_are_and_rejects_bad_ones(tmp_path):
    from mmtrain.data.ingest.inspect import inspect_shards
    from mmtrain.data.storage.manifest import read_manifest
    from mmtrain.data.stream.conversation_batches import read_conversation
    from mmtrain.data.stream.media import video_header

    images, videos = image_folder(tmp_path), video_folder(tmp_path)
    records = [
        # a video and an image interleaved: the video's tag comes first
        video_chat(["clips/a.mp4"], ["coco/a.jpg"], "<video>\nWhat happens? <image>", "A cat."),
        video_chat([], [], "Hi", "No."),
        video_chat(["clips/nowhere.mp4"], [], "<video>What?", "No."),
        video_chat(["clips/fake.mp4"], [], "<video>What?", "No."),
    ]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1, "--max-reject-rate", 0.6) == 0
    first, text = built_samples(out)
    assert set(first) == {"__key__", "json", "0.jpg", "v0.mp4"}
    assert first["v0.mp4"] == videos["clips/a.mp4"]  # never re-encoded
    assert first["0.jpg"] == images["coco/a.jpg"]
    meta = json.loads(first["json"])
    assert meta["messages"][0]["content"] == "<video>\nWhat happens? <image>"
    assert meta["images"] == ["0.jpg"] and meta["image_sizes"] == [[24, 20]]
    frames, height, width, fps = video_header(videos["clips/a.mp4"])
    assert (frames, width, height, fps) == (6, 22, 18, 8.0)
    assert meta["videos"] == ["v0.mp4"] and meta["video_sizes"] == [[6, 22, 18, 8.0]]
    text_meta = json.loads(text["json"])
    assert text_meta["videos"] == text_meta["images"] == []
    assert text_meta["video_sizes"] == text_meta["image_sizes"] == []
    # What the loader reads back: the conversation and the video's bytes, in tag order.
    conv, image_data, video_data = read_conversation(first)
    assert conv.videos == ["v0.mp4"] and video_data == [videos["clips/a.mp4"]]
    assert image_data == [images["coco/a.jpg"]]
    rejected = build_rejects(out)
    assert [(r["kind"], r["index"]) for r in rejected] == [("missing_video", 2), ("mislabelled", 3)]
    missing, mislabelled = rejected
    assert missing["path"].endswith("clips/nowhere.mp4")
    assert "video 1 of 1" in missing["reason"] and "--image-root" in missing["reason"]
    assert mislabelled["path"].endswith("clips/fake.mp4")
    assert "video 1 of 1" in mislabelled["reason"] and "jpg data" in mislabelled["reason"]
    assert read_manifest(out)["modalities"] == ["image", "video", "text"]
    summary = inspect_shards(str(out))["conversations"]
    assert summary["videos"]["count"] == 2 and summary["videos"]["max"] == 1
    assert summary["images"]["max"] == 1


def test_llava_video_records_build_and_dedup_counts_the_video_bytes(tmp_path):
    from mmtrain.data.storage.manifest import read_manifest

    videos = video_folder(tmp_path / "media")
    image_folder(tmp_path / "media")

    def record(key: str, video: str | list[str], question: str = "<video>What happens?") -> dict:
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": "It moves."}]
        return {"id": key, "video": video, "conversations": turns}

    records = [
        record("b", "clips/b.mp4"),
        record("a", "clips/a.mp4"),  # same text, another video: no duplicate
        record("b-again", "clips/b.mp4"),  # same text and video under another id: a duplicate
        dict(record("two", ["clips/b.mp4", "clips/a.mp4"], "<video> then <video>?"), image=[]),
        record("empty", "clips/empty.mp4"),
        record("undecodable", "clips/cut.mp4"),
    ]
    (tmp_path / "media/clips/empty.mp4").write_bytes(b"")
    (tmp_path / "media/clips/cut.mp4").write_bytes(videos["clips/a.mp4"][:40])  # ftyp, no more
    src = tmp_path / "llava.json"
    src.write_text(json.dumps(records))
    out = tmp_path / "out"
    flags = ("--workers", 1, "--max-reject-rate", 0.6, "--dedup")
    assert build(src, "--out", out, "--image-root", tmp_path / "media", *flags) == 0
    samples = built_samples(out)
    metas = [json.loads(s["json"]) for s in samples]
    assert [m["id"] for m in metas] == ["b", "a", "two"]
    assert [m["videos"] for m in metas] == [["v0.mp4"], ["v0.mp4"], ["v0.mp4", "v1.mp4"]]
    assert metas[2]["video_sizes"] == [[4, 16, 12, 8.0], [6, 22, 18, 8.0]]
    assert samples[2]["v0.mp4"] == videos["clips/b.mp4"]
    assert samples[2]["v1.mp4"] == videos["clips/a.mp4"]
    assert all(m["images"] == [] for m in metas)
    counts = read_manifest(out)["counts"]
    assert counts["filtered"] == 1 and counts["rejected"] == 2
    rejected = {r["kind"]: r for r in build_rejects(out)}
    assert set(rejected) == {"empty", "undecodable"}
    assert rejected["empty"]["path"].endswith("clips/empty.mp4")
    assert rejected["undecodable"]["path"].endswith("clips/cut.mp4")
    assert "video 1 of 1" in rejected["undecodable"]["reason"]
    assert read_manifest(out)["modalities"] == ["video", "text"]


# ----------------------------------------------------------------------------- formats
# One conversation (a system prompt, two rounds, an image in each question) in each format
# `data build` reads. Hugging Face parts are joined as written: LLaVA's "<image>\nWhat is
# this?" is an image part, then the text "\nWhat is this?".
SAME_IMAGES = ["coco/b.jpg", "web/c.png"]  # the second round's image is a PNG: order shows
SAME_LLAVA = {
    "id": "same",
    "image": SAME_IMAGES,
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "<image>\nWhat is this?"},
        {"from": "gpt", "value": "A red square."},
        {"from": "human", "value": "And <image>?"},
        {"from": "gpt", "value": "Two dogs."},
    ],
}
SAME_SHAREGPT = {
    "id": "same",
    "system": "Be brief.",
    "messages": [
        {"role": "user", "content": "<image>\nWhat is this?"},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "And <image>?"},
        {"role": "assistant", "content": "Two dogs."},
    ],
    "images": SAME_IMAGES,
}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def hf_messages(image_parts: list[dict]) -> list[dict]:
    first, second = image_parts
    return [
        {"role": "system", "content": [text_part("Be brief.")]},
        {"role": "user", "content": [first, text_part("\nWhat is this?")]},
        {"role": "assistant", "content": [text_part("A red square.")]},
        {"role": "user", "content": [text_part("And "), second, text_part("?")]},
        {"role": "assistant", "content": [text_part("Two dogs.")]},
    ]


SAME_HF = {"id": "same", "messages": hf_messages([{"type": "image"}] * 2), "images": SAME_IMAGES}
SAME_HF_INLINE = {
    "id": "same",
    "messages": hf_messages([{"type": "image", "image": p} for p in SAME_IMAGES]),
}
SAME_TRL = {
    "id": "same",
    "prompt": SAME_HF["messages"][:4],
    "completion": SAME_HF["messages"][4:],
    "images": SAME_IMAGES,
}


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_one_conversation_in_every_format_builds_the_same_samples(tmp_path, tok_dir, raw):
    """LLaVA, ShareGPT, Hugging Face parts (listed or inline), TRL prompt / completion and a
    parquet table of HF messages -> the same shard sample, which encodes to the same ids,
    labels and images (the chat template's encoding, as training reads it)."""
    files = image_folder(tmp_path)
    sources = {
        "llava.json": json.dumps([SAME_LLAVA]),
        "sharegpt.jsonl": json.dumps(SAME_SHAREGPT) + "\n",
        "hf.jsonl": json.dumps(SAME_HF) + "\n",
        "hf_inline.json": json.dumps([SAME_HF_INLINE]),
        "trl.jsonl": json.dumps(SAME_TRL) + "\n",
    }
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    # Arrow gives every part every field (absent ones null): the reader takes that as written.
    write_parquet(tmp_path / "hf.parquet", [SAME_HF])
    decoder = ConversationDecoder.for_spec(
        tiny_vlm(raw),
        get_tokenizer(tok_dir / "tokenizer.json"),
        get_template("chatml"),
        SEQUENCE,
        train=False,
    )
    built = {}
    for name in [*sources, "hf.parquet"]:
        out = tmp_path / f"out-{name}"
        assert build(tmp_path / name, "--out", out, "--workers", 1) == 0, name
        (sample,) = built_samples(out)
        built[name] = (sample, json.loads(sample["json"]), decoder.encode(sample, None))

    reference, meta, encoded = built["llava.json"]
    # The images in order, stored as they are: the JPEG of the first question, then the PNG.
    assert (reference["0.jpg"], reference["1.png"]) == (files["coco/b.jpg"], files["web/c.png"])
    assert trained_text(raw, torch.tensor(encoded.input_ids), torch.tensor(encoded.labels)) == [
        "A red square.<|im_end|>",
        "Two dogs.<|im_end|>",
    ]
    for name, (sample, other_meta, other) in built.items():
        assert {k: v for k, v in sample.items() if k != "json"} == {
            k: v for k, v in reference.items() if k != "json"
        }, name
        assert other_meta["messages"] == meta["messages"], name
        assert other.input_ids == encoded.input_ids and other.labels == encoded.labels, name
        assert torch.equal(other.images, encoded.images), name


def test_bad_parts_are_rejected_with_file_record_and_field(tmp_path):
    image_folder(tmp_path)

    def record(key: str, content: list, images: list[str]) -> dict:
        answer = {"role": "assistant", "content": [text_part("No.")]}
        return {
            "id": key,
            "messages": [{"role": "user", "content": content}, answer],
            "images": images,
        }

    records = [
        record("good", [{"type": "image"}, text_part("What?")], ["coco/a.jpg"]),
        record("audio", [{"type": "audio"}, text_part("What?")], []),
        record("two", [{"type": "image"}, {"type": "image"}, text_part("?")], ["coco/a.jpg"]),
        record("remote", [{"type": "image", "url": "http://x.org/a.jpg"}, text_part("?")], []),
        record("missing", [{"type": "image", "path": "coco/nowhere.jpg"}, text_part("?")], []),
    ]
    src = tmp_path / "hf.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1, "--max-reject-rate", 0.9) == 0
    assert [json.loads(s["json"])["id"] for s in built_samples(out)] == ["good"]
    rejected = build_rejects(out)
    assert [(r["kind"], r["path"]) for r in rejected] == [
        ("format", "hf.jsonl:2"),
        ("image_count", "hf.jsonl:3"),
        ("format", "hf.jsonl:4"),
        ("missing_image", str(tmp_path / "coco/nowhere.jpg")),
    ]
    reasons = [r["reason"] for r in rejected]
    assert reasons[0].startswith("messages[0].content[0].type: 'audio' is not a part type")
    assert "2 image part(s)" in reasons[1] and "1 image(s) in 'images'" in reasons[1]
    assert reasons[2].startswith("messages[0].content[0].url: 'http://x.org/a.jpg' is a URL")
    assert "hf.jsonl:5 (id missing): image 1 of 1: no such file" in reasons[3]


def test_parquet_of_conversations_builds_with_row_numbers_in_rejects(tmp_path):
    """A parquet table with a `messages` column is chat data, as a .jsonl of the same records;
    images embedded as bytes (a datasets Image column) are refused with what to do."""
    files = image_folder(tmp_path)
    rows = [
        {"system": "Be brief.", "messages": SAME_SHAREGPT["messages"], "images": SAME_IMAGES},
        {"system": "Be brief.", "messages": SAME_SHAREGPT["messages"], "images": SAME_IMAGES[:1]},
    ]
    src = write_parquet(tmp_path / "chat.parquet", rows)
    out = tmp_path / "out"
    assert build(src, "--out", out, "--workers", 1, "--max-reject-rate", 0.5) == 0
    (sample,) = built_samples(out)
    assert (sample["0.jpg"], sample["1.png"]) == (files["coco/b.jpg"], files["web/c.png"])
    assert json.loads(sample["json"])["source"] == "chat.parquet:1"
    (rejected,) = build_rejects(out)
    assert (rejected["kind"], rejected["path"]) == ("image_count", "chat.parquet:2")

    trl = write_parquet(tmp_path / "trl.parquet", [SAME_TRL])
    assert build(trl, "--out", tmp_path / "out-trl", "--workers", 1) == 0
    (trl_sample,) = built_samples(tmp_path / "out-trl")
    assert json.loads(trl_sample["json"])["messages"] == json.loads(sample["json"])["messages"]

    embedded = [
        {
            "messages": SAME_SHAREGPT["messages"],
            "images": [{"bytes": files["coco/b.jpg"], "path": "b.jpg"}] * 2,
        }
    ]
    src = write_parquet(tmp_path / "embedded.parquet", embedded)
    out = tmp_path / "out-embedded"
    assert build(src, "--out", out, "--workers", 1) == 2  # every record rejected
    (rejected,) = build_rejects(out)
    assert rejected["path"] == "embedded.parquet:1"
    assert "'images'[0]: image bytes inside the record are not read" in rejected["reason"]


def test_which_jsonl_and_parquet_files_are_chat_data(tmp_path):
    """Conversations in any form are chat data; a prompt and completion as plain strings (TRL's
    standard form, or any table's text columns) stay a table, as before."""
    from mmtrain.data.ingest.sources import is_conversation_file

    plain = {"image": "a.jpg", "prompt": "Describe it.", "completion": "A red square."}
    cases = {
        "llava": (SAME_LLAVA, True),
        "sharegpt": (SAME_SHAREGPT, True),
        "hf": (SAME_HF, True),
        "trl": (SAME_TRL, True),
        "plain": (plain, False),
        "captions": ({"image": "a.jpg", "caption": "A red square."}, False),
    }
    for name, (record, chat_data) in cases.items():
        jsonl = tmp_path / f"{name}.jsonl"
        jsonl.write_text(json.dumps(record) + "\n")
        parquet = write_parquet(tmp_path / f"{name}.parquet", [record])
        assert is_conversation_file(jsonl) is chat_data, name
        assert is_conversation_file(parquet) is chat_data, name
