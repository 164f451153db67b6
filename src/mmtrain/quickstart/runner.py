"""`run_quickstart`: run the demo a `QuickstartConfig` asks for.

Images only (the default) is the image-text demo (`image_text`); any other modalities, the
`--modalities` demo (`modalities`). Both hand back a `QuickstartResult`.
"""

from __future__ import annotations

from mmtrain.quickstart.common import Phase, QuickstartResult, StepHook
from mmtrain.quickstart.config import DEFAULT_MODALITIES, QuickstartConfig
from mmtrain.quickstart.image_text import run_image_text
from mmtrain.quickstart.modalities import run_modalities


def run_quickstart(
    config: QuickstartConfig,
    on_phase: Phase | None = None,
    on_step: StepHook | None = None,
) -> QuickstartResult:
    """The image-text demo, or the `--modalities` demo when `config.modalities` names more
    than images. Raises `emoji_data.MissingPackages` (before writing anything) when an
    optional package is missing and FieldError for bad settings."""
    config.validate()
    if tuple(config.modalities) != DEFAULT_MODALITIES:
        return run_modalities(config, on_phase, on_step)
    return run_image_text(config, on_phase, on_step)


__all__ = ["run_quickstart"]
