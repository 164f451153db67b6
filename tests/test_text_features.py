"""A frozen text encoder mmtrain has closes the MMDiT's loop: `data encode-latents
--text-encoder CLIP_DIR` caches each caption's text-tower outputs beside its latent (exactly what
the tower computes), an MMDiT of the encoder's widths trains on them with `mmtrain train`, and
`mmtrain generate RUN --prompt ...` encodes prompts with the encoder its data's manifest names.
Bad inputs exit 2 naming the flag."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image

import mmtrain
from micro import COLORS, micro_spec
from mmtrain.cli import main
from mmtrain.data.ingest.text_features import TextEncoderError, TextShape, load_text_encoder
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.tokenizer import ByteTokenizer
from mmtrain.spec import ModelSpec

diffusers = pytest.importorskip("diffusers")

# The tiny CLIP's text tower: 12 positions of width 32, a pooled (projected) embedding of 24.
SHAPE = TextShape(text_tokens=12, text_width=32, pooled_width=24)
NO_CAPTION, BLANK_CAPTION = 3, 5  # samples skipped for want of a caption


def clip_folder(folder: Path, embed_dim: int = SHAPE.pooled_width, **text) -> Path:
    spec = micro_spec(embed_dim=embed_dim, context_length=SHAPE.text_tokens)
    spec["towers"]["text"]["stem"].update(text)
    mmtrain.save_model(mmtrain.create_model(ModelSpec.from_dict(spec), seed=3), folder)
    return folder


def captioned_shards(folder: Path, n: int = 7) -> str:
    """Noisy coloured 20 x 24 PNGs with "a red square"-style captions; one sample has no .txt
    member and one a blank caption."""
    rng = np.random.default_rng(0)
    with ShardWriter(folder, max_samples=4) as writer:
        for i in range(n):
            pixels = np.zeros((20, 24, 3), np.uint8)
            pixels[..., i % 3] = 200
            pixels = (pixels + rng.integers(0, 40, pixels.shape)).astype(np.uint8)
            png = io.BytesIO()
            Image.fromarray(pixels).save(png, format="PNG")
            sample = {"__key__": f"s{i:03d}", "png": png.getvalue()}
            if i != NO_CAPTION:
                caption = "  " if i == BLANK_CAPTION else f"a {COLORS[i % 4]} square, number {i}"
                sample["txt"] = caption.encode()
            writer.write(sample)
    return str(folder)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The CLIP, the VAE, the captioned images and their latents with text (--flip)."""
    from test_convert_diffusers import VAE_CONFIG

    root = tmp_path_factory.mktemp("text-features")
    torch.manual_seed(0)
    diffusers.AutoencoderKL(**VAE_CONFIG).save_pretrained(root / "vae")
    clip = clip_folder(root / "clip")
    images = captioned_shards(root / "images")
    latents = root / "latents"
    argv = ["data", "encode-latents", images, "--vae", str(root / "vae"), "--size", "16",
            "--flip", "--batch-size", "8"]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main([*argv, "--out", str(latents), "--text-encoder", str(clip)])
    assert code == 0
    return root, argv, latents, printed.getvalue()


def read_array(sample: dict, member: str) -> np.ndarray:
    return np.load(io.BytesIO(sample[member]), allow_pickle=False)


def test_encode_latents_caches_each_captions_text_tower_outputs(made):
    root, _, latents, printed = made
    assert "wrote 10 latents [4, 8, 8]" in printed  # 5 captioned images, and their mirrors
    assert "0 samples without a readable image, 2 without a readable .txt caption" in printed
    assert "text_tokens 12, text_width 32, pooled_width 24" in printed
    manifest = json.loads((latents / "manifest.json").read_text())
    assert manifest["counts"] == {"samples": 10, "skipped": 0, "no_caption": 2}
    assert manifest["latent"]["text_encoder"] == {
        "path": str((root / "clip").resolve()), "tower": "text", "tokenizer": "byte",
        "text_tokens": 12, "text_width": 32, "pooled_width": 24}  # fmt: skip
    shards = ShardSet.open(latents)
    samples = {shards.key(i): shards.read(i) for i in range(len(shards))}
    kept = [i for i in range(7) if i not in (NO_CAPTION, BLANK_CAPTION)]
    assert sorted(samples) == sorted(f"s{i:03d}{s}" for i in kept for s in ("", "_flip"))
    # the text tower run directly on the same captions, in the one batch encode-latents ran
    captions = [samples[f"s{i:03d}"]["txt"].decode() for i in kept]
    model = mmtrain.load_model(root / "clip").eval()
    tower = model.towers["text"]
    with torch.no_grad():
        ids = ByteTokenizer()(captions, SHAPE.text_tokens)
        tokens = tower.forward_tokens(ids)
        pooled = tower.pool_and_project(tokens, ids)
        embedded = model.encode({"text": ids})["text"]  # what zero-shot compares
    for row, i in enumerate(kept):
        for suffix in ("", "_flip"):  # a mirror image has its original's text
            sample = samples[f"s{i:03d}{suffix}"]
            hidden, vector = (read_array(sample, m) for m in ("text_hidden.npy", "text_pooled.npy"))
            assert hidden.dtype == vector.dtype == np.float32
            assert hidden.shape == (12, 32) and vector.shape == (24,)
            assert np.array_equal(hidden, tokens[row].numpy())
            assert np.array_equal(vector, pooled[row].numpy())
    # the pooled vector is the zero-shot embedding before its normalisation
    stored = torch.stack([torch.from_numpy(read_array(samples[f"s{i:03d}"], "text_pooled.npy"))
                          for i in kept])  # fmt: skip
    assert torch.allclose(F.normalize(stored, dim=-1), embedded, rtol=0, atol=1e-6)


def train_mmdit(root: Path, latents: Path) -> Path:
    from test_mmdit import tiny

    spec = tiny(**{k: getattr(SHAPE, k) for k in ("text_tokens", "text_width", "pooled_width")})
    spec.save(root / "mmdit.yaml")
    config = {"model": str(root / "mmdit.yaml"), "data": {"train": str(latents)},
              "train": {"steps": 2, "batch_size": 4, "lr": 1e-3},
              "metrics": {"tensorboard": False}, "out": str(root / "run")}  # fmt: skip
    (root / "train.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(root / "train.yaml")]) == 0
    return root / "run"


def test_an_mmdit_trains_on_them_and_generates_from_prompts(made, capsys):
    root, argv, latents, _ = made
    run = train_mmdit(root, latents)
    out = root / "samples"
    prompts = ["--prompt", "a red square", "--prompt", "a blue square"]
    sampling = ["--num", "1", "--steps", "2", "--vae", str(root / "vae")]
    # the text encoder comes from the manifest of the run's training data
    assert main(["generate", str(run), *prompts, *sampling, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == [
        "grid.png",
        "prompt0_0.png",
        "prompt1_0.png",
    ]
    assert np.asarray(Image.open(out / "grid.png")).shape == (2 * 16, 16, 3)  # a row per prompt
    first, second = (np.asarray(Image.open(out / f"prompt{i}_0.png")) for i in (0, 1))
    assert first.shape == (16, 16, 3) and not np.array_equal(first, second)
    # named on the command line: the same encoder, the same images
    again = root / "again"
    named = ["--text-encoder", str(root / "clip"), "--out", str(again)]
    assert main(["generate", str(run), *prompts, *sampling, *named]) == 0
    for name in ("prompt0_0.png", "prompt1_0.png"):
        assert np.array_equal(
            np.asarray(Image.open(again / name)), np.asarray(Image.open(out / name))
        )
    capsys.readouterr()

    # bad inputs: exit 2, the message naming the flag
    bare = root / "bare"  # the run's model without its config: no data, so no known encoder
    bare.mkdir()
    for name in ("model.safetensors", "spec.yaml"):
        shutil.copy(run / name, bare / name)
    clip_folder(root / "narrow", embed_dim=16)
    sample = ["generate", str(run), "--prompt", "a red square", *sampling, "--out", str(out)]
    refused = {
        ("--text-encoder", "no text tower"): [*sample, "--text-encoder", str(run)],
        ("--text-encoder", "pooled_width 16", "pooled_width 24"): [
            *sample,
            "--text-encoder",
            str(root / "narrow"),
        ],  # fmt: skip
        ("--prompt", "--text-encoder MODEL_DIR", "--text-from SHARDS"): [
            "generate",
            str(bare),
            "--prompt",
            "a red square",
            *sampling,
            "--out",
            str(out),
        ],  # fmt: skip
        ("--prompt and --text-from",): [*sample, "--text-from", str(latents)],
        ("--text-encoder: ", "spec.yaml is missing"): [
            *argv,
            "--text-encoder",
            str(root / "vae"),
            "--out",
            str(root / "x"),
        ],  # fmt: skip
        ("--text-encoder: ", "has no text tower"): [
            *argv,
            "--text-encoder",
            str(run),
            "--out",
            str(root / "y"),
        ],  # fmt: skip
    }
    for words, refused_argv in refused.items():
        assert main(refused_argv) == 2, words
        err = capsys.readouterr().err
        assert all(w in err for w in words), (words, err)
    assert not (root / "x").exists() and not (root / "y").exists()


def test_the_tokenizer_is_the_one_the_model_was_trained_with(tmp_path):
    folder = clip_folder(tmp_path / "clip", vocab_size=300)  # not mmtrain's 258 bytes
    with pytest.raises(TextEncoderError, match="no config.yaml naming data.tokenizer"):
        load_text_encoder(folder)
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": "byte"}}))
    encoder = load_text_encoder(folder, batch_size=2)  # a run folder says how it tokenized
    assert encoder.tokenizer_name == "byte" and encoder.shape == SHAPE
    hidden, pooled = encoder(["a", "bb", "ccc"])  # two batches, in order
    assert hidden.shape == (3, 12, 32) and pooled.shape == (3, 24)
    again = encoder(["a", "bb", "ccc"])
    assert torch.equal(again[0], hidden) and torch.equal(again[1], pooled)  # deterministic
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": "nowhere.json"}}))
    with pytest.raises(TextEncoderError, match="its tokenizer 'nowhere.json' is neither"):
        load_text_encoder(folder)
