"""MultimodalModel: the towers of a `ModelSpec`, the contrastive temperature, an optional fusion
head; plus `create_model`, `save_model` and `load_model`, which also build, save and load a
`LanguageModel` (models/vlm.py) when the spec has a decoder.

A model folder (run folder or converted checkpoint) holds `spec.yaml` (the `ModelSpec`) and the
state dict: `model.safetensors`, or, past `MAX_SHARD_BYTES`, shards listed in
`model.safetensors.index.json` (models/safetensors_files.py). Every file is written atomically.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from mmtrain.atomic import atomic_write_text
from mmtrain.models.decoder import Decoder
from mmtrain.models.heads import FusionHead
from mmtrain.models.materialize import copy_full_, initialised_parameters, is_sharded
from mmtrain.models.safetensors_files import (
    INDEX_FILE,
    MAX_SHARD_BYTES,
    SafetensorsReader,
    TensorEntry,
    WeightsFileError,
    entries_of,
    has_weights,
    open_weights,
    write_tensors,
)
from mmtrain.models.towers import Tower
from mmtrain.models.vlm import LanguageModel
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError

WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "spec.yaml"

log = logging.getLogger(__name__)

_NORMS = (nn.LayerNorm, nn.RMSNorm)


class ModelFileError(FieldError):
    """A model file exists but cannot be used (corrupt, or keys/shapes that do not fit the spec)."""

    def __init__(self, file: str | Path, message: str):
        super().__init__(str(file), message)


class MultimodalModel(nn.Module):
    """Towers by name (the batch keys), `logit_scale` / `logit_bias` for the contrastive loss,
    and an optional `fusion` head over the towers' token sequences."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.towers = nn.ModuleDict(
            {name: Tower(tower, spec.embed_dim) for name, tower in spec.towers.items()}
        )
        if spec.pairs:
            self.logit_scale = nn.Parameter(torch.tensor(float(spec.logit_scale_init)))
        if spec.logit_bias_init is not None:
            self.logit_bias = nn.Parameter(torch.tensor(float(spec.logit_bias_init)))
        self.fused = spec.fused_towers()
        self.fusion = None
        if spec.fusion is not None:
            widths = {name: spec.towers[name].width for name in self.fused}
            self.fusion = FusionHead(spec.fusion, widths)

    def _present(self, batch: Mapping[str, torch.Tensor]) -> list[str]:
        names = [name for name in self.towers if name in batch]
        if not names:
            raise KeyError(
                f"the batch has none of this model's towers ({', '.join(self.towers)}); "
                f"batch keys: {', '.join(map(str, batch)) or 'none'}"
            )
        return names

    def encode(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """L2-normalised embeddings [B, embed_dim] for every tower whose name is a batch key
        (other keys, such as labels, are ignored)."""
        return {
            name: F.normalize(self.towers[name](batch[name]), dim=-1)
            for name in self._present(batch)
        }

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`encode(batch)`, plus "fusion" -> [B, num_outputs] when the model has a fusion head and
        every fused tower is in the batch (each tower runs once for both)."""
        out: dict[str, torch.Tensor] = {}
        memory: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name in self._present(batch):
            tower, x = self.towers[name], batch[name]
            tokens = tower.forward_tokens(x)
            out[name] = F.normalize(tower.pool_and_project(tokens, x), dim=-1)
            if name in self.fused:
                memory[name] = (tokens, tower.token_mask(x))
        if self.fusion is not None and all(name in memory for name in self.fused):
            out["fusion"] = self.fusion(memory)
        return out

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Width-aware random init (see `init_rules` for the std of every parameter kind and the
        convention it follows); norms 1/0, biases 0, `logit_scale`/`logit_bias` from the spec.

        Values are drawn on the CPU in float32 from `generator`, one parameter after another in
        `named_parameters()` order, and copied, so the same generator state gives the same weights
        on any device.
        """
        apply_init_rules(initialised_parameters(self), init_rules(self), generator)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute derived (non-persistent) buffers such as the audio stem's mel filterbank."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()


def apply_init_rules(
    named: list[tuple[str, nn.Parameter]],
    rules: Mapping[str, InitRule],
    generator: torch.Generator,
) -> None:
    """Initialise each (name, parameter) by its rule, one after another in the given order."""
    for name, param in named:
        rule = rules.get(name) or _fallback_rule(name, param)
        if rule.std is None:
            # Rounded to float32 like the drawn values: a model built in another dtype (on the
            # meta device, then materialised) starts from the same numbers.
            param.fill_(float(torch.tensor(rule.value, dtype=torch.float32)))
        else:
            _normal_(param, rule.std, generator)


def _normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill `param` with N(0, std) drawn on the CPU in float32 (in place when it lives there)."""
    if param.device.type == "cpu" and param.dtype == torch.float32 and not is_sharded(param):
        param.normal_(0.0, std, generator=generator)
    else:  # another device or dtype, or a shard: the full value drawn, this rank's rows kept
        copy_full_(param, torch.empty(param.shape).normal_(0.0, std, generator=generator))


# ----------------------------------------------------------------------------- initialisation
# Why width-aware: a fixed N(0, 0.02) is GPT-2's choice for width 768; at width 128 it leaves
# q.k logits ~20x too small (attention starts uniform) and the stems' tokens far below unit
# scale, and it learned 1.44x slower than OpenCLIP in bench/learning_parity.py. The stds below
# keep each layer's output near unit variance for unit-variance inputs (fan-in scaling) and the
# residual stream's growth bounded over depth (GPT-2 / OpenAI CLIP's 1/sqrt(2 * layers)).


@dataclass(frozen=True)
class InitRule:
    """N(0, std) when `std` is set, else the constant `value`."""

    std: float | None = None
    value: float = 0.0


def _fan_in(param: torch.Tensor) -> int:
    """Inputs per output of a Linear [out, in] or conv [out, in, *kernel] weight."""
    return param[0].numel()


def _block_rules(prefix: str, width: int, layers: int) -> dict[str, InitRule]:
    """One transformer block of a stack of `layers` (self- or cross-attention, MLP).

    OpenAI CLIP's / OpenCLIP's text-tower convention (`TextTransformer.init_parameters`), used here
    for every modality: q/k/v width**-0.5 (fan-in: unit-variance projections, so q.k/sqrt(d) starts
    O(1) and attention is not uniform); fc1 (2 * width)**-0.5 (GELU keeps about half the variance);
    the two residual outputs (attn.out, mlp.fc2) width**-0.5 * (2 * layers)**-0.5, so the 2 * layers
    branches added to the stream sum to about one unit of variance whatever the depth (GPT-2).
    """
    attn, fc1 = width**-0.5, (2 * width) ** -0.5
    residual = width**-0.5 * (2 * layers) ** -0.5
    stds = {
        "attn.qkv.weight": attn,  # self-attention
        "attn.q.weight": attn,  # cross-attention (MAP pooling, fusion)
        "attn.kv.weight": attn,
        "attn.out.weight": residual,
        "mlp.fc1.weight": fc1,
        "mlp.fc2.weight": residual,
    }
    return {prefix + k: InitRule(std) for k, std in stds.items()}


def _stem_rules(prefix: str, stem: nn.Module, width: int) -> dict[str, InitRule]:
    """Token embeddings, patch projections, positions and class tokens."""
    rules: dict[str, InitRule] = {}
    named = dict(stem.named_parameters())
    if "token_embed.weight" in named:
        # OpenCLIP's text tower: embeddings 0.02, positions 0.01 (the stream starts small; every
        # block input is normalised, so only the ratio to the residual branches matters).
        rules[prefix + "token_embed.weight"] = InitRule(0.02)
        rules[prefix + "pos_embed"] = InitRule(0.01)
        return rules
    # Patch stems: LeCun fan-in (timm's jax-style patch_embed init) so a standardised input gives
    # unit-variance tokens; positions and class token at width**-0.5 as OpenCLIP's vision tower
    # (`scale * randn`), small beside the content but not negligible.
    rules[prefix + "patch_embed.weight"] = InitRule(_fan_in(named["patch_embed.weight"]) ** -0.5)
    for name in ("cls_token", "pos_embed"):
        rules[prefix + name] = InitRule(width**-0.5)
    for name in ("pos_spatial", "pos_temporal"):  # video: summed, so each gets half the variance
        rules[prefix + name] = InitRule((2 * width) ** -0.5)
    return {k: v for k, v in rules.items() if k[len(prefix) :] in named}


def _tower_rules(prefix: str, tower: Tower) -> dict[str, InitRule]:
    width, layers = tower.spec.width, tower.spec.layers
    rules = _stem_rules(prefix + "stem.", tower.stem, width)
    for i in range(layers):
        rules.update(_block_rules(f"{prefix}blocks.{i}.", width, layers))
    if tower.pool is not None:
        # MAP head: the probe is a learned query (timm's AttentionPoolLatent: width**-0.5). Its
        # attention output starts the stream (not a residual branch: fan-in width**-0.5); the MLP
        # after it is one residual branch (layers=1 -> width**-0.5 * 2**-0.5).
        rules.update(_block_rules(prefix + "pool.", width, 1))
        rules[prefix + "pool.probe"] = InitRule(width**-0.5)
        rules[prefix + "pool.attn.out.weight"] = InitRule(width**-0.5)
    if tower.proj is not None:
        # OpenCLIP's proj / text_projection: width**-0.5 (fan-in of the normalised pooled token).
        rules[prefix + "proj.weight"] = InitRule(width**-0.5)
    return rules


def _fusion_rules(prefix: str, fusion: FusionHead) -> dict[str, InitRule]:
    width, layers = fusion.spec.width, fusion.spec.layers
    rules: dict[str, InitRule] = {}
    for name, linear in fusion.inputs.items():
        # Fan-in: the towers' normalised tokens map to unit variance at the fusion width.
        rules[f"{prefix}inputs.{name}.weight"] = InitRule(_fan_in(linear.weight) ** -0.5)
        # A modality-type embedding, scaled like OpenCLIP's vision positions.
        rules[f"{prefix}modality_embed.{name}"] = InitRule(width**-0.5)
    rules[prefix + "queries"] = InitRule(width**-0.5)  # learned queries, like the MAP probe
    for i in range(layers):
        rules.update(_block_rules(f"{prefix}blocks.{i}.", width, layers))
    # The classifier/regressor reads a normalised vector; 0.1 x fan-in starts its outputs at
    # std 0.1 whatever the width: near-uniform class probabilities (loss about ln C), as timm's
    # small head init, yet not zero, so the blocks below get gradient from step 1. At 1 x fan-in
    # (logits of std 1), SGD at lr 0.1 oscillated in tests/test_models.py's fusion test.
    rules[prefix + "out.weight"] = InitRule(0.1 * width**-0.5)
    return rules


def _constant_rules(model: nn.Module) -> dict[str, InitRule]:
    """Norms 1 (weight) / 0 (bias), and every bias 0."""
    rules: dict[str, InitRule] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, _ in module.named_parameters(recurse=False):
            if isinstance(module, _NORMS):
                rules[prefix + name] = InitRule(value=1.0 if name == "weight" else 0.0)
            elif name == "bias":  # timm / OpenCLIP text: zero biases, the function starts linear
                rules[prefix + name] = InitRule(value=0.0)
    return rules


def _decoder_rules(prefix: str, decoder: Decoder) -> dict[str, InitRule]:
    """What `Decoder.init_weights` draws (it is the one that draws; tests/test_vlm.py holds the
    two together): fan-in std shape[-1]**-0.5 (the embedding: width**-0.5), the residual
    outputs smaller by (2 * layers)**-0.5, norms 1, biases 0."""
    residual = (2 * decoder.spec.layers) ** -0.5
    rules: dict[str, InitRule] = {}
    for name, param in decoder.named_parameters():
        if name.endswith("bias"):
            rules[prefix + name] = InitRule(value=0.0)
        elif "norm" in name:
            rules[prefix + name] = InitRule(value=1.0)
        else:
            std = param.shape[-1] ** -0.5
            if name.endswith(("attn.out.weight", "mlp.fc2.weight")):
                std *= residual
            rules[prefix + name] = InitRule(std)
    return rules


def _language_model_rules(model: LanguageModel) -> dict[str, InitRule]:
    """The image tower as in a MultimodalModel, the decoder as `Decoder.init_weights` draws it,
    the projector fan-in (each output near unit variance for unit-variance inputs; the vision
    hidden states are not normalised, LLaVA trains this layer first), biases 0."""
    rules = _constant_rules(model)
    for name, tower in model.towers.items():
        if isinstance(tower, Tower):
            rules.update(_tower_rules(f"towers.{name}.", tower))
        else:
            rules.update(_decoder_rules(f"towers.{name}.", tower))
    if model.projector is not None:
        for name, param in model.projector.named_parameters():
            if name.endswith("weight"):
                rules[f"projector.{name}"] = InitRule(_fan_in(param) ** -0.5)
    return rules


def init_rules(model: MultimodalModel | LanguageModel) -> dict[str, InitRule]:
    """The init of every parameter of `model` by name (norms 1/0, biases 0, the rest above)."""
    if not isinstance(model, MultimodalModel):
        return _language_model_rules(model)
    rules = _constant_rules(model)
    for name, tower in model.towers.items():
        rules.update(_tower_rules(f"towers.{name}.", tower))
    if model.fusion is not None:
        rules.update(_fusion_rules("fusion.", model.fusion))
    if model.spec.pairs:
        rules["logit_scale"] = InitRule(value=float(model.spec.logit_scale_init))
    if model.spec.logit_bias_init is not None:
        rules["logit_bias"] = InitRule(value=float(model.spec.logit_bias_init))
    return rules


def _fallback_rule(name: str, param: torch.Tensor) -> InitRule:
    """A parameter `init_rules` does not know yet (a new layer): fan-in for matrices, 0 otherwise.

    tests/test_init_weights.py asserts that no parameter of a preset falls through to here.
    """
    log.warning("no init rule for %s; using fan-in N(0, fan_in**-0.5)", name)
    return InitRule(_fan_in(param) ** -0.5) if param.dim() >= 2 else InitRule(value=0.0)


def _new_model(spec: ModelSpec) -> MultimodalModel | LanguageModel:
    """The module class of `spec`: a LanguageModel when it has a decoder."""
    return LanguageModel(spec) if spec.decoder is not None else MultimodalModel(spec)


def create_model(
    name_or_spec: str | Path | ModelSpec,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> MultimodalModel | LanguageModel:
    """A randomly initialised model from a preset name, a spec file or a `ModelSpec`: a
    `LanguageModel` (LM or vision-language model) when the spec has a decoder, else a
    `MultimodalModel`.

    `device="meta"` builds without memory or init (instant, for counting and planning). The
    initialisation is a pure function of `seed`, whatever the device.
    """
    spec = load_spec(name_or_spec)
    device = torch.device(device) if device is not None else torch.device("cpu")
    # Build on the meta device (no memory, no default init), then allocate once and init once.
    with torch.device("meta"):
        model = _new_model(spec)
    if device.type != "meta":
        model = model.to_empty(device=device)
        model.init_weights(torch.Generator().manual_seed(seed))
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside torch.compile (`_orig_mod`) and DDP (`module`) wrappers; FSDP2 and
    per-block compile work in place, so their model is the module itself."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        if inner is None:
            return model
        model = inner


def _unwrap(model: nn.Module) -> MultimodalModel | LanguageModel:
    """The MultimodalModel or LanguageModel inside its wrappers."""
    inner = unwrap_model(model)
    if not isinstance(inner, (MultimodalModel, LanguageModel)):
        raise TypeError(f"expected a MultimodalModel or LanguageModel, got {type(model).__name__}")
    return inner


def save_model(
    model: nn.Module, directory: str | Path, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Path:
    """Write `model`'s weights (`model.safetensors`, or shards of at most `max_shard_bytes` and
    `model.safetensors.index.json`) and `spec.yaml` into `directory`, atomically.

    Returns the folder. Tensors are saved as they are (dtype kept), moved to the CPU one at a time.
    """
    model = _unwrap(model)
    state = model.state_dict()
    return write_model_folder(
        directory, model.spec, entries_of(state), state.items(), max_shard_bytes=max_shard_bytes
    )


def write_model_folder(
    directory: str | Path,
    spec: ModelSpec,
    layout: Sequence[TensorEntry],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a model folder from tensors that arrive one at a time: `layout` lists every
    (name, dtype, shape) up front, in the order `tensors` yields them, and each tensor is
    written and released before the next is asked for. A model whose weights do not fit one
    process (FSDP) is exported by gathering one parameter at a time into this iterator.

    The weights go first, spec.yaml last; a writer that fails leaves the folder as it was.
    """
    directory = Path(directory)
    write_tensors(directory, layout, tensors, max_shard_bytes=max_shard_bytes)
    atomic_write_text(directory / SPEC_FILE, yaml.safe_dump(spec.to_dict(), sort_keys=False))
    return directory


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor], source: str | Path
) -> None:
    """Raise ModelFileError listing missing, unexpected and mis-shaped keys of `state`."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    mis_shaped = sorted(
        f"{k} {list(state[k].shape)} (model: {list(expected[k])})"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if mis_shaped:
        problems.append(f"mis-shaped keys: {_listing(mis_shaped)}")
    if problems:
        raise ModelFileError(
            source,
            "weights do not fit the spec; "
            + "; ".join(problems)
            + ". Was it saved from a different model?",
        )


def model_with_weights(
    spec: ModelSpec, state: Mapping[str, torch.Tensor], source: str | Path | None = None
) -> MultimodalModel | LanguageModel:
    """A model of `spec` adopting the tensors of `state` (no copy, no random init), its derived
    buffers rebuilt. With `source`, keys and shapes are checked first (ModelFileError naming it);
    without, `load_state_dict`'s strict check applies."""
    with torch.device("meta"):
        model = _new_model(spec)
    if source is not None:
        check_state_dict(model, state, source)
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_buffers()
    return model


def read_model_folder(path: str | Path) -> tuple[ModelSpec, SafetensorsReader]:
    """(spec, lazy reader of the weights) of a model folder, or of the path of its
    model.safetensors or model.safetensors.index.json; no tensor is read yet. Raises
    FileNotFoundError naming a missing file and ModelFileError for an unreadable one."""
    path = Path(path)
    is_weights = path.is_file() and (path.suffix == ".safetensors" or path.name == INDEX_FILE)
    folder = path.parent if is_weights else path
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    expected = f"{WEIGHTS_FILE} (or shards listed in {INDEX_FILE}) and {SPEC_FILE}"
    if not (folder / SPEC_FILE).is_file():
        raise FileNotFoundError(
            f"{folder / SPEC_FILE} is missing: a model folder holds {expected} "
            "(written by mmtrain.save_model, a training run or `mmtrain convert`)"
        )
    if not is_weights and not has_weights(folder):
        raise FileNotFoundError(
            f"{folder / WEIGHTS_FILE} is missing: a model folder holds {expected}"
        )
    spec = ModelSpec.load(folder / SPEC_FILE)
    try:
        return spec, open_weights(path)
    except WeightsFileError as err:
        raise ModelFileError(err.path, err.message) from None


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> MultimodalModel | LanguageModel:
    """Load a model folder (run folder or converted checkpoint: spec.yaml and model.safetensors
    or shards with model.safetensors.index.json), or the path of its weights file. Raises
    FileNotFoundError naming a missing file and ModelFileError for a corrupt file or weights
    that do not fit the spec."""
    spec, reader = read_model_folder(path)
    with reader:
        try:
            state = {name: reader[name] for name in reader}
        except WeightsFileError as err:
            raise ModelFileError(err.path, err.message) from None
    model = model_with_weights(spec, state, reader.source)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model
