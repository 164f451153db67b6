"""What `mmtrain quickstart` runs: `QuickstartConfig`, its defaults per demo, `--modalities`.

The image-text demo and the `--modalities` demo share one config; `make_config` fills in the
defaults of the modalities asked for, then the CLI's flags. The defaults of the image-text demo
are explained (and were measured) in `mmtrain.quickstart.image_text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmtrain.structured import FieldError

MODALITIES = ("image", "audio", "timeseries")  # text is always there: everything binds to it
DEFAULT_MODALITIES = ("image",)  # the plain image-text quickstart


@dataclass
class QuickstartConfig:
    """What `mmtrain quickstart` runs; the defaults are tuned for 2 CPU cores and 5 minutes."""

    out: Path = Path("runs/quickstart")
    steps: int = 450  # fixed, so results do not depend on machine load
    minutes: float = 5.0  # upper bound on training time: fewer steps on a slower machine
    fit_budget: bool = True  # time the steps first and cut them to `minutes` if needed
    batch_size: int = 64
    lr: float = 1e-3  # 2e-3 sits at the chance loss for 50+ steps; 5e-4 learns half as fast
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    image_size: int = 32
    patch_size: int = 8
    context_length: int = 48  # bytes of the bare emoji name (90% fit whole)
    layers: int | None = 2  # transformer blocks per tower (None: tiny-clip's 5)
    text_pooling: str = "mean"  # tiny-clip's "eot" learns ~3x slower here (image_text docstring)
    val_fraction: float = 0.1  # share of emoji keys held out (by hash of the key)
    limit: int | None = None  # use an evenly spaced subset of this many emoji (tests)
    evals: int = 2  # validations during training (the last one is at the final step)
    build_workers: int = 2
    seed: int = 0
    # Towers besides text: ("image",) is the image-text quickstart; more in `modalities`.
    modalities: tuple[str, ...] = DEFAULT_MODALITIES

    def validate(self) -> None:
        if self.steps < 1:
            raise FieldError("--steps", f"must be at least 1, got {self.steps}")
        if not self.minutes > 0:
            raise FieldError("--minutes", f"must be positive, got {self.minutes}")
        if not 0 < self.val_fraction < 1:
            raise FieldError("val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        if self.limit is not None and self.limit < 20:
            raise FieldError("--limit", f"needs at least 20 emoji, got {self.limit}")
        for name in ("batch_size", "image_size", "patch_size", "context_length", "evals"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if tuple(self.modalities) != parse_modalities(",".join(self.modalities)):
            raise FieldError("--modalities", "give some of image, audio, timeseries in that order")


# With --modalities (more than images): batches of 32, as the sensor set has only 40
# recordings (a larger batch would repeat them as each other's negatives); steps measured to
# keep the whole run within about 5 minutes on 2 cores (README).
MODALITIES_DEFAULTS: dict[str, Any] = {"batch_size": 32, "steps": 900}


def make_config(modalities: tuple[str, ...] = DEFAULT_MODALITIES, **given: Any) -> QuickstartConfig:
    """A QuickstartConfig with the defaults of `modalities`, then the `given` fields that
    are not None (the CLI's flags)."""
    defaults = {} if tuple(modalities) == DEFAULT_MODALITIES else dict(MODALITIES_DEFAULTS)
    chosen = {name: value for name, value in given.items() if value is not None}
    return QuickstartConfig(modalities=tuple(modalities), **{**defaults, **chosen})


def parse_modalities(text: str | None) -> tuple[str, ...]:
    """`--modalities image,audio,timeseries` -> ("image", "audio", "timeseries") in that order.

    `text` may be listed (it is always included) and nothing else besides MODALITIES.
    """
    if text is None:
        return DEFAULT_MODALITIES
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in (*MODALITIES, "text")]
    if unknown:
        raise FieldError(
            "--modalities",
            f"{unknown[0]!r} is not one of {', '.join(MODALITIES)} (text is always included)",
        )
    chosen = tuple(m for m in MODALITIES if m in names)
    if not chosen:
        raise FieldError("--modalities", f"name at least one of {', '.join(MODALITIES)}")
    return chosen


__all__ = [
    "DEFAULT_MODALITIES",
    "MODALITIES",
    "MODALITIES_DEFAULTS",
    "QuickstartConfig",
    "make_config",
    "parse_modalities",
]
