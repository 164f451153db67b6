"""Any transformers VLM folder trains as it is (issue 42): `init: FOLDER` alone.

The four families are tiny random folders that transformers builds from configs, each with
its processor (tests/hub_folders.py): Qwen3-VL, InternVL (-hf), Gemma 3, Idefics3 (SmolVLM).
For each:
- a real `mmtrain train` from `init:` alone, at lr 0, exports the source weights bitwise as a
  folder transformers loads with the processor beside them;
- mmtrain's loss on a padded batch of two conversations made by the run's data path equals
  transformers' own loss of the class with the same labels, in float64; the batch equals
  the processor's own batched call (ids, pixels, masks).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from mmtrain.cli import main
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.processor_batches import (
    ProcessorDecoder,
    collate_processed,
    encode,
)

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from hub_folders import FAMILIES, image, load_processor, make_folder  # noqa: E402

ANSWERS = ["a red cat", "a picture of a mat on a cat"]


def conversation_shards(folder: Path, n: int = 8) -> Path:
    """`n` one-image conversations with answers of two lengths, as `mmtrain data build`
    writes them."""
    folder.mkdir(parents=True)
    with ShardWriter(folder, max_samples=4) as writer:
        for i in range(n):
            record = {"id": str(i), "images": ["0.png"],
                      "messages": [{"role": "user", "content": "<image>describe the image"},
                                   {"role": "assistant", "content": ANSWERS[i % 2]}]}  # fmt: skip
            buffer = io.BytesIO()
            image(i).save(buffer, format="PNG")
            writer.write({"__key__": f"{i:09d}", "json": json.dumps(record),
                          "0.png": buffer.getvalue()})  # fmt: skip
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return folder


def run_config(root: Path, init: str, **train) -> Path:
    config = {
        "init": init,
        "data": {"train": str(conversation_shards(root / "shards")), "sequence_length": 128},
        "train": {
            "steps": 2,
            "batch_size": 2,
            "lr": 1e-3,
            "warmup_steps": 0,
            "precision": "fp32",
            **train,
        },  # fmt: skip
        "out": str(root / "run"),
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    return root / "run.yaml"


@pytest.mark.parametrize("family", FAMILIES)
def test_init_folder_alone_trains_and_exports_the_class(tmp_path, family):
    folder = make_folder(family, tmp_path)
    assert main(["train", str(run_config(tmp_path, str(folder), lr=0.0))]) == 0
    run = tmp_path / "run"
    source, exported = load_file(folder / "model.safetensors"), load_file(run / "model.safetensors")
    assert exported.keys() == source.keys()
    for name, tensor in source.items():  # lr 0: the class's weights, bitwise, by their names
        assert torch.equal(exported[name], tensor), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses and all(np.isfinite(losses))
    model = transformers.AutoModelForImageTextToText.from_pretrained(run)
    assert (
        type(model).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    )
    processor = load_processor(run)
    assert processor.tokenizer.get_vocab() == load_processor(folder).tokenizer.get_vocab()
    settings = transformers.GenerationConfig.from_pretrained  # the source's, not the config's
    assert settings(run).to_diff_dict() == settings(folder).to_diff_dict()


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_equals_transformers_own_loss_in_float64(tmp_path, family):
    from mmtrain.models.hub.model import hub_spec_of
    from mmtrain.models.hub.source import model_class

    folder = make_folder(family, tmp_path)
    shards = conversation_shards(tmp_path / "shards", n=2)
    decoder = ProcessorDecoder(str(folder), 128)
    samples = [
        decoder(s, np.random.default_rng(0)) for s in shard_samples(shards)
    ]  # two lengths: the batch is padded
    assert samples[0]["input_ids"].shape[1] != samples[1]["input_ids"].shape[1]
    batch = collate_processed(samples, pad_id=_pad_id(folder))
    reference = _processor_batch(folder, family)  # the processor's own batched call
    for name, value in reference.items():
        assert torch.equal(batch[name], value), name

    hf = model_class(folder).from_pretrained(folder, dtype=torch.float64).train()
    from mmtrain.models.hub.model import HubModel

    ours = HubModel(hub_spec_of(folder, str(folder)), hf)
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    nll = ours(inputs)["nll_sum"]
    targets = (batch["labels"][:, 1:] != -100).sum()
    out = hf(**inputs, use_cache=False)
    # The class's logits (float64) scored against the same labels, shifted as its loss does:
    # float64 sums of a few dozen terms of size ~ln(vocab), equal to ~1e-15 relative.
    logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
    theirs = F.cross_entropy(logits, batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    assert logits.dtype == torch.float64
    assert torch.allclose(nll / targets, theirs, rtol=1e-12, atol=0), (nll / targets, theirs)
    # transformers' own loss casts the logits to float32 first: equal to float32's rounding.
    assert torch.allclose((nll / targets).float(), out.loss, rtol=1e-5), (nll, out.loss)


def shard_samples(shards: Path) -> list[dict]:
    import tarfile

    samples: dict[str, dict] = {}
    for shard in sorted(shards.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                samples.setdefault(key, {"__key__": key})[ext] = tar.extractfile(member).read()
    return [samples[k] for k in sorted(samples)]


def _pad_id(folder: Path) -> int:
    tokenizer = load_processor(folder).tokenizer
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _processor_batch(folder: Path, family: str) -> dict[str, torch.Tensor]:
    """The two conversations through the processor's own batched call, right-padded (the
    labels are mmtrain's: not compared here)."""
    processor = load_processor(folder)
    processor.tokenizer.padding_side = "right"
    texts = []
    for answer in ANSWERS:
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]  # fmt: skip
        texts.append(processor.apply_chat_template(messages, tokenize=False))
    bos = processor.tokenizer.bos_token
    special = {"add_special_tokens": False} if bos and texts[0].startswith(bos) else {}
    out = processor(
        text=texts,
        images=[[image(0)], [image(1)]],
        padding=True,
        padding_side="right",
        return_tensors="pt",
        **special,
    )
    return dict(out)


def test_encode_labels_only_the_answers(tmp_path):
    folder = make_folder("qwen3_vl", tmp_path)
    processor = load_processor(folder)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a red cat"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a mat"}]},
    ]
    out = encode(processor, messages, [image(0), image(1)])
    ids, labels = out["input_ids"][0], out["labels"][0]
    scored = processor.tokenizer.decode(ids[labels != -100])
    # Both answers with their end-of-turn marker, after two expanded images; nothing else.
    assert scored == "a red cat<|im_end|>a mat<|im_end|>"
    assert torch.equal(labels[labels != -100], ids[labels != -100])


# ----------------------------------------------------------------------------- bad input
def _refusal(tmp_path: Path, capsys, init: str, **overrides) -> str:
    config = yaml.safe_load(run_config(tmp_path, init).read_text())
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        config.setdefault(section, {})[name] = value
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    return capsys.readouterr().err


def test_what_a_hub_model_cannot_train_exits_2_saying_why(tmp_path, capsys):
    folder = make_folder("qwen3_vl", tmp_path)
    err = _refusal(tmp_path / "a", capsys, str(folder), **{"train.sequence_parallel": 2})
    assert "train.sequence_parallel" in err and "native-only" in err
    err = _refusal(tmp_path / "b", capsys, str(folder), **{"train.towers": {"audio": {"lr": 1.0}}})
    assert "train.towers.audio" in err and "vision, text" in err

    moe = tmp_path / "moe"
    moe.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_experts"] = 8
    (moe / "config.json").write_text(json.dumps(config))
    err = _refusal(tmp_path / "c", capsys, str(moe))
    assert "mixture-of-experts" in err and "not yet" in err

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    err = _refusal(tmp_path / "d", capsys, str(bare))
    assert "processor" in err and "save_pretrained" in err

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    err = _refusal(tmp_path / "e", capsys, str(unknown))
    assert "no_such_model" in err


def test_a_hub_name_resolves_through_the_cache_offline(tmp_path, capsys, monkeypatch):
    from hub_folders import hub_cache
    from mmtrain.model_sources import resolve_folder

    folder = make_folder("gemma3", tmp_path)
    cache = tmp_path / "hf-cache"
    hub_cache(folder, "tiny-org/gemma3-tiny", cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = resolve_folder("tiny-org/gemma3-tiny")
    assert (snapshot / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    monkeypatch.chdir(tmp_path)  # the name is no path here
    assert main(["train", str(run_config(tmp_path / "run", "tiny-org/gemma3-tiny", lr=0.0))]) == 0
    exported = load_file(tmp_path / "run" / "run" / "model.safetensors")
    for name, tensor in load_file(folder / "model.safetensors").items():
        assert torch.equal(exported[name], tensor), name
    err = _refusal(tmp_path / "missing", capsys, "tiny-org/not-there")
    assert str(cache) in err and "HF_HUB_OFFLINE" in err


def test_the_docs_example_config_trains(tmp_path):
    """docs/VLM.md's hub-model config, on a tiny folder: the keys it shows train as written."""
    text = (Path(__file__).parents[1] / "docs" / "VLM.md").read_text(encoding="utf-8")
    section = text.split("## Any Hugging Face VLM", 1)[1]
    config = yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])
    folder = make_folder("qwen3_vl", tmp_path)
    config["init"] = str(folder)
    config["data"]["train"] = str(conversation_shards(tmp_path / "shards"))
    config["data"]["sequence_length"] = 128
    config["train"].update(steps=2, batch_size=2, micro_batch=2)
    config["out"] = str(tmp_path / "run")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    assert all(".language_model." in m for m in adapter["target_modules"])


def test_convert_to_hf_of_a_hub_run_is_a_complete_folder(tmp_path, capsys):
    folder = make_folder("idefics3", tmp_path)
    assert main(["train", str(run_config(tmp_path, str(folder)))]) == 0
    out = tmp_path / "export"
    assert main(["convert", "--to", "hf", str(tmp_path / "run"), "--out", str(out)]) == 0
    model = transformers.AutoModelForImageTextToText.from_pretrained(out)
    trained = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "run")
    for (name, got), (_, want) in zip(
        model.state_dict().items(), trained.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name
    assert load_processor(out).tokenizer.get_vocab() == load_processor(folder).tokenizer.get_vocab()
    assert not (out / "spec.yaml").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_give_each_sample_its_unpacked_loss(tmp_path, family):
    """Two conversations in one packed row (attention inside each, positions restarting) score
    each answer as the padded batch does: the NLL sums agree to float64 rounding."""
    from mmtrain.data.stream.processor_batches import collate_packed
    from mmtrain.models.hub.model import HubModel, hub_spec_of
    from mmtrain.models.hub.source import model_class

    folder = make_folder(family, tmp_path)
    shards = conversation_shards(tmp_path / "shards", n=3)
    decoder = ProcessorDecoder(str(folder), 128)
    samples = [decoder(s, np.random.default_rng(0)) for s in shard_samples(shards)]
    lengths = [s["input_ids"].shape[1] for s in samples]
    # Rows of the two first samples together, the third alone (first-fit): packing and padding.
    packed = collate_packed(samples, pad_id=_pad_id(folder), row_length=lengths[0] + lengths[1])
    assert packed["input_ids"].shape[0] == 2 and "attention_mask" not in packed
    padded = collate_processed(samples, pad_id=_pad_id(folder))
    hf = model_class(folder).from_pretrained(folder, dtype=torch.float64).train()
    model = HubModel(hub_spec_of(folder, str(folder)), hf)

    def nll(batch):
        return model({k: v.double() if v.is_floating_point() else v for k, v in batch.items()})[
            "nll_sum"
        ]

    want, got = nll(padded), nll(packed)
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (got, want)
    assert int((packed["labels"] != -100).sum()) == int((padded["labels"] != -100).sum())


def test_data_vision_sets_the_processors_pixel_budget(tmp_path):
    """`data.vision.image_max_tokens` caps a Qwen-VL processor's pixels: the 64 x 32 image's
    8 tokens become at most 4; a tiling processor (InternVL's) refuses the budget by name."""
    from mmtrain.config import VisionDataConfig
    from mmtrain.data.stream.hf_processor import load_processor as product_processor
    from mmtrain.data.stream.processor_batches import pixel_budget
    from mmtrain.structured import FieldError

    folder = make_folder("qwen3_vl", tmp_path)
    shards = conversation_shards(tmp_path / "shards", n=1)
    sample = shard_samples(shards)[0]
    processor = product_processor(folder)
    image_id = processor.image_token_id
    wide = ProcessorDecoder(str(folder), 128)(sample, np.random.default_rng(0))
    budget = pixel_budget(processor.image_processor, VisionDataConfig(image_max_tokens=4))
    small = ProcessorDecoder(str(folder), 128, budget)(sample, np.random.default_rng(0))
    assert int((wide["input_ids"] == image_id).sum()) == 8
    assert 0 < int((small["input_ids"] == image_id).sum()) <= 4
    tiles = product_processor(make_folder("internvl", tmp_path)).image_processor
    with pytest.raises(FieldError, match="data.vision"):
        pixel_budget(tiles, VisionDataConfig(image_max_tokens=4))


def test_fp8_converts_the_linears_of_a_hub_models_blocks_only(tmp_path):
    """fp8 training (torchao) swaps the blocks' linears of both towers; the head, the
    embeddings, the patch embedding and the merger stay in bf16 (module selection runs on the
    CPU; the fp8 matmuls need a GPU: bench/gpu.sh)."""
    pytest.importorskip("torchao")
    from mmtrain.models.hub.model import HubModel, hub_spec_of
    from mmtrain.models.hub.source import model_class
    from mmtrain.train.precision import fp8_targets

    folder = make_folder("qwen3_vl", tmp_path)
    hf = model_class(folder).from_pretrained(folder)
    model = HubModel(hub_spec_of(folder, str(folder)), hf)
    names = set(fp8_targets(model))
    assert any(".language_model.layers.0.self_attn.q_proj" in n for n in names)
    assert any(".language_model.layers.1.mlp.down_proj" in n for n in names)
    assert any(".visual.blocks.0.mlp." in n for n in names)
    assert not any("lm_head" in n or "merger" in n or "patch_embed" in n for n in names)
