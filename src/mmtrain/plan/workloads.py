"""Workload presets beyond the trainable specs: VLMs, diffusion transformers and a document
model, each built from its public shape (source given), plus the default workload table.

The VLMs (`llava-1.5-13b`, `llava-34b`, `mllm-30b`, `vlm-70b`) are specs (`vlm_spec`): a preset
vision tower and the LM's published config as a `DecoderSpec`, planned by `plan/model.py` like
any language-model spec; `llava-1.5-7b` is the preset itself. `doc-ocr-2b`'s decoder (and its
2x2-merging vision tower, which a spec cannot express) still comes from the formula below.
The diffusion rows stay built from their published shapes too: `dit-2b` (SD3's MMDiT) and
`dit-12b` (FLUX.1) run text tokens beside the image tokens, with a second stream of weights
(MMDiT) or double- and single-stream blocks (FLUX), and `video-dit-30b` is a video DiT; a
`DenoiserSpec` (a class-conditional DiT over a square grid: DiT-XL-2, tiny-dit) is none of these.

Formula decoders are Llama-style: RMSNorm, grouped-query attention, SwiGLU MLP, untied LM head.
Parameters: embedding V h + L (2 h a d + 2 h kv d + 3 h f + 2 h) + h + LM head h V.
Forward FLOPs per sample: 2 x (non-embedding parameters) x tokens + 4 L s^2 (a d) attention
(counted in full, PaLM's convention).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from mmtrain.decoder_spec import DecoderSpec
from mmtrain.plan.model import PlanModel, Rows, Stack, default_rows, from_spec
from mmtrain.spec import ModelSpec, ProjectorSpec, TowerSpec, load_spec, with_input_sizes
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


def _vision_tower(preset: str, pooling: str | None = None) -> TowerSpec:
    """A preset's image tower as a VLM uses it: no output projection (the projector maps its
    hidden states), optionally without its pooling head (a VLM reads tokens, not a pooled
    vector: LLaVA-OneVision drops SigLIP's attention-pooling head)."""
    tower = load_spec(preset).towers["image"]
    changes = {"output_proj": False}
    if pooling is not None:
        changes["pooling"] = pooling
    return replace(tower, **changes)


def vlm_spec(
    name: str, tower: TowerSpec, decoder: DecoderSpec, feature_layer: int = -2
) -> ModelSpec:
    """A LLaVA-style spec: `tower`'s hidden states at `feature_layer`, an MLP projector (LLaVA-1.5's
    mlp2x_gelu), the decoder LM; the placeholder id is the vocabulary's last id."""
    return ModelSpec(
        name=name,
        embed_dim=tower.width,
        towers={"image": tower},
        objective="next_token",
        decoder=decoder,
        projector=ProjectorSpec(
            image_token_id=decoder.vocab_size - 1, kind="mlp", feature_layer=feature_layer
        ),
    )


# Decoder shapes from the models' config.json (Hugging Face), Llama-style (qkv_bias: Qwen2).
_VICUNA_13B = DecoderSpec(
    vocab_size=32064, width=5120, layers=40, heads=40, mlp_hidden=13824, max_positions=2048
)
_YI_34B = DecoderSpec(
    vocab_size=64000,
    width=7168,
    layers=60,
    heads=56,
    kv_heads=8,
    mlp_hidden=20480,
    rope_theta=5_000_000.0,
    max_positions=4096,
)
_LLAMA3_70B = DecoderSpec(
    vocab_size=128256,
    width=8192,
    layers=80,
    heads=64,
    kv_heads=8,
    mlp_hidden=28672,
    rope_theta=500_000.0,
    max_positions=4096,
)
_QWEN25_32B = DecoderSpec(
    vocab_size=152064,
    width=5120,
    layers=64,
    heads=40,
    kv_heads=8,
    mlp_hidden=27648,
    qkv_bias=True,
    rope_theta=1_000_000.0,
    max_positions=4096,
)


@dataclass(frozen=True)
class VlmWorkload:
    """A vision-language workload as a spec: `images` images per row of
    `spec.decoder.max_positions` positions; its image tower frozen (LLaVA's stage 2)."""

    spec: ModelSpec
    images: int = 1
    source: str = ""

    def model(self, context: int | None = None) -> PlanModel:
        positions = context or self.spec.decoder.max_positions
        model = from_spec(self.spec, Rows(positions=positions, images=self.images))
        return replace(model.with_modes({"image": "frozen"}), source=self.source)


def _vlm_workloads() -> dict[str, VlmWorkload]:
    vit_l = _vision_tower("ViT-L-14-336")
    return {
        "llava-1.5-13b": VlmWorkload(
            vlm_spec("llava-1.5-13b", vit_l, _VICUNA_13B),
            source="llava-hf/llava-1.5-13b-hf config (Vicuna-13B), 576 image + 1472 text positions",
        ),
        "llava-34b": VlmWorkload(
            vlm_spec("llava-34b", vit_l, _YI_34B),
            images=5,
            source="llava-hf/llava-v1.6-34b-hf config (Nous-Hermes-2-Yi-34B); anyres: 5 x 576 "
            "image + 1216 text positions",
        ),
        "vlm-70b": VlmWorkload(
            vlm_spec("vlm-70b", vit_l, _LLAMA3_70B),
            source="Llama-3-70B shape (meta-llama/Meta-Llama-3-70B config) after ViT-L/14-336: "
            "576 image + 3520 text positions",
        ),
        "mllm-30b": VlmWorkload(
            vlm_spec(
                "mllm-30b",
                _vision_tower("ViT-SO400M-14-SigLIP-384", pooling="mean"),
                _QWEN25_32B,
                feature_layer=-1,
            ),
            source="SigLIP So400m/14-384 + Qwen2.5-32B shapes: 729 image + 3367 text positions",
        ),
    }


def _builders() -> dict[str, callable]:
    return {
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
    return sorted([*_builders(), *_vlm_workloads()])


def load_model(
    name: str,
    *,
    image_size: int | None = None,
    frames: int | None = None,
    context: int | None = None,
    images: float | None = None,
    packed: bool = False,
) -> PlanModel:
    """A trainable preset or spec file (via spec.py) or a workload preset, by name.

    `image_size`, `frames` and `context` override the stems' geometry (spec models) or the
    sequence length of the decoder (workloads; for a language-model spec, the LM positions
    per row). `images` (images per row, default 1 for a VLM) and `packed` (rows of several
    documents) describe a language model's rows.
    """
    if name.lower() in _vlm_workloads():
        return _vlm_workloads()[name.lower()].model(context)
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
    if spec.is_language_model():
        spec = with_input_sizes(spec, image_size, frames, None)
        rows = default_rows(spec)
        rows = Rows(
            positions=context or rows.positions,
            images=rows.images if images is None else images,
            packed=packed,
        )
        return from_spec(spec, rows)
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
    context: int | None = None  # decoder positions per sample (default: the model's)


DEFAULT_WORKLOADS = (
    Workload("image classification fine-tuning (1B)", "vit-g-14", 1024, 10_000_000),
    Workload("OCR / document understanding (2B)", "doc-ocr-2b", 256, 5_000_000),
    Workload("image diffusion (2B)", "dit-2b", 256, 50_000_000),
    Workload("image diffusion (12B)", "dit-12b", 256, 50_000_000),
    Workload("CLIP-style pretraining (8B)", "clip-internvit-6b", 32768, 1_000_000_000),
    # LLaVA-1.5 stage 2: the tower frozen, model_max_length 2048 (scripts/v1_5/finetune.sh)
    Workload(
        "multimodal LLM joint training (7B)",
        "llava-1.5-7b",
        128,
        1_000_000,
        freeze=["image"],
        context=2048,
    ),
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
