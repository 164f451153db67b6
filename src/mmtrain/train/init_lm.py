"""`init` for a language model (`models/vlm.py`'s LanguageModel): an LM, or a LLaVA-style VLM.

    init: PATH                  # the whole model from one source
    init: {image: A, text: B}   # a VLM tower by tower; its projector keeps its random init

The decoder is the tower `text` (spec.decoder, not in spec.towers), so `init.py`'s tower
matching, which goes by the towers' specs, cannot place it; this module matches it by name
inside `towers.text.`. A source of the decoder is anything holding one: a HF Llama / Qwen2 /
LLaVA folder, an mmtrain LM or VLM folder, a checkpoint. A source of the image tower is any
source with an image tower (an OpenCLIP file, a HF CLIP / SigLIP / LLaVA folder, an mmtrain
folder), found and fitted as in `init.py` (positions interpolated to a new grid). A VLM reads
the tower's hidden states, so an encoder's output projection (`proj.*`) is not used (logged).

A native-resolution VLM's tower (the Qwen2-VL family's `vision`, merger included; not in
spec.towers either) is matched by name too, from any source that has one (an mmtrain folder,
a converted Qwen2-VL / Qwen2.5-VL folder).

The projector joins the two: it comes only with a whole-model source (`init: PATH`); when the
towers come from separate baselines it starts at its random init, which is logged.

A decoder may have a larger vocabulary than its source (LLaVA-1.5 adds `<image>` and `<pad>` to
Vicuna's 32000 tokens and pads to 32064): the token embedding, and an untied LM head, take the
source's rows and the new rows start at the mean of the source's rows (`grow_rows`); what grew is
logged. A smaller vocabulary is refused: tokens of the source would lose their rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from mmtrain.spec import VISION_TOWER, ModelSpec
from mmtrain.train.init import (
    InitError,
    InitMismatch,
    InitReport,
    Match,
    Source,
    apply_matches,
    clip_tower_names,
    match_towers,
    read_source,
    tower_for,
)

DECODER = "text"  # the decoder's tower name (models/vlm.py)
PROJECTOR = "projector."
# The decoder's tensors with one row per token: a larger vocabulary grows them.
VOCAB_ROWS = (f"towers.{DECODER}.embed.weight", f"towers.{DECODER}.lm_head.weight")


def lm_towers(spec: ModelSpec) -> list[str]:
    """The towers `init` may name: the image tower of a VLM (or its native-resolution
    tower), and the decoder."""
    native = [VISION_TOWER] if spec.vision is not None else []
    return [*spec.towers, *native, DECODER]


def _plan(spec: ModelSpec, init: str | Mapping[str, str]) -> dict[str, list[str]]:
    """{source path: the towers it fills}, checking the tower names `init` gives."""
    towers = lm_towers(spec)
    if isinstance(init, str):
        return {init: towers}
    plan: dict[str, list[str]] = {}
    for tower, path in init.items():
        if tower not in towers:
            raise InitError(
                f"init.{tower}",
                f"the model has no tower {tower!r}; its towers: {', '.join(towers)} "
                f"({DECODER} is the language model)",
            )
        plan.setdefault(path, []).append(tower)
    return plan


def _field(init: str | Mapping[str, str], towers: list[str]) -> str:
    return "init" if isinstance(init, str) or len(towers) > 1 else f"init.{towers[0]}"


def match_decoder(state: Mapping[str, Tensor], spec: ModelSpec, match: Match) -> None:
    """Fill the decoder (`towers.text.*`) from `match.source`'s decoder, key by key."""
    if match.source.spec.decoder is None:
        _none_for(state, match, DECODER, "language model")
        return
    _check_vocab(spec, match)
    _match_by_name(state, match, f"towers.{DECODER}.")
    match.notes += _decoder_differences(spec, match.source)


def match_native_vision(state: Mapping[str, Tensor], match: Match) -> None:
    """Fill a native-resolution tower (`towers.vision.*`, the Qwen2-VL family's: not in
    spec.towers) from the source's, key by key (an mmtrain or converted HF folder)."""
    if match.source.spec.vision is None:
        _none_for(state, match, VISION_TOWER, "native-resolution vision tower")
        return
    _match_by_name(state, match, f"towers.{VISION_TOWER}.")


def _none_for(state: Mapping[str, Tensor], match: Match, tower: str, what: str) -> None:
    match.reasons.append(f"{match.source.path} has no {what} for tower {tower!r}")
    prefix = f"towers.{tower}."
    match.missing += [f"{k} {list(v.shape)}" for k, v in state.items() if k.startswith(prefix)]


def _match_by_name(state: Mapping[str, Tensor], match: Match, prefix: str) -> None:
    """Every model tensor under `prefix` from the source's tensor of the same name (the token
    embedding and head may grow to a larger vocabulary)."""
    source = match.source
    mine = [key for key in state if key.startswith(prefix)]
    for key in mine:
        value = state[key]
        given = source.state.get(key)
        if given is None:
            match.missing.append(f"{key} {list(value.shape)}")
        elif given.shape == value.shape:
            match.loaded[key] = given.to(value.dtype)
        elif key in VOCAB_ROWS and _grows(given, value):
            match.loaded[key] = grow_rows(given, value.shape[0], value.dtype)
            match.notes.append(
                f"{key}: vocabulary {given.shape[0]} -> {value.shape[0]} rows; rows "
                f"{given.shape[0]}..{value.shape[0] - 1} start at the mean of {source.path}'s rows"
            )
        else:
            match.mis_shaped.append(f"{key} {list(given.shape)} (model: {list(value.shape)})")
    match.unexpected += [
        f"{k} {list(t.shape)}"
        for k, t in source.state.items()
        if k.startswith(prefix) and k not in state
    ]


def _grows(given: Tensor, value: Tensor) -> bool:
    """True where `value` is `given` with more rows (a larger vocabulary)."""
    return given.shape[1:] == value.shape[1:] and given.shape[0] < value.shape[0]


def _check_vocab(spec: ModelSpec, match: Match) -> None:
    """A vocabulary may grow, never shrink: cutting rows would silently drop tokens the
    source's tokenizer produces. Refused whatever `init_strict` says."""
    ours, theirs = spec.decoder.vocab_size, match.source.spec.decoder.vocab_size
    if ours < theirs:
        raise InitMismatch(
            match.field,
            f"the model's decoder.vocab_size {ours} is smaller than the {theirs} tokens of "
            f"{match.source.path}: init grows a vocabulary but never cuts one; set "
            f"decoder.vocab_size to {theirs} or more",
        )


def grow_rows(given: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """`given` [old, width] extended to [rows, width] in `dtype`: its rows bit for bit, then
    new rows equal to the mean of its rows.

    The mean keeps a new token's logit near the average logit, so the new tokens take no
    probability they have not learned (Hewitt 2021, what transformers' `resize_token_embeddings`
    does by default). transformers 5 draws each new row from a normal around the mean with the
    rows' covariance scaled by 1e-9: a spread ~3e-5 of the rows' own, i.e. the mean plus a
    nudge much smaller than the rows differ from one another (and than what training moves).
    We take the exact mean: every rank, seed and machine gets the same bits, with no generator
    and no Cholesky factor of a width x width covariance (whose rounding depends on the
    linear-algebra library).
    """
    added = rows - given.shape[0]
    # Summed in float64, the mean's rounding error stays far below the last bit of `dtype`.
    mean = given.to(torch.float64).mean(dim=0)
    return torch.cat([given.to(dtype), mean.to(dtype).expand(added, -1)])


def _decoder_differences(spec: ModelSpec, source: Source) -> list[str]:
    """Fields that change no shape but what the weights compute (rotary base, norm epsilon...):
    the model's own values are used, which is worth a line in the log. A larger vocabulary has
    a note of its own (`match_decoder`)."""
    ours, theirs = dataclasses.asdict(spec.decoder), dataclasses.asdict(source.spec.decoder)
    return [
        f"decoder.{name}: the model's {ours[name]!r} is used, {source.path} has {theirs[name]!r}"
        for name in ours
        if ours[name] != theirs[name] and name != "vocab_size"
    ]


def match_image(state: Mapping[str, Tensor], spec: ModelSpec, match: Match, tower: str) -> str:
    """Fill image tower `tower` from the source's image tower; returns the source's name."""
    theirs = tower_for(tower, spec, match.source)
    found = match_towers(state, spec, match.source, {tower: theirs}, match.field)
    unused = f"towers.{theirs}.proj."
    if not spec.towers[tower].output_proj:
        dropped = [key for key in found.unexpected if key.startswith(unused)]
        found.unexpected = [key for key in found.unexpected if key not in dropped]
        if dropped:
            match.notes.append(
                f"{unused}* of {match.source.path} not used: the language model reads the image "
                "tower's hidden states, not its projected embedding"
            )
    match.loaded.update(found.loaded)
    match.missing += found.missing
    match.mis_shaped += found.mis_shaped
    match.unexpected += found.unexpected
    match.notes += found.notes
    return theirs


def match_whole(state: Mapping[str, Tensor], match: Match, taken: list[str]) -> None:
    """A whole-model source: the projector too, and every source tensor must find a place."""
    source = match.source
    for key, value in state.items():
        if not key.startswith(PROJECTOR):
            continue
        given = source.state.get(key)
        if given is None:
            match.missing.append(f"{key} {list(value.shape)}")
        elif given.shape != value.shape:
            match.mis_shaped.append(f"{key} {list(given.shape)} (model: {list(value.shape)})")
        else:
            match.loaded[key] = given.to(value.dtype)
    prefixes = tuple(taken) + (PROJECTOR,)
    match.unexpected += [
        f"{k} {list(t.shape)}"
        for k, t in source.state.items()
        if not k.startswith(prefixes) or (k.startswith(PROJECTOR) and k not in state)
    ]


def load_init_lm(
    model: nn.Module, init: str | Mapping[str, str], strict: bool = True
) -> InitReport:
    """`init_start.load_init` for a LanguageModel (before any wrapping)."""
    spec: ModelSpec = model.spec
    plan = _plan(spec, init)
    names = clip_tower_names(spec)
    sources = {
        path: read_source(path, _field(init, towers), names) for path, towers in plan.items()
    }
    state = model.state_dict()
    matches = []
    for path, towers in plan.items():
        match = Match(_field(init, towers), sources[path])
        taken = []
        for tower in towers:
            if tower == DECODER:
                match_decoder(state, spec, match)
                taken.append(f"towers.{DECODER}.")
                continue
            if tower == VISION_TOWER and spec.vision is not None:
                match_native_vision(state, match)
                taken.append(f"towers.{VISION_TOWER}.")
                continue
            try:
                taken.append(f"towers.{match_image(state, spec, match, tower)}.")
            except InitMismatch as err:  # its weights are reported missing, with this reason
                match.reasons.append(err.message)
                match.missing += [
                    f"{k} {list(v.shape)}"
                    for k, v in state.items()
                    if k.startswith(f"towers.{tower}.")
                ]
        if isinstance(init, str):
            match_whole(state, match, taken)
        matches.append(match)
    if not isinstance(init, str) and spec.projector is not None:
        # Towers from separate baselines have never been joined: a new projector learns that.
        matches[0].notes.append(
            "projector.* keeps its random init (init names the towers, not the projector)"
        )
    return apply_matches(state, matches, sources.values(), init, strict)
