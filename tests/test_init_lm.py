"""`init` for language models (train/init_lm.py): a LanguageModel starts from a HF Llama / Qwen2
/ LLaVA folder exactly, and a new VLM takes its image tower from a CLIP baseline (an OpenCLIP
file or a HF CLIP folder) and its decoder from a HF LLM, with a fresh projector between them.
A decoder with a larger vocabulary than its source (LLaVA-1.5's 32064 over Vicuna's 32000)
takes the source's rows and starts the new ones at their mean.

Bitwise checks: `init` copies tensors (dtype kept), so every loaded tensor must equal the
source's exactly and every other one must equal a model built with the same seed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models

from micro import micro_spec
from mmtrain.config import config_from_dict
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.tokenizer import train_bpe
from mmtrain.models import create_model
from mmtrain.models.formats.hf import read_hf_model
from mmtrain.models.formats.openclip import mmtrain_to_openclip
from mmtrain.spec import ModelSpec, ProjectorSpec
from mmtrain.train.init import InitError, InitMismatch
from mmtrain.train.init_start import load_init
from mmtrain.train.loop import train
from test_hf_llava import hf_lm, llava

CLIP = ModelSpec.from_dict(micro_spec())  # OpenCLIP-shaped towers: 16 px, width 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """HF LLaVA and Llama folders, an OpenCLIP checkpoint and a HF CLIPModel folder."""
    root = tmp_path_factory.mktemp("sources")
    llava("clip-qwen2-full-tied", seed=4).save_pretrained(root / "llava", max_shard_size="20KB")
    hf_lm("llama-sharded", seed=5).save_pretrained(root / "llama")
    clip = create_model(CLIP, seed=7)
    torch.save({"state_dict": mmtrain_to_openclip(clip.state_dict(), CLIP)}, root / "clip.pt")
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                     "num_hidden_layers": 1, "num_attention_heads": 2,
                     "max_position_embeddings": 8, "eos_token_id": 63},
        vision_config={"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
        projection_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.CLIPModel(config).save_pretrained(root / "hf_clip")
    return {
        "llava": root / "llava",
        "llama": root / "llama",
        "openclip": root / "clip.pt",
        "clip_state": clip.state_dict(),
        "hf_clip": root / "hf_clip",
    }


def assert_equal(state: dict, source: dict, prefix: str) -> None:
    keys = [k for k in state if k.startswith(prefix)]
    assert keys, prefix
    for key in keys:
        assert torch.equal(state[key], source[key]), key


@pytest.mark.parametrize("name", ["llava", "llama"])
def test_a_language_model_starts_from_a_hf_folder_exactly(folders, name):
    spec, state = read_hf_model(folders[name])
    model = create_model(spec, seed=1)
    report = load_init(model, str(folders[name]))
    assert report.loaded == len(state) and not report.random and not report.ignored
    assert model.state_dict().keys() == state.keys()
    assert_equal(model.state_dict(), state, "")
    assert len(report.sha256) == len(list(folders[name].glob("*.safetensors")))


def vlm_spec(decoder, image_token_id: int = 63) -> ModelSpec:
    """A new VLM: the micro CLIP image tower (hidden states, no projection) and `decoder`."""
    image = {**micro_spec()["towers"]["image"], "output_proj": False}
    return ModelSpec.from_dict(
        {
            "name": "new-vlm",
            "embed_dim": 32,
            "towers": {"image": image},
            "objective": "next_token",
            "decoder": decoder.to_dict(),
            "projector": {"image_token_id": image_token_id, "kind": "mlp", "feature_layer": -1},
        }
    )


@pytest.mark.parametrize("image_source", ["openclip", "hf_clip"])
def test_per_tower_init_builds_a_vlm_with_a_fresh_projector(folders, image_source, caplog):
    llama_spec, llama_state = read_hf_model(folders["llama"])
    spec = vlm_spec(llama_spec.decoder)
    assert spec.projector == ProjectorSpec(image_token_id=63, kind="mlp", feature_layer=-1)
    model, fresh = create_model(spec, seed=2), create_model(spec, seed=2).state_dict()
    init = {"image": str(folders[image_source]), "text": str(folders["llama"])}
    with caplog.at_level(logging.INFO, logger="mmtrain.train.init"):
        report = load_init(model, init)
    state = model.state_dict()
    assert_equal(state, llama_state, "towers.text.")
    if image_source == "openclip":
        assert_equal(state, folders["clip_state"], "towers.image.")
    else:
        _, hf_state = read_hf_model(folders["hf_clip"])
        assert_equal(state, hf_state, "towers.image.")
    # the projector joins towers that never met: it keeps its random init
    assert_equal(state, fresh, "projector.")
    assert sorted(report.random) == sorted(k for k in state if k.startswith("projector."))
    assert "projector.* keeps its random init" in caplog.text
    assert "towers.image.proj.* of" in caplog.text  # the encoder's projection is not used


def test_per_tower_init_from_one_llava_folder(folders):
    # Both towers of a LLaVA, under another projector: the towers load, the projector does not.
    spec, state = read_hf_model(folders["llava"])
    model, fresh = create_model(spec, seed=3), create_model(spec, seed=3).state_dict()
    load_init(model, {"image": str(folders["llava"]), "text": str(folders["llava"])})
    assert_equal(model.state_dict(), state, "towers.")
    assert_equal(model.state_dict(), fresh, "projector.")


def test_sources_without_the_tower_are_refused_by_name(folders):
    llama_spec, _ = read_hf_model(folders["llama"])
    model = create_model(vlm_spec(llama_spec.decoder), seed=2)
    with pytest.raises(InitMismatch, match=r"init\.text: .*has no language model for tower 'text'"):
        load_init(model, {"text": str(folders["openclip"])})
    with pytest.raises(InitError, match=r"init\.audio: the model has no tower 'audio'"):
        load_init(model, {"audio": str(folders["llama"])})
    # The whole VLM from an LLM alone: the image tower and projector are missing.
    with pytest.raises(InitMismatch, match="has no image tower for tower 'image'"):
        load_init(model, str(folders["llama"]))
    report = load_init(model, str(folders["llama"]), strict=False)
    assert report.random and all(not k.startswith("towers.text.") for k in report.random)


def test_a_decoder_of_another_shape_is_refused(folders):
    llama_spec, _ = read_hf_model(folders["llama"])
    deeper = ModelSpec.from_dict(
        {**llama_spec.to_dict(), "decoder": {**llama_spec.decoder.to_dict(), "layers": 3}}
    )
    with pytest.raises(InitMismatch, match=r"missing in the source: towers\.text\.blocks\.2\."):
        load_init(create_model(deeper, seed=1), str(folders["llama"]))


# ----------------------------------------------------------------------------- a larger vocabulary
OLD_VOCAB, NEW_VOCAB = 96, 128  # as Vicuna's 32000 -> LLaVA-1.5's 32064
VOCAB_KEYS = ("towers.text.embed.weight", "towers.text.lm_head.weight")  # the LM head is untied


@pytest.fixture(scope="module")
def llama96(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama96")
    hf_lm("llama-sharded", seed=9, vocab_size=OLD_VOCAB).save_pretrained(folder)
    return folder


def with_vocab(spec: ModelSpec, vocab_size: int) -> ModelSpec:
    return dataclasses.replace(
        spec, decoder=dataclasses.replace(spec.decoder, vocab_size=vocab_size)
    )


def grown_spec(llama_spec: ModelSpec, kind: str, vocab_size: int = NEW_VOCAB) -> ModelSpec:
    """The LM alone with another vocabulary, or a new VLM whose <image> is the first new id
    (the last id where the vocabulary is smaller)."""
    if kind == "lm":
        return with_vocab(llama_spec, vocab_size)
    image_id = min(OLD_VOCAB, vocab_size - 1)
    return vlm_spec(with_vocab(llama_spec, vocab_size).decoder, image_token_id=image_id)


def init_of(kind: str, folders: dict, llama: Path) -> str | dict:
    """The whole LM from its folder; the VLM tower by tower (stage 1 of LLaVA-1.5)."""
    return str(llama) if kind == "lm" else {"image": str(folders["openclip"]), "text": str(llama)}


def assert_grown(state: dict, source: dict) -> None:
    """The source's decoder bit for bit, each vocabulary tensor's new rows at its rows' mean."""
    for key, value in source.items():
        if key not in VOCAB_KEYS:
            assert torch.equal(state[key], value), key
            continue
        assert state[key].shape == (NEW_VOCAB, value.shape[1]), key
        assert torch.equal(state[key][:OLD_VOCAB], value), key
        mean = value.double().mean(dim=0).to(state[key].dtype)
        assert torch.equal(state[key][OLD_VOCAB:], mean.expand(NEW_VOCAB - OLD_VOCAB, -1)), key


@pytest.mark.parametrize("kind", ["lm", "vlm"])
def test_init_grows_a_larger_vocabulary(folders, llama96, kind, caplog):
    llama_spec, source = read_hf_model(llama96)
    model = create_model(grown_spec(llama_spec, kind), seed=2)
    with caplog.at_level(logging.INFO, logger="mmtrain.train.init"):
        report = load_init(model, init_of(kind, folders, llama96))
    state = model.state_dict()
    assert_grown(state, source)
    assert not any(k.startswith("towers.text.") for k in report.random)
    for key in VOCAB_KEYS:
        assert f"{key}: vocabulary {OLD_VOCAB} -> {NEW_VOCAB} rows" in caplog.text
    assert "decoder.vocab_size" not in caplog.text  # one line says what grew, not two


def test_new_rows_are_transformers_mean_resizing_less_its_noise(llama96):
    """transformers' `resize_token_embeddings` (mean_resizing, the default) draws each new row
    around the mean with covariance 1e-9 * the rows' covariance; ours is the mean itself.

    Bound: its noise, per element at most 7 of its standard deviations sqrt(1e-9 * var_j), plus
    its float32 mean's rounding (n * 2^-24 * max|x| for a sum of n terms) and ours (2^-24 *
    max|x|). The bound must also be far below the rows' spread, or the test could not fail."""
    spec, source = read_hf_model(llama96)
    ours = create_model(grown_spec(spec, "lm"), seed=2)
    load_init(ours, str(llama96))
    theirs = transformers.LlamaForCausalLM.from_pretrained(llama96)
    torch.manual_seed(0)  # its draw uses the global generator
    theirs.resize_token_embeddings(NEW_VOCAB)
    hf = {
        "towers.text.embed.weight": theirs.get_input_embeddings().weight,
        "towers.text.lm_head.weight": theirs.get_output_embeddings().weight,
    }
    for key in VOCAB_KEYS:
        rows = source[key].double()
        noise = 7 * (1e-9 * rows.var(dim=0, unbiased=False).max()).sqrt()
        rounding = (OLD_VOCAB + 1) * 2.0**-24 * rows.abs().max()
        bound = (noise + rounding).item()
        assert bound < 1e-3 * rows.std(dim=0).min().item(), key
        new = slice(OLD_VOCAB, NEW_VOCAB)
        diff = (ours.state_dict()[key][new].double() - hf[key].detach()[new].double()).abs()
        assert diff.max().item() <= bound, key
        assert torch.equal(hf[key].detach()[:OLD_VOCAB], source[key]), key


@pytest.mark.parametrize("kind, field", [("lm", "init"), ("vlm", "init.text")])
def test_a_smaller_vocabulary_is_refused(folders, llama96, kind, field):
    llama_spec, _ = read_hf_model(llama96)
    model = create_model(grown_spec(llama_spec, kind, vocab_size=64), seed=2)
    words = rf"{field}: the model's decoder.vocab_size 64 is smaller than the 96 tokens of "
    for strict in (True, False):  # cutting tokens is never "what fits"
        with pytest.raises(InitMismatch, match=words):
            load_init(model, init_of(kind, folders, llama96), strict=strict)


# ----------------------------------------------------------------------------- a training run
def char_tokenizer(texts: list[str], path: Path) -> int:
    """A tokenizer.json with one id per character of `texts` (and the newline `plain` ends an
    answer with); returns its vocabulary size, small enough for a 96-token LM."""
    chars = sorted(set("".join(texts)) | {"\n"})
    Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[])).save(str(path))
    return len(chars)


def conversation_shards(folder: Path, chars: bool = False) -> int:
    """Eight one-turn conversations, every other one about a 16 px JPEG, and beside them a
    byte-level BPE of their words (or one id per character); returns its vocabulary size."""
    words = [f"Say {i}. colour {i}" for i in range(8)]
    folder.mkdir(parents=True, exist_ok=True)
    if chars:
        vocab = char_tokenizer(words, folder / "tokenizer.json")
    else:
        vocab = train_bpe(words, vocab_size=270, out_path=folder / "tokenizer.json").vocab_size
    with ShardWriter(folder, max_samples=4) as writer:
        for i in range(8):
            buffer = io.BytesIO()
            Image.new("RGB", (16, 16), (40 * i, 200 - 20 * i, 90)).save(buffer, format="JPEG")
            with_image = i % 2 == 0
            record = {
                "id": str(i),
                "messages": [
                    {"role": "user", "content": "<image>" if with_image else f"Say {i}."},
                    {"role": "assistant", "content": f"colour {i}"},
                ],
                "images": ["0.jpg"] if with_image else [],
            }
            sample = {"__key__": f"{i:09d}", "json": json.dumps(record)}
            if with_image:
                sample["0.jpg"] = buffer.getvalue()
            writer.write(sample)
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return vocab


def run_at_lr_zero(tmp_path: Path, spec: ModelSpec, init: str | dict) -> dict:
    """Two steps at lr 0 (AdamW's decay is scaled by it too: no weight can move) of `spec`
    started from `init` on tmp_path/shards; returns the run's model.safetensors."""
    spec.save(tmp_path / "spec.json")
    shards = tmp_path / "shards"
    config = config_from_dict(
        {
            "model": str(tmp_path / "spec.json"),
            "init": init,
            "data": {
                "train": str(shards),
                "tokenizer": str(shards / "tokenizer.json"),
                "chat_template": "plain",
                "sequence_length": 48,
            },
            "train": {"steps": 2, "batch_size": 2, "lr": 0.0, "warmup_steps": 0},
            "metrics": {"tensorboard": False},
            "out": str(tmp_path / "run"),
        }
    )
    result = train(config)
    assert result.step == 2 and all(row["target_tokens"] > 0 for row in result.history)
    return safetensors.torch.load_file(str(result.out / "model.safetensors"))


@pytest.mark.parametrize("kind", ["llava", "llama"])
def test_a_run_at_learning_rate_zero_ends_with_the_hf_weights(tmp_path, kind):
    """`init: HF_DIR` in a run config: the run's model.safetensors is the HF folder's weights,
    bit for bit."""
    image_id = conversation_shards(tmp_path / "shards")
    text = dict(vocab_size=image_id + 1, bos_token_id=None, eos_token_id=None)
    if kind == "llava":
        hf = llava("clip-llama-default", seed=8, image_id=image_id, **text)
    else:
        hf = hf_lm("llama-sharded", seed=8, **text)
    hf.save_pretrained(tmp_path / "hf")
    spec, state = read_hf_model(tmp_path / "hf")
    final = run_at_lr_zero(tmp_path, spec, str(tmp_path / "hf"))
    assert final.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(final[key], value), key


def test_a_run_at_learning_rate_zero_keeps_the_grown_vocabulary(tmp_path, folders, llama96):
    """LLaVA-1.5 stage 1 in small: per-tower init of a VLM whose <image> id is the first row
    the LM never had; the text's ids are all the LM's own."""
    assert conversation_shards(tmp_path / "shards", chars=True) <= OLD_VOCAB
    llama_spec, source = read_hf_model(llama96)
    final = run_at_lr_zero(
        tmp_path, grown_spec(llama_spec, "vlm"), init_of("vlm", folders, llama96)
    )
    assert_grown(final, source)
    assert_equal(final, folders["clip_state"], "towers.image.")
