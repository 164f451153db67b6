"""The run config of `mmtrain train CONFIG.yaml [key=value ...]`: YAML into typed dataclasses.

One small dataclass per concern (data, train, per-tower overrides, checkpoint, metrics), built by
`mmtrain.structured.from_dict`, so an unknown key names the closest valid one and a wrong type
names its dotted field. `key=value` overrides are applied to the YAML tree before it is typed;
their values are read as YAML (`train.lr=1e-3` is a number, `train.compile=true` a bool), except
for string fields, which keep the text as written (`out=runs/001` stays a string).

The fully resolved config (every default filled in) is what a run saves as `OUT/config.yaml` and
in every checkpoint, so a run folder says exactly what produced it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mmtrain.model_sources import SPEC_SUFFIXES, is_hub_name, is_model_folder
from mmtrain.plan.config import SP_ATTENTION
from mmtrain.structured import FieldError, check_choice, from_dict, to_dict

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp64")  # fp64: a reference mode for tests
SCHEDULES = ("cosine", "constant")
PARALLELS = ("auto", "ddp", "fsdp")
DEVICES = ("auto", "cpu", "cuda")
CHECKPOINT_FORMATS = ("auto", "full", "sharded")


# ----------------------------------------------------------------------------- sections
@dataclass
class DataSource:
    """One dataset: shards as a folder, glob, brace pattern or list; `weight` for mixing."""

    path: str | list[str]
    weight: float = 1.0


@dataclass
class VisionDataConfig:
    """How many LM tokens a native-resolution VLM's images and clips may take (`data.vision`,
    visual_budget.py): one token is merge_unit_pixels^2 pixels (28 x 28 for Qwen2-VL). Images
    are resized within [image_min_tokens, image_max_tokens] (null: the spec's min_pixels /
    max_pixels); clips sample `video_fps` frames a second within [video_min_frames,
    video_max_frames], each frame within [frame_min_tokens, frame_max_tokens], the clip within
    `video_max_tokens`; `sample_max_tokens` caps a sample's images and clips together (each
    shrunk by the same factor; a sample that cannot fit at the minimum sizes is refused)."""

    image_min_tokens: int | None = None
    image_max_tokens: int | None = None
    sample_max_tokens: int | None = None
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    frame_min_tokens: int = 128  # the Qwen2-VL video processor's 128 x 28 x 28 pixels
    frame_max_tokens: int = 768
    video_max_tokens: int | None = None

    def validate(self, path: str = "data.vision") -> None:
        counts = {
            "image_min_tokens": self.image_min_tokens,
            "image_max_tokens": self.image_max_tokens,
            "sample_max_tokens": self.sample_max_tokens,
            "video_min_frames": self.video_min_frames,
            "video_max_frames": self.video_max_frames,
            "frame_min_tokens": self.frame_min_tokens,
            "frame_max_tokens": self.frame_max_tokens,
            "video_max_tokens": self.video_max_tokens,
        }
        for name, value in counts.items():
            if value is not None and value < 1:
                raise FieldError(f"{path}.{name}", f"must be at least 1, got {value}")
        if not self.video_fps > 0:
            raise FieldError(f"{path}.video_fps", f"must be positive, got {self.video_fps}")
        for low, high in (("image_min_tokens", "image_max_tokens"),
                          ("video_min_frames", "video_max_frames"),
                          ("frame_min_tokens", "frame_max_tokens")):  # fmt: skip
            if counts[low] is not None and counts[high] is not None and counts[low] > counts[high]:
                raise FieldError(
                    f"{path}.{low}", f"{counts[low]} is more than {high} {counts[high]}"
                )


@dataclass
class DataConfig:
    train: list[DataSource]
    val: list[DataSource] = field(default_factory=list)
    # "byte", a tokenizer.json (or a folder holding one), or OpenCLIP's BPE merges file; left
    # out: the folder of `init` when it is a chat model's (tokenizer and chat template), else
    # "byte"
    tokenizer: str = "byte"
    workers: int = 0  # decode processes per rank; never changes the order of samples
    shuffle_window: int = 1000  # samples shuffled together inside the shard order
    # Labels of fusion heads: the sample's `.cls` member, else this field of its `.json` member
    # (an integer class, a class name from `class_names`, or a number/list for regression).
    label_field: str = "label"
    class_names: list[str] = field(default_factory=list)
    # s3:// shards are read through this local cache (node-local disk; default
    # $XDG_CACHE_HOME/mmtrain/shards), kept under cache_max_gb (decimal GB) by LRU eviction.
    cache_dir: str | None = None
    cache_max_gb: float = 100.0
    # Conversation shards for a decoder LM (data/stream/conversation_batches.py). chat_template: a name
    # (plain, chatml, llama-3, vicuna-v1) or a tokenizer_config.json / .jinja / model folder;
    # null: the template stored with data.tokenizer (its folder), so a model's own format is the
    # default and a mismatch cannot slip in silently. sequence_length: LM positions per row,
    # image tokens included (null: the decoder's max_positions); longer samples are truncated,
    # or refused when that would cut an image or leave no answer. pack: several samples per row.
    chat_template: str | None = None
    sequence_length: int | None = None
    pack: bool = False
    # Image / video pixels travel as uint8 (a quarter of float32's bytes, page-locked) and are
    # normalised on the device; null: when training on CUDA (on a CPU the workers do it).
    normalise_on_device: bool | None = None
    # A video denoiser's clips (one shot each: `data build --video-scene-threshold`): frames
    # every `video_stride` source frames from a random start inside the shot in training (the
    # middle one in evaluation), a window at the clip's own frame rate; null: spread evenly
    # over the whole clip.
    video_stride: int | None = None
    # A denoiser's shape buckets (data/stream/buckets.py): [height, width] ([frames, height,
    # width] for a video model) in its input's units; each step trains one bucket's shape,
    # each sample in the bucket nearest its aspect (and length). null: the spec's one shape.
    buckets: list[list[int]] | None = None
    # A native-resolution VLM's pixel budget (visual_budget.py); null: the spec's own.
    vision: VisionDataConfig | None = None
    # Conversation shards: deal each micro-batch of all ranks to the ranks by each sample's
    # forward FLOPs (its pages at their size and its text; train/sample_costs.py), so no rank
    # of many pages holds the others up; resumes only on the same ranks and micro-batch.
    balance: bool = False


@dataclass
class LoraConfig:
    """Low-rank adapters on a tower's block linears (`train.towers.NAME.lora`, train/lora.py).

    The tower's own weights are frozen; each targeted linear y = W x + b learns W + (alpha/rank)
    B A, with A [rank, in] and B [out, rank] (B starts at zero: step 0 is the base model).
    Targets: "attn" = `attn.qkv` and `attn.out`, "mlp" = `mlp.fc1` and `mlp.fc2` of every block
    (both by default, as `mmtrain plan --lora` assumes).
    `quantize_base: nf4` is QLoRA (train/qlora.py): the frozen linears of the tower's blocks
    (the adapted ones and the others) are held as torchao NF4 tensors (4-bit, blocks of 64
    with double-quantised scales), dequantised per linear in the forward; the adapters train
    as without it. null: the base is held in the compute dtype (bf16/fp16) or as it is.
    """

    rank: int = 16
    alpha: float | None = None  # scale = alpha / rank; default: alpha = rank (scale 1)
    dropout: float = 0.0  # on the adapter's input (torch's RNG, saved in checkpoints)
    targets: list[str] = field(default_factory=lambda: ["attn", "mlp"])
    quantize_base: str | None = None  # null or "nf4" (QLoRA)

    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank


@dataclass
class TowerTrainConfig:
    """Per-tower training overrides (keys of `train.towers` are tower names of the model).

    At most one of `freeze`, `freeze_blocks`, `unlocked_blocks` and `lora` decides what of the
    tower trains (docs/TRAINING.md, "Fine-tuning"); `lr_layer_decay` then scales the learning
    rate of what trains by depth.
    """

    lr: float | None = None  # absolute learning rate of this tower (default: train.lr)
    weight_decay: float | None = None  # default: train.weight_decay
    freeze: bool = False  # no gradient for the whole tower
    freeze_blocks: int = 0  # freeze the stem and the first N transformer blocks
    # LiT-style: freeze all but the last N blocks; norm_final, pooling and projection train.
    unlocked_blocks: int | None = None
    # BEiT/timm layer-wise decay: block i of L gets lr x decay^(L-i), the stem decay^(L+1),
    # norm_final / pooling / projection the tower's lr. null: one lr for the whole tower.
    lr_layer_decay: float | None = None
    lora: LoraConfig | None = None
    activation_checkpointing: bool = False  # recompute each block's activations in backward


@dataclass
class DiffusionConfig:
    """How a denoiser trains (`train.diffusion`, train/diffusion.py): the timesteps it sees and
    the condition dropout that classifier-free guidance needs at sampling time.

    flow_matching: t in (0, 1) from `timesteps` (logit_normal: sigmoid of N(logit_mean,
    logit_std), SD3's default; uniform), then shifted towards noise by `shift` (SD3 / Open-Sora:
    t' = shift t / (1 + (shift - 1) t); 1 = no shift; larger images and more frames want more;
    null, the default: the model's own, 1 for mmtrain's denoisers, the pipeline scheduler's for a
    pipeline folder's transformer: Wan's `shift` / `flow_shift`, FLUX's resolution-dependent
    exp(mu), models/hub/pipeline.py `FlowShift`).
    diffusion (DDPM): integer steps uniform in [0, ddpm_steps) of a linear beta schedule
    (beta_start .. beta_end, as DDPM and DiT); `min_snr` weights each step by min(SNR, gamma)
    over SNR (epsilon) or SNR + 1 (v), Hang et al. 2023; null: unweighted.
    temporal_weight (video denoisers): adds that weight times the mean squared change of the
    prediction's error from one frame to the next, a term against flicker (train/diffusion.py).
    """

    timesteps: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float | None = None
    cfg_dropout: float = 0.1  # share of samples trained without their class ("no class")
    ddpm_steps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    min_snr: float | None = None
    temporal_weight: float = 0.0
    # The guidance scale fed to a guidance-distilled denoiser while it trains (FLUX.1-dev, a
    # pipeline folder's transformer with guidance_embeds). Recipes differ: diffusers'
    # train_dreambooth_lora_flux.py defaults to 3.5, many published runs pass 1.
    guidance: float = 1.0

    def fixed_shift(self) -> float:
        """The shift where it does not depend on the model (mmtrain's denoisers): 1 unless set."""
        return 1.0 if self.shift is None else self.shift

    def validate(self, path: str = "train.diffusion") -> None:
        check_choice(f"{path}.timesteps", self.timesteps, ("logit_normal", "uniform"))
        if self.logit_std <= 0:
            raise FieldError(f"{path}.logit_std", f"must be positive, got {self.logit_std}")
        if self.shift is not None and self.shift <= 0:
            raise FieldError(f"{path}.shift", f"must be positive, got {self.shift}")
        if not 0.0 <= self.cfg_dropout < 1.0:
            raise FieldError(f"{path}.cfg_dropout", f"must be in [0, 1), got {self.cfg_dropout}")
        if self.temporal_weight < 0:
            raise FieldError(
                f"{path}.temporal_weight", f"must be 0 or more, got {self.temporal_weight}"
            )
        _at_least(f"{path}.ddpm_steps", self.ddpm_steps, 1)
        if not 0.0 < self.beta_start < self.beta_end < 1.0:
            raise FieldError(
                f"{path}.beta_end",
                f"needs 0 < beta_start ({self.beta_start}) < beta_end ({self.beta_end}) < 1",
            )
        if self.min_snr is not None and self.min_snr <= 0:
            raise FieldError(f"{path}.min_snr", f"must be positive or null, got {self.min_snr}")


@dataclass
class DpoConfig:
    """Preference tuning (`train.objective: dpo`, train/dpo.py): how a pair's log-probability
    ratios against the reference become its loss.

    sigmoid (Rafailov et al. 2023, DPO): -log sigmoid(beta m) with m the chosen's log-ratio minus
    the rejected's, each log-ratio the policy's summed answer log-probs minus the reference's;
    `label_smoothing` eps mixes in the flipped pair (cDPO: (1 - eps) of it, plus eps of
    -log sigmoid(-beta m)). ipo (Azar et al. 2023): (m - 1 / (2 beta))^2.
    """

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    # RPO (Pang et al. 2024; TRL's loss_type ["sigmoid", "sft"]): this weight times the
    # next-token loss of the chosen answers, which holds their likelihood up where DPO alone
    # lets it fall with the rejected answers' (likelihood displacement).
    sft_weight: float = 0.0
    # The reference model: "adapters", the model with its LoRA adapters disabled (no second
    # copy); "cache", the log-probs of every training pair scored once by the model the run
    # starts from, before the first step, and stored beside the run (train/reference_cache.py:
    # no copy in memory, no reference forward a step); "copy", a frozen copy of that model;
    # "auto": adapters when a tower has LoRA, else cache (copy where the images are randomly
    # cropped, which one stored score cannot follow).
    reference: str = "auto"

    def validate(self, path: str = "train.dpo") -> None:
        if not self.beta > 0:
            raise FieldError(f"{path}.beta", f"must be positive, got {self.beta}")
        check_choice(f"{path}.loss", self.loss, ("sigmoid", "ipo"))
        check_choice(f"{path}.reference", self.reference, ("auto", "adapters", "cache", "copy"))
        if self.sft_weight < 0:
            raise FieldError(f"{path}.sft_weight", f"must be 0 or more, got {self.sft_weight}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise FieldError(
                f"{path}.label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}"
            )
        if self.label_smoothing and self.loss != "sigmoid":
            raise FieldError(f"{path}.label_smoothing", "is sigmoid DPO's (cDPO), not ipo's")


@dataclass
class TrainConfig:
    steps: int
    batch_size: int  # global: samples per optimizer step over all ranks
    micro_batch: int | None = None  # samples per forward per rank (default: batch_size / ranks)
    precision: str = "fp32"
    tf32: bool = True  # fp32 on CUDA: matmuls/convolutions on TF32 tensor cores (false: IEEE fp32)
    lr: float = 5e-4
    min_lr: float = 0.0  # the cosine schedule ends here
    # AdamW's settings; null: the workload's default (train/optim.py WORKLOAD_DEFAULTS: a
    # language model's from transformers, a contrastive model's from OpenCLIP, a denoiser's from
    # diffusers), filled in at the run's start and recorded in its config.yaml.
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    warmup_steps: int = 0
    schedule: str = "cosine"
    grad_clip: float | None = 1.0  # max global grad norm; null: no clipping
    towers: dict[str, TowerTrainConfig] = field(default_factory=dict)
    fp8_keep_bf16: list[str] = field(default_factory=list)  # module-name fragments kept out of fp8
    fp8_recipe: str = "tensorwise"  # torchao's scaling: "tensorwise" or "rowwise"
    parallel: str = "auto"  # ddp, fsdp (FSDP2 fully_shard), auto: ddp (fsdp with offload)
    # FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer states live in host
    # memory (pinned on CUDA) and each unit is copied to the GPU for its all-gather; the
    # optimizer steps on the CPU. Needs train.parallel fsdp (auto picks it), on any rank count.
    offload: bool = False
    # torch.compile the towers' blocks (slower on CPU); null: on for fp8, off otherwise
    compile: bool | None = None
    # Sequence (context) parallelism: groups of N consecutive ranks split every row's sequence
    # (a decoder's positions, images spliced in; a denoiser's patches) and attend over the
    # whole rows (train/sequence_parallel.py); data parallelism runs over ranks / N. 1: off.
    sequence_parallel: int = 1
    # auto: all_to_all (DeepSpeed-Ulysses) when N divides the attention heads, else ring
    sequence_parallel_attention: str = "auto"
    ema: float | None = None  # decay of an exponential moving average of the weights
    device: str = "auto"  # auto: cuda when available
    fusion_weight: float = 1.0  # weight of the fusion head's loss beside the contrastive loss
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)  # a denoiser's training
    # A language model's objective: null, next-token on the assistant's answers (SFT); dpo,
    # preference pairs (train.dpo; the data's samples are pairs: `chosen` and `rejected`).
    objective: str | None = None
    dpo: DpoConfig = field(default_factory=DpoConfig)
    # Progressive resolution: [[from_step, image_size], ...] for image and video towers and
    # [[from_step, frames], ...] for video towers; the model spec keeps the full size and the
    # position embeddings are interpolated (see mmtrain.train.resolution). Empty: full size.
    resolution_schedule: list[tuple[int, int]] = field(default_factory=list)
    frames_schedule: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class GuardConfig:
    """What the loop does about non-finite losses and gradients."""

    max_nonfinite_in_a_row: int = 3  # then roll back to the last valid checkpoint
    rollback_lr_factor: float = 1.0  # multiply every learning rate by this at each rollback
    max_rollbacks: int = 3  # then stop: the run diverges even from its last good state
    # Fault injection (tests, issue 7's suite): at these steps the first micro-batch's float
    # inputs are overwritten with NaN, once per step number per process. Leave empty.
    inject_nan_steps: list[int] = field(default_factory=list)
    # ... or multiplied by 1e5: finite in fp32 and bf16, past fp16's range (an fp16 overflow).
    inject_overflow_steps: list[int] = field(default_factory=list)


@dataclass
class EvalConfig:
    """Periodic validation on `data.val` (run on every rank, each embedding its share)."""

    every_steps: int | None = None  # null: only at the end of training (when data.val is set)
    batch_size: int = 64  # samples per forward per rank
    # A denoiser's validation: besides its loss at fixed timesteps, the Fréchet distance of
    # `samples` generated images (`sample_steps`, guidance `cfg`) to the held-out ones in the
    # features of `extractor` (an mmtrain model folder with an image tower); null: loss only.
    extractor: str | None = None
    extractor_tokenizer: str = "byte"  # the extractor's text tower's (conditional accuracy)
    # A latent denoiser's VAE (a diffusers AutoencoderKL folder): its samples and the held-out
    # latents are decoded through it for the FD and the sample grids.
    vae: str | None = None
    samples: int = 256
    sample_steps: int = 25
    cfg: float = 1.0


@dataclass
class CheckpointConfig:
    every_steps: int | None = 1000
    every_minutes: float | None = None
    keep: int = 3
    # full: one gathered model.safetensors + state.pt (rank 0 writes); sharded: every rank
    # writes its shards through torch.distributed.checkpoint (resumable on any rank count);
    # auto: sharded under train.parallel=fsdp on several ranks, else full.
    format: str = "auto"

    def format_for(self, parallel: str, world_size: int) -> str:
        """The format `auto` resolves to for this run ("full" or "sharded")."""
        if self.format != "auto":
            return self.format
        return "sharded" if parallel == "fsdp" and world_size > 1 else "full"


@dataclass
class MetricsConfig:
    log_every: int = 10  # one console/summary line every N steps (metrics.jsonl gets every step)
    tensorboard: bool = True
    peak_tflops: float | None = None  # per device, for MFU; default: the detected GPU's peak
    # Time each step's collectives (comm_s, comm_exposed_s) through a DDP comm hook, FSDP2's
    # custom comms on CPU, and the loss's gathers. Off by default: the hook replaces DDP's C++
    # all-reduce with a Python one, and on a GPU the step then synchronises to read its events
    # (a cost not yet measured below 1% of a step); false leaves DDP and FSDP untouched.
    comm_timing: bool = False


@dataclass
class RunConfig:
    # A preset name (e.g. tiny-clip), a model spec YAML/JSON file, or a transformers model folder
    # or hub name (org/name): its class, trained as it is (a hub model) unless it is a native
    # family; left out, the `init` folder.
    model: str
    data: DataConfig
    train: TrainConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    guards: GuardConfig = field(default_factory=GuardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    out: str = "runs/run"
    # Start from a baseline (mmtrain.train.init): a model or run folder, an OpenCLIP checkpoint or
    # a Hugging Face folder, or {tower: PATH} per tower. Read once before step 0; a resume
    # restores its checkpoint and ignores this.
    init: str | dict[str, str] | None = None
    init_strict: bool = True  # false: load what fits, leave the rest at random init (logged)
    # sha256 of every weights file `init` read, {file: hex}, recorded by the run in its resolved
    # config; a file listed here before the run starts must still have this hash.
    init_sha256: dict[str, str] = field(default_factory=dict)

    # -- derived
    def data_ranks(self, world_size: int) -> int:
        """Ranks that read different samples: `world_size` over the sequence-parallel groups
        (what `micro_batch_for` and `accumulation_steps` split the batch over)."""
        return world_size // self.train.sequence_parallel

    def micro_batch_for(self, data_ranks: int) -> int:
        return self.train.micro_batch or self.train.batch_size // data_ranks

    def accumulation_steps(self, data_ranks: int) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.train.batch_size // (data_ranks * self.micro_batch_for(data_ranks))

    def validate(self, world_size: int = 1) -> None:
        """Raise FieldError naming the first wrong field; `world_size` checks the batch split."""
        t = self.train
        _at_least("train.steps", t.steps, 1)
        _at_least("train.batch_size", t.batch_size, 1)
        if self.data.video_stride is not None:
            _at_least("data.video_stride", self.data.video_stride, 1)
        if self.data.vision is not None:
            self.data.vision.validate()
        if self.data.buckets is not None and (t.resolution_schedule or t.frames_schedule):
            raise FieldError(
                "data.buckets", "buckets fix the shapes: drop train.resolution/frames_schedule"
            )
        check_choice("train.precision", t.precision, PRECISIONS)
        check_choice("train.fp8_recipe", t.fp8_recipe, ("tensorwise", "rowwise"))
        _resolve_compile(t)
        check_choice("train.schedule", t.schedule, SCHEDULES)
        check_choice("train.parallel", t.parallel, PARALLELS)
        _resolve_offload(t)
        check_choice("train.device", t.device, DEVICES)
        _at_least("train.lr", t.lr, 0.0)
        _at_least("train.min_lr", t.min_lr, 0.0)
        if t.min_lr > t.lr:
            raise FieldError("train.min_lr", f"{t.min_lr} is above train.lr {t.lr}")
        _at_least("train.warmup_steps", t.warmup_steps, 0)
        if t.warmup_steps > t.steps:
            raise FieldError(
                "train.warmup_steps", f"{t.warmup_steps} is more than train.steps {t.steps}"
            )
        _check_optimizer_settings(t)
        if t.grad_clip is not None and t.grad_clip <= 0:
            raise FieldError("train.grad_clip", f"must be positive or null, got {t.grad_clip}")
        if t.ema is not None and not 0.0 < t.ema < 1.0:
            raise FieldError("train.ema", f"must be in (0, 1) or null, got {t.ema}")
        for name, tower in t.towers.items():
            if tower.lr is not None:
                _at_least(f"train.towers.{name}.lr", tower.lr, 0.0)
            if tower.weight_decay is not None:
                _at_least(f"train.towers.{name}.weight_decay", tower.weight_decay, 0.0)
            _check_tower_tuning(f"train.towers.{name}", tower, t.ema)
            _check_quantize_base(f"train.towers.{name}", tower, t.precision)
        if t.micro_batch is not None:
            _at_least("train.micro_batch", t.micro_batch, 1)
        _at_least("train.fusion_weight", t.fusion_weight, 0.0)
        t.diffusion.validate()
        if t.objective is not None:
            check_choice("train.objective", t.objective, ("dpo",))
        t.dpo.validate()
        _check_schedule("train.resolution_schedule", t.resolution_schedule)
        _check_schedule("train.frames_schedule", t.frames_schedule)
        _at_least("train.sequence_parallel", t.sequence_parallel, 1)
        check_choice(
            "train.sequence_parallel_attention", t.sequence_parallel_attention, SP_ATTENTION
        )
        if world_size % t.sequence_parallel:
            raise FieldError(
                "train.sequence_parallel",
                f"groups of {t.sequence_parallel} ranks do not divide the {world_size} ranks; "
                "use a divisor of the rank count",
            )
        ranks = self.data_ranks(world_size)  # what the batch is split over
        if t.batch_size % ranks:
            raise FieldError(
                "train.batch_size",
                f"{t.batch_size} is not divisible by the {ranks} data-parallel ranks; use a multiple of {ranks}",
            )
        micro = self.micro_batch_for(ranks)
        if t.batch_size % (ranks * micro):
            raise FieldError(
                "train.batch_size",
                f"{t.batch_size} is not divisible by ranks x micro_batch = {ranks} x {micro}; "
                f"use a multiple of {ranks * micro} or change train.micro_batch",
            )
        c = self.checkpoint
        if c.every_steps is not None:
            _at_least("checkpoint.every_steps", c.every_steps, 1)
        if c.every_minutes is not None and c.every_minutes <= 0:
            raise FieldError(
                "checkpoint.every_minutes", f"must be positive or null, got {c.every_minutes}"
            )
        _at_least("checkpoint.keep", c.keep, 1)
        check_choice("checkpoint.format", c.format, CHECKPOINT_FORMATS)
        _at_least("data.workers", self.data.workers, 0)
        _at_least("data.shuffle_window", self.data.shuffle_window, 1)
        for i, source in enumerate(self.data.train):
            if source.weight <= 0:
                raise FieldError(
                    f"data.train[{i}].weight", f"must be positive, got {source.weight}"
                )
        _at_least("metrics.log_every", self.metrics.log_every, 1)
        g = self.guards
        _at_least("guards.max_nonfinite_in_a_row", g.max_nonfinite_in_a_row, 1)
        _at_least("guards.max_rollbacks", g.max_rollbacks, 0)
        if not 0.0 < g.rollback_lr_factor <= 1.0:
            raise FieldError(
                "guards.rollback_lr_factor", f"must be in (0, 1], got {g.rollback_lr_factor}"
            )
        if self.eval.every_steps is not None:
            _at_least("eval.every_steps", self.eval.every_steps, 1)
            if not self.data.val:
                raise FieldError("eval.every_steps", "needs validation shards in data.val")
        _at_least("eval.batch_size", self.eval.batch_size, 1)
        if self.metrics.peak_tflops is not None and self.metrics.peak_tflops <= 0:
            raise FieldError(
                "metrics.peak_tflops", f"must be positive, got {self.metrics.peak_tflops}"
            )
        if not self.out:
            raise FieldError("out", "give the run folder, e.g. out=runs/tiny")
        _check_init(self.init, self.init_sha256)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _resolve_compile(t: TrainConfig) -> None:
    """Fill `train.compile` when left out (null): on for fp8, off otherwise, in place (the
    resolved config.yaml records it). fp8 with compile explicitly off is refused: torchao's
    scaling and casts then run as separate kernels around each matmul, and the step is no
    faster than bf16's while holding more memory, so there is nothing to gain from it."""
    if t.precision != "fp8":
        if t.compile is None:
            t.compile = False
        return
    if t.compile is False:
        raise FieldError(
            "train.compile",
            "fp8 without torch.compile is no faster than bf16 (torchao's scaling and casts "
            "only fuse into the matmuls when compiled); leave train.compile out (fp8 turns it "
            "on) or set it true, or train in train.precision=bf16",
        )
    if t.compile is None:
        t.compile = True
        log.info("train.precision=fp8: compiling the towers' blocks (train.compile left out); "
                 "fp8 matmuls only pay off with torchao's scaling fused in by torch.compile")  # fmt: skip


def _resolve_offload(t: TrainConfig) -> None:
    """`train.offload` is FSDP2's CPU offload: `parallel: auto` becomes fsdp (in place, the
    resolved config.yaml records it); ddp is refused, naming the field."""
    if not t.offload:
        return
    if t.parallel == "auto":
        t.parallel = "fsdp"
        log.info("train.offload: train.parallel auto -> fsdp (CPU offload is FSDP2's)")
    elif t.parallel != "fsdp":
        raise FieldError(
            "train.offload",
            f"CPU offload is FSDP2's (CPUOffloadPolicy), not {t.parallel}'s: set "
            "train.parallel=fsdp (or leave it auto), or train.offload=false",
        )


def _check_optimizer_settings(t: TrainConfig) -> None:
    """AdamW's settings where the config sets them (null: the workload's default, valid)."""
    if t.weight_decay is not None:
        _at_least("train.weight_decay", t.weight_decay, 0.0)
    for i, beta in enumerate(t.betas or ()):
        if not 0.0 <= beta < 1.0:
            raise FieldError(f"train.betas[{i}]", f"must be in [0, 1), got {beta}")
    if t.eps is not None and t.eps <= 0:
        raise FieldError("train.eps", f"must be positive, got {t.eps}")


def _at_least(path: str, value: float, low: float) -> None:
    if value < low:
        raise FieldError(path, f"must be at least {low}, got {value}")


LORA_TARGETS = ("attn", "mlp")


def _check_tower_tuning(path: str, tower: TowerTrainConfig, ema: float | None) -> None:
    """What of a tower trains: one way at a time, numbers in range. Counts of blocks are
    checked against the model when the optimizer is built (train/optim.py)."""
    _at_least(f"{path}.freeze_blocks", tower.freeze_blocks, 0)
    if tower.unlocked_blocks is not None:
        _at_least(f"{path}.unlocked_blocks", tower.unlocked_blocks, 0)
    chosen = [
        key
        for key, on in (
            ("freeze", tower.freeze),
            ("freeze_blocks", tower.freeze_blocks > 0),
            ("unlocked_blocks", tower.unlocked_blocks is not None),
            ("lora", tower.lora is not None),
        )
        if on
    ]
    if len(chosen) > 1:
        raise FieldError(
            f"{path}.{chosen[1]}",
            f"cannot be combined with {path}.{chosen[0]}: set one of freeze, freeze_blocks, "
            "unlocked_blocks, lora",
        )
    decay = tower.lr_layer_decay
    if decay is not None and not 0.0 < decay <= 1.0:
        raise FieldError(f"{path}.lr_layer_decay", f"must be in (0, 1] or null, got {decay}")
    if tower.lora is None:
        return
    lora = tower.lora
    _at_least(f"{path}.lora.rank", lora.rank, 1)
    if lora.alpha is not None and lora.alpha <= 0:
        raise FieldError(f"{path}.lora.alpha", f"must be positive or null, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise FieldError(f"{path}.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    if not lora.targets:
        raise FieldError(f"{path}.lora.targets", f"name at least one of {', '.join(LORA_TARGETS)}")
    for i, target in enumerate(lora.targets):
        check_choice(f"{path}.lora.targets[{i}]", target, LORA_TARGETS)
    if ema is not None and lora.quantize_base is not None:
        # Not yet tried: the average of the adapters over an NF4 base, and its export.
        raise FieldError("train.ema", f"is not supported with {path}.lora.quantize_base (QLoRA) "
                         "yet; set it to null")  # fmt: skip


QUANTIZE_BASES = ("nf4",)


def _check_quantize_base(path: str, tower: TowerTrainConfig, precision: str) -> None:
    """QLoRA's base quantisation: a known kind, and not with fp8 (whose training linears would
    take the 4-bit base for a weight of their own to scale)."""
    if tower.lora is None or tower.lora.quantize_base is None:
        return
    key = f"{path}.lora.quantize_base"
    check_choice(key, tower.lora.quantize_base, QUANTIZE_BASES)
    if precision == "fp8":
        raise FieldError(
            key,
            "a 4-bit base cannot also run fp8 matmuls: use train.precision=bf16 (QLoRA's) "
            "or set quantize_base to null",
        )


def _check_init(init: str | dict[str, str] | None, sha256: dict[str, str]) -> None:
    """Non-empty paths; tower names are checked against the model in mmtrain.train.init."""
    if init == "" or init == {}:
        raise FieldError("init", "give a path, {tower: path}, or leave it out (null)")
    for tower, path in init.items() if isinstance(init, dict) else []:
        if not path:
            raise FieldError(f"init.{tower}", "give the path of the weights for this tower")
    for file, digest in sha256.items():
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise FieldError(f"init_sha256.{file}", f"not a sha256 hex digest: {digest!r}")


def _check_schedule(path: str, schedule: list[tuple[int, int]]) -> None:
    """[[step, value], ...] with steps >= 0 strictly increasing and positive values."""
    previous = -1
    for i, (step, value) in enumerate(schedule):
        if step <= previous:
            raise FieldError(
                f"{path}[{i}]", f"steps must be >= 0 and increasing, got {step} after {previous}"
            )
        _at_least(f"{path}[{i}][1]", value, 1)
        previous = step


# ----------------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` and `5e4` as numbers (YAML 1.1 needs a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str = "") -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise FieldError("", f"{source or 'text'} is not valid YAML: {err}") from None


# ----------------------------------------------------------------------------- loading
def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Read CONFIG.yaml, apply `key=value` overrides, type and validate (for one rank).

    Paths written in the file (the model spec, `init`, data, tokenizer, chat template, `out`,
    ...: `resolve_paths`) are relative to the file; paths given as overrides are relative to
    the current directory, as a shell's are. All of them are absolute in the result, so the
    run's saved config reads the same files from any directory.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise FieldError("", f"cannot read config {path}: {err.strerror}") from None
    data = parse_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise FieldError("", f"{path}: a run config is a mapping, got {type(data).__name__}")
    try:
        resolve_paths(data, path.absolute().parent)
    except FieldError as err:
        raise FieldError(err.path, f"{err.message} (in {path})") from None
    for item in overrides:
        apply_override(data, item)
    try:
        config = config_from_dict(data)
    except FieldError as err:
        raise FieldError(err.path, f"{err.message} (in {path})") from None
    return config


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Type a (YAML) tree into RunConfig; `data.train` and `data.val` also accept a path or
    a list of paths, and relative paths are taken from the current directory (made absolute).
    Validates for the fewest ranks it runs on, one sequence-parallel group (the loop validates
    again for its world size)."""
    data = dict(data)
    if isinstance(data.get("data"), dict):
        section = dict(data["data"])
        for key in ("train", "val"):
            if key in section:
                section[key] = _sources(section[key], f"data.{key}")
        data["data"] = section
    if isinstance(data.get("eval"), dict):
        data["eval"] = dict(data["eval"])  # resolved below: the caller's tree stays as it is
    resolve_paths(data, Path.cwd())
    _model_from_starting_folder(data)
    _tokenizer_from_starting_folder(data)
    config = from_dict(RunConfig, data)
    config.out = _absolute(config.out, Path.cwd())  # also the default `out`
    config.validate(world_size=max(config.train.sequence_parallel, 1))
    return config


def _sources(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, list):
        raise FieldError(
            path, f"expected a path, a list of paths or of {{path, weight}}, got {value!r}"
        )
    return [{"path": v} if isinstance(v, str) else v for v in value]


def _model_from_starting_folder(data: dict[str, Any]) -> None:
    """A transformers model folder (or hub name) is the whole description of a run's model:
    `init: FOLDER` alone gives `model: FOLDER`, and `model: FOLDER` alone starts from its
    weights (`init: FOLDER`). A spec or preset `model` with `init` is left as written."""
    model, init = data.get("model"), data.get("init")
    if model is None and isinstance(init, str):
        data["model"] = init
    elif isinstance(model, str) and init is None and _is_model_source(model):
        data["init"] = model


def _is_model_source(value: str) -> bool:
    return is_model_folder(value) or is_hub_name(value)


def _tokenizer_from_starting_folder(data: dict[str, Any]) -> None:
    """`data.tokenizer` left out while `init` is a chat model's folder (a tokenizer.json and a
    chat template: tokenizer_config.json's or chat_template.jinja): that folder, so the run
    reads text as the model was trained to (and `data.chat_template` left out then means the
    folder's template). A folder without a template (a CLIP's) does not decide for the run."""
    section = data.get("data")
    if not isinstance(section, dict) or section.get("tokenizer") is not None:
        return
    init = data.get("init")
    folders = [init] if isinstance(init, str) else []
    if isinstance(init, dict):  # the language model's tower first
        folders = [v for k, v in sorted(init.items(), key=lambda kv: kv[0] != "text")]
    from mmtrain.data.stream.chat_templates import holds_chat_template  # torch-free

    for folder in (Path(f) for f in folders if isinstance(f, str)):
        if (folder / "tokenizer.json").is_file() and holds_chat_template(folder):
            section["tokenizer"] = str(folder)
            log.info("data.tokenizer left out: the tokenizer and chat template of %s", folder)
            return


# ----------------------------------------------------------------------------- paths
# Values of path fields that are names, not files (kept as written unless a file of that name
# lies where a relative path would point).
TOKENIZER_NAMES = ("byte",)


def resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Make the relative paths of a config tree absolute against `base`, in place: `model`
    (a spec file; a preset name stays), `init` (a path, or one per tower) and the files of
    `init_sha256`, `out`, data sources (folders, globs, brace patterns; s3:// stays),
    `data.tokenizer` ("byte" stays), `data.chat_template` (a template name stays),
    `data.cache_dir`, `eval.extractor`, `eval.vae` and `eval.extractor_tokenizer`. Absolute paths and
    remote URLs are left as they are."""
    model = data.get("model")
    if isinstance(model, str) and _is_spec_path(model, base) and not is_hub_name(model, base):
        data["model"] = _absolute(model, base)
    init = data.get("init")
    if isinstance(init, str):
        data["init"] = _path_or_hub_name(init, base)
    elif isinstance(init, dict):
        # Per tower: files and folders of native towers (a hub model starts from one source).
        data["init"] = {k: _absolute(v, base) if isinstance(v, str) else v for k, v in init.items()}
    pinned = data.get("init_sha256")
    if isinstance(pinned, dict):  # the files `init` reads, by their (now absolute) paths
        data["init_sha256"] = {
            _absolute(k, base) if isinstance(k, str) else k: v for k, v in pinned.items()
        }
    if isinstance(data.get("out"), str):
        data["out"] = _absolute(data["out"], base)
    section = data.get("data")
    if isinstance(section, dict):
        for key in ("train", "val"):
            if key in section:
                section[key] = _absolute_sources(section[key], base)
        tokenizer = section.get("tokenizer")
        if isinstance(tokenizer, str) and not _is_name(tokenizer, base, TOKENIZER_NAMES):
            section["tokenizer"] = _absolute(tokenizer, base)
        template = section.get("chat_template")
        if isinstance(template, str) and not _is_template_name(template, base):
            section["chat_template"] = _absolute(template, base)
        if isinstance(section.get("cache_dir"), str):
            section["cache_dir"] = _absolute(section["cache_dir"], base)
    evaluation = data.get("eval")
    if isinstance(evaluation, dict):
        for key in ("extractor", "vae"):
            if isinstance(evaluation.get(key), str):
                evaluation[key] = _absolute(evaluation[key], base)
        tokenizer = evaluation.get("extractor_tokenizer")
        if isinstance(tokenizer, str) and not _is_name(tokenizer, base, TOKENIZER_NAMES):
            evaluation["extractor_tokenizer"] = _absolute(tokenizer, base)


def _path_or_hub_name(value: str, base: Path) -> str:
    """A Hugging Face hub name (`org/name`, no such path) as it is, else the absolute path."""
    return value if is_hub_name(value, base) else _absolute(value, base)


def _absolute(path: str, base: Path) -> str:
    """`path` against `base` (normalised, links kept), `~` expanded; URLs and absolute paths
    as they are."""
    if not path or "://" in path:
        return path
    expanded = os.path.expanduser(path)
    if os.path.isabs(expanded):
        return expanded
    return os.path.normpath(os.path.join(base, expanded))


def _absolute_sources(value: Any, base: Path) -> Any:
    """`data.train` / `data.val` in any of their forms, with each path made absolute."""
    if isinstance(value, str):
        return _absolute(value, base)
    if isinstance(value, dict) and "path" in value:
        return {**value, "path": _absolute_sources(value["path"], base)}
    if isinstance(value, list):
        return [_absolute_sources(v, base) for v in value]
    return value


def _is_name(value: str, base: Path, names: typing.Iterable[str]) -> bool:
    """True when `value` is one of `names` (in any case, as the readers take them) and no file
    of that name lies beside the config."""
    return value.lower() in names and not (base / value).exists()


def _is_spec_path(value: str, base: Path) -> bool:
    """`model` names a spec file (or folder), not a preset: load_spec's rule (a spec suffix, or
    something that exists) plus a path separator, so a mistyped preset name stays a name and
    its error suggests the closest preset."""
    path = Path(os.path.expanduser(value))
    return path.suffix in SPEC_SUFFIXES or len(path.parts) > 1 or (base / path).exists()


def _is_template_name(value: str, base: Path) -> bool:
    """A chat template's name (plain, chatml, ...) has no path separator and no suffix; a file
    or folder of that name beside the config is taken as a path."""
    return "/" not in value and "." not in value and not (base / value).exists()


# ----------------------------------------------------------------------------- overrides
def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in the YAML tree `data`, creating missing mappings on the way.

    The value is YAML (numbers, booleans, lists, null), except where the field is a string,
    which keeps the text as written. Unknown keys are left for `from_dict`, which names the
    closest valid one.
    """
    if "=" not in item:
        raise FieldError("", f"override {item!r} is not key=value (e.g. train.lr=1e-3)")
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise FieldError(key, f"override {item!r} has an empty key part")
    value: Any = text if _is_string_field(parts) else parse_yaml(text, f"override {key}")
    if value is text and _admits_mapping(parts):  # `init=PATH`, `init={image: A}`, `init=null`
        value = _mapping_or_text(text)
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise FieldError(where, f"is {child!r}, not a mapping; cannot set {key}")
        node = child
    node[parts[-1]] = value


def _is_string_field(parts: list[str]) -> bool:
    """True when the dotted path names a field typed `str` (or `str | None`) in RunConfig."""
    tp = _field_type(parts)
    args = typing.get_args(tp)
    return tp is str or (
        bool(args) and str in args and list not in [typing.get_origin(a) for a in args]
    )


def _field_type(parts: list[str]) -> Any:
    """The type hint of the dotted path in RunConfig, or None when there is no such field."""
    tp: Any = RunConfig
    for part in parts:
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return None
            tp = hints[part]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif mapping := [a for a in typing.get_args(tp) if typing.get_origin(a) is dict]:
            tp = typing.get_args(mapping[0])[1]  # `init.image=PATH` in `str | dict[str, str]`
        else:
            return None
    return tp


def _admits_mapping(parts: list[str]) -> bool:
    """True for a `str | dict` field such as `init` (a path, or paths by tower), and for a
    `dict[str, str]` (which the string test above also takes)."""
    tp = _field_type(parts)
    return any(typing.get_origin(a) is dict for a in (tp, *typing.get_args(tp)))


def _mapping_or_text(text: str) -> Any:
    """`{...}` or null read as YAML; anything else (a path) kept as written."""
    try:
        value = parse_yaml(text)
    except FieldError:
        return text
    return value if value is None or isinstance(value, dict) else text


def diff_configs(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (for resume warnings)."""
    keys = sorted(set(old) | set(new))
    changed = []
    for key in keys:
        path = f"{prefix}{key}"
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += diff_configs(a, b, path + ".")
        elif a != b:
            changed.append(path)
    return changed


__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DataSource",
    "EvalConfig",
    "GuardConfig",
    "LoraConfig",
    "MetricsConfig",
    "RunConfig",
    "TowerTrainConfig",
    "TrainConfig",
    "apply_override",
    "config_from_dict",
    "diff_configs",
    "load_config",
    "parse_yaml",
    "resolve_paths",
]
