"""The options of `mmtrain data build` and their checks: `BuildOptions` -> (`Source`, `BuildConfig`).

`BuildOptions` holds one field per flag of `mmtrain data build`, named as the flag is
(`--min-side` is `min_side`; `--no-progress` is `progress`), with the flag's default.
`config_from_options` validates them (errors name the flag at fault) and turns them into the
source to read and the build configuration; `command_line` gives the canonical command recorded
in the manifest and the fingerprint that decides whether a rerun may resume a build.

Library code (no flag parsing, it prints nothing), so that the CLI (`commands/_data_args.py`
declares the flags and fills a `BuildOptions` from them) and `quickstart` (which builds shards in
process) turn the same options into the same build, recorded as the same command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.data.ingest.filters import FilterConfig
from mmtrain.data.ingest.outcome import ProcessOptions
from mmtrain.data.ingest.pipeline import BuildConfig
from mmtrain.data.ingest.sources import MODALITIES, Source, open_source, parse_columns
from mmtrain.data.ingest.video_clips import DEFAULT_KEYFRAME_INTERVAL, ClipOptions
from mmtrain.data.storage.remote_cache import default_cache_dir
from mmtrain.data.storage.s3 import is_remote, staging_dir
from mmtrain.data.stream.media import DEFAULT_MAX_PIXELS
from mmtrain.structured import FieldError

__all__ = [
    "BuildOptions",
    "CHAT_IGNORED",
    "NOT_IN_FINGERPRINT",
    "command_line",
    "config_from_options",
    "flag",
    "option_defaults",
]

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
# Options whose flag is not `--` + the field name with dashes.
_FLAGS = {"progress": "--no-progress"}


def _cpu_count() -> int:
    return os.cpu_count() or 1


@dataclass
class BuildOptions:
    """One field per flag of `mmtrain data build`, in the order `--help` lists them (the order
    of the recorded command); the defaults are the flags' defaults."""

    src: str  # SRC: folder of files, table, shards or chat data
    out: Path | str  # --out: a local folder or an s3:// URL
    modalities: str | None = None  # comma-separated; None: all found
    columns: str | None = None
    image_root: Path | None = None
    # media
    image_max_side: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    audio_rate: int = 16000
    timeseries_window: int | None = None
    fix_text: bool = False
    # video
    video_clip_seconds: float | None = None
    video_scene_threshold: float | None = None
    video_min_clip_seconds: float = 1.0
    video_keyframe_interval: int | None = None
    video_max_side: int | None = None
    # filters (each off unless given)
    dedup: bool = False
    near_dup_bits: int | None = None
    min_side: int | None = None
    max_aspect: float | None = None
    min_sharpness: float | None = None
    min_caption_chars: int | None = None
    max_caption_chars: int | None = None
    min_caption_words: int | None = None
    max_caption_words: int | None = None
    min_video_seconds: float | None = None
    min_audio_dbfs: float | None = None
    relevance_model: str | None = None
    relevance_threshold: float | None = None
    relevance_top_fraction: float | None = None
    relevance_tokenizer: str = "byte"
    relevance_device: str = "cpu"
    # shards and run
    max_samples_per_shard: int = 10_000
    max_shard_bytes: int = 1 << 30
    max_reject_rate: float = 0.1
    workers: int = field(default_factory=_cpu_count)
    progress: bool = True


def option_defaults() -> dict[str, Any]:
    """The default of every option that has one (what leaving its flag out means)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(BuildOptions):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def flag(name: str) -> str:
    """The command-line flag of option `name` (`min_side` -> `--min-side`)."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def command_line(options: BuildOptions) -> tuple[str, str]:
    """The canonical command (options that differ from their defaults) and its fingerprint,
    which leaves out the options that cannot change the shards (workers, reject rate, device)."""
    defaults = option_defaults()
    words, kept = ["mmtrain", "data", "build", str(options.src)], []
    for f in dataclasses.fields(BuildOptions):
        if f.name == "src":
            continue
        value = getattr(options, f.name)
        if f.name in defaults and value == defaults[f.name]:
            continue
        part = [flag(f.name)] if isinstance(value, bool) else [flag(f.name), str(value)]
        words += part
        if f.name not in NOT_IN_FINGERPRINT:
            kept += part
    fingerprint = hashlib.sha256(json.dumps([str(options.src), *kept]).encode()).hexdigest()[:16]
    return shlex.join(words), fingerprint


def _filter_config(options: BuildOptions) -> FilterConfig:
    try:
        return FilterConfig(
            exact_duplicates=options.dedup,
            near_duplicate_bits=options.near_dup_bits,
            min_side=options.min_side,
            max_aspect=options.max_aspect,
            min_sharpness=options.min_sharpness,
            min_caption_chars=options.min_caption_chars,
            max_caption_chars=options.max_caption_chars,
            min_caption_words=options.min_caption_words,
            max_caption_words=options.max_caption_words,
            min_video_s=options.min_video_seconds,
            min_audio_dbfs=options.min_audio_dbfs,
            relevance_threshold=options.relevance_threshold,
            relevance_top_fraction=options.relevance_top_fraction,
        )
    except ValueError as err:
        raise FieldError("filters", str(err)) from None


def _modalities(options: BuildOptions, source: Source) -> tuple[str, ...]:
    if options.modalities:
        names = [m.strip() for m in options.modalities.split(",") if m.strip()]
        unknown = [m for m in names if m not in MODALITIES]
        if unknown:
            raise FieldError(
                "--modalities", f"{', '.join(unknown)}: not one of {', '.join(MODALITIES)}"
            )
        return tuple(m for m in MODALITIES if m in names)
    found = source.modalities()
    if not found:
        raise FieldError(
            "SRC", f"{options.src}: no image, video, audio, time-series or text files found"
        )
    return tuple(found)


def _check_options(options: BuildOptions) -> None:
    for name in ("max_samples_per_shard", "max_shard_bytes", "workers", "max_pixels", "audio_rate"):
        if getattr(options, name) < 1:
            raise FieldError(flag(name), "must be at least 1")
    for name in ("image_max_side", "timeseries_window"):
        if getattr(options, name) is not None and getattr(options, name) < 1:
            raise FieldError(flag(name), "must be at least 1")
    splits_video = (
        options.video_clip_seconds is not None or options.video_scene_threshold is not None
    )
    if splits_video and options.timeseries_window is not None:
        raise FieldError(
            "--timeseries-window",
            "cannot be combined with --video-clip-seconds or --video-scene-threshold: each cuts a "
            "sample into several; build the two modalities separately",
        )
    if not 0 <= options.max_reject_rate <= 1:
        raise FieldError("--max-reject-rate", "must be between 0 and 1")
    if options.fix_text:
        try:
            import ftfy  # noqa: F401
        except ImportError:
            raise FieldError(
                "--fix-text", "mojibake repair needs the ftfy package (pip install ftfy)"
            ) from None
    relevance = (
        options.relevance_threshold is not None or options.relevance_top_fraction is not None
    )
    if relevance != (options.relevance_model is not None):
        raise FieldError(
            "--relevance-model",
            "give a model folder together with --relevance-threshold or --relevance-top-fraction",
        )
    out = options.out
    if not is_remote(out) and Path(options.src).resolve() == Path(out).resolve():
        raise FieldError("--out", f"{out} is SRC; write the shards to another folder")


def _clip_options(options: BuildOptions) -> ClipOptions | None:
    """The video options, or None when videos are stored as they are."""
    given = (options.video_clip_seconds, options.video_scene_threshold)
    given += (options.video_keyframe_interval, options.video_max_side)
    if all(value is None for value in given):
        return None
    try:
        return ClipOptions(
            clip_s=options.video_clip_seconds,
            scene_threshold=options.video_scene_threshold,
            min_clip_s=options.video_min_clip_seconds,
            keyframe_interval=DEFAULT_KEYFRAME_INTERVAL
            if options.video_keyframe_interval is None
            else options.video_keyframe_interval,
            max_side=options.video_max_side,
        )
    except ValueError as err:  # the message starts with the ClipOptions field at fault
        field_name = str(err).split()[0]
        raise FieldError(VIDEO_FLAGS.get(field_name, "--video-clip-seconds"), str(err)) from None


# Options that mean nothing for chat data (see data/ingest/conversation_items.py), and why.
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


def _check_chat_options(options: BuildOptions) -> None:
    for name, why in CHAT_IGNORED.items():
        if getattr(options, name) not in (None, False):
            raise FieldError(flag(name), f"does not apply to chat data: {why}")


def config_from_options(options: BuildOptions) -> tuple[Source, BuildConfig]:
    """Validate the options; the source to read and the build configuration."""
    _check_options(options)
    out_dir = options.out if is_remote(options.out) else Path(options.out)
    if is_remote(options.out):  # built locally first: the staging folder makes reruns resume
        out_dir = staging_dir(options.out, default_cache_dir().parent)
    filters = _filter_config(options)
    video = _clip_options(options)
    if video is not None and video.splits:
        # A video shorter than the minimum clip gives no clip: filter it, counted as short_video.
        shortest = max(filters.min_video_s or 0.0, video.min_clip_s)
        filters = dataclasses.replace(filters, min_video_s=shortest)
    source = open_source(
        str(options.src), parse_columns(options.columns), out_dir, options.image_root
    )
    if source.kind == "conversations":
        _check_chat_options(options)
    relevance_size = None
    if filters.needs_relevance:
        from mmtrain.spec import ModelSpec

        spec = ModelSpec.load(Path(options.relevance_model) / "spec.yaml")
        towers = [t for t in spec.towers.values() if t.modality == "image"]
        if not towers:
            raise FieldError("--relevance-model", f"{options.relevance_model} has no image tower")
        relevance_size = towers[0].stem.image_size
    modalities = _modalities(options, source)
    if filters.needs_relevance and not {"image", "text"} <= set(modalities):
        raise FieldError("--modalities", "the relevance filter needs image and text")
    process = ProcessOptions(
        modalities=modalities,
        image_max_side=options.image_max_side,
        max_pixels=options.max_pixels,
        audio_rate=options.audio_rate,
        timeseries_window=options.timeseries_window,
        video=video,
        fix_text=options.fix_text,
        sharpness=filters.min_sharpness is not None,
        phash=filters.near_duplicate_bits is not None,
        relevance_size=relevance_size,
    )
    command, fingerprint = command_line(options)
    config = BuildConfig(
        out_dir=out_dir,
        publish_to=str(options.out) if is_remote(options.out) else None,
        process=process,
        filters=filters,
        max_samples_per_shard=options.max_samples_per_shard,
        max_shard_bytes=options.max_shard_bytes,
        max_reject_rate=options.max_reject_rate,
        workers=options.workers,
        command=command,
        fingerprint=fingerprint,
        relevance_model=options.relevance_model,
        relevance_device=options.relevance_device,
        relevance_tokenizer=options.relevance_tokenizer,
    )
    return source, config
