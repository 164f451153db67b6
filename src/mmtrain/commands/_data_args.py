"""Data flags shared by commands (a helper module, not a command: its name starts with _).

- `mmtrain data build`: argparse declarations -> `BuildOptions` -> the build.
  `add_build_arguments` declares one flag per field of `data.ingest.options.BuildOptions` (same
  name, same default); `options_from_args` reads them back and `config_from_args` validates them
  (errors name the flag at fault) into the source to read and the build configuration, through
  `data.ingest.options.config_from_options`, which `quickstart` calls without a command line.
- `--budget KEY=VALUE` (repeatable), a native-resolution VLM's pixel budget as a run's
  `data.vision` sets it, for `data inspect --model` and `plan --data`: `add_budget_argument`
  declares it, `visual_budget` turns it into the loader's `VisualBudget` (errors name --budget).

Imports of the data package happen inside the functions: `mmtrain plan` declares `--budget`
from here and must stay quick to start (no numpy, no PIL until it reads data).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmtrain.config import VisionDataConfig
    from mmtrain.data.ingest.options import BuildOptions
    from mmtrain.data.ingest.pipeline import BuildConfig
    from mmtrain.data.ingest.sources import Source
    from mmtrain.spec import ModelSpec
    from mmtrain.visual_budget import VisualBudget

__all__ = [
    "add_build_arguments",
    "options_from_args",
    "config_from_args",
    "add_budget_argument",
    "budget_settings",
    "visual_budget",
    "BudgetChoice",
]

BUDGET_FLAG = "--budget"


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `mmtrain data build` (commands/data.py wires them to `run_build`): one
    flag per `BuildOptions` field, with its default."""
    from mmtrain.data.ingest.options import option_defaults
    from mmtrain.data.ingest.sources import MODALITIES
    from mmtrain.data.ingest.video_clips import DEFAULT_KEYFRAME_INTERVAL

    d = option_defaults()
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
        "--max-pixels", type=int, default=d["max_pixels"], help="refuse larger images (bombs)"
    )
    media.add_argument(
        "--audio-rate", type=int, default=d["audio_rate"], help="resample audio to this rate"
    )
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
        default=d["video_min_clip_seconds"],
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
    f.add_argument(
        "--relevance-tokenizer", default=d["relevance_tokenizer"], help="the model's tokenizer"
    )
    f.add_argument(
        "--relevance-device", default=d["relevance_device"], help="device for the relevance model"
    )
    run = parser.add_argument_group("shards and run")
    run.add_argument("--max-samples-per-shard", type=int, default=d["max_samples_per_shard"])
    run.add_argument("--max-shard-bytes", type=int, default=d["max_shard_bytes"])
    run.add_argument(
        "--max-reject-rate",
        type=float,
        default=d["max_reject_rate"],
        help="fail (exit 2) above this reject rate",
    )
    run.add_argument("--workers", type=int, default=d["workers"], help="decoding processes")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> BuildOptions:
    """The `BuildOptions` of parsed flags (other attributes of `args` are ignored)."""
    from mmtrain.data.ingest.options import BuildOptions

    return BuildOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BuildOptions)})


def config_from_args(args: argparse.Namespace) -> tuple[Source, BuildConfig]:
    """Validate the parsed flags; the source to read and the build configuration."""
    from mmtrain.data.ingest.options import config_from_options

    return config_from_options(options_from_args(args))


def _out_location(text: str) -> Path | str:
    """`--out`: a local folder, or an s3:// URL (kept as text: a Path would fold its '//')."""
    from mmtrain.data.storage.s3 import is_remote

    return text if is_remote(text) else Path(text)


# ----------------------------------------------------------------------------- --budget
def add_budget_argument(parser: argparse.ArgumentParser, needs: str) -> None:
    """`--budget KEY=VALUE` (repeatable): a `data.vision` setting; `needs` says which flag
    it goes with (`with --model`, `with --data`)."""
    parser.add_argument(
        BUDGET_FLAG,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{needs}: a native-resolution VLM's data.vision setting (image_max_tokens=1280, "
        "sample_max_tokens=8192, image_min_tokens=..., frame_max_tokens=..., video_fps=...), "
        "as the run sets it (repeatable; default the spec's own budget)",
    )


def budget_settings(items: list[str]) -> VisionDataConfig:
    """The `data.vision` settings `--budget KEY=VALUE` items give (values read as YAML, as a
    run config's); UsageError / FieldError naming --budget when one is malformed, unknown or
    out of range."""
    import yaml

    from mmtrain.cli import UsageError
    from mmtrain.config import VisionDataConfig
    from mmtrain.structured import from_dict

    values = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(
                f"{BUDGET_FLAG} {item!r}: expected KEY=VALUE, e.g. image_max_tokens=1280"
            )
        try:
            values[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UsageError(f"{BUDGET_FLAG} {item!r}: {value!r} is not a value") from None
    settings = from_dict(VisionDataConfig, values, BUDGET_FLAG)
    settings.validate(BUDGET_FLAG)
    return settings


@dataclass(frozen=True)
class BudgetChoice:
    """What `--budget` chose for a native VLM: the settings (`data.vision`), the loader's
    budget they make, and whether the model wraps each input in start / end ids."""

    settings: VisionDataConfig
    budget: VisualBudget
    wrap: bool

    def to_dict(self) -> dict:
        """The settings and the pixels they allow, for --json."""
        b = self.budget
        return {
            "settings": dataclasses.asdict(self.settings),
            "image_min_pixels": b.image_min_pixels,
            "image_max_pixels": b.image_max_pixels,
            "sample_max_tokens": b.sample_max_tokens,
            "frame_min_pixels": b.frames.min_pixels,
            "frame_max_pixels": b.frames.max_pixels,
            "wrap": self.wrap,
        }


def visual_budget(spec: ModelSpec, items: list[str]) -> BudgetChoice:
    """The budget the loader applies to `spec`'s inputs under `--budget` `items` (a run with
    those `data.vision` settings), and whether it wraps inputs (VisionTokens.start_id)."""
    from mmtrain.visual_budget import budget_of

    assert spec.vision is not None
    settings = budget_settings(items)
    wrap = spec.vision_tokens is not None and spec.vision_tokens.start_id is not None
    return BudgetChoice(settings, budget_of(spec.vision, settings), wrap)
