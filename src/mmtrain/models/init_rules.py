"""The random init of every parameter of a model, by name: width-aware normal draws for
matrices, norms 1/0, biases 0, the contrastive temperature from the spec.

`init_rules(model)` maps each parameter name to an `InitRule`; `apply_init_rules` draws them in a
given order from one generator on the CPU in float32, so the same generator state gives the
same weights on any device, and a model built on the meta device and materialised shard by
shard (train/model_setup.py) starts from the same numbers as one built whole. The model classes
call this module; it reads their structure and imports none of them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mmtrain.models.decoder import Decoder, RMSNorm
from mmtrain.models.heads import FusionHead
from mmtrain.models.materialize import copy_full_, is_sharded
from mmtrain.models.towers import Tower
from mmtrain.spec import VISION_TOWER

log = logging.getLogger(__name__)

NORMS = (nn.LayerNorm, nn.RMSNorm, RMSNorm)  # RMSNorm: the decoder's (and a native tower's)


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
            if isinstance(module, NORMS):
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


def _native_vision_rules(prefix: str, tower: nn.Module) -> dict[str, InitRule]:
    """A native-resolution tower (models/native_vision.py): its patch embedding fan-in, its
    blocks as every tower's (`_block_rules`), the merger's two layers fan-in (its input is
    normalised; its output enters the LM like the projector's)."""
    spec = tower.spec
    rules = {prefix + "patch_embed.weight": InitRule(spec.patch_dim() ** -0.5)}
    for i in range(spec.depth):
        rules.update(_block_rules(f"{prefix}blocks.{i}.", spec.width, spec.depth))
    for name in ("fc1", "fc2"):
        weight = getattr(tower.merger, name).weight
        rules[f"{prefix}merger.{name}.weight"] = InitRule(_fan_in(weight) ** -0.5)
    return rules


def _language_model_rules(model: nn.Module) -> dict[str, InitRule]:
    """The image tower as in a MultimodalModel, the decoder as `Decoder.init_weights` draws it,
    the projector fan-in (each output near unit variance for unit-variance inputs; the vision
    hidden states are not normalised, LLaVA trains this layer first), biases 0."""
    rules = _constant_rules(model)
    for name, tower in model.towers.items():
        if isinstance(tower, Tower):
            rules.update(_tower_rules(f"towers.{name}.", tower))
        elif name == VISION_TOWER:
            rules.update(_native_vision_rules(f"towers.{name}.", tower))
        else:
            rules.update(_decoder_rules(f"towers.{name}.", tower))
    if model.projector is not None:
        for name, param in model.projector.named_parameters():
            if name.endswith("weight"):
                rules[f"projector.{name}"] = InitRule(_fan_in(param) ** -0.5)
    return rules


DIT_EMBEDDING_STD = 0.02  # DiT's timestep MLP and class table
# adaLN-Zero: every block's modulation (an MMDiT's text stream's too), the final layer's
# modulation and its output layer (the denoiser's own `out`, not a block's `attn.out`)
DIT_ZERO = (".modulation.weight", ".context_modulation.weight",
            ".denoiser.modulation_out.weight", ".denoiser.out.weight")  # fmt: skip
# What plays the class table's part: DiT's embedding std (an MMDiT's pooled text MLP)
DIT_EMBEDDINGS = (".time_fc", ".pooled_fc")


def _denoiser_rules(model: nn.Module) -> dict[str, InitRule]:
    """DiT's init (Peebles & Xie 2023, section 3): every matrix with Xavier's variance
    2 / (fan_in + fan_out) (drawn normal, as every rule here), the timestep MLP and the class
    table N(0, 0.02), the modulations and the output layer zero, so each block starts as the
    identity and the first prediction is 0; biases 0. An MMDiT follows the same rules: its
    text stream's modulations start at zero too (both streams start as the identity), its
    pooled text's MLP is drawn like the timestep's and its text projection like any matrix."""
    rules = _constant_rules(model)
    for name, param in model.named_parameters():
        if name.endswith(DIT_ZERO) or name.endswith("bias"):
            rules[name] = InitRule(value=0.0)
        elif any(part in name for part in DIT_EMBEDDINGS) or name.endswith("classes.weight"):
            rules[name] = InitRule(DIT_EMBEDDING_STD)
        elif param.dim() >= 2:
            rules[name] = InitRule((2 / (_fan_in(param) + param.shape[0])) ** 0.5)
    return rules


def init_rules(model: nn.Module) -> dict[str, InitRule]:
    """The init of every parameter of `model` (a MultimodalModel, LanguageModel or
    DiffusionModel) by name (norms 1/0, biases 0, the rest above)."""
    if model.spec.decoder is not None:  # a LanguageModel (by its spec: no import of its class)
        return _language_model_rules(model)
    if model.spec.denoiser is not None:  # a DiffusionModel
        return _denoiser_rules(model)
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
