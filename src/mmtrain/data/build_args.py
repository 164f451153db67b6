"""The options of `mmtrain data build` and their checks: parsed flags -> (`Source`, `BuildConfig`).

`add_build_arguments` declares the flags; `config_from_args` validates them (errors name the flag
at fault) and turns them into the source to read and the build configuration; `command_line`
gives the canonical command recorded in the manifest and the fingerprint that decides whether a
rerun may resume a build.

Library code (it prints nothing), kept apart from the build so that both the CLI
(`commands/data.py`, which also prints the summary) and `quickstart` (which builds shards in
process) turn the same flags into the same build.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shlex
from pathlib import Path

from mmtrain.data.filters import FilterConfig
from mmtrain.data.ingest import BuildConfig
from mmtrain.data.media import DEFAULT_MAX_PIXELS
from mmtrain.data.process import ProcessOptions
from mmtrain.data.remote import is_remote, staging_dir
from mmtrain.data.shard_cache import default_cache_dir
from mmtrain.data.sources import MODALITIES, Source, open_source, parse_columns
from mmtrain.data.video_clips import DEFAULT_KEYFRAME_INTERVAL, ClipOptions
from mmtrain.structured import FieldError

# ClipOptions fields -> the flags that set them (for error messages).
VIDEO_FLAGS = {
    "clip_s": "--video-clip-seconds",
    "scene_threshold": "--video-scene-threshold",
    "min_clip_s": "--video-min-clip-seconds",
    "keyframe_interval": "--video-keyframe-interval",
    "max_side": "--video-max-side",
}
# Options that do not change the shards: a rerun that differs only in these resumes.
NOT_IN_FINGERPRINT = {"out", "workers", "max_reject_rate", "relevance_device", "progress"}


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `mmtrain data build` (commands/data.py wires them to `run_build`)."""
    parser.add_argument(
        "src",
        metavar="SRC",
        help="folder of files, CSV/TSV/JSONL/parquet table, shards, or chat data (LLaVA .json, "
        "LLaVA or ShareGPT messages .jsonl)",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=_out_location,
        help="output folder (shards, manifest), or s3://bucket/prefix/ (built in a local "
        "staging folder, each shard uploaded when complete, the manifest last)",
    )
    parser.add_argument(
        "--modalities",
        help=f"required modalities, comma-separated ({','.join(MODALITIES)}); default: all found",
    )
    parser.add_argument(
        "--columns", help="table columns per modality, e.g. image=filepath,text=caption"
    )
    parser.add_argument(
        "--image-root",
        type=Path,
        help="chat data (LLaVA / ShareGPT .json or .jsonl): folder the image paths start from "
        "(default: the file's folder)",
    )
    media = parser.add_argument_group("media")
    media.add_argument("--image-max-side", type=int, help="re-encode larger images to this side")
    media.add_argument(
        "--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, help="refuse larger images (bombs)"
    )
    media.add_argument("--audio-rate", type=int, default=16000, help="resample audio to this rate")
    media.add_argument("--timeseries-window", type=int, help="cut time-series into windows of N")
    media.add_argument("--fix-text", action="store_true", help="repair mojibake (needs ftfy)")
    video = parser.add_argument_group(
        "video (each flag but --video-min-clip-seconds re-encodes videos to MP4, H.264 when "
        "available; audio tracks are dropped)"
    )
    video.add_argument(
        "--video-clip-seconds",
        type=float,
        metavar="S",
        help="cut videos (within scenes) into windows of S s",
    )
    video.add_argument(
        "--video-scene-threshold",
        type=float,
        metavar="T",
        help="cut at frames differing from the previous one by more than T levels "
        "(mean absolute RGB difference of 64-px-wide thumbnails, 0-255; about 30 for hard cuts)",
    )
    video.add_argument(
        "--video-min-clip-seconds",
        type=float,
        metavar="S",
        default=1.0,
        help="shortest scene and clip kept when cutting (shorter videos are filtered)",
    )
    video.add_argument(
        "--video-keyframe-interval",
        type=int,
        metavar="N",
        help=f"a keyframe every N frames (default {DEFAULT_KEYFRAME_INTERVAL} when re-encoding)",
    )
    video.add_argument(
        "--video-max-side", type=int, metavar="PIXELS", help="downscale frames to this longer side"
    )
    f = parser.add_argument_group("filters (each off unless given)")
    f.add_argument("--dedup", action="store_true", help="drop exact duplicates (sha256)")
    f.add_argument(
        "--near-dup-bits", type=int, help="drop images within N pHash bits of a kept one"
    )
    f.add_argument("--min-side", type=int, help="drop images whose shorter side is smaller")
    f.add_argument(
        "--max-aspect", type=float, help="drop images with a longer/shorter side ratio above"
    )
    f.add_argument("--min-sharpness", type=float, help="drop blurry images (Laplacian variance)")
    f.add_argument("--min-caption-chars", type=int)
    f.add_argument("--max-caption-chars", type=int)
    f.add_argument("--min-caption-words", type=int)
    f.add_argument("--max-caption-words", type=int)
    f.add_argument("--min-video-seconds", type=float, help="drop shorter videos")
    f.add_argument("--min-audio-dbfs", type=float, help="drop audio quieter than this RMS level")
    f.add_argument("--relevance-model", help="mmtrain model folder scoring image-text relevance")
    f.add_argument("--relevance-threshold", type=float, help="drop CLIP scores below (0..100)")
    f.add_argument("--relevance-top-fraction", type=float, help="keep the best-scored fraction")
    f.add_argument("--relevance-tokenizer", default="byte", help="the model's tokenizer")
    f.add_argument("--relevance-device", default="cpu", help="device for the relevance model")
    run = parser.add_argument_group("shards and run")
    run.add_argument("--max-samples-per-shard", type=int, default=10_000)
    run.add_argument("--max-shard-bytes", type=int, default=1 << 30)
    run.add_argument(
        "--max-reject-rate", type=float, default=0.1, help="fail (exit 2) above this reject rate"
    )
    run.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decoding processes")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def command_line(args: argparse.Namespace) -> tuple[str, str]:
    """The canonical command (options that differ from their defaults) and its fingerprint,
    which leaves out the options that cannot change the shards (workers, reject rate, device)."""
    reference = argparse.ArgumentParser(add_help=False)
    add_build_arguments(reference)
    words, kept = ["mmtrain", "data", "build", str(args.src)], []
    for action in reference._actions:
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        part = [flag] if isinstance(value, bool) else [flag, str(value)]
        words += part
        if action.dest not in NOT_IN_FINGERPRINT:
            kept += part
    fingerprint = hashlib.sha256(json.dumps([str(args.src), *kept]).encode()).hexdigest()[:16]
    return shlex.join(words), fingerprint


def _filter_config(args: argparse.Namespace) -> FilterConfig:
    try:
        return FilterConfig(
            exact_duplicates=args.dedup,
            near_duplicate_bits=args.near_dup_bits,
            min_side=args.min_side,
            max_aspect=args.max_aspect,
            min_sharpness=args.min_sharpness,
            min_caption_chars=args.min_caption_chars,
            max_caption_chars=args.max_caption_chars,
            min_caption_words=args.min_caption_words,
            max_caption_words=args.max_caption_words,
            min_video_s=args.min_video_seconds,
            min_audio_dbfs=args.min_audio_dbfs,
            relevance_threshold=args.relevance_threshold,
            relevance_top_fraction=args.relevance_top_fraction,
        )
    except ValueError as err:
        raise FieldError("filters", str(err)) from None


def _modalities(args: argparse.Namespace, source: Source) -> tuple[str, ...]:
    if args.modalities:
        names = [m.strip() for m in args.modalities.split(",") if m.strip()]
        unknown = [m for m in names if m not in MODALITIES]
        if unknown:
            raise FieldError(
                "--modalities", f"{', '.join(unknown)}: not one of {', '.join(MODALITIES)}"
            )
        return tuple(m for m in MODALITIES if m in names)
    found = source.modalities()
    if not found:
        raise FieldError(
            "SRC", f"{args.src}: no image, video, audio, time-series or text files found"
        )
    return tuple(found)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("max_samples_per_shard", "max_shard_bytes", "workers", "max_pixels", "audio_rate"):
        if getattr(args, name) < 1:
            raise FieldError(f"--{name.replace('_', '-')}", "must be at least 1")
    for name in ("image_max_side", "timeseries_window"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise FieldError(f"--{name.replace('_', '-')}", "must be at least 1")
    splits_video = args.video_clip_seconds is not None or args.video_scene_threshold is not None
    if splits_video and args.timeseries_window is not None:
        raise FieldError(
            "--timeseries-window",
            "cannot be combined with --video-clip-seconds or --video-scene-threshold: each cuts a "
            "sample into several; build the two modalities separately",
        )
    if not 0 <= args.max_reject_rate <= 1:
        raise FieldError("--max-reject-rate", "must be between 0 and 1")
    if args.fix_text:
        try:
            import ftfy  # noqa: F401
        except ImportError:
            raise FieldError(
                "--fix-text", "mojibake repair needs the ftfy package (pip install ftfy)"
            ) from None
    relevance = args.relevance_threshold is not None or args.relevance_top_fraction is not None
    if relevance != (args.relevance_model is not None):
        raise FieldError(
            "--relevance-model",
            "give a model folder together with --relevance-threshold or --relevance-top-fraction",
        )
    if not is_remote(args.out) and Path(args.src).resolve() == args.out.resolve():
        raise FieldError("--out", f"{args.out} is SRC; write the shards to another folder")


def _clip_options(args: argparse.Namespace) -> ClipOptions | None:
    """The video options, or None when videos are stored as they are."""
    flags = (args.video_clip_seconds, args.video_scene_threshold)
    flags += (args.video_keyframe_interval, args.video_max_side)
    if all(flag is None for flag in flags):
        return None
    try:
        return ClipOptions(
            clip_s=args.video_clip_seconds,
            scene_threshold=args.video_scene_threshold,
            min_clip_s=args.video_min_clip_seconds,
            keyframe_interval=DEFAULT_KEYFRAME_INTERVAL
            if args.video_keyframe_interval is None
            else args.video_keyframe_interval,
            max_side=args.video_max_side,
        )
    except ValueError as err:  # the message starts with the ClipOptions field at fault
        field_name = str(err).split()[0]
        raise FieldError(VIDEO_FLAGS.get(field_name, "--video-clip-seconds"), str(err)) from None


def _out_location(text: str) -> Path | str:
    """`--out`: a local folder, or an s3:// URL (kept as text: a Path would fold its '//')."""
    return text if is_remote(text) else Path(text)


# Flags that mean nothing for chat data (see data/conversation_ingest.py), and why.
CHAT_IGNORED = {
    "near_dup_bits": "several conversations about one image are not duplicates (use --dedup)",
    "relevance_threshold": "a conversation is no caption to score",
    "relevance_top_fraction": "a conversation is no caption to score",
    "min_caption_chars": "a conversation is no caption",
    "max_caption_chars": "a conversation is no caption",
    "min_caption_words": "a conversation is no caption",
    "max_caption_words": "a conversation is no caption",
    "fix_text": "chat templates are whitespace-sensitive: text is kept as written",
}


def _check_chat_flags(args: argparse.Namespace) -> None:
    for name, why in CHAT_IGNORED.items():
        if getattr(args, name) not in (None, False):
            raise FieldError(f"--{name.replace('_', '-')}", f"does not apply to chat data: {why}")


def config_from_args(args: argparse.Namespace) -> tuple[Source, BuildConfig]:
    """Validate the parsed options; the source to read and the build configuration."""
    _check_args(args)
    out_dir = args.out
    if is_remote(args.out):  # built locally first: the staging folder makes reruns resume
        out_dir = staging_dir(args.out, default_cache_dir().parent)
    filters = _filter_config(args)
    video = _clip_options(args)
    if video is not None and video.splits:
        # A video shorter than the minimum clip gives no clip: filter it, counted as short_video.
        shortest = max(filters.min_video_s or 0.0, video.min_clip_s)
        filters = dataclasses.replace(filters, min_video_s=shortest)
    source = open_source(str(args.src), parse_columns(args.columns), out_dir, args.image_root)
    if source.kind == "conversations":
        _check_chat_flags(args)
    relevance_size = None
    if filters.needs_relevance:
        from mmtrain.spec import ModelSpec

        spec = ModelSpec.load(Path(args.relevance_model) / "spec.yaml")
        towers = [t for t in spec.towers.values() if t.modality == "image"]
        if not towers:
            raise FieldError("--relevance-model", f"{args.relevance_model} has no image tower")
        relevance_size = towers[0].stem.image_size
    modalities = _modalities(args, source)
    if filters.needs_relevance and not {"image", "text"} <= set(modalities):
        raise FieldError("--modalities", "the relevance filter needs image and text")
    process = ProcessOptions(
        modalities=modalities,
        image_max_side=args.image_max_side,
        max_pixels=args.max_pixels,
        audio_rate=args.audio_rate,
        timeseries_window=args.timeseries_window,
        video=video,
        fix_text=args.fix_text,
        sharpness=filters.min_sharpness is not None,
        phash=filters.near_duplicate_bits is not None,
        relevance_size=relevance_size,
    )
    command, fingerprint = command_line(args)
    config = BuildConfig(
        out_dir=out_dir,
        publish_to=str(args.out) if is_remote(args.out) else None,
        process=process,
        filters=filters,
        max_samples_per_shard=args.max_samples_per_shard,
        max_shard_bytes=args.max_shard_bytes,
        max_reject_rate=args.max_reject_rate,
        workers=args.workers,
        command=command,
        fingerprint=fingerprint,
        relevance_model=args.relevance_model,
        relevance_device=args.relevance_device,
        relevance_tokenizer=args.relevance_tokenizer,
    )
    return source, config
