"""`init`: start a run from the weights of a baseline instead of a random initialisation.

    init: PATH                      # the whole model from one source
    init: {image: A, text: B}       # tower by tower; towers not named keep their random init

A source is recognised by what it holds, not by its name:

- an mmtrain model folder or finished run folder: `model.safetensors` + `spec.yaml`
  (or the `model.safetensors` file of one), and a checkpoint folder `checkpoints/step_N`;
- an OpenCLIP ViT CLIP checkpoint (.pt/.pth/.bin read only by `torch.load(weights_only=True)`,
  or .safetensors): a bare state dict or a training checkpoint `{"epoch", "state_dict"}` with
  `module.` prefixes;
- a Hugging Face folder (`config.json` + safetensors) of CLIP, SigLIP, Llama, Qwen2 or LLaVA,
  read by `mmtrain.models.formats.hf`.

A language model (a spec with a decoder: LM or LLaVA-style VLM) is filled by
`mmtrain.train.init_lm`, where the decoder is the tower `text` and a VLM's projector comes
only from a whole-model source; `mmtrain.train.init_start.load_init` picks one of the two.

Every source becomes a `Source`: a `ModelSpec` and a state dict in mmtrain's names. Weights then
move tower by tower (`tower_for` says which source tower feeds which tower of the model) and by
name inside a tower. Shapes must match, with two exceptions that a new resolution or context
length needs: image (and video) position embeddings are interpolated over their 2-D grid
(bicubic, class token kept; `mmtrain.train.resolution`), and text position embeddings are
truncated, or extended with the extra rows keeping their random init (positions the baseline
never saw start as the model's other new weights do). Both are logged. A decoder's vocabulary
may grow: see `init_lm`.

Anything else that does not fit raises `InitMismatch` naming the field, the file, the first few
keys with their shapes and the counts; with `init_strict: false` what fits is loaded and what
stays at random init is logged instead. `logit_scale` / `logit_bias` come from the source when
it has them and the whole model comes from one source.

`init` is read once, before step 0 of a fresh run, on every rank (each rank reads the same
files, so DDP ranks start identical and FSDP shards afterwards); a resumed run restores its
checkpoint and ignores `init`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmtrain.atomic import sha256_file
from mmtrain.folders import SPEC_FILE, WEIGHTS_FILE
from mmtrain.models.formats.diffusers import is_diffusers_folder, read_diffusers_dit
from mmtrain.models.formats.keys import CheckpointMismatch
from mmtrain.models.formats.openclip import (
    OPENCLIP_SUFFIXES,
    openclip_to_mmtrain,
    read_openclip_checkpoint,
)
from mmtrain.models.safetensors_files import has_weights, open_weights
from mmtrain.spec import ImageStem, ModelSpec, TextStem, TowerSpec
from mmtrain.structured import FieldError
from mmtrain.train.resolution import resize_grid, resize_pos_embed, resize_time

log = logging.getLogger(__name__)

# Parameters outside the towers that only make sense together with the towers they were trained
# with: taken from a whole-model source when it has them, else left at the spec's init.
SCALE_KEYS = ("logit_scale", "logit_bias")
SHOWN = 4  # keys listed per kind of problem before "... (N in all)"


class InitError(FieldError):
    """An `init` source cannot be read; `path` is the config field (`init`, `init.image`)."""


class InitMismatch(InitError):
    """A source does not fit the model; the message lists keys, shapes and counts."""


# ----------------------------------------------------------------------------- sources
@dataclass
class Source:
    """A baseline's weights in mmtrain's names and the spec they belong to.

    `exact_spec` is False where the format does not record everything a spec holds (an OpenCLIP
    state dict has no head count or activation; those come from the model being trained).
    """

    path: Path
    kind: str  # "mmtrain", "checkpoint", "openclip", "hf", "diffusers"
    spec: ModelSpec
    state: dict[str, Tensor]
    files: list[Path]  # the weight files read (recorded with their sha256)
    exact_spec: bool = True


def read_source(
    path: str | Path, field: str = "init", tower_names: tuple[str, str] = ("image", "text")
) -> Source:
    """Read the baseline at `path`, whatever its format; `field` names it in errors.

    `tower_names` names the (image, text) towers of an OpenCLIP checkpoint, which has none.
    """
    path = Path(path)
    if not path.exists():
        raise InitError(field, f"{path} does not exist")
    if path.is_dir():
        return _read_folder(path, field)
    return _read_file(path, field, tower_names)


def _read_folder(path: Path, field: str) -> Source:
    if (path / SPEC_FILE).is_file() and has_weights(path):  # one file, or shards + index
        return _read_mmtrain(path, path / SPEC_FILE, field)
    if (path / "meta.json").is_file() and (path / "manifest.json").is_file():
        return _read_checkpoint(path, field)
    if is_diffusers_folder(path):
        return _read_diffusers(path, field)
    hf = _hf_module()
    if hf is not None and hf.is_hf_folder(path):
        return _read_hf(hf, path, field)
    if (path / "config.json").is_file() and hf is None:
        raise InitError(
            field, f"{path} looks like a Hugging Face folder, which this mmtrain cannot read"
        )
    hint = ""
    if (path / "checkpoints").is_dir():
        hint = (
            "; a run that has not finished has no model.safetensors yet: give one of its "
            f"checkpoints ({path / 'checkpoints'}/step_N)"
        )
    raise InitError(
        field,
        f"{path} holds no weights this mmtrain reads: expected {WEIGHTS_FILE} + {SPEC_FILE} (a "
        f"model or run folder), a checkpoint folder, or a Hugging Face folder (config.json + "
        f"*.safetensors){hint}",
    )


def _read_mmtrain(weights: Path, spec_file: Path, field: str) -> Source:
    """An mmtrain folder (one file or shards + index) or the path of its weights file."""
    spec = _load_spec(spec_file, field)
    try:
        with open_weights(weights) as reader:
            state, files = dict(reader.items()), list(reader.files)
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise InitError(field, f"{weights} is not a readable safetensors file: {err}") from None
    folder = weights if weights.is_dir() else weights.parent
    return Source(folder, "mmtrain", spec, state, files)


def _read_checkpoint(path: Path, field: str) -> Source:
    """A checkpoint folder of a run (full or sharded), its manifest verified."""
    from mmtrain.checkpoint import CheckpointError, load_weights, read_meta

    try:
        meta = read_meta(path, verify=True)
        state = load_weights(path, verify=False)  # verified just above
    except CheckpointError as err:
        raise InitError(field, str(err)) from None
    spec = ModelSpec.from_dict(meta["spec"], source=str(path / "meta.json"))
    weights = path / WEIGHTS_FILE
    # A sharded checkpoint's weights are spread over dcp/ beside the optimizer state: its
    # manifest, which holds the sha256 of every one of those files, stands for them.
    files = [weights] if weights.is_file() else [path / "manifest.json"]
    return Source(path, "checkpoint", spec, state, files)


def _read_hf(hf: Any, path: Path, field: str) -> Source:
    try:
        spec, state = hf.read_hf_model(path)
    except (ValueError, KeyError, OSError) as err:  # FieldError is a ValueError
        raise InitError(field, f"{path}: {err}") from None
    return Source(path, "hf", spec, dict(state), sorted(path.glob("*.safetensors")))


def _read_diffusers(path: Path, field: str) -> Source:
    try:
        spec, state = read_diffusers_dit(path)
    except (ValueError, KeyError, OSError) as err:  # FieldError is a ValueError
        raise InitError(field, f"{path}: {err}") from None
    return Source(path, "diffusers", spec, state, sorted(path.glob("*.safetensors")))


def _hf_module() -> Any:
    """`mmtrain.models.formats.hf`, imported when first needed (it is optional to this module)."""
    try:
        from mmtrain.models.formats import hf
    except ImportError:
        return None
    return hf


def _read_file(path: Path, field: str, tower_names: tuple[str, str]) -> Source:
    if path.suffix not in OPENCLIP_SUFFIXES:
        raise InitError(
            field,
            f"{path}: weights files are read as {', '.join(OPENCLIP_SUFFIXES)} only (PyTorch "
            "files with torch.load(weights_only=True), never other pickles)",
        )
    try:
        # A bare or a training-checkpoint state dict, `module.` prefixes removed; safe loads only.
        state = read_openclip_checkpoint(path)
    except ValueError as err:  # its message names the file
        raise InitError(field, str(err)) from None
    tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
    if any(key.startswith("towers.") for key in tensors):  # mmtrain's own names
        spec_file = path.parent / SPEC_FILE
        if not spec_file.is_file():
            raise InitError(
                field, f"{path} holds mmtrain weights but no {SPEC_FILE} lies next to it"
            )
        return _read_mmtrain(path, spec_file, field)
    if "visual.conv1.weight" in tensors or "token_embedding.weight" in tensors:
        spec = openclip_spec(tensors, path, field, tower_names)
        try:
            weights = openclip_to_mmtrain(state, spec)
        except CheckpointMismatch as err:
            raise InitError(field, f"{path}: {err}") from None
        return Source(path, "openclip", spec, weights, [path], exact_spec=False)
    raise InitError(
        field,
        f"{path} is neither mmtrain weights (towers.*) nor an OpenCLIP ViT CLIP state dict "
        f"(visual.conv1.weight, token_embedding.weight); its first keys: {_first(list(state))}",
    )


def _load_spec(path: Path, field: str) -> ModelSpec:
    try:
        return ModelSpec.load(path)
    except FieldError as err:
        raise InitError(field, f"{path}: {err}") from None


# ----------------------------------------------------------------------------- OpenCLIP
def openclip_spec(
    state: Mapping[str, Tensor],
    path: Path,
    field: str = "init",
    tower_names: tuple[str, str] = ("image", "text"),
) -> ModelSpec:
    """The spec of an OpenCLIP ViT CLIP state dict, read off its tensor shapes.

    Shapes give every size; they do not give the head count or the activation, which change no
    tensor: the spec says 1 head and gelu, and the model being trained decides (`exact_spec`).
    """

    def shape(key: str) -> tuple[int, ...]:
        if key not in state:
            raise InitError(field, f"{path} has no {key}: not an OpenCLIP ViT CLIP state dict")
        return tuple(state[key].shape)

    width, _, patch, _ = shape("visual.conv1.weight")
    grid = math.isqrt(shape("visual.positional_embedding")[0] - 1)
    embed_dim = shape("visual.proj")[1]
    vocab, text_width = shape("token_embedding.weight")
    image = TowerSpec(
        modality="image",
        stem=ImageStem(image_size=grid * patch, patch_size=patch),
        width=width,
        layers=_blocks(state, "visual.transformer.resblocks."),
        heads=1,
        mlp_ratio=_ratio(shape("visual.transformer.resblocks.0.mlp.c_fc.weight")[0], width),
        pooling="cls",
    )
    text = TowerSpec(
        modality="text",
        stem=TextStem(vocab_size=vocab, context_length=shape("positional_embedding")[0]),
        width=text_width,
        layers=_blocks(state, "transformer.resblocks."),
        heads=1,
        mlp_ratio=_ratio(shape("transformer.resblocks.0.mlp.c_fc.weight")[0], text_width),
        pooling="eot",
        proj_bias="text_projection.bias" in state,
    )
    image_name, text_name = tower_names
    bias = float(state["logit_bias"]) if "logit_bias" in state else None
    return ModelSpec(
        name=f"openclip:{path.name}",
        embed_dim=embed_dim,
        towers={image_name: image, text_name: text},
        pairs=[(image_name, text_name)],
        objective="clip" if bias is None else "siglip",
        logit_bias_init=bias,
    )


def _blocks(state: Mapping[str, Tensor], prefix: str) -> int:
    indices = {int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix)}
    return max(indices) + 1 if indices else 0


def _ratio(hidden: int, width: int) -> float:
    """mlp_ratio with int(width * ratio) == hidden, also where the quotient rounds down."""
    ratio = hidden / width
    while int(width * ratio) < hidden:
        ratio = math.nextafter(ratio, math.inf)
    return ratio


# ----------------------------------------------------------------------------- which tower
def tower_for(target: str, spec: ModelSpec, source: Source) -> str:
    """The tower of `source` that initialises tower `target` of `spec`: the source's tower of the
    same name when it has the same modality, else its only tower of that modality (an OpenCLIP
    or HF image tower feeds a tower named `vision`). Raises InitError when there is none or
    several to choose from."""
    modality = spec.towers[target].modality
    towers = source.spec.towers
    same = towers.get(target)
    if same is not None and same.modality == modality:
        return target
    candidates = [name for name, tower in towers.items() if tower.modality == modality]
    if len(candidates) == 1:
        return candidates[0]
    have = ", ".join(f"{n} ({t.modality})" for n, t in towers.items())
    reason = "no" if not candidates else "more than one"
    raise InitMismatch(
        "init",
        f"{source.path} has {reason} {modality} tower for tower {target!r} (its towers: {have})",
    )


# ----------------------------------------------------------------------------- matching
@dataclass
class Match:
    """What one source gives a model: tensors to load, and what does not fit."""

    field: str
    source: Source
    loaded: dict[str, Tensor] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # model keys the source lacks
    mis_shaped: list[str] = field(default_factory=list)  # "key [source] (model: [target])"
    unexpected: list[str] = field(default_factory=list)  # source keys nothing takes
    notes: list[str] = field(default_factory=list)  # adaptations made (logged)
    reasons: list[str] = field(default_factory=list)  # why whole towers find nothing

    def problems(self) -> int:
        return len(self.missing) + len(self.mis_shaped) + len(self.unexpected)

    def describe(self) -> str:
        parts = [
            f"{len(keys)} {what}: {_first(keys)}"
            for what, keys in (
                ("missing in the source", self.missing),
                ("with another shape", self.mis_shaped),
                ("not in the model", self.unexpected),
            )
            if keys
        ]
        file = self.source.files[0] if self.source.files else self.source.path
        return f"{file} does not fit the model: " + "; ".join(self.reasons + parts)


def match_towers(
    model_state: Mapping[str, Tensor],
    spec: ModelSpec,
    source: Source,
    pairs: dict[str, str],
    field: str,
) -> Match:
    """Fill towers `pairs` ({model tower: source tower}) of the model from `source`."""
    match = Match(field, source)
    for target, theirs in pairs.items():
        ours_prefix, their_prefix = f"towers.{target}.", f"towers.{theirs}."
        used = set()
        for key, value in model_state.items():
            if not key.startswith(ours_prefix):
                continue
            rest = key[len(ours_prefix) :]
            their_key = their_prefix + rest
            if their_key not in source.state:
                match.missing.append(f"{key} {list(value.shape)}")
                continue
            used.add(their_key)
            given = source.state[their_key]
            fitted = _fit(
                key, rest, given, value, spec.towers[target], source.spec.towers[theirs], match
            )
            if fitted is None:
                match.mis_shaped.append(f"{key} {list(given.shape)} (model: {list(value.shape)})")
            else:
                match.loaded[key] = fitted
        match.unexpected += [
            f"{k} {list(v.shape)}"
            for k, v in source.state.items()
            if k.startswith(their_prefix) and k not in used
        ]
    return match


def match_rest(
    model_state: Mapping[str, Tensor], pairs: dict[str, str], match: Match, whole: bool
) -> None:
    """Add to `match` what lies outside the towers: with `whole` (`init: PATH`) everything (logit
    scale/bias, fusion head) and the source's towers nothing takes; else (every tower named, all
    from this source) the logit scale/bias only."""
    source = match.source
    for key, value in model_state.items():
        if whole and key.startswith("towers.") and key.split(".")[1] not in pairs:
            match.missing.append(f"{key} {list(value.shape)}")  # a tower the source lacks
        if key.startswith("towers.") or (not whole and key not in SCALE_KEYS):
            continue
        if key not in source.state:
            if key in SCALE_KEYS:
                match.notes.append(f"{key} keeps the spec's init ({source.path} has none)")
            else:
                match.missing.append(f"{key} {list(value.shape)}")
        elif tuple(source.state[key].shape) != tuple(value.shape):
            shapes = f"{list(source.state[key].shape)} (model: {list(value.shape)})"
            match.mis_shaped.append(f"{key} {shapes}")
        else:
            match.loaded[key] = source.state[key].to(value.dtype)
    if not whole:
        return
    taken = {f"towers.{t}." for t in pairs.values()}
    for key in source.state:
        outside = not key.startswith("towers.") and key not in model_state
        untaken = key.startswith("towers.") and not key.startswith(tuple(taken))
        if (outside and key not in SCALE_KEYS) or untaken:
            match.unexpected.append(f"{key} {list(source.state[key].shape)}")


def _fit(
    key: str,
    rest: str,
    given: Tensor,
    target: Tensor,
    ours: TowerSpec,
    theirs: TowerSpec,
    match: Match,
) -> Tensor | None:
    """`given` in the shape of `target` (cast to its dtype), or None when it cannot be."""
    dtype = target.dtype
    if given.shape == target.shape:
        return given.to(dtype)
    if given.dim() != 2 or given.shape[1] != target.shape[1] or ours.modality != theirs.modality:
        return None
    rows, wanted = given.shape[0], target.shape[0]
    if ours.modality == "image" and rest == "stem.pos_embed":
        prefix = int(ours.has_cls_token())
        if prefix != int(theirs.has_cls_token()) or not _square(rows - prefix):
            return None
        grid = ours.stem.grid()
        old = math.isqrt(rows - prefix)
        match.notes.append(
            f"{key}: interpolated from a {old}x{old} to a {grid}x{grid} grid of positions "
            "(bicubic, class token kept)"
        )
        return resize_pos_embed(given, grid, prefix).to(dtype)
    if ours.modality == "video" and rest == "stem.pos_spatial" and _square(rows):
        match.notes.append(f"{key}: interpolated to a {ours.stem.grid()}-wide grid (bicubic)")
        return resize_grid(given, ours.stem.grid()).to(dtype)
    if ours.modality == "video" and rest == "stem.pos_temporal":
        match.notes.append(f"{key}: interpolated from {rows} to {wanted} time steps (linear)")
        return resize_time(given, wanted).to(dtype)
    if ours.modality == "text" and rest == "stem.pos_embed":
        if rows > wanted:
            match.notes.append(f"{key}: context {rows} -> {wanted} tokens, truncated")
            return given[:wanted].to(dtype)
        match.notes.append(
            f"{key}: context {rows} -> {wanted} tokens; rows {rows}..{wanted - 1} keep their "
            "random init"
        )
        return torch.cat([given.to(dtype), target[rows:]])
    return None


def _square(n: int) -> bool:
    return n >= 0 and math.isqrt(n) ** 2 == n


def _first(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > SHOWN else "")


# ----------------------------------------------------------------------------- loading
@dataclass
class InitReport:
    """What `load_init` did: tensors loaded, keys left at random init, files and hashes."""

    loaded: int = 0
    random: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # source keys nothing took
    notes: list[str] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)  # {weights file: hex digest}


def plan_init(
    spec: ModelSpec, init: str | Mapping[str, str], sources: Mapping[str, Source]
) -> list[tuple[str, Source, dict[str, str], str, list[str]]]:
    """(field, source, {model tower: source tower}, rest) per source; `rest`: "whole" when the
    whole model comes from it (`init: PATH`), "scales" when all its towers do (the logit
    scale/bias come along), "" otherwise; and why towers of the model find nothing."""
    if isinstance(init, str):
        source, pairs, reasons = sources[init], {}, []
        for tower in spec.towers:
            try:
                pairs[tower] = tower_for(tower, spec, source)
            except InitMismatch as err:  # its weights are reported missing, with this reason
                reasons.append(err.message)
        return [("init", source, pairs, "whole", reasons)]
    for tower in init:
        if tower not in spec.towers:
            raise InitError(
                f"init.{tower}",
                f"the model has no tower {tower!r}; its towers: {', '.join(spec.towers)}",
            )
    by_path: dict[str, list[str]] = {}
    for tower, path in init.items():
        by_path.setdefault(path, []).append(tower)
    plans = []
    for path, towers in by_path.items():
        source, fields = sources[path], [f"init.{t}" for t in towers]
        try:
            pairs = {t: tower_for(t, spec, source) for t in towers}
        except InitMismatch as err:
            raise InitMismatch(fields[0], err.message) from None
        # One source for every tower: its temperature belongs with them.
        rest = "scales" if len(by_path) == 1 and set(towers) == set(spec.towers) else ""
        plans.append((fields[0] if len(fields) == 1 else "init", source, pairs, rest, []))
    return plans


def load_init_towers(
    model: nn.Module, init: str | Mapping[str, str], strict: bool = True
) -> InitReport:
    """Copy the weights of `init` into `model` (a MultimodalModel, before any wrapping).

    Raises InitError/InitMismatch; with `strict=False` loads what fits and reports the rest.
    """
    spec: ModelSpec = model.spec
    paths = [init] if isinstance(init, str) else list(dict.fromkeys(init.values()))
    names = clip_tower_names(spec)
    sources = {}
    for path in paths:
        field_name = "init" if isinstance(init, str) else _field_of(init, path)
        sources[path] = read_source(path, field_name, names)
    state = model.state_dict()
    matches = []
    for field_name, source, pairs, rest, reasons in plan_init(spec, init, sources):
        match = match_towers(state, spec, source, pairs, field_name)
        match.reasons += reasons
        if rest:
            match_rest(state, pairs, match, whole=rest == "whole")
        matches.append(match)
    return apply_matches(state, matches, sources.values(), init, strict)


def apply_matches(
    state: Mapping[str, Tensor],
    matches: list[Match],
    sources: Iterable[Source],
    init: str | Mapping[str, str],
    strict: bool,
) -> InitReport:
    """Copy what `matches` found into the model's `state` (its live tensors), or raise
    InitMismatch listing what does not fit when `strict`; the report is logged."""
    bad = [m for m in matches if m.problems()]
    if strict and bad:
        raise InitMismatch(
            bad[0].field,
            "; and ".join(
                m.describe() if i == 0 else f"{m.field}: {m.describe()}" for i, m in enumerate(bad)
            )
            + ". Set init_strict: false to load what fits and leave the rest at random init, "
            "or init one tower at a time ({tower: path}).",
        )
    report = InitReport()
    with torch.no_grad():
        for m in matches:
            for key, value in m.loaded.items():
                state[key].copy_(value)
            report.loaded += len(m.loaded)
            report.ignored += m.unexpected
            report.notes += m.notes
    taken = {key for m in matches for key in m.loaded}
    report.random = [key for key in state if key not in taken]
    for source in sources:
        for file in source.files:
            report.sha256[str(file)] = sha256_file(file)
    _log(report, init, strict)
    return report


def clip_tower_names(spec: ModelSpec) -> tuple[str, str]:
    """Names for an OpenCLIP checkpoint's towers: the model's image and text towers when it has
    one of each, so that names match as well as modalities."""
    image = [n for n, t in spec.towers.items() if t.modality == "image"]
    text = [n for n, t in spec.towers.items() if t.modality == "text"]
    return (
        image[0] if len(image) == 1 else "image",
        text[0] if len(text) == 1 else "text",
    )


def _field_of(init: Mapping[str, str], path: str) -> str:
    return f"init.{next(t for t, p in init.items() if p == path)}"


def _log(report: InitReport, init: str | Mapping[str, str], strict: bool) -> None:
    where = init if isinstance(init, str) else ", ".join(f"{t}: {p}" for t, p in init.items())
    log.info("init: %d tensors from %s", report.loaded, where)
    for note in report.notes:
        log.info("init: %s", note)
    if report.random:
        # Expected for towers `init` does not name; with init_strict false, also what misfit.
        level = logging.WARNING if not strict else logging.INFO
        log.log(level, "init: %d tensors keep their random init: %s", len(report.random),
                _first(report.random))  # fmt: skip
    if report.ignored:
        log.warning(
            "init: %d tensors of the source(s) not used: %s",
            len(report.ignored), _first(report.ignored),
        )  # fmt: skip
