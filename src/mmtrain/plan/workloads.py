"""Workload presets beyond the trainable specs: decoder LMs, VLMs and diffusion transformers,
each built from its public shape (source given), plus the default workload table.

Decoders are Llama-style: RMSNorm, grouped-query attention, SwiGLU MLP, untied LM head.
Parameters: embedding V h + L (2 h a d + 2 h kv d + 3 h f + 2 h) + h + LM head h V.
Forward FLOPs per sample: 2 x (non-embedding parameters) x tokens + 4 L s^2 (a d) attention
(counted in full, PaLM's convention).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from mmtrain.plan.model import PlanModel, Stack, from_spec
from mmtrain.spec import load_spec, with_input_sizes
from mmtrain.structured import FieldError, closest, from_dict


def decoder(
    name: str,
    layers: int,
    width: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    tokens: int,
    source: str,
    head_dim: int | None = None,
    mode: str = "train",
) -> Stack:
    """A Llama-style decoder LM stack predicting `tokens` tokens per sample."""
    d = head_dim or width // heads
    block = 2 * width * heads * d + 2 * width * kv_heads * d + 3 * width * ffn + 2 * width
    params = vocab * width + layers * block + width + width * vocab
    non_embedding = params - vocab * width
    flops = 2 * non_embedding * tokens + 4 * layers * tokens * tokens * heads * d
    return Stack(
        name,
        "decoder",
        layers,
        width,
        heads,
        kv_heads,
        d,
        ffn,
        params,
        flops,
        tokens,
        gated=True,
        norm="rmsnorm",
        causal=True,
        vocab=vocab,
        mode=mode,
        source=source,
    )


def transformer(
    name: str,
    kind: str,
    layers: int,
    width: int,
    heads: int,
    ffn: int,
    tokens: int,
    source: str,
    params: int | None = None,
    gated: bool = False,
    mode: str = "train",
) -> Stack:
    """A plain pre-norm stack (ViT encoder, DiT). `params` overrides the block count when the
    published model has extra weights per block (adaLN modulation, two streams)."""
    block = 4 * width * width + (3 if gated else 2) * width * ffn + 4 * width
    total = params if params is not None else layers * block
    flops = 2 * total * tokens + 4 * layers * tokens * tokens * width
    return Stack(
        name,
        kind,
        layers,
        width,
        heads,
        heads,
        width // heads,
        ffn,
        total,
        flops,
        tokens,
        gated=gated,
        mode=mode,
        source=source,
    )


def projector(in_width: int, width: int, tokens: int) -> Stack:
    """LLaVA-1.5's two-layer MLP projector (in -> width -> width, GELU), as one thin stack."""
    params = in_width * width + width + width * width + width
    return Stack(
        "projector",
        "projector",
        1,
        width,
        1,
        1,
        width,
        width,
        params,
        2 * params * tokens,
        tokens,
        source="LLaVA-1.5 mlp2x_gelu",
    )


def _vit_l14_336(mode: str = "frozen") -> Stack:
    # CLIP ViT-L/14 at 336 px: 577 tokens (LLaVA drops CLS and feeds 576 to the LLM).
    return transformer(
        "vision",
        "encoder",
        24,
        1024,
        16,
        4096,
        577,
        "openai/clip-vit-large-patch14-336 config",
        mode=mode,
    )


def _siglip_so400m(mode: str = "frozen") -> Stack:
    return transformer(
        "vision",
        "encoder",
        27,
        1152,
        16,
        4304,
        729,
        "google/siglip-so400m-patch14-384 config (hidden 1152, FFN 4304, 27 layers)",
        mode=mode,
    )


def _llava(name: str, llm: Stack, image_tokens: int = 576) -> PlanModel:
    return PlanModel(
        name, (_vit_l14_336(), projector(1024, llm.width, image_tokens), llm), source=llm.source
    )


def _builders() -> dict[str, callable]:
    return {
        "llava-1.5-7b": lambda: _llava(
            "llava-1.5-7b",
            decoder(
                "llm",
                32,
                4096,
                32,
                32,
                11008,
                32000,
                2048,
                "llava-hf/llava-1.5-7b-hf config (Vicuna-7B: Llama-2-7B shape), 576 image + 1472 text tokens",
            ),
        ),
        "llava-1.5-13b": lambda: _llava(
            "llava-1.5-13b",
            decoder(
                "llm",
                40,
                5120,
                40,
                40,
                13824,
                32000,
                2048,
                "llava-hf/llava-1.5-13b-hf config (Vicuna-13B), 576 image + 1472 text tokens",
            ),
        ),
        "llava-34b": lambda: _llava(
            "llava-34b",
            decoder(
                "llm",
                60,
                7168,
                56,
                8,
                20480,
                64000,
                4096,
                "llava-hf/llava-v1.6-34b-hf config (Nous-Hermes-2-Yi-34B), anyres 2880 image + 1216 text tokens",
            ),
            2880,
        ),
        "vlm-70b": lambda: _llava(
            "vlm-70b",
            decoder(
                "llm",
                80,
                8192,
                64,
                8,
                28672,
                128256,
                4096,
                "Llama-3-70B shape (meta-llama/Meta-Llama-3-70B config) after ViT-L/14-336: 576 image + 3520 text tokens",
            ),
        ),
        "mllm-30b": lambda: PlanModel(
            "mllm-30b",
            (
                _siglip_so400m(),
                projector(1152, 5120, 729),
                decoder(
                    "llm",
                    64,
                    5120,
                    40,
                    8,
                    27648,
                    152064,
                    4096,
                    "Qwen2.5-32B config after SigLIP So400m/14-384: 729 image + 3367 text tokens",
                ),
            ),
            source="SigLIP + Qwen2.5-32B shapes",
        ),
        "dit-2b": lambda: PlanModel(
            "dit-2b",
            (
                transformer(
                    "dit",
                    "diffusion",
                    24,
                    1536,
                    24,
                    6144,
                    4096 + 154,
                    "SD3-Medium MMDiT (depth 24, width 64 x depth), 1024 px: (1024/8/2)^2 = 4096 image + 154 text tokens",
                    params=2_028_000_000,
                ),
            ),
            source="Esser et al. 2024 (SD3)",
        ),
        "dit-12b": lambda: PlanModel(
            "dit-12b",
            (
                transformer(
                    "dit",
                    "diffusion",
                    57,
                    3072,
                    24,
                    12288,
                    4096 + 512,
                    "FLUX.1 (19 double + 38 single blocks, width 3072, 24 heads), 1024 px: 4096 image + 512 text tokens",
                    params=11_900_000_000,
                ),
            ),
            source="black-forest-labs/flux (FLUX.1 [dev] config)",
        ),
        "video-dit-30b": lambda: PlanModel(
            "video-dit-30b",
            (video_dit(),),
            source="Movie Gen (Polyak et al. 2024), 30B: 48 layers, width 6144, FFN 16384, 48 heads",
        ),
        "doc-ocr-2b": lambda: PlanModel(
            "doc-ocr-2b",
            (
                transformer(
                    "vision",
                    "encoder",
                    32,
                    1280,
                    16,
                    5120,
                    5476,
                    "Qwen2-VL-2B vision tower (675M), 1036 px page at patch 14: 74^2 tokens",
                    mode="train",
                ),
                decoder(
                    "llm",
                    28,
                    1536,
                    12,
                    2,
                    8960,
                    151936,
                    1369 + 1024,
                    "Qwen2-1.5B config; 2x2 token merge: 1369 image + 1024 text tokens",
                ),
            ),
            source="Qwen/Qwen2-VL-2B-Instruct config",
        ),
        "vit-g-14": lambda: PlanModel(
            "vit-g-14",
            (
                transformer(
                    "vision",
                    "encoder",
                    40,
                    1408,
                    16,
                    6144,
                    257,
                    "ViT-g/14 (Zhai et al. 2022), 224 px",
                ),
            ),
            source="Zhai et al. 2022, Scaling Vision Transformers",
        ),
        "clip-internvit-6b": lambda: PlanModel(
            "clip-internvit-6b",
            (
                transformer(
                    "image",
                    "encoder",
                    48,
                    3200,
                    25,
                    12800,
                    257,
                    "OpenGVLab/InternViT-6B-224px config",
                ),
                transformer("text", "encoder", 32, 2048, 16, 8192, 77, "1.6B text tower (assumed)"),
            ),
            embed_dim=1024,
            pairs=1,
            source="InternVL (Chen et al. 2024)",
        ),
    }


def video_dit(
    frames: int = 256,
    height: int = 768,
    width: int = 768,
    temporal: int = 8,
    spatial: int = 8,
    patch: int = 2,
) -> Stack:
    """Token geometry: (frames / temporal) x (H / (spatial x patch)) x (W / (spatial x patch)).
    Movie Gen's defaults give 32 x 48 x 48 = 73,728 tokens (its "73K tokens" context)."""
    tokens = (frames // temporal) * (height // (spatial * patch)) * (width // (spatial * patch))
    return transformer(
        "dit",
        "diffusion",
        48,
        6144,
        48,
        16384,
        tokens,
        f"Movie Gen Video 30B; {frames} frames {height}x{width}, compression {temporal}x{spatial}x{spatial}, patch {patch}",
        params=30_000_000_000,
        gated=True,
    )


def workload_names() -> list[str]:
    return sorted(_builders())


def load_model(
    name: str,
    *,
    image_size: int | None = None,
    frames: int | None = None,
    context: int | None = None,
) -> PlanModel:
    """A trainable preset or spec file (via spec.py) or a workload preset, by name.

    `image_size`, `frames` and `context` override the stems' geometry (spec models) or the
    sequence length of the decoder (workloads).
    """
    if name.lower() in _builders():
        model = _builders()[name.lower()]()
        if context is not None:
            model = replace(model, stacks=tuple(_with_context(s, context) for s in model.stacks))
        return model
    try:
        spec = load_spec(name)
    except FieldError as err:
        if err.path != "model":
            raise
        from mmtrain.spec import preset_names

        names = preset_names() + workload_names()
        raise FieldError(
            "--model", f"unknown model {name!r}{closest(name, names)}; presets: {', '.join(names)}"
        ) from None
    spec = with_input_sizes(spec, image_size, frames, context)
    spec.validate()
    return from_spec(spec)


def _with_context(stack: Stack, context: int) -> Stack:
    if stack.kind != "decoder":
        return stack
    return decoder(
        stack.name,
        stack.layers,
        stack.width,
        stack.heads,
        stack.kv_heads,
        stack.mlp_hidden,
        stack.vocab,
        context,
        stack.source,
        stack.head_dim,
        stack.mode,
    )


# ----------------------------------------------------------------------------- workload table
@dataclass(frozen=True)
class Workload:
    """A row of the workload table: a task, the model, the batch and what is trained."""

    task: str
    model: str
    global_batch: int = 256
    samples: int = 10_000_000
    freeze: list[str] | None = None
    precision: str = "bf16"


DEFAULT_WORKLOADS = (
    Workload("image classification fine-tuning (1B)", "vit-g-14", 1024, 10_000_000),
    Workload("OCR / document understanding (2B)", "doc-ocr-2b", 256, 5_000_000),
    Workload("image diffusion (2B)", "dit-2b", 256, 50_000_000),
    Workload("image diffusion (12B)", "dit-12b", 256, 50_000_000),
    Workload("CLIP-style pretraining (8B)", "clip-internvit-6b", 32768, 1_000_000_000),
    Workload("multimodal LLM joint training (7B)", "llava-1.5-7b", 128, 1_000_000),
    Workload("multimodal LLM joint training (33B)", "mllm-30b", 256, 5_000_000),
    Workload("multimodal LLM joint training (70B)", "vlm-70b", 256, 5_000_000),
    Workload("video generation (30B)", "video-dit-30b", 64, 5_000_000),
)


def load_workloads(source: str) -> list[Workload]:
    """`default` or a YAML file holding a list of workload rows."""
    if source == "default":
        return list(DEFAULT_WORKLOADS)
    path = Path(source)
    try:
        rows = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise FieldError("--workloads", f"cannot read {path}: {err}") from None
    if not isinstance(rows, list):
        raise FieldError(
            "--workloads",
            f"{path}: expected a list of workloads (task, model, global_batch, samples)",
        )
    return [from_dict(Workload, row, f"{path}[{i}]") for i, row in enumerate(rows)]
