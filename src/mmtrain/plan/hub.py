"""A hub model (a transformers class trained as it is, models/hub/) as the planner sees it.

Its parameters are exact (the meta-device build); its FLOPs and the bytes autograd keeps come
from a trace at the planned row (models/hub/trace.py, done by the command layer, which hands
this module the torch-free `HubTrace`). Each tower becomes one stack: `vision` (the visual
encoder with its merger or projector) an encoder, `text` (the language model with its head) a
decoder, whose `traced` field carries what the trace counted, per block and outside blocks.

Pricing the trace (`traced_activations`), per row, times the micro-batch:
- the trace runs in float32: its float elements are counted at the plan's activation bytes,
  and each block's hidden-state input (the residual stream its first norm keeps) at the
  residual bytes (fp32 under 16-bit autocast, as activations.py counts native blocks);
  integer and boolean tensors as traced. At --precision fp32 this is the trace exactly.
- checkpointing: "none" every block's saved tensors; "full" each block's input and, once,
  the blocks' other inputs (rotary tables, masks); "selective" a block's saved tensors less
  those of its attention module, plus that module's input; the block recomputed in backward
  is live again (the largest block, in the recompute term).
- outside the blocks: what the tower keeps there (embeddings, patch projection, merger, final
  norm, the loss's inputs: the chunked loss's logits are transient, activations.py's
  `loss_chunk_bytes`).
- frozen parts are frozen in the trace itself (the command traces with them), so a frozen
  tower with nothing trained before it keeps nothing, and a frozen one on the gradient's path
  keeps what that gradient needs. A LoRA tower is priced as its trace with the tower trained:
  the adapted linears keep their inputs either way (A's gradient reads them); the rank-r
  intermediates are not counted, the frozen norms' copies are (a few percent of a block).
Sequence parallelism is native-only: a hub stack is never split (`Stack.sequence_split`).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from mmtrain.hub_spec import DENOISER_FAMILIES, HubTrace, TowerTrace
from mmtrain.plan.model import PlanModel, Stack
from mmtrain.structured import FieldError

HUB_PRESETS = Path(__file__).resolve().parent.parent / "presets" / "hub"
PIPELINE_INDEX = "model_index.json"  # a diffusers pipeline folder; its transformer in transformer/
# A hub name, as models/hub/source.py's HUB_NAME (plan/ imports no torch, nor models/).
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SP_NATIVE_ONLY = (
    "sequence parallelism is native-only (LLaVA, Qwen2/2.5-VL, Llama/Qwen2 families): a hub "
    "model trains with train.sequence_parallel 1; plan it without --sequence-parallel"
)


def hub_plan_model(name: str, trace: HubTrace, source: str) -> PlanModel:
    """The plan model of a traced hub model: one stack per tower, exact parameters."""
    stacks = tuple(
        _stack(t, t.params, trace.vocab_size if t.name == "text" else 0) for t in trace.towers
    )
    shape = trace.shape
    row = f"{shape.positions} positions"
    if shape.images:
        row += (f", {shape.images} image(s) of {shape.image_height}x{shape.image_width} px "
                f"({trace.image_tokens} tokens)")  # fmt: skip
    return PlanModel(
        name=name,
        stacks=stacks,
        embed_dim=stacks[-1].width,
        source=source,
        language_model=True,
        notes=(f"hub model {trace.architecture} (transformers' class), traced at one row of "
               f"{row}: FLOPs and saved activations from the trace (docs/PLANNER.md)",),
    )  # fmt: skip


def _stack(t: TowerTrace, params: int, vocab: int) -> Stack:
    return Stack(
        name=t.name,
        kind="decoder" if t.name == "text" else "encoder",
        layers=t.blocks,
        width=t.width,
        heads=t.heads,
        kv_heads=t.kv_heads,
        head_dim=t.head_dim,
        mlp_hidden=t.mlp_hidden,
        params=params,
        unused_params=t.unused_params,
        forward_flops=t.forward_flops,
        tokens=t.tokens,
        causal=t.name == "text",
        vocab=vocab,
        logit_rows=t.tokens if vocab else 0,
        stem_params=t.stem_params,
        layer_params=t.block_params,
        fp32_params=t.norm_params,
        stem_fp32_params=min(t.stem_params, t.norm_params),
        norm="rmsnorm",
        rotary=t.name == "text",
        traced=t,
        source=f"{t.name} tower (traced)",
    )


def hub_source(model: str) -> tuple[Path, bool] | None:
    """(folder, whether it is a preset) when `model` names a hub model: a preset of
    presets/hub/ (a published config.json), a transformers model folder, or a hub name
    `org/name` (resolved by the command layer); None for mmtrain's own presets and specs."""
    for folder in sorted(HUB_PRESETS.iterdir()) if HUB_PRESETS.is_dir() else ():
        if folder.name.lower() == model.lower() and (folder / "config.json").is_file():
            return folder, True
    if (Path(model) / "config.json").is_file():
        return Path(model), False
    if (Path(model) / PIPELINE_INDEX).is_file():
        return Path(model) / "transformer", False
    spec_file = model.lower().endswith((".yaml", ".yml", ".json"))
    if HUB_NAME.match(model) and not spec_file and not Path(model).exists():
        return Path(model), False
    return None


def hub_preset_names() -> list[str]:
    if not HUB_PRESETS.is_dir():
        return []
    return sorted(f.name for f in HUB_PRESETS.iterdir() if (f / "config.json").is_file())


def check_hub_strategy(sequence_parallel: int) -> None:
    if sequence_parallel > 1:
        raise FieldError("--sequence-parallel", SP_NATIVE_ONLY)


def _block_bytes(t: TowerTrace, i: int, act: float, residual: float, ac: str) -> float:
    """One block's kept bytes for one row under checkpointing `ac`: nothing for a block the
    trace saw keep nothing (frozen, no gradient through it: it runs without autograd)."""
    if not t.block_saved[i].floats and not t.block_saved[i].other_bytes:
        return 0.0
    adjust = t.block_input * (residual - act)  # its input, the residual stream
    if ac == "full":
        return t.block_input * residual
    saved = t.block_saved[i]
    if ac == "selective":
        kept = saved.bytes(act) - t.attention_saved[i].bytes(act)
        return kept + t.attention_input * act + adjust
    return saved.bytes(act) + adjust


def traced_bytes(
    t: TowerTrace, micro_batch: float, act: float, residual: float, ac: str, tp: int = 1
) -> tuple[float, float, float]:
    """(blocks, outside blocks, recompute working set) bytes of a traced tower for
    `micro_batch` rows."""
    blocks = sum(_block_bytes(t, i, act, residual, ac) for i in range(t.blocks)) / tp
    if ac == "full" and any(_block_bytes(t, i, act, residual, ac) for i in range(t.blocks)):
        blocks += t.shared_inputs.bytes(act)
    working = 0.0
    if ac != "none" and t.blocks:
        working = max(_block_bytes(t, i, act, residual, "none") for i in range(t.blocks)) / tp
    return micro_batch * blocks, micro_batch * t.outside.bytes(act), micro_batch * working


def traced_activations(stack: Stack, micro_batch: float, o, loss_chunk: float):  # noqa: ANN001
    """activations.py's StackActivations of a traced hub stack (module docstring)."""
    from mmtrain.plan.activations import StackActivations

    t = stack.traced
    assert t is not None
    blocks, outside, working = traced_bytes(
        t, micro_batch, o.act_bytes, o.residual_bytes, o.ac, o.tp
    )
    if stack.vocab:
        working = max(working, loss_chunk)
    return StackActivations(blocks, outside, 0.0, working)


# ----------------------------------------------------------------------------- denoisers
def denoiser_class(folder: Path) -> str | None:
    """The diffusers class `folder`'s config.json names (`_class_name`), or None for a
    transformers model's config (which names `architectures`) or a folder without one."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("_class_name") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def check_denoiser_class(name: str, folder: Path) -> None:
    if name not in DENOISER_FAMILIES:
        raise FieldError(
            "--model",
            f"{folder / 'config.json'}: {name} is not a denoiser the planner traces yet; "
            f"supported: {', '.join(DENOISER_FAMILIES)} (Wan 2.1 text-to-video, FLUX.1, SD3, "
            "LTX-Video, CogVideoX, HunyuanVideo)",
        )


def denoiser_plan_model(name: str, trace: HubTrace, source: str) -> PlanModel:
    """The plan model of a traced diffusers denoiser: one "diffusion" stack per kind of block
    (`denoiser`, and FLUX's `denoiser_single`), exact parameters, chained (the gradient of the
    later blocks flows through the earlier ones)."""
    family = DENOISER_FAMILIES[trace.architecture]
    stacks = tuple(_denoiser_stack(t) for t in trace.towers)
    shape = trace.shape
    sample = f"{shape.image_height}x{shape.image_width} px"
    if family.temporal:
        sample = f"{shape.frames} frames x {sample}"
    latent = "x".join(str(n) for n in trace.latent_shape)
    return PlanModel(
        name=name,
        stacks=stacks,
        embed_dim=stacks[0].width,
        source=source,
        language_model=True,  # the stacks feed each other; no contrastive embeddings
        notes=(
            f"diffusers denoiser {trace.architecture} ({family.pipeline}), traced at one sample "
            f"of {sample}: latent {latent} ({trace.image_tokens:,} tokens) and {shape.positions} "
            f"text tokens ({family.text}); the VAE and text encoders are not in the plan "
            "(latents and text features encoded beforehand); docs/PLANNER.md",
        ),
    )


def _denoiser_stack(t: TowerTrace) -> Stack:
    return replace(_stack(t, t.params, 0), kind="diffusion", causal=False, norm="layernorm",
                   source=f"{t.name} (traced)")  # fmt: skip
