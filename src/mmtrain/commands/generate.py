"""`mmtrain generate RUN_DIR --image X.jpg --prompt "..."`: ask a (vision-)language model;
`mmtrain generate RUN_DIR --class 3 --num 8 --out DIR`: sample images from a trained DiT;
`mmtrain generate RUN_DIR --prompt "..." [--prompt ...] --out DIR` or
`--text-from SHARDS --num 8 --out DIR`: from a trained MMDiT.

Loads the model (a model folder, a finished run, or a run's newest checkpoint), the tokenizer
and chat template the run trained with (its config.yaml: `data.tokenizer`,
`data.chat_template`; flags override them), renders the prompt as one user turn with the
template's generation prompt, and prints the answer. Each `--image` takes one `<image>` tag in
the prompt; a prompt without tags gets one per image in front of it, as LLaVA's data has them.
A hub model (models/hub/) answers through its run folder's own processor (chat template and
image processor) and its class's `generate` (eval/hub.py); it takes no --tokenizer,
--chat-template or --video.

A denoiser (a DiT: flow matching or DDPM) is sampled with the run's own `train.diffusion`
settings (eval/sampling.py): `--num` images per `--class` (or unconditionally), `--steps`,
`--cfg` (classifier-free guidance scale), `--sampler`, `--seed`; the PNGs and a grid (one row
per class) go to `--out`. An MMDiT (SD3) is conditioned on a text encoder's outputs. With
`--prompt` they come from a frozen text encoder mmtrain runs (data/ingest/text_features.py: the
text tower of a model folder), `--text-encoder MODEL_DIR` or the one the run's training data was
cached with (its manifest's `latent.text_encoder`): `--num` images per prompt, a grid row each.
mmtrain runs none of SD3's own encoders (CLIP-L, CLIP-G, T5-XXL); for outputs cached by other
encoders, `--text-from` samples one image for each of the first `--num` samples of shards, from
their cached `.text_hidden.npy` and `.text_pooled.npy` (what it trained on), in order, the grid
one row of them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mmtrain.cli import UsageError
from mmtrain.commands._args import count, sample_size

ORDER = 45
IMAGE_TAG = (
    "<image>"  # mmtrain.data.stream.conversations.IMAGE_TAG (not imported: --help stays fast)
)
VIDEO_TAG = "<video>"  # mmtrain.data.stream.conversations.VIDEO_TAG


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="answer a prompt (about images) with a trained language or vision-language model",
        description=(
            "Generate an answer with the language model in RUN_DIR (or a model folder). Each "
            "--image fills one <image> tag of the prompt (a prompt without tags gets one per "
            "image in front). Greedy by default; --temperature > 0 samples (nucleus: --top-p). "
            "A denoiser writes images to --out instead: a DiT's for --class K, an MMDiT's for "
            "each --prompt (encoded by --text-encoder or the one its training data names) or for "
            "the cached text of --text-from SHARDS. Exit code 2 on bad input."
        ),
    )
    p.add_argument(
        "model",
        metavar="RUN_DIR|MODEL_DIR|CHECKPOINT",
        help="a run folder, a model folder (model.safetensors + spec.yaml) or a checkpoint",
    )
    p.add_argument(
        "--prompt",
        action="append",
        help="the user's message (language models); an MMDiT's text to draw (repeat for "
        "several), encoded by --text-encoder",
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image (repeat for several, in the order of the prompt's <image> tags)",
    )
    p.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="FILE",
        help="a clip for a native-resolution VLM (repeat for several, in the order of the "
        "prompt's <video> tags), its frames sampled as the run's data.vision says",
    )
    p.add_argument("--system", help="system prompt (default: the template's own)")
    p.add_argument(
        "--max-new-tokens", type=count, default=128, help="answer length limit (default 128)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling"
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: all tokens)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument(
        "--tokenizer", help="tokenizer.json or its folder (default: the run's data.tokenizer)"
    )
    p.add_argument(
        "--chat-template",
        help="plain, chatml, llama-3, vicuna-v1 or a tokenizer_config.json / .jinja "
        "(default: the run's data.chat_template, else the tokenizer folder's)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    images = p.add_argument_group("denoisers (a DiT or an MMDiT: flow matching or DDPM)")
    images.add_argument(
        "--class",
        dest="classes",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="a class id to sample (repeat for several; class-conditional models)",
    )
    images.add_argument(
        "--text-from",
        metavar="SHARDS",
        help="an MMDiT's condition: shards holding its text encoders' cached outputs "
        "(.text_hidden.npy, .text_pooled.npy), one image for each of the first --num samples, "
        "in order (outputs of encoders mmtrain does not run, such as SD3's)",
    )
    images.add_argument(
        "--text-encoder",
        metavar="MODEL_DIR",
        help="an MMDiT's --prompt encoder: a model folder with a text tower (default: the one "
        "its training data's manifest names, latent.text_encoder)",
    )
    images.add_argument(
        "--num",
        type=count,
        default=4,
        help="images per class or prompt, or texts taken from --text-from (default 4)",
    )
    images.add_argument("--steps", type=count, default=50, help="sampling steps (default 50)")
    images.add_argument(
        "--size",
        type=sample_size,
        metavar="HxW",
        help="the size to sample in the denoiser's input space (pixels, or latent positions; "
        "TxHxW for clips), e.g. one of the data.buckets it trained on (default: its spec's)",
    )
    images.add_argument(
        "--cfg", type=float, default=1.0, help="guidance scale (default 1: no guidance)"
    )
    images.add_argument("--sampler", help="euler or heun (flow matching), ddim (DDPM)")
    images.add_argument("--out", help="folder for the PNGs and grid.png")
    images.add_argument(
        "--vae",
        metavar="VAE_DIR",
        help="a diffusers AutoencoderKL folder that decodes a latent denoiser's samples",
    )
    images.add_argument(
        "--no-ema",
        action="store_true",
        help="sample the trained weights, not the run's EMA (RUN_DIR/ema, used when present)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from mmtrain.commands.eval import _load_model, _run_budget
    from mmtrain.models.build import is_model_folder, load_model

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise UsageError(f"{model_dir}: not a folder (expected RUN_DIR or a model folder)")
    device = _device(args.device, torch)
    from mmtrain.models.hub.pipeline import is_pipeline_folder

    if is_pipeline_folder(model_dir):  # a hub denoiser's run: the folder is its pipeline
        return generate_with_pipeline(args, model_dir, device)
    model, run_dir, _ = _load_model(model_dir, device)
    if model.spec.denoiser is not None:
        ema = model_dir / "ema"
        if not args.no_ema and is_model_folder(ema):  # an EMA samples better (DiT's practice)
            model = load_model(ema, device=device)
        return generate_images(args, model, run_dir)
    if not args.prompt:
        raise UsageError(f"{model.spec.name} is a language model: give --prompt")
    if len(args.prompt) > 1:
        raise UsageError(
            f"--prompt: {model.spec.name} answers one prompt, {len(args.prompt)} given"
        )
    _check_numbers(args)
    images, videos = [Path(p) for p in args.image], [Path(p) for p in args.video]
    for flag, path in [*(("--image", p) for p in images), *(("--video", p) for p in videos)]:
        if not path.is_file():
            raise UsageError(f"{flag} {path}: no such file")
    if model.spec.hub is not None:
        print(hub_answer(args, model, run_dir, images, videos))
        return 0
    prompt = _prompt_with_tags(args.prompt[0], len(images), IMAGE_TAG, "--image")
    prompt = _prompt_with_tags(prompt, len(videos), VIDEO_TAG, "--video")
    spec = model.spec
    if spec.decoder is None:
        raise UsageError(
            f"{model_dir}: {spec.name} is not a language model (it has no decoder); "
            "`mmtrain generate` needs an LM or a vision-language model"
        )
    if images and spec.projector is None and spec.vision is None:
        raise UsageError(f"{spec.name} is a text-only language model; it takes no --image")
    if videos and spec.vision is None:
        raise UsageError(f"{spec.name} takes no --video (only a native-resolution VLM does)")
    tokenizer, template = _tokenizer_and_template(args, run_dir, model_dir)
    answer = generate_answer(
        model,
        tokenizer,
        template,
        prompt,
        images,
        videos=videos,
        budget=_run_budget(spec, run_dir) if spec.vision is not None else None,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(answer)
    return 0


def hub_answer(
    args: argparse.Namespace, model: Any, run_dir: Path, images: list[Path], videos: list[Path]
) -> str:
    """A hub model's answer (eval/hub.py): the prompt as one user turn (after --system) in
    transformers' content lists, rendered by the processor the run folder holds, the class's
    own generate; the text up to its end-of-turn id."""
    from mmtrain.data.stream.processor_batches import content_items
    from mmtrain.eval.hub import end_ids, greedy_settings, hub_answer_ids, processor_folder
    from mmtrain.structured import FieldError

    folder = processor_folder(run_dir, model.spec)
    native_only = {"--video": videos, "--tokenizer": args.tokenizer,
                   "--chat-template": args.chat_template}  # fmt: skip
    used = [flag for flag, value in native_only.items() if value]
    if used:
        raise UsageError(
            f"{', '.join(used)}: {model.spec.name} is a hub model: its inputs are made by the "
            f"processor of {folder} (its tokenizer and chat template; images only, no clips "
            "yet): leave them out"
        )
    from mmtrain.data.stream.hf_processor import load_processor

    try:
        processor = load_processor(folder)
    except FieldError as err:
        raise UsageError(f"{args.model}: {err.message}") from None
    prompt = args.prompt[0]
    if prompt.count(IMAGE_TAG) == 0:  # the images first, as transformers' content lists do
        content = [{"type": "image"}] * len(images) + content_items(prompt)
    else:
        content = content_items(_prompt_with_tags(prompt, len(images), IMAGE_TAG, "--image"))
    messages = [{"role": "system", "content": content_items(args.system)}] if args.system else []
    messages.append({"role": "user", "content": content})
    pictures = [_picture(path) for path in images]
    new = hub_answer_ids(model, processor, messages, pictures, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         folder=folder)  # fmt: skip
    stops = end_ids(greedy_settings(model.hf, folder, 1, processor.tokenizer), processor.tokenizer)
    end = next((i for i, token in enumerate(new) if token in stops), len(new))
    return processor.tokenizer.decode(new[:end]).strip()


def _picture(path: Path) -> Any:
    """An --image file as an RGB PIL image (what a processor takes)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as err:
        raise UsageError(f"--image {path}: cannot be read as an image ({err})") from None


def generate_with_pipeline(args: argparse.Namespace, folder: Path, device: Any) -> int:
    """Sample a pipeline folder (a hub denoiser's run, or its source) through the family's own
    diffusers pipeline: `--num` PNGs per `--prompt` into `--out` (a video pipeline, Wan: an MP4
    each and a PNG of its first frame), `--size` in latent positions (HxW, TxHxW for video: the
    VAE's factors give the pixels and frames), `--cfg` the pipeline's guidance_scale (FLUX.1-dev's
    embedded guidance)."""
    import diffusers
    import torch

    if not args.prompt or args.out is None:
        raise UsageError(f"{folder} is a diffusers pipeline: give --prompt and --out DIR")
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(folder)).to(device)
    video = hasattr(pipe, "vae_scale_factor_temporal")
    size = _pipeline_size(pipe, args.size, video)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(args.seed)
    written = 0
    for p, prompt in enumerate(args.prompt):
        if video:
            text = _video_text(pipe, folder, prompt, args.cfg)
            frames = pipe(num_videos_per_prompt=args.num, num_inference_steps=args.steps,
                          guidance_scale=args.cfg, generator=g, output_type="np", **size,
                          **text).frames  # fmt: skip
            written += _write_clips(frames, out, f"prompt{p}")
            continue
        images = pipe(prompt, num_images_per_prompt=args.num, num_inference_steps=args.steps,
                      guidance_scale=args.cfg, generator=g, **size).images  # fmt: skip
        for i, image in enumerate(images):
            image.save(out / f"prompt{p}_{i}.png")
            written += 1
    kind = "videos (MP4, first frame PNG)" if video else "images"
    print(f"wrote {written} {kind} to {out} ({type(pipe).__name__})")
    return 0


def _video_text(pipe: Any, folder: Path, prompt: str, cfg: float) -> dict[str, Any]:
    """WanPipeline's text keywords for `prompt` at the caption length the run trained at (its
    spec.yaml; the pipeline's default for a source folder)."""
    from mmtrain.folders import SPEC_FILE
    from mmtrain.models.hub.wan import wan_prompt
    from mmtrain.spec import load_spec

    tokens = None
    if (folder / SPEC_FILE).is_file():
        tokens = load_spec(str(folder / SPEC_FILE)).denoiser.text_tokens
    return wan_prompt(pipe, prompt, tokens, cfg)


def _pipeline_size(pipe: Any, size: tuple[int, ...] | None, video: bool) -> dict[str, int]:
    """The pipeline's height / width (/ num_frames) keywords of `--size` in latent positions."""
    if size is None:
        return {}
    if len(size) != (3 if video else 2):
        kind = "videos (TxHxW)" if video else "images (HxW)"
        raise UsageError(f"--size: {type(pipe).__name__} makes {kind}")
    if not video:
        factor = int(getattr(pipe, "vae_scale_factor", 8))
        return {"height": size[0] * factor, "width": size[1] * factor}
    space, time = int(pipe.vae_scale_factor_spatial), int(pipe.vae_scale_factor_temporal)
    return {"num_frames": 1 + (size[0] - 1) * time, "height": size[1] * space,
            "width": size[2] * space}  # fmt: skip


def _write_clips(frames: Any, out: Path, stem: str, fps: int = 16) -> int:
    """Write each clip of `frames` ([N, F, H, W, 3] in [0, 1]) as STEM_i.mp4 and its first frame
    as STEM_i.png; returns how many."""
    import numpy as np
    from PIL import Image

    from mmtrain.data.stream.media import encode_video

    clips = (np.clip(np.asarray(frames), 0.0, 1.0) * 255).round().astype(np.uint8)
    for i, clip in enumerate(clips):
        (out / f"{stem}_{i}.mp4").write_bytes(encode_video(clip, fps=fps))
        Image.fromarray(clip[0]).save(out / f"{stem}_{i}.png")
    return len(clips)


def generate_images(args: argparse.Namespace, model: Any, run_dir: Path) -> int:
    """Sample a denoiser: `--num` PNGs per `--class` (an MMDiT: one per text of
    `--text-from`) into `--out`, and their grid."""
    from PIL import Image

    from mmtrain.commands.eval import run_diffusion_config
    from mmtrain.eval.sampling import image_grid, sample, to_uint8

    d = model.spec.denoiser
    condition, stems, rows = _condition(args, model.spec, run_dir, next(model.parameters()).device)
    if args.out is None:
        raise UsageError("a denoiser writes images: give --out DIR")
    if args.size is not None:
        try:
            d.grid_of(args.size)
        except ValueError as err:
            raise UsageError(f"--size {'x'.join(map(str, args.size))}: {err}") from None
    vae = _vae(args, d, next(model.parameters()).device)
    config = run_diffusion_config(run_dir)
    import torch

    model.eval()
    try:
        images = sample(model, condition, len(stems), steps=args.steps, cfg=args.cfg,
                        seed=args.seed, config=config, sampler=args.sampler,
                        shape=args.size)  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err)) from None
    if vae is not None:
        with torch.no_grad():
            images = vae.decode_latent(vae.from_diffusion(images.to(next(vae.parameters()).dtype)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if d.is_video():  # [N, C, T, H, W]: an MP4 each; the grid shows their first frames
        from mmtrain.data.stream.media import encode_video

        clips = (
            to_uint8(images.transpose(1, 2).flatten(0, 1))
            .numpy()
            .reshape(images.shape[0], images.shape[2], *images.shape[3:], -1)
        )  # [N, T, H, W, C]
        for stem, clip in zip(stems, clips, strict=True):
            (out / f"{stem}.mp4").write_bytes(encode_video(clip, fps=8))
        pixels = clips[:, 0]
    else:
        pixels = to_uint8(images).numpy()
        for stem, image in zip(stems, pixels, strict=True):
            Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image).save(
                out / f"{stem}.png"
            )
    Image.fromarray(image_grid(pixels, rows)).save(out / "grid.png")
    kind = "videos" if d.is_video() else "images"
    print(f"wrote {len(stems)} {kind} and grid.png to {out}")
    return 0


NO_TEXT_ENCODER = (
    "--prompt: {name} is an MMDiT, conditioned on a text encoder's outputs, and no text encoder "
    "is known to turn a prompt into them (no manifest of the run's data.train names one, "
    "latent.text_encoder): give --text-encoder MODEL_DIR, a model folder with a text tower of "
    "the widths it trained on, or give --text-from SHARDS, shards holding the cached "
    ".text_hidden.npy and .text_pooled.npy (e.g. the validation shards it trained beside)"
)


def _condition(
    args: argparse.Namespace, spec: Any, run_dir: Path, device: Any
) -> tuple[dict | None, list[str], int]:
    """What to sample: the condition (eval/sampling.py), a file stem per sample, grid rows."""
    d = spec.denoiser
    if d.is_mmdit():
        return _text_condition(args, spec, run_dir, device)
    text = {"--prompt": args.prompt, "--text-from": args.text_from,
            "--text-encoder": args.text_encoder}  # fmt: skip
    flag = next((flag for flag, value in text.items() if value), None)
    if flag is not None:
        what = f"give --class K (0..{d.num_classes - 1})" if d.num_classes else "it takes none"
        raise UsageError(f"{flag}: {spec.name} is not text-conditioned (an MMDiT is): {what}")
    if d.num_classes and not args.classes:
        raise UsageError(
            f"{spec.name} is class-conditional: give --class K (0..{d.num_classes - 1})"
        )
    bad = [k for k in args.classes if not 0 <= k < max(d.num_classes, 1)]
    if bad or (args.classes and not d.num_classes):
        raise UsageError(f"--class {bad or args.classes}: {spec.name} has {d.num_classes} classes")
    if not args.classes:
        return None, [f"sample_{i}" for i in range(args.num)], 1
    import torch

    classes = [k for k in args.classes for _ in range(args.num)]
    stems = [f"class{k}_{i}" for k in args.classes for i in range(args.num)]
    return {"class": torch.tensor(classes)}, stems, len(args.classes)


def _text_condition(
    args: argparse.Namespace, spec: Any, run_dir: Path, device: Any
) -> tuple[dict, list[str], int]:
    """An MMDiT's condition: its --prompt texts encoded, or the cached text of --text-from."""
    if args.classes:
        raise UsageError(
            f"--class: {spec.name} is an MMDiT, conditioned on text: give --prompt or --text-from"
        )
    if args.prompt and args.text_from is not None:
        raise UsageError("--prompt and --text-from: give one (texts to encode, or cached text)")
    if args.prompt:
        return _prompt_condition(args, spec, run_dir, device)
    if args.text_encoder is not None:
        raise UsageError(
            "--text-encoder encodes --prompt texts: give --prompt (--text-from shards hold "
            "their encoded text already)"
        )
    if args.text_from is None:
        raise UsageError(
            f"{spec.name} is an MMDiT, conditioned on text: give --prompt TEXT (encoded by "
            "--text-encoder) or --text-from SHARDS (cached text)"
        )
    return _cached_condition(args, spec)


def _prompt_condition(
    args: argparse.Namespace, spec: Any, run_dir: Path, device: Any
) -> tuple[dict, list[str], int]:
    """--num samples for each --prompt, encoded by the text encoder; a grid row per prompt."""
    if args.num < 1:
        raise UsageError("--num must be >= 1 (images per --prompt)")
    hidden, pooled = _prompt_encoder(args, spec, run_dir, device)(args.prompt)
    condition = {"text_hidden": hidden.repeat_interleave(args.num, 0),
                 "text_pooled": pooled.repeat_interleave(args.num, 0)}  # fmt: skip
    stems = [f"prompt{i}_{j}" for i in range(len(args.prompt)) for j in range(args.num)]
    return condition, stems, len(args.prompt)


def _prompt_encoder(args: argparse.Namespace, spec: Any, run_dir: Path, device: Any) -> Any:
    """The text encoder of --text-encoder, else the one the run's training data names; refused
    when its (text_tokens, text_width, pooled_width) are not the MMDiT's."""
    from mmtrain.data.ingest.text_features import TextShape, load_text_encoder
    from mmtrain.structured import FieldError

    if args.text_encoder is not None:
        folder, source, hint = args.text_encoder, "--text-encoder", ""
    else:
        named = _data_text_encoder(run_dir)
        if named is None:
            raise UsageError(NO_TEXT_ENCODER.format(name=spec.name))
        folder, source = named
        hint = "; give --text-encoder MODEL_DIR"
    try:
        encoder = load_text_encoder(folder, device=device)
    except (OSError, FieldError, ValueError) as err:
        raise UsageError(f"{source}: {err}{hint}") from None
    d = spec.denoiser
    takes = TextShape(d.text_tokens, d.text_width, d.pooled_width)
    if encoder.shape != takes:
        raise UsageError(
            f"{source} {folder}: its text tower gives {encoder.shape}, but {spec.name} takes "
            f"{takes} (its denoiser section): give the text encoder it trained on{hint}"
        )
    return encoder


def _data_text_encoder(run_dir: Path) -> tuple[str, str] | None:
    """(folder, where it is named) of the text encoder the run's training data was cached
    with: the manifests' `latent.text_encoder` of its data.train sources; None when none names
    one, a UsageError when they name different ones."""
    from mmtrain.data.storage.manifest import read_manifest

    found: dict[str, str] = {}
    for path in _train_paths(run_dir):
        manifest = _manifest_of(Path(_in_run(path, run_dir)))
        if manifest is None:
            continue
        try:
            latent = read_manifest(manifest).get("latent")
        except (OSError, ValueError):
            continue  # an unreadable manifest names nothing; --text-encoder still can
        record = latent.get("text_encoder") if isinstance(latent, dict) else None
        if isinstance(record, dict) and isinstance(record.get("path"), str):
            found.setdefault(record["path"], f"{manifest} latent.text_encoder")
    if len(found) > 1:
        raise UsageError(
            f"--prompt: the run's training data names {len(found)} text encoders "
            f"({', '.join(found)}): give --text-encoder MODEL_DIR"
        )
    return next(iter(found.items()), None)


def _train_paths(run_dir: Path) -> list[str]:
    """The shard paths of the run's config.yaml `data.train` (a path, a list, {path, weight})."""
    sources = _run_data_config(run_dir).get("train") or []
    paths: list[str] = []
    for source in sources if isinstance(sources, list) else [sources]:
        path = source.get("path") if isinstance(source, dict) else source
        paths += [str(p) for p in path] if isinstance(path, list) else [str(path)] if path else []
    return paths


def _manifest_of(path: Path) -> Path | None:
    """The manifest.json of a shard folder, or of the folder of a shard file or pattern."""
    for folder in (path, path.parent):
        if (folder / "manifest.json").is_file():
            return folder / "manifest.json"
    return None


def _cached_condition(args: argparse.Namespace, spec: Any) -> tuple[dict, list[str], int]:
    """The cached text of the first --num samples of --text-from, a stem per sample's key."""
    import re

    import torch

    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.data.stream.media import MediaError
    from mmtrain.eval.diffusion import cached_text

    try:
        shards = ShardSet.open(args.text_from)
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(f"--text-from {args.text_from}: {err}") from None
    if len(shards) < args.num:
        raise UsageError(f"--text-from {args.text_from}: {len(shards)} samples, --num {args.num}")
    texts, stems = [], []
    for i in range(args.num):
        key = shards.key(i)
        try:
            texts.append(cached_text(shards, i, spec.denoiser))
        except MediaError as err:
            raise UsageError(f"--text-from {args.text_from}: sample {key}: {err}") from None
        stems.append(f"text{i}_" + re.sub(r"[^\w.-]", "_", key))  # a key may hold a path
    keys = spec.denoiser.text_members()
    condition = {key: torch.stack([t[j] for t in texts]) for j, key in enumerate(keys)}
    return condition, stems, 1


def _vae(args: argparse.Namespace, denoiser: Any, device: Any) -> Any:
    """The autoencoder that decodes a latent denoiser's samples (--vae); None for pixels."""
    from mmtrain.models.formats.diffusers import read_diffusers_vae
    from mmtrain.structured import FieldError

    if denoiser.input != "latent":
        if args.vae:
            raise UsageError("--vae: this denoiser generates pixels, not latents")
        return None
    if denoiser.is_video():
        raise UsageError("decoding latent videos needs a video autoencoder (not available yet)")
    if not args.vae:
        raise UsageError("this denoiser generates latents: give --vae VAE_DIR to decode them")
    try:
        vae = read_diffusers_vae(args.vae).to(device).eval()
    except (OSError, FieldError) as err:
        raise UsageError(f"--vae {args.vae}: {err}") from None
    if vae.config.latent_channels != denoiser.channels:
        raise UsageError(
            f"--vae {args.vae}: {vae.config.latent_channels} latent channels, the denoiser "
            f"takes {denoiser.channels}"
        )
    return vae


def _check_numbers(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be 0 or more, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")


def _prompt_with_tags(prompt: str, inputs: int, tag: str, flag: str) -> str:
    """The prompt with one `tag` per input: added in front when it has none."""
    tags = prompt.count(tag)
    if tags == 0:
        return tag * inputs + ("\n" if inputs else "") + prompt
    if tags != inputs:
        raise UsageError(
            f"--prompt has {tags} {tag} tag(s) but {inputs} {flag} given: give one per tag, "
            "or no tags to put them in front of the prompt"
        )
    return prompt


def _native_prompt(
    spec: Any, tokenizer: Any, segments: Any, images: list[Path], videos: list[Path], budget: Any
) -> tuple[list[int], dict[str, Any]]:
    """A native VLM's prompt ids and its pages and clips at the sizes the budget gives them."""
    from mmtrain.data.stream.chat_templates import encode_segments
    from mmtrain.data.stream.media import MediaError
    from mmtrain.data.stream.native_inputs import NativeInputs
    from mmtrain.visual_budget import BudgetExceeded

    tokens = spec.vision_tokens
    wrap = None if tokens.start_id is None else (tokens.start_id, tokens.end_id)
    ids = encode_segments(
        segments, tokenizer, tokens.image_token_id, tokens.video_token_id, wrap
    ).input_ids
    native = NativeInputs(budget)
    pages, clips = [p.read_bytes() for p in images], [p.read_bytes() for p in videos]
    try:
        visual = native.decode("prompt", pages, clips, native.measure("prompt", pages, clips))
    except (MediaError, BudgetExceeded) as err:
        raise UsageError(f"--image / --video: {err}") from None
    inputs = {"image": visual.images, "video": visual.videos, "video_fps": visual.video_fps}
    return ids, inputs


def _device(name: str | None, torch: Any) -> Any:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise UsageError(f"--device {name!r}: {err}") from None


def _run_data_config(run_dir: Path) -> dict[str, Any]:
    """The `data` section of the run's config.yaml ({} without one)."""
    from mmtrain.commands.eval import run_config

    data = run_config(run_dir).get("data")
    return data if isinstance(data, dict) else {}


def _in_run(value: str, run_dir: Path) -> str:
    """A relative path from the run's config, resolved against the run folder when it exists
    there (the run may be read from another working directory)."""
    path = Path(value)
    if not path.is_absolute() and not path.exists() and (run_dir / path).exists():
        return str(run_dir / path)
    return value


def _tokenizer_and_template(args: argparse.Namespace, run_dir: Path, model_dir: Path) -> tuple:
    from mmtrain.data.stream.conversation_batches import resolve_chat_template
    from mmtrain.data.stream.tokenizer import get_tokenizer

    data = _run_data_config(run_dir)
    tokenizer = args.tokenizer or data.get("tokenizer")
    if tokenizer is None and (model_dir / "tokenizer.json").is_file():
        tokenizer = str(model_dir)  # a converted model folder keeps its tokenizer beside it
    if tokenizer is None:
        raise UsageError(
            f"{run_dir}: no config.yaml naming data.tokenizer and no tokenizer.json; "
            "give --tokenizer"
        )
    tokenizer = _in_run(str(tokenizer), run_dir)
    template = args.chat_template or data.get("chat_template")
    template = _in_run(str(template), run_dir) if template is not None else None
    return get_tokenizer(tokenizer, language_model=True), resolve_chat_template(template, tokenizer)


def generate_answer(
    model: Any,
    tokenizer: Any,
    template: Any,
    prompt: str,
    images: list[Path],
    *,
    videos: list[Path] | None = None,
    budget: Any = None,
    system: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> str:
    """The model's answer to one user turn `prompt` (its <image> tags matching `images`, a
    native VLM's <video> tags `videos`, read under `budget`: the run's data.vision)."""
    import torch

    from mmtrain.data.stream.chat_templates import encode_segments
    from mmtrain.data.stream.conversations import Conversation, Turn
    from mmtrain.data.stream.media import MediaError
    from mmtrain.data.stream.transforms import ImageTransform
    from mmtrain.eval.generation import prompt_and_reference, stop_ids

    spec = model.spec
    turns = [Turn("system", system)] if system is not None else []
    # A stand-in answer: the segments before it are the prompt with the generation prompt,
    # found the same way for named and Jinja templates (eval.generation).
    turns += [Turn("user", prompt), Turn("assistant", "answer")]
    videos = videos or []
    conv = Conversation("prompt", turns, list(map(str, images)), list(map(str, videos)))
    segments, _ = prompt_and_reference(conv, template)
    param = next(model.parameters())
    if spec.vision is not None:
        ids, inputs = _native_prompt(spec, tokenizer, segments, images, videos, budget)
        batch = {"text": torch.tensor([ids], dtype=torch.long, device=param.device)}
        batch |= {k: [x.to(param.device, param.dtype) for x in v] if k != "video_fps" else v
                  for k, v in inputs.items()}  # fmt: skip
    else:
        image_token_id = spec.projector.image_token_id if spec.projector is not None else -1
        ids = encode_segments(segments, tokenizer, image_token_id).input_ids
        batch = {"text": torch.tensor([ids], dtype=torch.long, device=param.device)}
    if spec.projector is not None:
        transform = ImageTransform.from_stem(spec.towers[spec.projector.tower].stem, False)
        pixels = []
        for path in images:
            try:
                pixels.append(transform.decode(path.read_bytes()))
            except (MediaError, OSError, ValueError) as err:
                raise UsageError(f"--image {path}: cannot be read as an image ({err})") from None
        size, channels = transform.size, transform.channels
        stacked = torch.stack(pixels) if pixels else torch.zeros(0, channels, size, size)
        batch["image"] = stacked.to(param.device, param.dtype)
    stops = stop_ids(template, tokenizer, spec.decoder.eos_ids)
    generator = torch.Generator(param.device).manual_seed(seed)
    model.eval()
    new = model.generate(
        batch,
        max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        generator=generator,
        eos_ids=stops,
    )[0].tolist()
    end = next((i for i, token in enumerate(new) if token in stops), len(new))
    return tokenizer.decode(new[:end]).strip()
