"""`mmtrain quickstart --modalities image,audio,timeseries`: bind more than images to text.

One model with a tower per modality asked for, plus the text tower they all align to (the
ImageBind idea: every modality is paired with text only, never with each other):

    Twemoji + names ──▶ image-text pairs      ─┐
    names ──eSpeak NG──▶ spoken-caption pairs ─┼─ mmtrain data build ─▶ one shard set each
    BasicMotions .ts ──▶ sensor-caption pairs ─┘        │
        mmtrain train: the sources are mixed by step (each step one source, by weight), and
        each step aligns the pair its source holds: (image, text), (audio, text) or
        (timeseries, text)
        ──▶ held-out retrieval both ways for every pair, zero-shot activity recognition for
            the time-series ──▶ OUT/run/eval.json, report.html

The data: spoken captions are the emoji names (the same train/validation split by key as the
images) read by eSpeak NG at a rate and pitch drawn per name, resampled to the audio tower's
16 kHz and stored as FLAC. The sensor set is BasicMotions (smartwatch accelerometer and
gyroscope of a person standing, walking, running or playing badminton): its 40 TRAIN
recordings are captioned from templates ("someone running"), its 40 TEST recordings are held
out. Nothing is downloaded: the speech engine and the sensor files come in pip packages
(`modalities` extra; licences in the README and OUT/ATTRIBUTION.txt).

Sizes were chosen to stay well within 5 minutes on 2 cores (module `image_text` docstring for
the image-text part): batches of 32 (the sensor set has only 40 recordings, and a batch larger
than the set would repeat samples as each other's negatives), audio as 32 mel bands x 3 s in
8x8 patches (72 tokens), sensors as 6 channels x 96 steps in patches of 8 (12 tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmtrain.quickstart.budget import fit_steps, time_steps
from mmtrain.quickstart.common import (
    QuickstartResult,
    begin,
    build_shards,
    chance_levels,
    run_config_dict,
)
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.quickstart.emoji_data import (
    INSTALL_HINT,
    REQUIRED,
    Emoji,
    MissingPackages,
    RawSplit,
    caption,
    is_validation,
    list_emoji,
    write_attribution,
    write_raw,
)
from mmtrain.quickstart.image_text import quickstart_spec
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

# Import name -> pip requirement of the `modalities` extra, per modality.
MODALITY_REQUIRED = {
    "audio": {"espeakng_loader": "espeakng-loader==0.2.4"},
    "timeseries": {"sktime": "sktime==1.2.0"},
}
MODALITIES_HINT = (
    "pip install 'mmtrain[quickstart,modalities]' "
    "(in a checkout: .venv/bin/pip install -e '.[quickstart,modalities]')"
)
# Share of the training steps each source gets (renormalised over the modalities asked for).
STEP_WEIGHTS = {"image": 0.5, "audio": 0.35, "timeseries": 0.15}

ATTRIBUTION_AUDIO = """
Spoken captions (audio)
  The emoji names above, spoken by eSpeak NG {espeak_version} (https://github.com/espeak-ng/espeak-ng,
  GPL-3.0-or-later) from the `espeakng-loader` Python package, which ships the library and its
  voice data. mmtrain loads the library at run time only to make this demo's audio; it neither
  links nor redistributes it. Voice "en", rate and pitch drawn per caption from sha256(KEY);
  resampled to {sample_rate} Hz and stored as 16-bit FLAC.
"""
ATTRIBUTION_SERIES = """
Sensor time-series
  BasicMotions, from the UEA multivariate time series classification archive
  (Bagnall et al., "The UEA multivariate time series classification archive, 2018",
  arXiv:1811.00075; https://timeseriesclassification.com), as shipped in the `sktime` Python
  package {sktime_version} (BSD-3-Clause). Smartwatch accelerometer and gyroscope, 6 channels x
  100 steps at 10 Hz; classes Standing, Walking, Running, Badminton. TRAIN (40) is used for
  training, TEST (40) is held out. Captions are written from templates by mmtrain.
"""


def check_modality_packages(modalities: tuple[str, ...]) -> None:
    """Raise MissingPackages naming every package the chosen modalities need that is not
    installed (the emoji names are needed for images and spoken captions alike)."""
    import importlib.util

    required = dict(REQUIRED) if {"image", "audio"} & set(modalities) else {}
    for modality in modalities:
        required.update(MODALITY_REQUIRED.get(modality, {}))
    missing = [req for mod, req in required.items() if importlib.util.find_spec(mod) is None]
    if missing:
        only_base = all(req in REQUIRED.values() for req in missing)
        raise MissingPackages(missing, INSTALL_HINT if only_base else MODALITIES_HINT)


# ----------------------------------------------------------------------------- raw data
def write_spoken(
    items: list[Emoji], out_dir: Path, val_fraction: float, sample_rate: int
) -> RawSplit:
    """`train|val/KEY.flac + KEY.txt` under `out_dir`: each emoji name spoken, split as the
    images are (by KEY), so held-out names are never heard in training."""
    from mmtrain.quickstart.speech import Speaker, to_flac, voice_for

    split = RawSplit(out_dir / "train", out_dir / "val", 0, 0)
    split.train_dir.mkdir(parents=True, exist_ok=True)
    split.val_dir.mkdir(parents=True, exist_ok=True)
    with Speaker() as speaker:
        for item in items:
            text = caption(item)
            wave = speaker.speak(text, voice_for(item.key))
            held_out = is_validation(item.key, val_fraction)
            folder = split.val_dir if held_out else split.train_dir
            (folder / f"{item.key}.flac").write_bytes(
                to_flac(wave, speaker.sample_rate, sample_rate)
            )
            (folder / f"{item.key}.txt").write_text(text + "\n", encoding="utf-8")
            split.val += held_out
            split.train += not held_out
    return split


def write_motions(out_dir: Path) -> tuple[RawSplit, list[str]]:
    """`train|val/KEY.npy + KEY.txt + KEY.cls` from BasicMotions TRAIN and TEST; returns the
    split and the activity of each class index (what the `.cls` numbers mean)."""
    from mmtrain.quickstart.series import ACTIVITIES, basic_motions_files, read_ts, series_caption

    classes = list(ACTIVITIES)
    split = RawSplit(out_dir / "train", out_dir / "val", 0, 0)
    for file, folder, prefix in zip(
        basic_motions_files(), (split.train_dir, split.val_dir), ("train", "test"), strict=True
    ):
        data = read_ts(file)
        folder.mkdir(parents=True, exist_ok=True)
        for i, (series, label) in enumerate(zip(data.series, data.labels, strict=True)):
            if label not in ACTIVITIES:
                raise ValueError(f"{file}: unexpected class {label!r}")
            key = f"basicmotions-{prefix}-{i:03d}"
            np.save(folder / f"{key}.npy", series)
            (folder / f"{key}.txt").write_text(series_caption(key, label) + "\n", encoding="utf-8")
            (folder / f"{key}.cls").write_text(f"{classes.index(label)}\n", encoding="utf-8")
        count = len(data.labels)
        split.train, split.val = (count, split.val) if prefix == "train" else (split.train, count)
    return split, [ACTIVITIES[c] for c in classes]


def attribution_text(modalities: tuple[str, ...], sample_rate: int) -> str:
    """The licence notes of the audio and sensor data, for ATTRIBUTION.txt."""
    from importlib.metadata import version

    text = ""
    if "audio" in modalities:
        text += ATTRIBUTION_AUDIO.format(espeak_version=_espeak_version(), sample_rate=sample_rate)
    if "timeseries" in modalities:
        text += ATTRIBUTION_SERIES.format(sktime_version=version("sktime"))
    return text


def _espeak_version() -> str:
    """eSpeak NG's version from the library's file name (libespeak-ng.so.1.52.0), if shown."""
    from mmtrain.quickstart.speech import _library_paths

    folder = _library_paths()[0].parent
    names = sorted(p.name for p in folder.glob("libespeak-ng.so.*.*.*"))
    return names[-1].split(".so.", 1)[1] if names else "(version not shown)"


# ----------------------------------------------------------------------------- model
def modalities_spec(image_text: ModelSpec, modalities: tuple[str, ...]) -> ModelSpec:
    """The quickstart's image-text model plus an audio and a time-series tower of the same
    width and depth, each paired with text (without "image", the image tower is dropped)."""
    data = image_text.to_dict()
    text = data["towers"]["text"]
    body = {k: text[k] for k in ("width", "layers", "heads")}
    towers: dict[str, Any] = {}
    if "image" in modalities:
        towers["image"] = data["towers"]["image"]
    if "audio" in modalities:
        towers["audio"] = {
            "modality": "audio",
            "stem": {"sample_rate": 16000, "n_mels": 32, "n_fft": 400, "hop": 320,
                     "clip_seconds": 3.0, "patch": 8},
            **body,
            "pooling": "mean",
        }  # fmt: skip
    if "timeseries" in modalities:
        towers["timeseries"] = {
            "modality": "timeseries",
            "stem": {"channels": 6, "length": 96, "patch": 8},
            **body,
            "pooling": "mean",
        }
    towers["text"] = text
    data.update(
        name="quickstart-" + "-".join([*modalities, "text"]),
        towers=towers,
        pairs=[[m, "text"] for m in modalities],
    )
    spec = ModelSpec.from_dict(data)
    spec.validate()
    return spec


def step_weights(modalities: tuple[str, ...]) -> dict[str, float]:
    """Each source's share of the steps (STEP_WEIGHTS over the modalities asked for)."""
    total = sum(STEP_WEIGHTS[m] for m in modalities)
    return {m: STEP_WEIGHTS[m] / total for m in modalities}


# ----------------------------------------------------------------------------- evaluation
@dataclass
class HeldOut:
    """One held-out set to evaluate: its shards, the pair, and zero-shot classes (or none)."""

    modality: str
    shards: Path
    class_names: list[str] | None = None
    templates: tuple[str, ...] = ()


def evaluate_held_out(
    run_dir: Path, sets: list[HeldOut], step: int, batch_size: int = 256
) -> dict[str, Any]:
    """Retrieval both ways for each (modality, text) pair on its held-out set, zero-shot
    accuracy where classes are given; written to RUN_DIR/eval.json and returned.

    eval.json: "retrieval" holds every direction ("audio->text", "text->audio", ...) with R@k
    and n_queries; "chance" the R@k of a random ranking for each; "zeroshot" per tower;
    "sets" each set's data path and sample count.
    """
    from mmtrain import __version__, load_model
    from mmtrain.atomic import atomic_write_text
    from mmtrain.eval.run import Evaluator, ZeroShotConfig

    model = load_model(run_dir).eval()
    document: dict[str, Any] = {
        "schema_version": 1,
        "model": str(run_dir),
        "model_name": model.spec.name,
        "mmtrain_version": __version__,
        "step": step,
        "retrieval": {},
        "chance": {},
        "sets": {},
    }
    for held in sets:
        zeroshot = None
        if held.class_names:
            zeroshot = ZeroShotConfig(held.class_names, list(held.templates), ks=(1,))
        evaluator = Evaluator(
            # Only the set's two towers: zero-shot would otherwise decode every non-text one.
            only_towers(model.spec, (held.modality, "text")),
            held.shards,
            batch_size=batch_size,
            pairs=[(held.modality, "text")],
            zeroshot=zeroshot,
            rank=0,
            world_size=1,
        )
        try:
            report = evaluator.report(model)
        finally:
            evaluator.close()
        n = report["n_samples"]
        document["sets"][held.modality] = {"data": str(held.shards), "n_samples": n}
        for direction, metrics in report.get("retrieval", {}).items():
            document["retrieval"][direction] = metrics
            document["chance"][direction] = chance_levels(n)
        if "zeroshot" in report:
            document.setdefault("zeroshot", {}).update(report["zeroshot"])
            document["chance"][f"zeroshot/{held.modality}"] = {"top1": 1 / len(held.class_names)}
    atomic_write_text(run_dir / "eval.json", json.dumps(document, indent=2) + "\n")
    return document


def only_towers(spec: ModelSpec, names: tuple[str, ...]) -> ModelSpec:
    """`spec` cut to the towers `names` and the pairs between them."""
    data = spec.to_dict()
    data["towers"] = {n: t for n, t in data["towers"].items() if n in names}
    data["pairs"] = [p for p in data["pairs"] if set(p) <= set(names)]
    return ModelSpec.from_dict(data)


# ----------------------------------------------------------------------------- the whole run
def data_dir(out: Path, modality: str) -> Path:
    """OUT/data/MODALITY: raw/ files, then train/ and val/ shards."""
    return out / "data" / modality


def run_modalities(
    config: QuickstartConfig, on_phase: Any = None, on_step: Any = None
) -> QuickstartResult:
    """The `--modalities` quickstart: data per modality, calibration, one training run mixing
    the sources by step, held-out evaluation of every pair, report (see the module docstring).

    Raises MissingPackages (before writing anything) when a package of a chosen modality is
    missing.
    """
    import shutil

    from mmtrain.quickstart.series import ZEROSHOT_TEMPLATES

    modalities = tuple(config.modalities)
    config.validate()
    check_modality_packages(modalities)
    phase, paths, lap = begin(config, on_phase)
    seconds = lap.seconds

    phase("data", f"{', '.join(modalities)} with text; held-out sets for evaluation")
    spec = modalities_spec(quickstart_spec(config), modalities)
    emoji = list_emoji(config.limit) if {"image", "audio"} & set(modalities) else []
    held_out: list[HeldOut] = []
    counts: dict[str, int] = {}
    for modality in modalities:
        where = data_dir(paths.out, modality)
        if modality == "image":
            split = write_raw(emoji, where / "raw", config.val_fraction)
        elif modality == "audio":
            rate = spec.towers["audio"].stem.sample_rate
            split = write_spoken(emoji, where / "raw", config.val_fraction, rate)
        else:
            split, activities = write_motions(where / "raw")
        if split.train < config.batch_size or split.val < 2:
            raise FieldError(
                "--limit",
                f"{split.train} train / {split.val} held-out {modality} samples are too few for "
                f"batches of {config.batch_size}; use more emoji or a smaller batch",
            )
        build_shards(split.train_dir, where / "train", config.build_workers, f"{modality},text")
        build_shards(split.val_dir, where / "val", config.build_workers, f"{modality},text")
        counts[modality] = split.train
        classes = activities if modality == "timeseries" else None
        held_out.append(HeldOut(modality, where / "val", classes, ZEROSHOT_TEMPLATES))
    attribution = write_attribution(paths.out / "data") if emoji else None
    text = attribution.read_text(encoding="utf-8") if attribution else ""
    rate = spec.towers["audio"].stem.sample_rate if "audio" in modalities else 0
    (paths.out / "ATTRIBUTION.txt").write_text(text + attribution_text(modalities, rate))
    spec.save(paths.spec)
    lap("data")

    weights = step_weights(modalities)
    steps, step_seconds = fit_steps(
        config,
        phase,
        lap,
        lambda: sum(  # each source's steps hold its own towers
            share * time_steps(spec, config.batch_size, towers=(modality, "text"))
            for modality, share in weights.items()
        ),
    )

    shares = ", ".join(f"{m}-text {share:.0%}" for m, share in weights.items())
    phase("train", f"{steps} steps of {config.batch_size} pairs ({shares} of the steps)")
    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    run = run_config_dict(config, paths, steps)
    run["data"]["train"] = [
        {"path": str(data_dir(paths.out, m) / "train"), "weight": w} for m, w in weights.items()
    ]
    # Validation runs after training, one held-out set per pair (below).
    run["data"]["val"] = []
    run["eval"] = {"every_steps": None}
    hook = None if on_step is None else lambda row: on_step({**row, "total_steps": steps})
    result = train(config_from_dict(run), on_step=hook)
    lap("train")

    phase("evaluate", ", ".join(f"{m}<->text" for m in modalities) + " on held-out data")
    document = evaluate_held_out(paths.run, held_out, result.step)
    lap("evaluate")

    phase("report", str(paths.run / "report.html"))
    from mmtrain.report import build_report

    report = build_report(paths.run)
    lap("report")
    shutil.copy2(paths.out / "ATTRIBUTION.txt", paths.run / "ATTRIBUTION.txt")
    first = document["sets"][modalities[0]]["n_samples"]
    return QuickstartResult(
        paths=paths,
        n_train=sum(counts.values()),
        n_val=first,
        steps=steps,
        step_seconds=step_seconds,
        retrieval=document["retrieval"],
        chance=chance_levels(first),
        report_html=report.html,
        seconds=seconds,
        modalities=modalities,
        chance_by_direction=document["chance"],
        zeroshot=document.get("zeroshot", {}),
        n_by_modality={m: d["n_samples"] for m, d in document["sets"].items()},
    )


__all__ = [
    "MODALITIES_HINT",
    "MODALITY_REQUIRED",
    "STEP_WEIGHTS",
    "HeldOut",
    "attribution_text",
    "data_dir",
    "check_modality_packages",
    "evaluate_held_out",
    "modalities_spec",
    "run_modalities",
    "step_weights",
    "write_motions",
    "write_spoken",
]
