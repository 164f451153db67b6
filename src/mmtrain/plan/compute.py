"""Step time, throughput, MFU, time and cost to train.

FLOPs per sample (2 x multiply-adds, spec.py's convention, attention counted non-causally as in
PaLM's MFU definition) are `spec.train_flops` over the stacks, the definition the trainer's MFU
uses too: a trainable stack costs 3x its forward (6N per token plus the attention term, PaLM
App. B: 6N + 12 L H Q T); a LoRA-adapted stack 2x (input gradients, no weight gradients); a
frozen stack 1x, 2x when a language model's gradient passes through it to a trained stack before
it. MFU counts model FLOPs only; hardware FLOPs add what activation checkpointing recomputes:
one more forward of the trained blocks with full recompute (Narayanan et al. 2021's 8N), the
attention sub-block's forward with selective recompute.

Achievable fraction of peak, per workload family (`--mfu` overrides). The step time divides
the *hardware* FLOPs of the computed positions (padding included) by dense peak x fraction.
Each family's fraction comes from one published MFU range, converted in three stated steps:
1. the midpoint of the published range (no point is picked to fit a check);
2. times the published run's hardware / model FLOPs as this planner counts them for that
   run's recipe (a published MFU counts model FLOPs, while the run also spent time on what
   its activation checkpointing recomputed): 1 without checkpointing, 4/3 with full
   checkpointing, the planner's selective count for torchtitan's recipe (Llama-3.1-8B at
   8,192 positions: 1.12);
3. divided by the MAMF fraction of the GPU it was measured on, and multiplied by the planned
   GPU's (best measured bf16 matmul over spec peak, stas00/ml-engineering "Maximum Achievable
   Matmul FLOPS"; hardware/gpus.csv `mamf_fraction`). A share of MAMF transfers across GPUs
   better than a share of peak: AMD's MI300X reaches 51% of its peak in a bare matmul, NVIDIA's
   parts 73-87%, and no training run can exceed its GPU's matmul ceiling.
So planning a published run's recipe on its GPU gives back its published MFU (before any
exposed communication).

| family | the planner picks it for | published MFU | on | recompute | share of MAMF | source |
|---|---|---|---|---|---|---|
| contrastive | encoder towers with contrastive pairs (CLIP, SigLIP) | 11-12% -> 11.5% (an estimate) | A100 (MAMF 86.9%) | none: 1 | 0.132 | OpenCLIP ViT-B/32 and ViT-L/14 on A100, derived from OpenCLIP's published throughput by this project's research, not a figure of OpenCLIP's authors (../shared/reference/published-runs.md, "Contrastive training") |
| llm | a decoder LM without an image tower | 33-39% -> 36% | H100 SXM (80.3%) | selective: 1.12 | 0.502 | torchtitan, Llama-3.1-8B on 8 x H100, FSDP, selective AC, bf16: 33% eager to 39% compiled (its Table 1: 5,762 and 6,667 tokens/s/GPU at 57.9 GFLOPs per token, i.e. 8,192 positions; pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md; its H100s ran at 500 W with a peak below the SXM figure the MFU divides by, so the figure is low) |
| vlm-packed | a decoder LM with an image tower and projector, packed rows | 30-40% -> 35% | A800 = A100 compute (86.9%) | full: 4/3 | 0.537 | lmms-engine, Qwen2.5-VL-7B / Qwen3-VL-8B on 32 x A800, FSDP2, first-fit packing to 61,440 positions, padding removed, ViT FLOPs not counted (EvolvingLMMs-Lab lmms-engine docs/reference/mfu.md, "Image Models") |
| vlm-padded | the same with padded rows | vlm-packed's fraction, applied to the computed positions | | | 0.537 | as vlm-packed: see below |

Padding is not counted twice. lmms-engine's MFU counts the tokens a row really holds, and
its "35-40% with packing vs 20-25% without" (same page) compares useful work; the planner
instead computes every padded position (a padded layout's FLOPs are those of its computed
positions, plan/lengths.py) at the rate of a dense row. Applying the unpacked 20-25% to
computed positions would charge padding twice; the packed figure applied to them, times the
layout's fill, is the useful MFU (the LLaVA check's padded rows: 35% x 58.9% fill = 20.5%,
inside the unpacked 20-25%). lmms-engine's checkpointing is not stated on that page; its
example Qwen2.5-VL config sets `gradient_checkpointing: true`, and 61,440 positions of a 7B
model do not fit 80 GB without it (Korthikanti's 34 s h bytes per layer alone: 28 x 61,440 x
34 x 3,584 B = 210 GB), so the run is read as full recompute. It leaves the ViT's FLOPs out of
its MFU, so the fraction is low for VLMs whose tower is a large share of the work (for
LLaVA-1.5's frozen ViT-L/14-336 under 1%).

Families the planner can tell apart but has no published figure for (diffusion transformers;
encoder models without contrastive pairs: classifiers, fusion heads) borrow the llm figure,
and the plan says so (`efficiency_source`); pass `--mfu` with a figure of your own. The
figures are bf16 runs; other precisions apply the same share of MAMF to their own peak
(not measured). Small widths reach less than these runs; treat sub-1B models as optimistic.

Communication (comm.py) overlaps with compute where frameworks overlap it: data-parallel
gradient reduction with the last micro-batch's backward, ZeRO-3 gathers with each micro-batch;
tensor-parallel all-reduces (4 per layer per micro-batch, 6 with full recompute) and the
ZeRO-1/2 parameter all-gather after the optimizer step are exposed. Overlap is capped at 80%
of the compute they hide behind.

CPU offload (plan/offload.py): each unit's shards are copied in over the host link for its
all-gathers and the gradient shards copied out; what compute does not hide is on the step's
critical path (`offload_exposed_s`); the optimizer's step on the host is not timed. A QLoRA
stack computes as a LoRA one (its weights are dequantized per matmul: memory traffic, not FLOPs).

DPO (`--objective dpo`, plan/preference.py): a sample is a pair, two rows through the policy's
language model and, in a native VLM, one set of images through its vision stacks (a hub
model's: two); the step time and MFU count pairs. A reference that runs in the step
(`adapters`, `copy`) adds its forward of the pair (model FLOPs: a frozen model's forward), its
TP all-reduces, and under ZeRO-3 one more all-gather a micro-batch (of the policy's weights for
adapters, of the copy's for a copy); a cached reference (`cache`) adds nothing to the step and
instead one pass before training, one forward of every pair at the plan's rate
(`reference_pass_s`: the achievable fraction of peak the step's hardware FLOPs run at, over all
GPUs; compute only), added to the run's time and cost.

Sequence parallelism over N ranks: each rank computes 1/N of the split stacks' FLOPs (their
tokens, attention included: T/N queries against all T keys) and all of the rest (vision
towers and projector, which every rank of the group runs whole); the data-parallel gradient
reduction spans dp x N ranks. Its communication (comm.py: all-to-alls, ring passes, a
denoiser's output gather) is counted per layer and micro-batch like tensor parallelism's
(again for the recomputed forward under full checkpointing), and its exposed part is on the
step's critical path beside the compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mmtrain.hardware import CURRENCY, GPU, Catalog, Interconnect, default_catalog
from mmtrain.plan import preference as pref
from mmtrain.plan.comm import (
    Traffic,
    all_gather_s,
    all_reduce_s,
    group_link,
    output_gather,
    reduce_scatter_s,
    ring_layer,
    ulysses_layer,
)
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.fsdp_units import frozen_gathered_bytes
from mmtrain.plan.model import PlanModel, Stack
from mmtrain.plan.offload import host_estimate
from mmtrain.plan.states import state_bytes
from mmtrain.spec import FUSION_PART, PartTraining, train_flops

OVERLAP = 0.8


@dataclass(frozen=True)
class PublishedMfu:
    """A published MFU range (model FLOPs over dense bf16 peak) and the run it describes."""

    low: float
    high: float
    gpu: str  # catalog key of the GPU it was measured on (for its MAMF fraction)
    ac: str  # the run's activation checkpointing, in the planner's terms
    source: str
    # decoder shape of the run (layers, width, heads, kv heads, MLP width, vocab, positions),
    # for the planner's count of what its checkpointing recomputed; None: nothing recomputed
    recipe: tuple[int, ...] | None = None

    @property
    def point(self) -> float:
        """The midpoint of the published range: the rule, for every family."""
        return (self.low + self.high) / 2


PUBLISHED = {
    "contrastive": PublishedMfu(
        0.11,
        0.12,
        "a100",
        "none",
        "OpenCLIP ViT-B/32 and ViT-L/14 on A100: about 11-12% MFU, an estimate derived from "
        "OpenCLIP's published throughput (published-runs.md, Contrastive training)",
    ),
    "llm": PublishedMfu(
        0.33,
        0.39,
        "h100",
        "selective",
        "torchtitan Llama-3.1-8B on 8 x H100, FSDP, selective AC, bf16: 33-39% MFU "
        "(pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md)",
        recipe=(32, 4096, 32, 8, 14336, 128256, 8192),
    ),
    "vlm": PublishedMfu(
        0.30,
        0.40,
        "a100",  # A800: the A100's compute with fewer NVLink lanes
        "full",
        "lmms-engine Qwen2.5-VL-7B / Qwen3-VL-8B on 32 x A800, FSDP2, packed to 61,440 "
        "positions, ViT FLOPs not counted: 30-40% MFU (EvolvingLMMs-Lab lmms-engine "
        "docs/reference/mfu.md)",
        recipe=(28, 3584, 28, 4, 18944, 152064, 61440),
    ),
}
FAMILIES = ("contrastive", "llm", "vlm-padded", "vlm-packed")  # each with a published figure
UNSOURCED = ("diffusion", "encoder")  # told apart, but no published figure: llm's stands in
_FIGURE = {
    "contrastive": "contrastive",
    "llm": "llm",
    "vlm-padded": "vlm",
    "vlm-packed": "vlm",
    "diffusion": "llm",
    "encoder": "llm",
}


@dataclass(frozen=True)
class Efficiency:
    """The achievable fraction of dense peak a plan's hardware FLOPs run at, and its origin."""

    family: str
    fraction: float
    source: str


def workload_family(model: PlanModel) -> str:
    """The workload family of `model`, from its stacks: a decoder with an image tower is a VLM
    (packed when its rows hold several documents), a decoder alone an LLM; a diffusion stack;
    encoder towers with contrastive pairs; other encoder models (classifiers, fusion heads)."""
    decoder = next((s for s in model.stacks if s.kind == "decoder"), None)
    if decoder is not None:
        if any(s.kind in ("encoder", "projector") for s in model.stacks):
            return "vlm-packed" if decoder.document_mask else "vlm-padded"
        return "llm"
    if any(s.kind == "diffusion" for s in model.stacks):
        return "diffusion"
    return "contrastive" if model.pairs else "encoder"


def published_mfu(model: PlanModel) -> PublishedMfu:
    """The published MFU figure `model`'s workload family stands on (llm's for the unsourced)."""
    return PUBLISHED[_FIGURE[workload_family(model)]]


@lru_cache(maxsize=8)
def recompute_ratio(figure: str) -> float:
    """Hardware over model FLOPs of a published run, as the planner counts its recipe."""
    p = PUBLISHED[figure]
    if p.ac == "none" or p.recipe is None:
        return 1.0
    from mmtrain.plan.workloads import decoder  # a Llama-style stack from its shape

    layers, width, heads, kv, ffn, vocab, tokens = p.recipe
    stack = decoder(figure, layers, width, heads, kv, ffn, vocab, tokens, p.source)
    model_flops, hardware_flops = flops_per_sample(PlanModel(figure, (stack,)), p.ac)
    return hardware_flops / model_flops


def share_of_mamf(figure: str) -> float:
    """A published figure as a share of its GPU's MAMF, in hardware FLOPs (module docstring)."""
    p = PUBLISHED[figure]
    measured_on = default_catalog().gpu(p.gpu)
    return p.point * recompute_ratio(figure) / measured_on.mamf_fraction


def _attention_block_forward(stack: Stack) -> float:
    """Forward FLOPs per sample of the attention sub-blocks (what selective recompute redoes)."""
    s, h = stack.tokens, stack.width
    kv = stack.kv_heads * stack.head_dim
    return stack.layers * (
        2 * s * (2 * h * h + 2 * h * kv) + 4 * s * s * stack.heads * stack.head_dim
    )


@lru_cache(maxsize=256)
def flops_per_sample(
    model: PlanModel, ac: str, sequence_parallel: int = 1, rows: tuple[int, ...] | None = None
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per training sample; with `sequence_parallel` N, what one
    rank of the group computes of it: the split stacks' share 1/N, the other stacks whole.
    `rows`: per stack, the rows' worth of inputs it runs on a sample (a DPO pair's,
    plan/preference.py `stack_rows`); default one each."""
    n = {s.name: sequence_parallel if s.sequence_split else 1 for s in model.stacks}
    k = dict(zip((s.name for s in model.stacks), rows or (1,) * len(model.stacks), strict=True))
    forward = {s.name: k[s.name] * s.forward_flops / n[s.name] for s in model.stacks}
    modes = {s.name: PartTraining(s.mode, s.trained_layer_share()) for s in model.stacks}
    if model.head_flops:
        forward[FUSION_PART] = float(model.head_flops)  # the fusion head trains
    chained = model.language_model
    model_flops = train_flops(forward, modes, chained=chained)
    if ac == "full":
        hardware = train_flops(forward, modes, chained=chained, recompute=list(forward))
    elif ac == "selective":
        redone = [  # a frozen stack on the gradient's path keeps, so recomputes, too
            k[s.name] * _attention_block_forward(s) / n[s.name]
            for s in model.stacks
            if model.keeps_activations(s)
        ]
        hardware = model_flops + sum(redone)
    else:
        hardware = model_flops
    return model_flops, hardware


def objective_flops(
    model: PlanModel, cfg: PlanConfig, per_rank: bool = False
) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per sample of the plan's step (`per_rank`: what one rank of
    a sequence-parallel group computes of it): `flops_per_sample` for SFT; for a DPO pair
    (plan/preference.py) its two rows' and, where the reference runs in the step (adapters,
    copy), its forward over both rows, which is model work (a frozen model's forward, as a
    frozen tower's) and recomputes nothing (it runs without gradients). A cached reference
    adds none (its one pass before training: `reference_pass_s`). A native VLM's vision
    stacks run on each pair's images once, a hub model's on each row's."""
    split = cfg.sequence_parallel if per_rank else 1
    if not pref.is_dpo(cfg):
        return flops_per_sample(model, cfg.ac, split)
    rows = pref.stack_rows(model, cfg.objective)
    model_flops, hardware = flops_per_sample(model, cfg.ac, split, rows)
    reference = pref.reference_forward_flops(model, cfg)
    return model_flops + reference, hardware + reference


def reference_pass_samples_per_s(model: PlanModel, cfg: PlanConfig, gpu: GPU) -> float:
    """Pairs a second a cached reference's one pass before the first step scores (0 for the
    other references): one forward of both rows of a pair, spread over every GPU, at the rate
    the plan's step runs its hardware FLOPs (dense peak x the achievable fraction). Compute
    only: its all-gathers and data loading are not timed."""
    flops = pref.reference_pass_flops(model, cfg)
    if not flops:
        return 0.0
    return gpu.peak_flops(cfg.precision) * efficiency(model, gpu, cfg).fraction * cfg.gpus / flops


def reference_pass_s(model: PlanModel, cfg: PlanConfig, gpu: GPU) -> float:
    """Seconds of a cached reference's pass over the run's --samples pairs (0: no pass)."""
    rate = reference_pass_samples_per_s(model, cfg, gpu)
    return cfg.samples / rate if rate else 0.0


def efficiency(model: PlanModel, gpu: GPU, cfg: PlanConfig) -> Efficiency:
    """The fraction of `gpu`'s dense peak the plan's hardware FLOPs run at: `--mfu`, else the
    published figure of the model's workload family moved to `gpu` by MAMF (module docstring)."""
    family = workload_family(model)
    if cfg.mfu is not None:
        return Efficiency(family, cfg.mfu, f"--mfu (in place of the {family} figure)")
    figure = _FIGURE[family]
    p = PUBLISHED[figure]
    share = share_of_mamf(figure)
    source = (
        f"{p.source}; midpoint {p.point:.1%} x recompute {recompute_ratio(figure):.3g} "
        f"/ MAMF {default_catalog().gpu(p.gpu).mamf_fraction:.1%} = {share:.3f} of MAMF, "
        f"x {gpu.key} MAMF {gpu.mamf_fraction:.1%}"
    )
    if family == "vlm-padded":
        source += "; applied to computed positions, padding included (fill gives useful MFU)"
    if family in UNSOURCED:
        source = (
            f"no published {family} run in the reference: the llm figure stands in "
            f"(--mfu overrides); {source}"
        )
    return Efficiency(family, share * gpu.mamf_fraction, source)


@dataclass(frozen=True)
class TimeEstimate:
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    dp_exposed_s: float
    sp_comm_bytes: float  # sequence-parallel traffic one rank sends per step
    sp_comm_s: float  # its link time per step
    sp_exposed_s: float  # of which compute hides none (in the step time)
    sp_comm_share: float  # sp_exposed_s / step_time_s (the run's measured comm share beside it)
    bubble_s: float
    offload_h2d_s: float  # CPU offload: host-to-device copies' link time per step
    offload_d2h_s: float  # device-to-host
    offload_exposed_s: float  # of which compute hides none (in the step time)
    step_time_s: float
    samples_per_s: float
    mfu: float
    achievable_fraction: float
    efficiency_family: str  # the workload family whose published figure gave the fraction
    efficiency_source: str  # that figure, its source and its conversion (or --mfu)
    time_to_train_s: float  # the steps over --samples, and a cached reference's pass
    cost: float
    reference_pass_s: float  # DPO's cached reference: its one pass before training (in both)
    reference_pass_cost: float
    reference_pass_samples_per_s: float  # pairs it scores a second (0: no pass)
    price_per_gpu_hour: float
    price_source: str  # the catalog's indicative list price, the flag, or a user file
    intra_node: str
    dp_link: str
    sp_link: str  # the sequence-parallel group's link ("" without sequence parallelism)

    def to_dict(self) -> dict:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}
        return {**out, "currency": CURRENCY}


def micro_compute_s(model: PlanModel, cfg: PlanConfig, gpu: GPU) -> float:
    """One micro-batch's compute on one GPU: TP splits each layer, PP the layers, SP the tokens."""
    hw_flops = objective_flops(model, cfg, per_rank=True)[1]  # a rank's
    rate = gpu.peak_flops(cfg.precision) * efficiency(model, gpu, cfg).fraction
    return hw_flops * cfg.micro_batch / (rate * cfg.tp * cfg.pp)


def training_time(model: PlanModel, cfg: PlanConfig, gpu: GPU, catalog: Catalog) -> TimeEstimate:
    model_flops = objective_flops(model, cfg)[0]
    eff = efficiency(model, gpu, cfg)
    fraction = eff.fraction
    rate = gpu.peak_flops(cfg.precision) * fraction
    m = cfg.accumulation
    micro_compute = micro_compute_s(model, cfg, gpu)
    gpn = cfg.gpus_per_node or gpu.gpus_per_node
    tp_link = group_link(catalog, gpu, cfg.tp, gpn, cfg.network)
    act_bytes = 4 if cfg.precision == "fp32" else 2
    tp_comm = 0.0
    step_reference = pref.reference_in_step(model, cfg)  # adapters or copy: a forward a step
    if cfg.tp > 1:
        per_layer = 6 if cfg.ac == "full" else 4
        for s in model.stacks:
            tokens = s.tokens / (cfg.sequence_parallel if s.sequence_split else 1)
            rows = cfg.micro_batch * pref.input_rows(s, cfg.objective)  # a DPO pair's: 2 or 1
            size = rows * s.per_sample * tokens * s.width * act_bytes
            calls = per_layer if s.mode != "frozen" else 2
            calls += 2 if step_reference else 0  # the reference's forward
            tp_comm += s.layers / cfg.pp * calls * all_reduce_s(size, cfg.tp, tp_link)
    dp_link = group_link(catalog, gpu, cfg.gpus, gpn, cfg.network)
    b = state_bytes(cfg.precision, cfg.optimizer, cfg.bytes_per_param)
    shard_params = model.trainable_params() / (cfg.tp * cfg.pp)
    grads = shard_params * min(b.grads, 4)
    weights = shard_params * b.weights
    backward = micro_compute * 2 / 3 * _policy_share(model, cfg)
    ranks = cfg.shard_ranks  # gradients are reduced (and ZeRO shards) over dp x sp
    if cfg.zero == 0:
        dp_comm = all_reduce_s(grads, ranks, dp_link)
        exposed = max(0.0, dp_comm - OVERLAP * backward)
    elif cfg.zero in (1, 2):
        rs = reduce_scatter_s(grads, ranks, dp_link)
        ag = all_gather_s(weights, ranks, dp_link)
        dp_comm = rs + ag
        exposed = max(0.0, rs - OVERLAP * backward) + ag
    else:  # ZeRO-3: gather weights for forward and backward, reduce-scatter grads, per micro-batch
        frozen = frozen_gathered_bytes(model, cfg.precision, cfg.shard_ranks) / (cfg.tp * cfg.pp)
        # DPO's reference in the step is one more sharded forward: the policy's without its
        # adapters (one more gather of its weights), or the copy's (a gather of the copy)
        adapters = pref.is_dpo(cfg) and pref.reference_kind(model, cfg) == "adapters"
        gathers = 3 if adapters else 2
        copy = pref.reference_copy_bytes(model, cfg)
        per_micro = gathers * all_gather_s(weights + frozen, ranks, dp_link) + reduce_scatter_s(
            grads, ranks, dp_link
        )
        per_micro += all_gather_s(copy, ranks, dp_link)
        dp_comm = m * per_micro
        exposed = m * max(0.0, per_micro - OVERLAP * micro_compute)
    sp_link = group_link(catalog, gpu, cfg.sequence_parallel * cfg.tp, gpn, cfg.network)
    sp = sequence_comm(model, cfg, sp_link, rate)
    micro_step = micro_compute + tp_comm + sp.exposed_s
    bubble = (cfg.pp - 1) * micro_step if cfg.pp > 1 else 0.0
    host = host_estimate(model, cfg, gpu, catalog, micro_compute) if cfg.offload else None
    offload_exposed = host.exposed_s if host else 0.0
    step = m * micro_step + exposed + bubble + offload_exposed
    global_batch = cfg.effective_global_batch
    samples_per_s = global_batch / step
    peak_total = gpu.peak_flops(cfg.precision) * cfg.gpus
    mfu = model_flops * samples_per_s / peak_total
    if cfg.price_per_gpu_hour is not None:
        price, price_source = cfg.price_per_gpu_hour, "--price-per-gpu-hour"
    elif gpu.price_per_gpu_hour is not None:
        price, price_source = gpu.price_per_gpu_hour, gpu.price_source
    else:
        price, price_source = 0.0, "no price in the catalog: pass --price-per-gpu-hour"
    reference_pass = reference_pass_s(model, cfg, gpu)  # a cached reference's, before training
    time_to_train = cfg.samples / samples_per_s + reference_pass if cfg.samples else 0.0
    return TimeEstimate(
        compute_s=m * micro_compute,
        tp_comm_s=m * tp_comm,
        dp_comm_s=dp_comm,
        dp_exposed_s=exposed,
        sp_comm_bytes=m * sp.sent_bytes,
        sp_comm_s=m * sp.seconds,
        sp_exposed_s=m * sp.exposed_s,
        sp_comm_share=m * sp.exposed_s / step,
        bubble_s=bubble,
        offload_h2d_s=host.h2d_s if host else 0.0,
        offload_d2h_s=host.d2h_s if host else 0.0,
        offload_exposed_s=offload_exposed,
        step_time_s=step,
        samples_per_s=samples_per_s,
        mfu=mfu,
        achievable_fraction=fraction,
        efficiency_family=eff.family,
        efficiency_source=eff.source,
        time_to_train_s=time_to_train,
        cost=time_to_train / 3600 * cfg.gpus * price,
        reference_pass_s=reference_pass,
        reference_pass_cost=reference_pass / 3600 * cfg.gpus * price,
        reference_pass_samples_per_s=reference_pass_samples_per_s(model, cfg, gpu),
        price_per_gpu_hour=price,
        price_source=price_source,
        intra_node=tp_link.key if cfg.tp > 1 else gpu.intra_node,
        dp_link=dp_link.key,
        sp_link=sp_link.key if cfg.sequence_parallel > 1 else "",
    )


def _policy_share(model: PlanModel, cfg: PlanConfig) -> float:
    """The share of a micro-batch's compute that is the policy's forward and backward (1 but
    for DPO, whose reference's forward comes before them): what the backward share scales."""
    if cfg.objective != "dpo":
        return 1.0
    total = objective_flops(model, cfg, per_rank=True)[1]
    return 1 - pref.reference_forward_flops(model, cfg) / total


def sequence_comm(
    model: PlanModel, cfg: PlanConfig, link: Interconnect, rate_flops: float
) -> Traffic:
    """One rank's sequence-parallel traffic for one micro-batch (comm.py's formulas): per
    layer of each split stack (q, k, v and output all-to-alls, or ring passes of k and v),
    and a denoiser's output gather. TP splits the heads, so each TP rank moves 1/tp of them.
    A frozen stack runs its forward only; full checkpointing runs a trained one's twice."""
    n = cfg.sequence_parallel
    if n == 1:
        return Traffic()
    act_bytes = 4 if cfg.precision == "fp32" else 2
    mode = cfg.sp_attention(model.split_heads())
    total = Traffic()
    for s in (s for s in model.stacks if s.sequence_split):
        trained = s.mode != "frozen"
        forwards = 2 if cfg.ac == "full" and trained else 1
        local = cfg.micro_batch * s.tokens / n  # this rank's positions of the micro-batch
        heads, kv = s.heads / cfg.tp, s.kv_heads / cfg.tp
        if mode == "all_to_all":
            qkvo_bytes = local * s.head_dim * (2 * heads + 2 * kv) * act_bytes
            layer = ulysses_layer(qkvo_bytes, n, link, forwards + trained)
        else:
            kv_bytes = local * 2 * kv * s.head_dim * act_bytes
            # one T/N x T/N block: QK^T and PV, 2 FLOPs per multiply-add each
            block_s = 4 * local * (s.tokens / n) * heads * s.head_dim / rate_flops
            layer = ring_layer(kv_bytes, n, link, block_s, forwards, trained)
        total += layer.scaled(s.layers / cfg.pp)
        if s.output_elements:
            gathered = cfg.micro_batch * s.output_elements * act_bytes
            total += output_gather(gathered, n, link, trained)
    return total
