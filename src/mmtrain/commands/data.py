"""`mmtrain data build|inspect|order`: make WebDataset shards, look at them and at their order.

- `build SRC --out DIR [...]`: ingest files, a table or shards into filtered shards with a
  manifest (flags in `mmtrain.commands._data_args`, the work in `mmtrain.data.ingest.pipeline`);
  prints a summary and exits 2 when the reject rate is too high.
- `inspect DIR|PATTERN [--verify] [--json] [--contact-sheet FILE.png]`: shards, samples, sample
  counts per extension and modality, the manifest's filter statistics and command, sizes and
  sha256 checked against the manifest, refused (unsafe) members and damaged shards; `--verify`
  decodes every member and lists corrupt ones (logic in `mmtrain.data.ingest.inspect`). Exit
  code 1 when a shard does not match its manifest, is damaged, or holds corrupt samples; 2 bad
  input.
- `order DIR|PATTERN --seed S --epoch E [--world-size W --rank R] [--skip N] [--limit N]`: the keys
  rank R reads in epoch E, one per line, after N global samples were consumed — the tool to debug
  reproducibility (`--skip` is what a resumed loader has behind it: steps x global batch).
  `--buckets 16x16,12x20` orders as a denoiser's bucketed loader does (steps of one shape).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mmtrain.cli import UsageError
from mmtrain.commands._args import bucket_shapes, count
from mmtrain.commands._data_args import (
    add_budget_argument,
    add_build_arguments,
    config_from_args,
    visual_budget,
)
from mmtrain.data.ingest import pipeline
from mmtrain.data.ingest.inspect import contact_sheet, inspect_shards, open_shards
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.loader import planned_samples

ORDER = 30


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="build and inspect WebDataset shards, show their order")
    commands = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    build = commands.add_parser("build", help="files, a table or shards -> filtered shards")
    add_build_arguments(build)
    build.set_defaults(func=run_build)

    inspect = commands.add_parser(
        "inspect",
        help="shards, samples, modalities; verify the manifest and decode samples",
        description="Report shards, samples, modalities, sizes and the manifest's filter "
        "statistics; check shards against the manifest; optionally decode every sample "
        "(--verify) and draw a contact sheet. Exit code: 0 clean; 1 when a shard does not "
        "match its manifest, a shard is damaged (truncated) or --verify finds corrupt samples; "
        "2 bad input (no shards, unreadable manifest, bad option).",
    )
    inspect.add_argument("shards", nargs="+", help="shard folder, .tar file, glob or brace pattern")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument("--no-hash", action="store_true", help="check sizes only, not sha256")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="decode every member with the loader's decoders; list failures under 'corrupt'",
    )
    inspect.add_argument(
        "--contact-sheet", metavar="FILE.png", help="write a PNG grid of a few samples with keys"
    )
    inspect.add_argument(
        "--sheet-samples", type=count, default=16, help="samples on the contact sheet (default 16)"
    )
    inspect.add_argument(
        "--tokenizer", help="conversation shards: count tokens with this tokenizer.json / folder"
    )
    inspect.add_argument(
        "--chat-template",
        help="with --tokenizer: vicuna-v1, chatml, llama-3, plain or a tokenizer_config.json",
    )
    inspect.add_argument(
        "--image-tokens",
        type=count,
        default=1,
        help="LM positions one image takes (the model's; e.g. 576 for LLaVA-1.5), default 1",
    )
    inspect.add_argument(
        "--model",
        help="a native-resolution VLM (e.g. Qwen2.5-VL-7B): each page's and clip's tokens from "
        "its size under the model's pixel budget, instead of --image-tokens",
    )
    add_budget_argument(inspect, "with --model")
    inspect.set_defaults(func=run_inspect)

    order = commands.add_parser("order", help="the keys a rank reads, in order")
    order.add_argument("shards", nargs="+", help="shard folder, .tar file, glob or brace pattern")
    order.add_argument("--seed", type=int, required=True)
    order.add_argument("--epoch", type=int, required=True)
    order.add_argument("--world-size", type=count, default=1)
    order.add_argument("--rank", type=int, default=0)
    order.add_argument("--skip", type=count, default=0, help="global samples already consumed")
    order.add_argument("--limit", type=count, default=None, help="print at most N keys")
    order.add_argument(
        "--batch-size", type=count, default=1, help="per-rank batch (sets the padding)"
    )
    order.add_argument("--drop-tail", action="store_true", help="drop the tail instead of padding")
    order.add_argument("--shuffle-window", type=count, default=1000)
    order.add_argument("--no-shuffle", action="store_true", help="shard order, no shuffling")
    order.add_argument("--with-shard", action="store_true", help="print 'position shard key'")
    order.add_argument(
        "--buckets",
        type=bucket_shapes,
        metavar="HxW,...",
        help="shape buckets, as data.buckets (HxW, or TxHxW for clips): each step one bucket's",
    )
    order.add_argument("--bucket-input", choices=("image", "video", "latent"), default="image",
                       help="what the buckets measure: the samples' images (default), clips or "
                       ".npy latents")  # fmt: skip
    order.add_argument("--video-stride", type=count, help="as data.video_stride, for clips")
    order.set_defaults(func=run_order)

    latents = commands.add_parser(
        "encode-latents",
        help="image or clip shards -> latent shards for a latent denoiser (a VAE encodes each "
        "sample once)",
        description="Encode every image of SHARDS with the diffusers AutoencoderKL in --vae into "
        "a float32 .npy latent (scaled as the denoiser sees it), copying the samples' other "
        "members (.cls, .json, .txt); --flip adds each mirror image as its own sample (key_flip). "
        "--text-encoder MODEL_DIR also stores each caption's text for an MMDiT "
        "(.text_hidden.npy, .text_pooled.npy; samples without a .txt caption are skipped). "
        "--pipeline DIR takes both from a diffusers pipeline folder: its vae/, and its own "
        "encode_prompt for the captions (SD3: CLIP-L + CLIP-G + T5; FLUX.1: CLIP-L + T5; "
        "Wan 2.1: UMT5). "
        "Video: with a video VAE (a WanPipeline folder's AutoencoderKLWan, or such a folder as "
        "--vae, run as diffusers' own class) each clip's first F frames are encoded, F every "
        "frame that fits the VAE's 1 + k x T rule (T its scale_factor_temporal: 4 for Wan) or "
        "--frames F; a clip shorter than --frames is refused by key. Frames are resized to "
        "cover --size (square) or their --buckets FxHxW (the nearest aspect ratio among the "
        "buckets whose frames the clip holds, then the most frames); images are 1-frame clips. "
        "Each sample stores .latent.npy [C, 1 + (F-1)/T, H/8, W/8] (for Wan), the VAE's "
        "latent mean normalised as WanPipeline un-normalises it: (z - latents_mean) / "
        "latents_std; Wan's captions store .text_hidden.npy alone (no pooled vector). Train "
        "with data.buckets of the latent shapes the command prints.",
    )
    latents.add_argument("shards", help="shard folder, .tar file, glob or brace pattern")
    source = latents.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--vae",
        metavar="VAE_DIR",
        help="an AutoencoderKL folder (images), or diffusers' AutoencoderKLWan (clips and images)",
    )
    source.add_argument(
        "--pipeline",
        metavar="PIPELINE_DIR",
        help="a diffusers pipeline folder (model_index.json: StableDiffusion3Pipeline, "
        "FluxPipeline, WanPipeline): its VAE encodes the images or clips, its text encoders "
        "the captions",
    )
    shape = latents.add_mutually_exclusive_group(required=True)
    shape.add_argument(
        "--size", type=count, help="image or frame side before encoding (the square)"
    )
    shape.add_argument(
        "--buckets",
        type=bucket_shapes,
        metavar="HxW,...",
        help="encode each image at its aspect-ratio bucket instead (pixel shapes, multiples of "
        "the VAE's downscale; FxHxW for a video VAE, F frames by its rule): train with "
        "data.buckets of the latent shapes",
    )
    latents.add_argument(
        "--frames",
        type=count,
        metavar="F",
        help="video VAE with --size: encode each clip's first F frames (1 + k x T; default: "
        "every frame that fits)",
    )
    latents.add_argument("--out", required=True, help="the folder of the latent shards")
    latents.add_argument("--flip", action="store_true", help="also store each mirror image")
    latents.add_argument("--batch-size", type=count, default=None,
                         help="samples per encode (default 16; clips through a video VAE: 1, "
                         "and 16 captions)")  # fmt: skip
    latents.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    latents.add_argument(
        "--text-encoder",
        metavar="MODEL_DIR",
        help="a model folder with a text tower (a CLIP trained with mmtrain, or converted from "
        "OpenCLIP): also cache each caption's hidden states and pooled embedding for an MMDiT",
    )
    latents.add_argument(
        "--max-sequence-length",
        type=count,
        metavar="N",
        help="with --pipeline: T5's (UMT5's) tokens a caption (default: the pipeline's own, "
        "what it generates with: 256 for SD3, 512 for FLUX.1 and Wan)",
    )
    latents.set_defaults(func=run_encode_latents)


IMAGES_PER_ENCODE = 16  # --batch-size's default for images and captions
CLIPS_PER_ENCODE = 1  # and for clips: a clip's activations in the VAE are frames x an image's


def run_encode_latents(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.pipeline is not None:
        _pipeline_class(args.pipeline)  # a folder of no supported pipeline: said first
    flag = "--pipeline" if args.pipeline else "--vae"
    vae_dir = str(Path(args.pipeline) / "vae") if args.pipeline else str(args.vae)
    video = _video_vae(vae_dir, flag, device)
    if video is not None:
        return _encode_clips(args, video, vae_dir, device)
    if args.frames is not None:
        raise UsageError(f"--frames: {vae_dir} is an image VAE (AutoencoderKL); frames are a "
                         "video VAE's (AutoencoderKLWan)")  # fmt: skip
    return _encode_images(args, vae_dir, device)


def _encode_images(args: argparse.Namespace, vae_dir: str, device: Any) -> int:
    from mmtrain.data.ingest.latents import encode_latent_shards
    from mmtrain.data.ingest.pipeline_encoders import component_identity

    batch_size = args.batch_size or IMAGES_PER_ENCODE
    encoder, provenance, named = _encoders(args, device, batch_size)
    vae = _vae(vae_dir, "--pipeline" if args.pipeline else "--vae", device)
    vae_identity = {"vae": component_identity(vae_dir)}
    provenance["components"] = {**vae_identity, **provenance.get("components", {})}
    down = vae.config.downscale()
    sides = [args.size] if args.size is not None else [n for b in args.buckets for n in b]
    flag = "--size" if args.size is not None else "--buckets"
    if any(side == 0 or side % down for side in sides):
        raise UsageError(f"{flag}: sides must be positive multiples of the VAE's {down}x")
    if args.buckets is not None and any(len(b) != 2 for b in args.buckets):
        raise UsageError("--buckets: an image's buckets are HxW")
    try:
        counts = encode_latent_shards(args.shards, vae, args.out, size=args.size or 0,
                                      flip=args.flip, batch_size=batch_size,
                                      vae_name=vae_dir, text_encoder=encoder,
                                      buckets=args.buckets, provenance=provenance)  # fmt: skip
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(f"{args.shards}: {err}") from None
    shapes = [(args.size, args.size)] if args.size is not None else args.buckets
    latents = [[h // down, w // down] for h, w in shapes]
    channels = vae.config.latent_channels
    skipped = f"{counts['skipped']} samples without a readable image"
    if encoder is not None:
        skipped += f", {counts['no_caption']} without a readable .txt caption"
    held = ", ".join(str([channels, *shape]) for shape in latents)
    print(f"wrote {counts['samples']} latents {held} to {args.out} ({skipped} skipped)")
    if args.buckets is not None:
        print(f"train a denoiser on them with data.buckets: {latents}")
    if encoder is not None:
        print(_text_line(encoder, named))
    return 0


def _encode_clips(args: argparse.Namespace, video: Any, vae_dir: str, device: Any) -> int:
    """`encode-latents` through a video VAE: clips (images as 1-frame clips) -> video latents."""
    from mmtrain.data.ingest.pipeline_encoders import component_identity
    from mmtrain.data.ingest.video_latents import encode_video_latent_shards

    _check_clip_shapes(args, video)
    text_batch = args.batch_size or IMAGES_PER_ENCODE
    encoder, provenance, named = _encoders(args, device, text_batch)
    provenance["components"] = {"vae": component_identity(vae_dir),
                                **provenance.get("components", {})}  # fmt: skip
    try:
        counts, shapes = encode_video_latent_shards(
            args.shards, video, args.out, size=args.size or 0, frames=args.frames,
            buckets=args.buckets, batch_size=args.batch_size or CLIPS_PER_ENCODE,
            text_encoder=encoder, text_batch_size=text_batch, provenance=provenance,
            vae_name=vae_dir)  # fmt: skip
    except (FileNotFoundError, ValueError) as err:
        raise UsageError(f"{args.shards}: {err}") from None
    filled = [s["latent"] for s in shapes if s["samples"]]
    skipped = f"{counts['skipped']} samples without a readable clip or image"
    if encoder is not None:
        skipped += f", {counts['no_caption']} without a readable .txt caption"
    held = ", ".join(str([video.channels, *latent]) for latent in filled) or "(none)"
    print(f"wrote {counts['samples']} latents {held} to {args.out} ({skipped} skipped)")
    print(f"train a denoiser on them with data.buckets: {filled}")
    if encoder is not None:
        print(_text_line(encoder, named))
    return 0


def _check_clip_shapes(args: argparse.Namespace, video: Any) -> None:
    """--size / --buckets / --frames against a video VAE's rule (UsageError naming the flag)."""
    if args.flip:
        raise UsageError("--flip: a mirrored clip moves the other way (and its caption's left "
                         "and right with it); clips are encoded as they are")  # fmt: skip
    if args.frames is not None:
        if args.buckets is not None:
            raise UsageError("--frames: with --buckets each bucket gives its clips' frames")
        try:
            video.check_frames(args.frames)
        except ValueError as err:
            raise UsageError(f"--frames {args.frames}: {err}") from None
    sides = [args.size] if args.size is not None else []
    for bucket in args.buckets or ():
        if len(bucket) != 3:
            raise UsageError("--buckets: a video VAE's buckets are FxHxW (frames x height x "
                             f"width), got {'x'.join(map(str, bucket))}")  # fmt: skip
        try:
            video.check_frames(bucket[0])
        except ValueError as err:
            raise UsageError(f"--buckets {'x'.join(map(str, bucket))}: {err}") from None
        sides += bucket[1:]
    flag = "--size" if args.size is not None else "--buckets"
    if any(side == 0 or side % video.spatial for side in sides):
        raise UsageError(f"{flag}: sides must be positive multiples of the VAE's {video.spatial}x")


def _text_line(encoder: Any, named: str) -> str:
    """What the command says of the cached text and the denoiser that takes it."""
    s = encoder.shape
    if s.pooled_width:
        return (f"with text [{s.text_tokens}, {s.text_width}] + pooled [{s.pooled_width}] from "
                f"{named}: an MMDiT on them takes {s}")  # fmt: skip
    return (f"with text [{s.text_tokens}, {s.text_width}] (no pooled vector) from {named}: a "
            f"cross-attention denoiser on them takes {s}")  # fmt: skip


def _pipeline_class(folder: str) -> str:
    """The class of a pipeline folder of a supported family (UsageError otherwise)."""
    from mmtrain.data.ingest.pipeline_encoders import PipelineFolderError, read_model_index

    try:
        return read_model_index(folder)[0]
    except PipelineFolderError as err:
        raise UsageError(f"--pipeline: {err}") from None


def _video_vae(folder: str, flag: str, device: Any) -> Any:
    """The video VAE of a diffusers VAE folder of a video class (diffusers' own class); None
    for an AutoencoderKL folder (or none readable: mmtrain's reader says why); UsageError
    naming any other class."""
    from mmtrain.data.ingest.video_latents import (
        VIDEO_VAES,
        VideoVAEError,
        load_video_vae,
        vae_class_name,
    )

    name = vae_class_name(folder)
    if name is None or name == "AutoencoderKL":
        return None
    if name not in VIDEO_VAES:
        raise UsageError(f"{flag} {folder}: a {name}; mmtrain encodes with AutoencoderKL "
                         f"(images) and {', '.join(VIDEO_VAES)} (clips and images)")  # fmt: skip
    try:
        return load_video_vae(folder, device=device)
    except (OSError, VideoVAEError) as err:
        raise UsageError(f"{flag} {folder}: {err}") from None


def _encoders(args: argparse.Namespace, device: Any, batch_size: int) -> tuple[Any, dict, str]:
    """(text encoder or None, what the manifest records of the pipeline and its text
    encoders, the encoder's name) of --text-encoder or of --pipeline."""
    if args.pipeline is None:
        if args.max_sequence_length is not None:
            raise UsageError("--max-sequence-length: a pipeline's T5 length; give --pipeline")
        encoder = _text_encoder(args.text_encoder, device, batch_size)
        return encoder, {}, str(args.text_encoder)
    if args.text_encoder is not None:
        raise UsageError("--text-encoder: --pipeline encodes captions with its own encoders")
    from mmtrain.data.ingest.pipeline_encoders import (
        PipelineFolderError,
        load_pipeline_text_encoder,
        pipeline_identity,
    )

    folder = Path(args.pipeline)
    try:
        encoder = load_pipeline_text_encoder(folder, device=device, batch_size=batch_size,
                                             max_sequence_length=args.max_sequence_length)  # fmt: skip
    except PipelineFolderError as err:
        raise UsageError(f"--pipeline: {err}") from None
    provenance = {"pipeline": pipeline_identity(folder), "components": encoder.components}
    named = f"{encoder.class_name}'s encode_prompt ({encoder.family.names}, {folder})"
    return encoder, provenance, named


def _vae(folder: str, flag: str, device: Any) -> Any:
    """mmtrain's AutoencoderKL of a diffusers VAE folder, in eval mode on `device`."""
    from mmtrain.models.formats.diffusers import read_diffusers_vae
    from mmtrain.structured import FieldError

    try:
        return read_diffusers_vae(folder).to(device).eval()
    except (OSError, FieldError) as err:
        raise UsageError(f"{flag} {folder}: {err}") from None


def _text_encoder(folder: str | None, device: Any, batch_size: int) -> Any:
    """The frozen text encoder of --text-encoder (None without the flag)."""
    if folder is None:
        return None
    from mmtrain.data.ingest.text_features import load_text_encoder
    from mmtrain.structured import FieldError

    try:
        return load_text_encoder(folder, device=device, batch_size=batch_size)
    except (OSError, FieldError, ValueError) as err:
        raise UsageError(f"--text-encoder: {err}") from None


def _spec(shards: list[str]) -> str | list[str]:
    return shards[0] if len(shards) == 1 else shards


def run_build(args: argparse.Namespace) -> int:
    """`mmtrain data build`: build, print a summary; exit 2 when the reject rate is too high."""
    source, config = config_from_args(args)
    show = args.progress and sys.stderr.isatty()
    if show:
        from rich.progress import Progress as Bar

        with Bar(transient=True) as bar:
            tasks: dict[str, Any] = {}

            def update(phase: str, done: int, total: int | None) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=total)
                bar.update(tasks[phase], completed=done)

            report = pipeline.build(source, config, update)
    else:
        report = pipeline.build(source, config)
    counts = report.manifest["counts"]
    if report.already_complete:
        print(f"already built: {len(report.shards)} shard(s) verified against their sha256")
    elif report.resumed_at_shard is not None:
        print(f"resumed: {report.resumed_at_shard} finished shard(s) verified and kept")
    print(
        f"{counts['samples']} samples in {len(report.shards)} shard(s) from "
        f"{counts['source_items']} source items; {counts['rejected']} rejected, "
        f"{counts['filtered']} filtered"
    )
    removed = report.manifest["filters"]["removed"]
    if removed:
        print("filtered: " + ", ".join(f"{k} {v}" for k, v in removed.items()))
    if not report.ok:
        print(
            f"mmtrain data build: error: reject rate {report.reject_rate:.1%} is above "
            f"--max-reject-rate {config.max_reject_rate:.1%}; see {config.out_dir / pipeline.REJECTS_NAME} "
            "(no manifest written)",
            file=sys.stderr,
        )
        return 2
    if config.publish_to is not None:
        print(f"uploaded {len(report.shards)} shard(s) and the manifest to {config.publish_to}")
    print(f"wrote {config.out_dir / 'manifest.json'}")
    return 0


def run_order(args: argparse.Namespace) -> int:
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank {args.rank} is not in 0..{args.world_size - 1}")
    if args.seed < 0 or args.epoch < 0 or args.skip < 0 or args.batch_size < 1:
        raise UsageError("--seed, --epoch and --skip must be >= 0 and --batch-size >= 1")
    sources = ShardSet.open(_spec(args.shards))
    samples = planned_samples(
        sources,
        seed=args.seed,
        epoch=args.epoch,
        rank=args.rank,
        world_size=args.world_size,
        skip=args.skip,
        batch_size=args.batch_size,
        drop_tail=args.drop_tail,
        shuffle=not args.no_shuffle,
        shuffle_window=args.shuffle_window,
        buckets=_bucket_ids(args, sources),
    )
    for n, (position, shard, key) in enumerate(samples):
        if args.limit is not None and n >= args.limit:
            break
        print(f"{position}\t{Path(shard).name}\t{key}" if args.with_shard else key)
    return 0


def _bucket_ids(args: argparse.Namespace, sources: ShardSet) -> Any:
    if args.buckets is None:
        return None
    from mmtrain.data.stream.buckets import NO_BUCKET, Buckets
    from mmtrain.data.stream.sample_sizes import bucket_ids

    shapes = tuple(args.buckets)
    ids, counts = bucket_ids([sources], Buckets(shapes, args.bucket_input, args.video_stride))
    if counts.get(NO_BUCKET, 0) == len(ids):
        raise UsageError(f"--buckets {args.buckets}: no sample falls in any bucket")
    return ids


def run_inspect(args: argparse.Namespace) -> int:
    sheet = Path(args.contact_sheet) if args.contact_sheet else None
    if sheet is not None:
        if sheet.suffix.lower() != ".png":
            raise UsageError(f"--contact-sheet {sheet}: the file name must end in .png")
        if not sheet.parent.is_dir():
            raise UsageError(f"--contact-sheet {sheet}: folder {sheet.parent} does not exist")
    if args.sheet_samples < 1:
        raise UsageError("--sheet-samples must be >= 1")
    spec = _spec(args.shards)
    tokenizer, template = _conversation_tools(args)
    report = inspect_shards(
        spec,
        check_hash=not args.no_hash,
        verify=args.verify,
        tokenizer=tokenizer,
        template=template,
        image_tokens=args.image_tokens,
        **_visual_budget(args),
    )
    if sheet is not None:
        sources = open_shards(spec)[2]
        report["contact_sheet"] = {
            "path": str(sheet),
            "keys": contact_sheet(sources, sheet, count=args.sheet_samples),
        }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 1 if report["problems"] else 0


def _visual_budget(args: argparse.Namespace) -> dict[str, Any]:
    """`--model` (a native-resolution VLM) with its `--budget KEY=VALUE` settings: the budget
    the loader would apply (data.vision) and whether it wraps each input in start / end ids,
    as `inspect_shards` keywords ({} without --model)."""
    if args.model is None:
        if args.budget:
            raise UsageError("--budget needs --model (a native-resolution VLM)")
        return {}
    from mmtrain.spec import load_spec

    spec = load_spec(args.model)
    if spec.vision is None:
        raise UsageError(
            f"--model {args.model}: not a native-resolution VLM (no vision); use --image-tokens"
        )
    choice = visual_budget(spec, args.budget)
    return {"budget": choice.budget, "wrap": choice.wrap}


def _conversation_tools(args: argparse.Namespace) -> tuple[Any, Any]:
    """The tokenizer and chat template that count a conversation's tokens (both or none)."""
    if (args.tokenizer is None) != (args.chat_template is None):
        raise UsageError("--tokenizer and --chat-template go together (tokens need both)")
    if args.image_tokens < 1:
        raise UsageError("--image-tokens must be >= 1")
    if args.tokenizer is None:
        return None, None
    from mmtrain.data.stream.chat_templates import get_template
    from mmtrain.data.stream.tokenizer import get_tokenizer

    return get_tokenizer(args.tokenizer, language_model=True), get_template(args.chat_template)


def _print_conversations(summary: dict[str, Any]) -> None:
    refused = summary["refused"]
    why = ", ".join(f"{kind} {n:,}" for kind, n in refused.items())
    print(
        f"  chats       {summary['samples']:,} conversations, {sum(refused.values()):,} refused"
        + (f" ({why})" if why else "")
    )
    names = ("positions", "text_ids", "images") if "positions" in summary else ("images",)
    names = (*names, "videos", *(n for n in ("visual_tokens", "page_tokens") if n in summary))
    for name in (*names, *(() if "positions" in summary else ("text_bytes",))):
        stats = summary[name]
        figures = ", ".join(f"{k} {stats[k]:,.0f}" for k in ("mean", "p50", "p90", "p99", "max"))
        print(f"  {name:<11} {figures}")
    if "note" in summary:
        print(f"  note        {summary['note']}")


def _print_report(report: dict[str, Any]) -> None:
    listing = ", ".join(f"{k} {v:,}" for k, v in report["modalities"].items()) or "none recognised"
    print(f"{report['path']}: {len(report['shards'])} shards, {report['samples']:,} samples, "
          f"{report['bytes'] / 2**20:,.1f} MiB")  # fmt: skip
    print(f"  modalities  {listing}")
    print(f"  extensions  {', '.join(f'{k} {v:,}' for k, v in report['extensions'].items())}")
    if report["manifest"]:
        checked = "sizes and sha256" if report["verified"] == "sha256" else "sizes"
        bad = len({p.split(":", 1)[0] for p in report["mismatched"]})
        print(f"  manifest    {len(report['shards']) - bad}/{len(report['shards'])} shards match "
              f"({checked})")  # fmt: skip
        if report["command"]:
            print(f"  built by    {report['command']}")
        for name, value in report["filters"].items():
            print(f"  filter      {name}: {value}")
    else:
        print("  manifest    none (shards read as they are, nothing to verify against)")
    if report["decoded"]:
        print(f"  decoded     {report['decoded']:,} samples: {report['corrupt_samples']:,} corrupt")
    if report["unsafe"]:
        print(f"  refused     {len(report['unsafe'])} member(s) (never reach a sample):")
        for m in report["unsafe"][:20]:
            print(f"    {m['shard']}: {m['member']}: {m['reason']}")
    if report.get("conversations"):
        _print_conversations(report["conversations"])
    if "contact_sheet" in report:
        sheet = report["contact_sheet"]
        print(f"  contact     {sheet['path']} ({len(sheet['keys'])} samples)")
    for problem in report["problems"][:50]:
        print(f"  PROBLEM     {problem}")
    if len(report["problems"]) > 50:
        print(f"  ...         {len(report['problems']) - 50} more (--json lists all)")
