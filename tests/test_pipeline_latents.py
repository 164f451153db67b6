"""`data encode-latents --pipeline DIR` encodes with the diffusers pipeline's own parts: images
with its `vae/`, captions with its own `encode_prompt` (SD3: CLIP-L + CLIP-G + T5; FLUX.1:
CLIP-L + T5), stored as the members the native MMDiT reads and equal to what the pipeline
computes; the manifest records each component's identity; the MMDiT started from the
pipeline's transformer trains on them, and a spec of another text length is refused at start.
The pipelines are tiny ones diffusers builds from configs, with tokenizers made here (offline:
no sentencepiece, no download)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mmtrain.cli import main
from mmtrain.data.storage.shards import ShardSet
from test_text_features import captioned_shards, read_array

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CLIP_TOKENS, T5_TOKENS = 8, 6  # the tiny CLIP tokenizers' length; --max-sequence-length
SIZE, BATCH = 16, 3
SUPPORTED = ("StableDiffusion3Pipeline", "FluxPipeline", "WanPipeline")
VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
           block_out_channels=(32, 64), norm_num_groups=8, sample_size=32,
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
           shift_factor=0.0609, scaling_factor=1.5305)  # fmt: skip


def clip_tokenizer():
    """A CLIP BPE tokenizer of single letters (no merges): one token a letter of a word."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in LETTERS:
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_TOKENS)


def t5_tokenizer():
    """A T5 Unigram tokenizer of letters, word-initial ones first."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + c, -1.0) for c in LETTERS] + [(c, -2.0) for c in LETTERS]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0)


def clip_encoder(width: int, projection: bool = True):
    config = transformers.CLIPTextConfig(
        vocab_size=2 + 2 * len(LETTERS), hidden_size=width, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
        projection_dim=width, bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
    kind = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
    return kind(config)


def t5_encoder(width: int):
    config = transformers.T5Config(vocab_size=3 + 2 * len(LETTERS), d_model=width, d_ff=32,
                                   d_kv=8, num_layers=2, num_heads=2)  # fmt: skip
    return transformers.T5EncoderModel(config)


def sd3_pipeline(folder: Path) -> Path:
    """SD3's layout at toy widths: CLIP-L 8 + CLIP-G 12 wide (pooled 20), T5 24 wide."""
    torch.manual_seed(0)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32,
        pooled_projection_dim=20, out_channels=4, pos_embed_max_size=6)  # fmt: skip
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=diffusers.AutoencoderKL(**VAE), text_encoder=clip_encoder(8),
        tokenizer=clip_tokenizer(), text_encoder_2=clip_encoder(12), tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5_encoder(24), tokenizer_3=t5_tokenizer())  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


def flux_pipeline(folder: Path) -> Path:
    """FLUX.1's layout at toy widths: CLIP-L 8 wide (pooled), T5 24 wide."""
    torch.manual_seed(1)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4))  # fmt: skip
    pipe = diffusers.FluxPipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=diffusers.AutoencoderKL(**{**VAE, "latent_channels": 16}),
        text_encoder=clip_encoder(8, projection=False),
        tokenizer=clip_tokenizer(),
        text_encoder_2=t5_encoder(24),
        tokenizer_2=t5_tokenizer(),
    )
    pipe.save_pretrained(folder)
    return folder


def encode(images: str, pipeline: Path, out: Path, *more: str) -> tuple[int, str]:
    argv = ["data", "encode-latents", images, "--pipeline", str(pipeline), "--size", str(SIZE),
            "--batch-size", str(BATCH), "--out", str(out), *more]  # fmt: skip
    return run_cli(argv)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """(exit code, what it printed) of `mmtrain ARGV`, argparse's refusals included."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse's refusals
            code = exit.code
    return code, printed.getvalue()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny SD3 pipeline, captioned images and their latents encoded through it."""
    root = tmp_path_factory.mktemp("pipeline-latents")
    pipeline = sd3_pipeline(root / "sd3")
    images = captioned_shards(root / "images")
    latents = root / "latents"
    code, printed = encode(images, pipeline, latents, "--max-sequence-length", str(T5_TOKENS))
    assert code == 0
    return root, pipeline, images, latents, printed


def captions_in_order(images: str) -> list[tuple[str, str | None]]:
    source = ShardSet.open(images)
    samples = [source.read(i) for i in range(len(source))]
    return [(s["__key__"], s["txt"].decode().strip() or None if "txt" in s else None)
            for s in samples]  # fmt: skip


def expected_text(pipe, captions: list[str], family: str, **kwargs) -> tuple[np.ndarray, ...]:
    """The pipeline's own encode_prompt on `captions`, in the command's batches."""
    hidden, pooled = [], []
    for start in range(0, len(captions), BATCH):
        batch = captions[start : start + BATCH]
        with torch.no_grad():
            if family == "sd3":
                out = pipe.encode_prompt(batch, None, None, do_classifier_free_guidance=False,
                                         **kwargs)  # fmt: skip
                h, p = out[0], out[2]
            else:
                h, p, _ = pipe.encode_prompt(batch, None, **kwargs)
        hidden.append(h.float().numpy())
        pooled.append(p.float().numpy())
    return np.concatenate(hidden), np.concatenate(pooled)


def test_the_text_members_are_the_pipelines_own_encode_prompt(made):
    root, pipeline, images, latents, printed = made
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(pipeline, transformer=None)
    kept = [(k, c) for k, c in captions_in_order(images) if c is not None]
    hidden, pooled = expected_text(pipe, [c for _, c in kept], "sd3",
                                   max_sequence_length=T5_TOKENS)  # fmt: skip
    # SD3: CLIP's tokens then T5's, T5 wide; pooled: both CLIPs' projections side by side
    assert hidden.shape == (len(kept), CLIP_TOKENS + T5_TOKENS, 24)
    assert pooled.shape == (len(kept), 8 + 12)
    out = ShardSet.open(latents)
    assert [out.key(i) for i in range(len(out))] == [k for k, _ in kept]
    for i in range(len(out)):
        sample = out.read(i)
        assert read_array(sample, "text_hidden.npy").dtype == np.float32
        assert np.array_equal(read_array(sample, "text_hidden.npy"), hidden[i])
        assert np.array_equal(read_array(sample, "text_pooled.npy"), pooled[i])
    assert "text [14, 24] + pooled [20]" in printed and "StableDiffusion3Pipeline" in printed


def test_the_latents_are_the_pipeline_vaes_scaled_mean(made, tmp_path):
    """The pipeline's vae/ read by mmtrain encodes as diffusers' own AutoencoderKL does, scaled
    as the transformer sees it: float64 both sides, to the float32 rounding of the stored
    array; and the command (float32) writes what the library writes in float32."""
    from mmtrain.data.ingest.latents import encode_latent_shards
    from mmtrain.data.ingest.pipeline_encoders import load_pipeline_text_encoder
    from mmtrain.data.stream.transforms import AugmentConfig, ImageTransform
    from mmtrain.models.formats.diffusers import read_diffusers_vae

    root, pipeline, images, latents, _ = made
    vae = diffusers.AutoencoderKL.from_pretrained(pipeline / "vae").double().eval()
    half = (0.5, 0.5, 0.5)
    transform = ImageTransform(SIZE, train=False, augment=AugmentConfig(mean=half, std=half))
    source, out = ShardSet.open(images), ShardSet.open(latents)
    keys = [out.key(i) for i in range(len(out))]
    pixels = torch.stack([transform.decode(source.read(i)["png"]) for i in range(len(source))
                          if source.key(i) in keys]).double()  # fmt: skip
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean
    expected = ((mean - vae.config.shift_factor) * vae.config.scaling_factor).numpy()
    ours64 = tmp_path / "float64"
    encode_latent_shards(images, read_diffusers_vae(pipeline / "vae").double(), ours64,
                         size=SIZE, batch_size=BATCH)  # fmt: skip
    in64 = latents_by_key(ours64)
    for i, key in enumerate(keys):
        rounding = np.spacing(np.abs(expected[i]).astype(np.float32)) + 1e-10
        assert np.all(np.abs(in64[key] - expected[i]) <= rounding), key
    # the command's float32 latents: what the same code writes from the float32 VAE (with the
    # text encoder, so that the images are encoded in the same batches)
    ours32 = tmp_path / "float32"
    text = load_pipeline_text_encoder(pipeline, max_sequence_length=T5_TOKENS)
    encode_latent_shards(images, read_diffusers_vae(pipeline / "vae"), ours32, size=SIZE,
                         batch_size=BATCH, text_encoder=text)  # fmt: skip
    in32 = latents_by_key(ours32)
    for i, key in enumerate(keys):
        assert np.array_equal(read_array(out.read(i), "npy"), in32[key])


def latents_by_key(folder: Path) -> dict[str, np.ndarray]:
    shards = ShardSet.open(folder)
    return {shards.key(i): read_array(shards.read(i), "npy") for i in range(len(shards))}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_manifest_records_each_components_identity(made):
    root, pipeline, _, latents, _ = made
    manifest = json.loads((latents / "manifest.json").read_text())
    latent = manifest["latent"]
    assert latent["pipeline"] == {"folder": str(pipeline.resolve()),
                                  "class": "StableDiffusion3Pipeline",
                                  "model_index_sha256": sha256(pipeline / "model_index.json")}  # fmt: skip
    components = latent["components"]
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        assert components[name]["folder"] == str((pipeline / name).resolve())
        assert components[name]["config_sha256"] == sha256(pipeline / name / "config.json")
    assert components["text_encoder_3"]["class"] == "T5EncoderModel"
    text = latent["text_encoder"]
    assert (text["text_tokens"], text["text_width"], text["pooled_width"]) == (14, 24, 20)
    assert text["max_sequence_length"] == T5_TOKENS
    assert text["pipeline"] == str(pipeline.resolve()) and "path" not in text
    assert manifest["counts"]["no_caption"] == 2  # no .txt, and a blank one
    tokenizers = {components[name]["files_sha256"] for name in ("tokenizer", "tokenizer_3")}
    assert len(tokenizers) == 2  # CLIP's and T5's: another vocabulary, another identity


def test_latents_of_another_pipelines_components_are_refused_by_name(made, tmp_path):
    from mmtrain.data.ingest.pipeline_encoders import PipelineFolderError, refuse_other_components

    root, pipeline, _, latents, _ = made
    latent = json.loads((latents / "manifest.json").read_text())["latent"]
    refuse_other_components(latent, pipeline, "data.train[0]")  # its own pipeline: taken
    other = tmp_path / "other"
    shutil.copytree(pipeline, other)
    original = (other / "vae" / "config.json").read_text()
    changed = {**json.loads(original), "scaling_factor": 0.5}
    (other / "vae" / "config.json").write_text(json.dumps(changed))
    with pytest.raises(PipelineFolderError, match=r"data.train\[0\] was encoded by the vae "):
        refuse_other_components(latent, other, "data.train[0]")
    shutil.rmtree(other / "text_encoder_3")
    (other / "vae" / "config.json").write_text(original)
    with pytest.raises(PipelineFolderError, match="text_encoder_3 T5EncoderModel.* has none"):
        refuse_other_components(latent, other, "data.train[0]")


def train_config(root: Path, spec: Path, latents: Path, run: str) -> Path:
    config = {"model": str(spec), "init": str(root / "native"), "data": {"train": str(latents)},
              "train": {"steps": 2, "batch_size": 4, "lr": 1e-3},
              "metrics": {"tensorboard": False}, "out": str(root / run)}  # fmt: skip
    path = root / f"{run}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_transformer_trains_on_them_refuses_another_text_length_and_goes_back(made, capsys):
    root, pipeline, _, latents, _ = made
    native = root / "native"
    argv = ["convert", "--from", "diffusers", str(pipeline / "transformer"), "--out", str(native)]
    assert main(argv) == 0
    spec = yaml.safe_load((native / "spec.yaml").read_text())
    assert spec["denoiser"]["text_tokens"] == 77 + 256  # SD3's pipeline default, assumed
    capsys.readouterr()
    assert main(["train", str(train_config(root, native / "spec.yaml", latents, "refused"))]) == 2
    err = capsys.readouterr().err
    assert "denoiser.text_tokens" in err and "encode-latents` wrote 14 text tokens" in err
    spec["denoiser"]["text_tokens"] = CLIP_TOKENS + T5_TOKENS
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["train", str(train_config(root, root / "spec.yaml", latents, "run"))]) == 0
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)

    # The run back into its pipeline: the trained transformer, every other part the source's.
    out = root / "pipeline-out"
    argv = ["convert", "--to", "diffusers", str(root / "run"), "--pipeline", str(pipeline),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    transformer = root / "transformer-alone"
    assert main(["convert", "--to", "diffusers", str(root / "run"), "--out", str(transformer)]) == 0
    weights = "diffusion_pytorch_model.safetensors"
    assert (out / "transformer" / weights).read_bytes() == (transformer / weights).read_bytes()
    assert (out / "vae" / "config.json").read_bytes() == (pipeline / "vae" / "config.json").read_bytes()
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(out)
    image = pipe("a red square", num_inference_steps=2, height=16, width=16,
                 max_sequence_length=T5_TOKENS).images[0]  # fmt: skip
    assert image.size == (16, 16)
    other = root / "other-sd3"
    shutil.copytree(pipeline, other)
    config = json.loads((other / "transformer" / "config.json").read_text())
    config["num_layers"] += 1
    (other / "transformer" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    argv[5], argv[-1] = str(other), str(root / "refused-out")
    assert main(argv) == 2
    assert "differs in num_layers" in capsys.readouterr().err


def test_flux_captions_are_its_own_encode_prompt(tmp_path):
    pipeline = flux_pipeline(tmp_path / "flux")
    images = captioned_shards(tmp_path / "images")
    code, printed = encode(images, pipeline, tmp_path / "latents")
    assert code == 0
    pipe = diffusers.FluxPipeline.from_pretrained(pipeline, transformer=None)
    kept = [c for _, c in captions_in_order(images) if c is not None]
    hidden, pooled = expected_text(pipe, kept, "flux")
    assert hidden.shape == (len(kept), 512, 24) and pooled.shape == (len(kept), 8)  # T5's 512
    out = ShardSet.open(tmp_path / "latents")
    for i in range(len(out)):
        sample = out.read(i)
        assert np.array_equal(read_array(sample, "text_hidden.npy"), hidden[i])
        assert np.array_equal(read_array(sample, "text_pooled.npy"), pooled[i])
    latent = json.loads((tmp_path / "latents" / "manifest.json").read_text())["latent"]
    assert latent["pipeline"]["class"] == "FluxPipeline"
    assert set(latent["components"]) >= {"vae", "text_encoder", "text_encoder_2"}


def test_folders_that_are_no_supported_pipeline_exit_2_naming_why(made, tmp_path, capsys):
    root, pipeline, images, _, _ = made
    index = json.loads((pipeline / "model_index.json").read_text())
    other = tmp_path / "hunyuan"  # a family mmtrain does not encode with yet: named, and ours
    other.mkdir()
    (other / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "HunyuanVideoPipeline"})
    )
    no_t5 = tmp_path / "no-t5"
    no_t5.mkdir()
    (no_t5 / "model_index.json").write_text(json.dumps({**index, "text_encoder_3": [None, None]}))
    for name in ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        (no_t5 / name).symlink_to(pipeline / name)
    capsys.readouterr()
    refused = {
        (str(pipeline / "vae"), "model_index.json"): [pipeline / "vae"],
        ("HunyuanVideoPipeline", *SUPPORTED): [other],
        ("text_encoder_3", "T5"): [no_t5],
        ("--pipeline", "--vae"): [pipeline, "--vae", str(pipeline / "vae")],
    }
    for words, (folder, *more) in refused.items():
        code, _ = encode(images, folder, tmp_path / "out", *more)
        err = capsys.readouterr().err
        assert code == 2 and all(w in err for w in words), (words, err)
    assert not (tmp_path / "out").exists()
