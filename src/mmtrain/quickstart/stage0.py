"""Stage 0 of the demos built on the image-text quickstart (`--vlm`, `--diffusion`): its CLIP,
trained here into OUT/clip, or a finished one given with `--clip`.

The VLM takes the CLIP's image tower as its vision tower; the diffusion demo takes the whole
CLIP as its offline feature extractor (FD, conditional accuracy, CLIP score). Both use the
same emoji and the same split by key, so neither the CLIP nor the later model saw the
held-out emoji.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmtrain.quickstart.common import Phase, StepHook
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.quickstart.emoji_data import list_emoji, write_attribution, write_raw
from mmtrain.quickstart.image_text import run_image_text
from mmtrain.structured import FieldError


@dataclass
class ClipStage:
    """What stage 0 gave: the CLIP's run folder, the emoji images written (raw folder, or None
    when not asked for), its held-out retrieval and its steps (both None when given)."""

    run: Path
    raw: Path | None
    retrieval: dict[str, Any] | None
    steps: int | None


def clip_run_folder(path: Path) -> Path:
    """The run folder of an image-text quickstart given as its OUT folder or its run folder."""
    for candidate in (path, path / "run"):
        if (candidate / "model.safetensors").is_file() and (candidate / "spec.yaml").is_file():
            return candidate
    raise FieldError(
        "--clip",
        f"{path} holds no finished run (model.safetensors + spec.yaml, or run/ with them); "
        "give the --out folder of `mmtrain quickstart`, or leave --clip out to train one here",
    )


def clip_stage(
    given: Path | None,
    config: QuickstartConfig,
    out: Path,
    phase: Phase,
    on_step: StepHook | None,
    *,
    images: Path | None = None,
) -> ClipStage:
    """The CLIP run `given` (its OUT or run folder), or the image-text quickstart `config`
    trained into `config.out`. The emoji images with their names come back as `raw`: the
    CLIP's own when trained here, written into `images` when given (None: not written).
    OUT/ATTRIBUTION.txt is written."""
    out.mkdir(parents=True, exist_ok=True)
    if given is not None:
        run = clip_run_folder(given)
        phase("clip", f"taken from {run}")
        if images is not None:
            write_raw(list_emoji(config.limit), images, config.val_fraction)
        write_attribution(out)
        return ClipStage(run, images, None, None)
    phase("clip", f"{config.steps} steps, into {config.out}")
    clip = run_image_text(
        config,
        on_phase=lambda name, detail: phase(f"clip:{name}", detail),
        on_step=on_step,
    )
    write_attribution(out)  # the same text as the CLIP's: images and names
    return ClipStage(clip.paths.run, clip.paths.raw, clip.retrieval, clip.steps)


__all__ = ["ClipStage", "clip_run_folder", "clip_stage"]
