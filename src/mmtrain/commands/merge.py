"""`mmtrain merge BASE FINETUNED --alpha A --out DIR`: weight-space ensembling (WiSE-FT).

    theta = (1 - alpha) * base + alpha * finetuned        (per tensor)

alpha 0 gives BASE, alpha 1 FINETUNED; values in between often keep much of the base model's
robustness while gaining most of the fine-tuned accuracy (Wortsman et al., "Robust fine-tuning
of zero-shot models"). BASE and FINETUNED may be in any format `init` reads (mmtrain model, run
or checkpoint folder, OpenCLIP checkpoint, Hugging Face folder) but must be the same model: every
tensor under the same name with the same shape. DIR gets an mmtrain model folder.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from mmtrain.cli import UsageError

if TYPE_CHECKING:
    from torch import Tensor

    from mmtrain.spec import ModelSpec
    from mmtrain.train.init import Source

# torch is imported inside the functions: every command registers its parser at start-up.

ORDER = 75
# Spec fields that change no weight and no computation of a trained model.
IGNORED_SPEC_FIELDS = ("name", "logit_scale_init", "logit_bias_init")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="interpolate the weights of two models of the same shape (WiSE-FT)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("base", metavar="BASE", help="the model at alpha 0 (e.g. the zero-shot model)")
    p.add_argument("finetuned", metavar="FINETUNED", help="the model at alpha 1 (fine-tuned)")
    p.add_argument(
        "--alpha",
        type=float,
        required=True,
        help="weight of FINETUNED; 0..1 interpolates, values outside extrapolate",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the output model folder")
    p.add_argument(
        "--model",
        help="preset or spec YAML of the models; needed only when both are OpenCLIP checkpoints "
        "(which do not record head counts or the activation)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mmtrain.models.build import model_with_weights, save_model
    from mmtrain.train.init import read_source

    if not math.isfinite(args.alpha):
        raise UsageError(f"--alpha must be a finite number, got {args.alpha}")
    out = Path(args.out)
    for path in (args.base, args.finetuned):
        if out.resolve() == _folder(Path(path)).resolve():
            raise UsageError(f"--out {out} is the folder of {path}: write the merge elsewhere")
    base = read_source(args.base, "BASE")
    finetuned = read_source(args.finetuned, "FINETUNED")
    spec = output_spec(args.model, base, finetuned)
    base_state, finetuned_state = _named_as(base, spec), _named_as(finetuned, spec)
    differences = state_differences(base_state, finetuned_state)
    if differences:
        raise UsageError(
            f"{args.base} and {args.finetuned} are not the same model ({len(differences)} "
            "differences, BASE vs FINETUNED):\n  " + "\n  ".join(differences[:8])
        )
    check_specs(spec, args.model, base, finetuned)  # what the weights do not show: heads, ...
    # Keys and shapes checked against the spec (a --model may not fit the weights).
    model = model_with_weights(spec, wise_ft(base_state, finetuned_state, args.alpha), args.base)
    save_model(model, out)
    print(
        f"wrote {out}: (1 - {args.alpha:g}) x {args.base} + {args.alpha:g} x {args.finetuned} "
        f"({spec.name}, {len(base_state)} tensors)"
    )
    return 0


def wise_ft(
    base: dict[str, Tensor], finetuned: dict[str, Tensor], alpha: float
) -> dict[str, Tensor]:
    """(1 - alpha) * base + alpha * finetuned for every tensor, computed in float32 (float64
    when either is) and cast to the wider of the two dtypes. Written as two products, not a
    lerp, so alpha 0 and 1 return the inputs exactly. Non-float tensors must be equal."""
    import torch

    merged = {}
    for key, a in base.items():
        b = finetuned[key]
        if not a.is_floating_point():
            if not torch.equal(a, b):
                raise UsageError(f"{key}: integer tensors differ; they cannot be interpolated")
            merged[key] = a.clone()
            continue
        out_dtype = torch.promote_types(a.dtype, b.dtype)
        work = torch.promote_types(out_dtype, torch.float32)
        value = (1.0 - alpha) * a.to(work) + alpha * b.to(work)
        merged[key] = value.to(out_dtype)
    return merged


def state_differences(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """Keys only one side has and keys whose shapes differ, as `key: [shape] vs [shape]`."""
    lines = []
    for key in dict.fromkeys([*a, *b]):
        left = list(a[key].shape) if key in a else "absent"
        right = list(b[key].shape) if key in b else "absent"
        if left != right:
            lines.append(f"{key}: {left} vs {right}")
    return lines


def output_spec(model_arg: str | None, *sources: Source) -> ModelSpec:
    """The spec of the merged model: --model, else the first source that records a whole spec."""
    from mmtrain.spec import load_spec

    exact = [s for s in sources if s.exact_spec]
    if model_arg is not None:
        return load_spec(model_arg)
    if exact:
        return exact[0].spec
    raise UsageError(
        "both models are OpenCLIP checkpoints, which do not record head counts or the "
        "activation: give --model (a preset such as ViT-B-32, or a spec YAML)"
    )


def check_specs(spec: ModelSpec, model_arg: str | None, *sources: Source) -> None:
    """Every source that records a whole spec agrees with `spec` (names and init values aside)."""
    from mmtrain.config import diff_configs

    wanted = _comparable(spec)
    exact = [s for s in sources if s.exact_spec]
    for source in exact:
        changed = diff_configs(wanted, _comparable(source.spec))
        if changed:
            raise UsageError(
                f"{source.path} holds a different model: {', '.join(changed[:8])} differ"
                + (f" from --model {model_arg}" if model_arg else f" from {exact[0].path}")
            )


def _comparable(spec: ModelSpec) -> dict:
    data = spec.to_dict()
    for key in IGNORED_SPEC_FIELDS:
        data.pop(key, None)
    return data


def _named_as(source: Source, spec: ModelSpec) -> dict[str, Tensor]:
    """The source's state dict; an OpenCLIP checkpoint's towers renamed as `spec` names them."""
    from mmtrain.train.init import clip_tower_names

    if source.exact_spec:
        return source.state
    renames = dict(zip(source.spec.towers, clip_tower_names(spec), strict=True))
    state = {}
    for key, value in source.state.items():
        if key.startswith("towers."):
            tower, rest = key[len("towers.") :].split(".", 1)
            key = f"towers.{renames[tower]}.{rest}"
        state[key] = value
    return state


def _folder(path: Path) -> Path:
    return path if path.is_dir() else path.parent
