"""OpenCLIP interop: weights of OpenCLIP's ViT CLIP models <-> mmtrain's parameter names.

OpenCLIP's `CLIP` class (ViT-B-32, ViT-B-16, ViT-L-14, ViT-L-14-336, ...) and an mmtrain spec with
an image tower (cls pooling) and a causal text tower (eot pooling) compute the same function; only
names and two layouts differ. OpenCLIP keeps its output projections as `x @ proj` matrices
([width, embed_dim]) where we use `nn.Linear` ([embed_dim, width]), so those two are transposed.
Everything else is a rename: `nn.MultiheadAttention`'s packed `in_proj_weight` stores rows in q, k,
v order, exactly as our `attn.qkv`.

Every key is mapped explicitly from the spec (`key_map`). A state dict with an unknown, a missing or
a mis-shaped key is rejected with one `CheckpointMismatch` (`formats.keys`) listing all of them, so
a user who picked the wrong `--model` sees the whole picture at once.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mmtrain.atomic import atomic_open
from mmtrain.models.formats.keys import CheckpointMismatch, check_keys
from mmtrain.spec import ModelSpec, TowerSpec, load_spec

log = logging.getLogger(__name__)

# Non-persistent buffers that some exports include anyway: the text tower's causal mask. They hold
# no learned values (the model rebuilds them), so they are dropped rather than mapped.
IGNORED_OPENCLIP_KEYS = frozenset({"attn_mask"})

# Wrappers that prefix every key of a saved state dict: DistributedDataParallel and torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")

OPENCLIP_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")

# OpenCLIP's LayerNorm uses torch's default epsilon.
OPENCLIP_NORM_EPS = 1e-5


class IncompatibleSpec(ValueError):
    """The model spec has no OpenCLIP `CLIP` counterpart; the message lists every reason."""


# ----------------------------------------------------------------------------- the key map
@dataclass(frozen=True)
class KeyPair:
    """One tensor under both names. `transpose`: OpenCLIP stores it as the transpose of ours."""

    ours: str
    theirs: str
    shape: tuple[int, ...]  # our shape
    transpose: bool = False

    @property
    def their_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transpose else self.shape


def clip_towers(spec: ModelSpec) -> tuple[str, str]:
    """Names of the (image, text) towers of a spec shaped like OpenCLIP's ViT `CLIP`.

    Raises IncompatibleSpec listing every field that OpenCLIP's model cannot express.
    """
    problems: list[str] = []
    by_modality: dict[str, list[str]] = {}
    for name, tower in spec.towers.items():
        by_modality.setdefault(tower.modality, []).append(name)
    images, texts = by_modality.get("image", []), by_modality.get("text", [])
    if len(images) != 1 or len(texts) != 1 or len(spec.towers) != 2:
        problems.append(
            "towers: OpenCLIP's CLIP has exactly one image and one text tower, "
            f"got {', '.join(f'{n} ({t.modality})' for n, t in spec.towers.items())}"
        )
    if spec.fusion is not None:
        problems.append("fusion: OpenCLIP's CLIP has no fusion head")
    if images:
        problems += _tower_problems(f"towers.{images[0]}", spec.towers[images[0]])
    if texts:
        problems += _tower_problems(f"towers.{texts[0]}", spec.towers[texts[0]])
    activations = {t.activation for t in spec.towers.values()}
    if len(activations) > 1:
        problems.append(
            "activation: OpenCLIP uses one activation for both towers (its quick_gelu flag), "
            f"got {', '.join(sorted(activations))}"
        )
    if problems:
        raise IncompatibleSpec(
            f"model {spec.name!r} has no OpenCLIP ViT CLIP counterpart:\n  "
            + "\n  ".join(problems)
            + "\nUse a spec shaped like the ViT-B-32 preset (image tower with cls pooling, causal "
            "text tower with eot pooling)."
        )
    return images[0], texts[0]


def _tower_problems(path: str, tower: TowerSpec) -> list[str]:
    wanted = {
        "norm": "layernorm",
        "norm_eps": OPENCLIP_NORM_EPS,
        "qkv_bias": True,
        "output_proj": True,
        "pooling": "cls" if tower.modality == "image" else "eot",
    }
    problems = [
        f"{path}.{field}: OpenCLIP needs {value!r}, got {getattr(tower, field)!r}"
        for field, value in wanted.items()
        if getattr(tower, field) != value
    ]
    if tower.activation not in ("gelu", "quick_gelu"):
        problems.append(
            f"{path}.activation: OpenCLIP needs gelu or quick_gelu, got {tower.activation!r}"
        )
    if tower.modality == "image":
        stem = tower.stem
        if stem.channels != 3:
            problems.append(f"{path}.stem.channels: OpenCLIP's conv1 takes 3, got {stem.channels}")
        if stem.patch_bias:
            problems.append(f"{path}.stem.patch_bias: OpenCLIP's conv1 has no bias")
        if tower.proj_bias:
            problems.append(f"{path}.proj_bias: OpenCLIP's visual.proj has no bias")
    elif tower.modality == "text" and not tower.stem.causal:
        problems.append(f"{path}.stem.causal: OpenCLIP's text tower is causal")
    return problems


def key_map(spec: ModelSpec | str) -> list[KeyPair]:
    """Every tensor of the model under our name and OpenCLIP's, in OpenCLIP's order."""
    spec = load_spec(spec)
    image_name, text_name = clip_towers(spec)
    image, text = spec.towers[image_name], spec.towers[text_name]
    img, txt = f"towers.{image_name}", f"towers.{text_name}"
    w, E = image.width, spec.embed_dim
    p = image.stem.patch_size

    pairs = [
        KeyPair(f"{img}.stem.patch_embed.weight", "visual.conv1.weight", (w, 3, p, p)),
        KeyPair(f"{img}.stem.cls_token", "visual.class_embedding", (w,)),
        KeyPair(f"{img}.stem.pos_embed", "visual.positional_embedding", (image.tokens(), w)),
        *_norm(f"{img}.norm_pre", "visual.ln_pre", w),
        *_blocks(f"{img}.blocks", "visual.transformer.resblocks", image),
        *_norm(f"{img}.norm_final", "visual.ln_post", w),
        KeyPair(f"{img}.proj.weight", "visual.proj", (E, w), transpose=True),
    ]
    tw, stem = text.width, text.stem
    pairs += [
        KeyPair(f"{txt}.stem.token_embed.weight", "token_embedding.weight", (stem.vocab_size, tw)),
        KeyPair(f"{txt}.stem.pos_embed", "positional_embedding", (stem.context_length, tw)),
        *_blocks(f"{txt}.blocks", "transformer.resblocks", text),
        *_norm(f"{txt}.norm_final", "ln_final", tw),
    ]
    if text.proj_bias:  # OpenCLIP then uses an nn.Linear, stored as ours
        pairs += [
            KeyPair(f"{txt}.proj.weight", "text_projection.weight", (E, tw)),
            KeyPair(f"{txt}.proj.bias", "text_projection.bias", (E,)),
        ]
    else:
        pairs.append(KeyPair(f"{txt}.proj.weight", "text_projection", (E, tw), transpose=True))
    pairs.append(KeyPair("logit_scale", "logit_scale", ()))
    if spec.logit_bias_init is not None:
        pairs.append(KeyPair("logit_bias", "logit_bias", ()))
    return pairs


def _norm(ours: str, theirs: str, width: int) -> list[KeyPair]:
    return [KeyPair(f"{ours}.{p}", f"{theirs}.{p}", (width,)) for p in ("weight", "bias")]


def _blocks(ours: str, theirs: str, tower: TowerSpec) -> list[KeyPair]:
    w, h = tower.width, tower.mlp_hidden()
    pairs = []
    for i in range(tower.layers):
        o, t = f"{ours}.{i}", f"{theirs}.{i}"
        pairs += [
            *_norm(f"{o}.norm1", f"{t}.ln_1", w),
            KeyPair(f"{o}.attn.qkv.weight", f"{t}.attn.in_proj_weight", (3 * w, w)),
            KeyPair(f"{o}.attn.qkv.bias", f"{t}.attn.in_proj_bias", (3 * w,)),
            KeyPair(f"{o}.attn.out.weight", f"{t}.attn.out_proj.weight", (w, w)),
            KeyPair(f"{o}.attn.out.bias", f"{t}.attn.out_proj.bias", (w,)),
            *_norm(f"{o}.norm2", f"{t}.ln_2", w),
            KeyPair(f"{o}.mlp.fc1.weight", f"{t}.mlp.c_fc.weight", (h, w)),
            KeyPair(f"{o}.mlp.fc1.bias", f"{t}.mlp.c_fc.bias", (h,)),
            KeyPair(f"{o}.mlp.fc2.weight", f"{t}.mlp.c_proj.weight", (w, h)),
            KeyPair(f"{o}.mlp.fc2.bias", f"{t}.mlp.c_proj.bias", (w,)),
        ]
    return pairs


# ----------------------------------------------------------------------------- conversion
def openclip_to_mmtrain(
    state_dict: Mapping[str, Tensor], spec: ModelSpec | str
) -> dict[str, Tensor]:
    """OpenCLIP `CLIP.state_dict()` -> mmtrain `MultimodalModel` state dict for `spec`.

    Wrapper prefixes (`module.`, `_orig_mod.`) are removed and the causal-mask buffer is ignored;
    anything else that does not fit raises one CheckpointMismatch listing every offending key.
    """
    spec = load_spec(spec)
    pairs = key_map(spec)
    state_dict = {
        k: v
        for k, v in strip_wrapper_prefixes(state_dict).items()
        if k not in IGNORED_OPENCLIP_KEYS
    }
    check_keys(
        state_dict,
        {p.theirs: p.their_shape for p in pairs},
        what=f"the OpenCLIP state dict does not match model {spec.name!r}",
        hint="Convert with the model spec the checkpoint was trained with (its OpenCLIP name, e.g. "
        "ViT-B-32, or a spec file with the same widths, layers, image and patch size, vocabulary "
        "and context length).",
    )
    return {p.ours: _flip(state_dict[p.theirs], p.transpose) for p in pairs}


def mmtrain_to_openclip(
    state_dict: Mapping[str, Tensor], spec: ModelSpec | str
) -> dict[str, Tensor]:
    """mmtrain `MultimodalModel` state dict -> the state dict OpenCLIP's `CLIP` loads with
    `strict=True` (no `attn_mask`: OpenCLIP registers it as a non-persistent buffer)."""
    spec = load_spec(spec)
    pairs = key_map(spec)
    check_keys(
        state_dict,
        {p.ours: p.shape for p in pairs},
        what=f"the mmtrain state dict does not match model {spec.name!r}",
        hint="Export with the spec the model was built from (the spec.yaml next to its weights).",
    )
    return {p.theirs: _flip(state_dict[p.ours], p.transpose) for p in pairs}


def _flip(tensor: Tensor, transpose: bool) -> Tensor:
    # contiguous: safetensors refuses strided views; other tensors are passed through, not copied
    return tensor.t().contiguous() if transpose else tensor


def strip_wrapper_prefixes(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Remove the `module.` (DDP) and `_orig_mod.` (torch.compile) prefixes training adds to keys."""
    out = {}
    for key, value in state_dict.items():
        name = key
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        if name in out:
            raise CheckpointMismatch(
                "the state dict has the same key with and without a wrapper prefix",
                [],
                [key],
                [],
                "Save the unwrapped model's state dict.",
            )
        out[name] = value
    return out


# ----------------------------------------------------------------------------- files
def read_openclip_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """The state dict inside an OpenCLIP weights file: a bare state dict, or a training
    checkpoint `{"epoch", "state_dict": {"module.…": …}, "optimizer", …}`; .pt/.pth/.bin are read
    with `torch.load(weights_only=True)` (never unpickling arbitrary objects), or .safetensors.
    Wrapper prefixes are removed; the keys are not checked (see `openclip_to_mmtrain`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no OpenCLIP checkpoint at {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            obj: object = load_file(str(path), device="cpu")
        except SafetensorError as err:
            raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    else:
        obj = _torch_load_weights(path)
    # An OpenCLIP training checkpoint: the weights are under "state_dict"; "optimizer", "epoch",
    # "name" and the like are not model weights.
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return strip_wrapper_prefixes(obj)


def _torch_load_weights(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = [line.strip() for line in str(err).splitlines() if "Unsupported global" in line]
        if not reason:
            raise ValueError(f"{path} is not a readable PyTorch checkpoint: {err}") from None
        raise ValueError(
            f"{path} holds Python objects besides tensors and plain containers, which are not "
            f"unpickled for safety ({reason[0].split('. Please')[0]}). Re-save just the weights: "
            "torch.save(model.state_dict(), path)."
        ) from None
    except Exception as err:  # torch.load raises many types on corrupt or foreign files
        raise ValueError(
            f"{path} is not a readable PyTorch checkpoint: {type(err).__name__}: {err}"
        ) from None


def write_state_dict(state_dict: Mapping[str, Tensor], path: str | Path) -> None:
    """Write a state dict as .safetensors or .pt (by suffix), atomically: a reader never sees a
    half-written file."""
    path = Path(path)
    if path.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise ValueError(f"{path}: the output must end in .safetensors or .pt, got {path.suffix!r}")
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path) as f:
        if path.suffix == ".safetensors":
            from safetensors.torch import save

            f.write(save(tensors))
        else:
            torch.save(tensors, f)


# ----------------------------------------------------------------------------- models
def load_openclip(path: str | Path, spec: ModelSpec | str) -> torch.nn.Module:
    """An mmtrain model for `spec` holding the weights of the OpenCLIP checkpoint at `path`."""
    spec = load_spec(spec)
    model = model_from_openclip(read_openclip_checkpoint(path), spec)
    log.info("loaded OpenCLIP weights from %s into %s", path, spec.name)
    return model


def model_from_openclip(state_dict: Mapping[str, Tensor], spec: ModelSpec) -> torch.nn.Module:
    """An mmtrain model for `spec` holding the given OpenCLIP weights (dtype kept)."""
    from mmtrain.models.build import model_with_weights

    return model_with_weights(spec, openclip_to_mmtrain(state_dict, spec))


def export_openclip(model: torch.nn.Module, path: str | Path) -> None:
    """Write `model`'s weights as an OpenCLIP state dict (.safetensors or .pt by suffix)."""
    write_state_dict(mmtrain_to_openclip(model.state_dict(), model.spec), path)


def openclip_differences(a: ModelSpec, b: ModelSpec) -> list[str]:
    """Differences that make two specs different OpenCLIP models (empty when they are the same):
    tensor names and shapes, and the activation (OpenCLIP's quick_gelu flag)."""
    diffs = []
    shapes_a = {p.theirs: p.their_shape for p in key_map(a)}
    shapes_b = {p.theirs: p.their_shape for p in key_map(b)}
    for key in _ordered_union(shapes_a, shapes_b):
        if shapes_a.get(key) != shapes_b.get(key):
            diffs.append(
                f"{key}: {_shape_or_absent(shapes_a.get(key))} vs {_shape_or_absent(shapes_b.get(key))}"
            )
    act_a = next(iter(a.towers.values())).activation
    act_b = next(iter(b.towers.values())).activation
    if act_a != act_b:
        diffs.append(f"activation: {act_a} vs {act_b}")
    return diffs


def _ordered_union(*keys: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(k for ks in keys for k in ks))


def _shape_or_absent(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(list(shape))
