"""`data encode-latents SHARDS --pipeline WAN_DIR` encodes clips with the Wan pipeline's own
parts: frames through its AutoencoderKLWan (`latent_dist.mean`, normalised as WanPipeline
un-normalises before decoding), captions through its own `encode_prompt` (UMT5, no pooled
vector); the manifest records each component, the frames and the buckets; `--frames` follows
the VAE's 1 + k x T rule and a clip shorter than it is refused by key; images are 1-frame
clips; a VAE folder alone (`--vae`) of diffusers' AutoencoderKLWan is read with diffusers' own
class; and a cross-attention denoiser's decoder reads the samples, refusing another text length
at start. The pipeline is the tiny one of tests/wan_pipeline.py."""

from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmtrain.data.storage.shards import ShardSet

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_latents import VAE, run_cli  # noqa: E402
from test_text_features import captioned_shards, read_array  # noqa: E402
from wan_pipeline import (  # noqa: E402
    FRAMES,
    LATENT_CHANNELS,
    SIDE,
    TEXT_TOKENS,
    TEXT_WIDTH,
    TIME_FACTOR,
    captioned_clips,
    wan_pipeline,
)

SIZE = SIDE // 2  # the clips are resized to it: the resize is part of what is checked
BATCH = 3  # 4 clips: a batch of 3 and one of 1
LATENT_FRAMES = 1 + (FRAMES - 1) // TIME_FACTOR
LATENT_SIDE = SIZE // 2  # the tiny VAE's 2x


def encode(shards: str, out: Path, *flags: str) -> tuple[int, str]:
    argv = ["data", "encode-latents", shards, "--out", str(out), "--batch-size", str(BATCH),
            *flags]  # fmt: skip
    return run_cli(argv)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny Wan pipeline, 4 captioned clips of 9 frames and their latents through it."""
    root = tmp_path_factory.mktemp("wan-latents")
    pipeline = wan_pipeline(root / "wan")
    clips = captioned_clips(root / "clips", n=4)
    latents = root / "latents"
    code, printed = encode(clips, latents, "--pipeline", str(pipeline), "--size", str(SIZE),
                           "--max-sequence-length", str(TEXT_TOKENS))  # fmt: skip
    assert code == 0, printed
    return root, pipeline, clips, latents, printed


def all_frames(data: bytes) -> np.ndarray:
    """Every frame of a clip, uint8 [F, H, W, 3], decoded by PyAV directly."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def resized(frames: np.ndarray, side: int) -> np.ndarray:
    """Square frames at `side` x `side`, bicubic (the clips are square: no crop)."""
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(f).resize((side, side), Image.Resampling.BICUBIC))
                     for f in frames])  # fmt: skip


def wan_reference(vae_folder: Path, pixels: np.ndarray) -> np.ndarray:
    """diffusers' AutoencoderKLWan in float64 on uint8 [B, F, H, W, 3] (in [-1, 1] as the
    float32 the command computes): its latent mean, normalised as WanPipeline un-normalises it
    before decoding ((z - mean) / std)."""
    vae = diffusers.AutoencoderKLWan.from_pretrained(vae_folder).double().eval()
    x = (torch.from_numpy(pixels).float().permute(0, 4, 1, 2, 3) / 127.5 - 1.0).double()
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float64).view(shape)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float64).view(shape)
    return ((z - mean) / std).numpy()


def by_key(folder: Path, member: str = "latent.npy") -> dict[str, np.ndarray]:
    shards = ShardSet.open(folder)
    return {shards.key(i): read_array(shards.read(i), member) for i in range(len(shards))}


def within_float32_rounding(ours: np.ndarray, expected: np.ndarray) -> bool:
    rounding = np.spacing(np.abs(expected).astype(np.float32)) + 1e-10
    return bool(np.all(np.abs(ours.astype(np.float64) - expected) <= rounding))


def test_the_latents_are_the_wan_vaes_normalised_mean(made, tmp_path):
    """Every frame of each clip, resized, through diffusers' own AutoencoderKLWan: the library
    with the float64 VAE equals the float64 reference to the float32 rounding of the stored
    array, and the command (float32) writes what the library writes in float32."""
    from mmtrain.data.ingest.video_latents import encode_video_latent_shards, load_video_vae

    root, pipeline, clips, latents, printed = made
    source = ShardSet.open(clips)
    keys = [source.key(i) for i in range(len(source))]
    pixels = np.stack([resized(all_frames(source.read(i)["mp4"]), SIZE) for i in range(4)])
    assert pixels.shape == (4, FRAMES, SIZE, SIZE, 3)
    expected = wan_reference(pipeline / "vae", pixels)
    assert expected.shape == (4, LATENT_CHANNELS, LATENT_FRAMES, LATENT_SIDE, LATENT_SIDE)

    vae64 = load_video_vae(pipeline / "vae", dtype=torch.float64)
    encode_video_latent_shards(clips, vae64, tmp_path / "float64", size=SIZE, batch_size=BATCH)
    in64 = by_key(tmp_path / "float64")
    assert list(in64) == keys
    for i, key in enumerate(keys):
        assert in64[key].dtype == np.float32
        assert within_float32_rounding(in64[key], expected[i]), key

    encode_video_latent_shards(clips, load_video_vae(pipeline / "vae"), tmp_path / "float32",
                               size=SIZE, batch_size=BATCH)  # fmt: skip
    stored, in32 = by_key(latents), by_key(tmp_path / "float32")
    assert all(np.array_equal(stored[key], in32[key]) for key in keys)
    out = ShardSet.open(latents)
    assert out.read(0)["txt"] == source.read(0)["txt"]  # the caption comes along
    shape = [LATENT_CHANNELS, LATENT_FRAMES, LATENT_SIDE, LATENT_SIDE]
    assert f"wrote 4 latents {shape}" in printed
    assert f"data.buckets: [{shape[1:]}]" in printed


def wan_text(pipeline: Path, captions: list[str], length: int) -> np.ndarray:
    """WanPipeline's own encode_prompt, in the command's batches."""
    pipe = diffusers.WanPipeline.from_pretrained(pipeline, transformer=None, vae=None)
    out = []
    for start in range(0, len(captions), BATCH):
        with torch.no_grad():
            hidden, _ = pipe.encode_prompt(captions[start : start + BATCH],
                                           do_classifier_free_guidance=False,
                                           max_sequence_length=length)  # fmt: skip
        out.append(hidden.float().numpy())
    return np.concatenate(out)


def captions(shards: str) -> list[str]:
    source = ShardSet.open(shards)
    return [source.read(i)["txt"].decode() for i in range(len(source))]


def test_the_text_is_wans_own_encode_prompt_and_no_pooled_member(made):
    root, pipeline, clips, latents, printed = made
    expected = wan_text(pipeline, captions(clips), TEXT_TOKENS)
    assert expected.shape == (4, TEXT_TOKENS, TEXT_WIDTH)
    out = ShardSet.open(latents)
    for i in range(len(out)):
        sample = out.read(i)
        assert np.array_equal(read_array(sample, "text_hidden.npy"), expected[i])
        assert "text_pooled.npy" not in sample  # Wan's transformer takes no pooled vector
    assert f"text [{TEXT_TOKENS}, {TEXT_WIDTH}]" in printed and "WanPipeline" in printed


def test_the_default_text_length_is_the_pipelines_512_zero_padded(made, tmp_path):
    """Without --max-sequence-length the captions take WanPipeline's own 512 tokens (its
    __call__'s default, not encode_prompt's 226), zero past the caption as Wan pads them."""
    root, pipeline, clips, _, _ = made
    two = captioned_clips(tmp_path / "clips", n=2)
    code, _ = encode(two, tmp_path / "latents", "--pipeline", str(pipeline), "--size", str(SIZE))
    assert code == 0
    expected = wan_text(pipeline, captions(two), 512)
    hidden = list(by_key(tmp_path / "latents", "text_hidden.npy").values())
    assert np.array_equal(np.stack(hidden), expected) and expected.shape[1] == 512
    tokens = len(diffusers.WanPipeline.from_pretrained(pipeline, transformer=None, vae=None)
                 .tokenizer(captions(two)[0]).input_ids)  # fmt: skip
    assert not hidden[0][tokens:].any() and hidden[0][:tokens].any()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_manifest_records_components_frames_and_buckets(made):
    root, pipeline, _, latents, _ = made
    latent = json.loads((latents / "manifest.json").read_text())["latent"]
    assert latent["pipeline"]["class"] == "WanPipeline"
    assert latent["pipeline"]["model_index_sha256"] == sha256(pipeline / "model_index.json")
    components = latent["components"]
    assert set(components) == {"vae", "text_encoder", "tokenizer"}
    assert components["vae"]["class"] == "AutoencoderKLWan"
    assert components["text_encoder"]["class"] == "UMT5EncoderModel"
    for name in ("vae", "text_encoder"):
        assert components[name]["config_sha256"] == sha256(pipeline / name / "config.json")
    assert "files_sha256" in components["tokenizer"]
    video = latent["video"]
    assert video["frames"] is None  # every frame that fits, per clip
    assert (video["scale_factor_temporal"], video["frame_step"]) == (TIME_FACTOR, 4)
    assert latent["buckets"] == [{"pixels": [FRAMES, SIZE, SIZE],
                                  "latent": [LATENT_FRAMES, LATENT_SIDE, LATENT_SIDE],
                                  "samples": 4}]  # fmt: skip
    text = latent["text_encoder"]
    widths = (text["text_tokens"], text["text_width"], text["pooled_width"])
    assert widths == (TEXT_TOKENS, TEXT_WIDTH, 0)


def test_a_vae_folder_alone_is_read_with_diffusers_own_class(made, tmp_path):
    """`--vae WAN_DIR/vae` (AutoencoderKLWan, not mmtrain's AutoencoderKL) encodes the clips as
    the pipeline run did, without text members."""
    root, pipeline, clips, latents, _ = made
    code, _ = encode(clips, tmp_path / "out", "--vae", str(pipeline / "vae"), "--size", str(SIZE))
    assert code == 0
    ours, theirs = by_key(tmp_path / "out"), by_key(latents)
    assert list(ours) == list(theirs)
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
    sample = ShardSet.open(tmp_path / "out").read(0)
    assert "text_hidden.npy" not in sample
    latent = json.loads((tmp_path / "out" / "manifest.json").read_text())["latent"]
    assert latent["components"]["vae"]["class"] == "AutoencoderKLWan"


def test_frames_and_buckets_choose_the_frames_and_sizes(made, tmp_path):
    """--frames 5 encodes each clip's first 5 frames (the library in float64 against the
    reference; the command's latents of that shape); buckets pick a clip's shape."""
    from mmtrain.data.ingest.video_latents import encode_video_latent_shards, load_video_vae

    root, pipeline, clips, _, _ = made
    vae = str(pipeline / "vae")
    code, printed = encode(clips, tmp_path / "five", "--vae", vae, "--size", str(SIZE),
                           "--frames", "5")  # fmt: skip
    assert code == 0
    shape = (LATENT_CHANNELS, 3, LATENT_SIDE, LATENT_SIDE)  # 1 + (5 - 1) / 2 latent frames
    assert {a.shape for a in by_key(tmp_path / "five").values()} == {shape}
    encode_video_latent_shards(clips, load_video_vae(vae, dtype=torch.float64), tmp_path / "64",
                               size=SIZE, frames=5)  # fmt: skip
    first = next(iter(by_key(tmp_path / "64").values()))
    source = ShardSet.open(clips)
    expected = wan_reference(pipeline / "vae",
                             resized(all_frames(source.read(0)["mp4"])[:5], SIZE)[None])  # fmt: skip
    assert within_float32_rounding(first, expected[0])  # the clip's first 5 frames
    # a square clip goes to the square bucket of the most frames it holds
    code, _ = encode(clips, tmp_path / "buckets", "--vae", vae,
                     "--buckets", f"5x{SIZE}x{SIZE},9x{SIZE}x{SIZE},9x{SIZE}x{2 * SIZE}")  # fmt: skip
    assert code == 0
    assert {a.shape for a in by_key(tmp_path / "buckets").values()} == {
        (LATENT_CHANNELS, LATENT_FRAMES, LATENT_SIDE, LATENT_SIDE)}  # fmt: skip
    latent = json.loads((tmp_path / "buckets" / "manifest.json").read_text())["latent"]
    assert [b["samples"] for b in latent["buckets"]] == [0, 4, 0]
    assert latent["buckets"][2]["latent"] == [LATENT_FRAMES, LATENT_SIDE, SIZE]


def test_images_are_one_frame_clips(made, tmp_path):
    """Wan trains on images as 1-frame videos: an image shard through the Wan pipeline gives
    [C, 1, H, W] latents, the VAE's encoding of the one frame."""
    from mmtrain.data.ingest.video_latents import encode_video_latent_shards, load_video_vae
    from mmtrain.data.stream.buckets import cover_crop
    from mmtrain.data.stream.media import LazyImage

    root, pipeline, _, _, _ = made
    images = captioned_shards(tmp_path / "images")
    code, printed = encode(images, tmp_path / "out", "--pipeline", str(pipeline), "--size",
                           str(SIZE), "--max-sequence-length", str(TEXT_TOKENS))  # fmt: skip
    assert code == 0, printed
    assert "without a readable .txt caption" in printed
    shape = (LATENT_CHANNELS, 1, LATENT_SIDE, LATENT_SIDE)
    assert {a.shape for a in by_key(tmp_path / "out").values()} == {shape}
    vae64 = load_video_vae(pipeline / "vae", dtype=torch.float64)
    encode_video_latent_shards(images, vae64, tmp_path / "64", size=SIZE)
    ours = by_key(tmp_path / "64")
    source = ShardSet.open(images)
    png = {source.key(i): source.read(i)["png"] for i in range(len(source))}
    frames = np.stack([np.asarray(cover_crop(LazyImage(png[k]), (SIZE, SIZE)).convert("RGB"))
                       for k in ours])[:, None]  # fmt: skip
    expected = wan_reference(pipeline / "vae", frames)
    assert expected.shape[2] == 1
    for i, latent in enumerate(ours.values()):
        assert within_float32_rounding(latent, expected[i])


def refused(argv_tail: list[str], shards: str, out: Path, capsys) -> str:
    capsys.readouterr()
    code, _ = encode(shards, out, *argv_tail)
    err = capsys.readouterr().err
    assert code == 2, err
    assert not (out / "manifest.json").exists()
    return err


def test_bad_frames_short_clips_and_unsupported_vaes_exit_2(made, tmp_path, capsys):
    root, pipeline, clips, _, _ = made
    vae, out = str(pipeline / "vae"), tmp_path / "out"
    size = ["--size", str(SIZE)]
    # 4 is no 1 + k x 4; 7 is 1 + 3 x 2 (the config's factor), and diffusers' encoder would
    # drop its last 2 frames: it encodes the frames after the first 4 at a time
    for frames in ("4", "7"):
        err = refused(["--vae", vae, *size, "--frames", frames], clips, out, capsys)
        assert f"--frames {frames}" in err and "1 + 4k" in err
    err = refused(["--vae", vae, "--buckets", f"3x{SIZE}x{SIZE}"], clips, out, capsys)
    assert "--buckets" in err and "1 + 4k" in err
    err = refused(["--vae", vae, "--buckets", f"{SIZE}x{SIZE}"], clips, out, capsys)
    assert "FxHxW" in err
    assert "--flip" in refused(["--vae", vae, *size, "--flip"], clips, out, capsys)
    short = captioned_clips(tmp_path / "short", n=2, frames=5)
    err = refused(["--pipeline", str(pipeline), *size, "--frames", "9"], short, out, capsys)
    assert "clip000" in err and "5 frames" in err and "--frames 9" in err
    # an image VAE takes no --frames; a VAE class mmtrain does not encode with is named
    torch.manual_seed(0)
    diffusers.AutoencoderKL(**VAE).save_pretrained(tmp_path / "image-vae")
    err = refused(["--vae", str(tmp_path / "image-vae"), *size, "--frames", "9"], clips, out,
                  capsys)  # fmt: skip
    assert "--frames" in err and "AutoencoderKL" in err
    other = tmp_path / "hunyuan-vae"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLHunyuanVideo"}))
    err = refused(["--vae", str(other), *size], clips, out, capsys)
    assert "AutoencoderKLHunyuanVideo" in err and "AutoencoderKLWan" in err


def cross_attention_spec(text_tokens: int):
    from mmtrain.denoiser_spec import DenoiserSpec
    from mmtrain.spec import ModelSpec

    denoiser = DenoiserSpec(architecture="cross_attention", input="latent",
                            channels=LATENT_CHANNELS, frames=LATENT_FRAMES,
                            sample_size=LATENT_SIDE, patch_size=2, width=16, layers=1, heads=2,
                            text_tokens=text_tokens, text_width=TEXT_WIDTH)  # fmt: skip
    return ModelSpec(name="wan", embed_dim=16, towers={}, objective="flow_matching",
                     denoiser=denoiser)  # fmt: skip


def test_the_denoiser_reads_them_for_a_cross_attention_spec(made):
    from mmtrain.data.stream.denoiser_inputs import DenoiserDecoder, check_first_samples
    from mmtrain.structured import FieldError

    root, pipeline, _, latents, _ = made
    source = ShardSet.open(latents)
    spec = cross_attention_spec(TEXT_TOKENS)
    sample = source.read(0)
    out = DenoiserDecoder(spec)(sample, np.random.default_rng(0))
    assert set(out) == {"latent", "text_hidden"}
    assert torch.equal(out["latent"], torch.from_numpy(read_array(sample, "latent.npy")))
    assert torch.equal(out["text_hidden"], torch.from_numpy(read_array(sample, "text_hidden.npy")))
    check_first_samples([source], spec)
    with pytest.raises(FieldError, match="encode-latents` wrote 6 text tokens") as err:
        check_first_samples([source], cross_attention_spec(512))
    assert "denoiser.text_tokens" in str(err.value) and "takes 512" in str(err.value)
