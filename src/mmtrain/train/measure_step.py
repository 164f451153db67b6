"""`--measure`: build the real module, run one fp32 training step on the CPU at the planned
micro-batch and checkpointing mode, and count what it holds, to set beside the prediction.

- Activations: every tensor autograd saves for backward during the forward pass and the loss
  (`torch.autograd.graph.saved_tensors_hooks`), deduplicated by storage, parameters excluded,
  that the graph still holds when the loss is computed.
  With non-reentrant checkpointing the hooks see exactly the checkpointed blocks' inputs.
- Language models (spec.decoder): rows of the planned length (`context`, default
  `decoder.max_positions`), `images` placeholders per row, `packed` rows of two documents,
  scored by the next-token cross-entropy the model's forward sums in chunks (`next_token_loss`).
  A native-resolution VLM (spec.vision) gets in every row the planned `visual_inputs` (images
  and clips at the tower's size, random pixels, listed under "image" and "video") and one
  placeholder id for each (`native_language_batch`).
- Denoisers (spec.denoiser): random clean samples under the spec's input key (and classes, or
  an MMDiT's text encoders' outputs at the planned text length),
  made noisy by the trainer's own objective (train/diffusion.py: timesteps, noise, guidance
  dropout) and scored by its MSE.
- Model states: parameters, gradients and optimizer states after one AdamW step, by storage.
- What trains: frozen towers (`--freeze`) and LoRA towers (`--lora`, `--lora-rank`,
  `--lora-targets`) are set up by the trainer's own code (train/optim.py's freezing,
  train/lora.py's adapters, the trainer's AdamW parameter groups); the parameters that got a
  gradient and those holding optimizer state are counted, to set beside the planner's
  trainable-parameter count, which must equal both.

It lives in train/ because it runs the trainer's own set-up; `mmtrain plan` imports it only
with --measure, so the planner itself stays torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from mmtrain.config import DiffusionConfig, LoraConfig, TowerTrainConfig, TrainConfig
from mmtrain.losses import ContrastiveLoss
from mmtrain.models.build import create_model
from mmtrain.models.dit import CLASS, TEXT_HIDDEN, TEXT_POOLED
from mmtrain.plan.estimate import Plan
from mmtrain.plan.memory import training_memory
from mmtrain.spec import ModelSpec, load_spec, with_input_sizes
from mmtrain.train.diffusion import DiffusionObjective
from mmtrain.train.local_ranks import run_on_local_ranks
from mmtrain.train.lora import apply_lora
from mmtrain.train.objectives import count_targets, token_nll_sum
from mmtrain.train.optim import freeze_parameters, make_optimizer, resolve_optimizer_defaults
from mmtrain.train.parallel import apply_activation_checkpointing
from mmtrain.train.sequence_parallel import apply_sequence_parallel


@dataclass(frozen=True)
class Measured:
    activations_bytes: int
    model_state_bytes: int
    predicted_activations_bytes: int
    predicted_model_state_bytes: int
    micro_batch: int
    ac: str
    trainable_params: int = 0  # parameters that got a gradient in the step
    optimizer_state_params: int = 0  # parameters whose AdamW state the step created
    predicted_trainable_params: int = 0

    @property
    def activations_error(self) -> float:
        return self.predicted_activations_bytes / self.activations_bytes - 1

    @property
    def model_state_error(self) -> float:
        return self.predicted_model_state_bytes / self.model_state_bytes - 1

    def to_dict(self) -> dict:
        return {
            "activations_bytes": self.activations_bytes,
            "model_state_bytes": self.model_state_bytes,
            "predicted_activations_bytes": self.predicted_activations_bytes,
            "predicted_model_state_bytes": self.predicted_model_state_bytes,
            "activations_error": round(self.activations_error, 5),
            "model_state_error": round(self.model_state_error, 6),
            "micro_batch": self.micro_batch,
            "ac": self.ac,
            "trainable_params": self.trainable_params,
            "optimizer_state_params": self.optimizer_state_params,
            "predicted_trainable_params": self.predicted_trainable_params,
            "device": "cpu",
            "dtype": "float32",
        }


def spec_with_overrides(
    name: str | ModelSpec,
    image_size: int | None = None,
    frames: int | None = None,
    context: int | None = None,
) -> ModelSpec:
    """The spec `workloads.load_model` plans for, with the same stem overrides."""
    spec = load_spec(name)
    return with_input_sizes(spec, image_size, frames, context)


def random_batch(
    spec: ModelSpec, batch: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Inputs of the batch contract's shapes; text has a random length and zero padding after."""
    out = {}
    for name, tower in spec.towers.items():
        s = tower.stem
        if tower.modality == "image":
            out[name] = torch.randn(
                batch, s.channels, s.image_size, s.image_size, generator=generator
            )
        elif tower.modality == "video":
            out[name] = torch.randn(
                batch, s.frames, s.channels, s.image_size, s.image_size, generator=generator
            )
        elif tower.modality == "audio":
            out[name] = torch.randn(batch, s.samples(), generator=generator) * 0.1
        elif tower.modality == "timeseries":
            out[name] = torch.randn(batch, s.channels, s.length, generator=generator)
        else:
            ids = torch.randint(
                1, min(s.vocab_size, 256), (batch, s.context_length), generator=generator
            )
            lengths = torch.randint(2, s.context_length + 1, (batch, 1), generator=generator)
            out[name] = ids * (torch.arange(s.context_length)[None] < lengths)
    return out


def language_batch(
    spec: ModelSpec,
    rows: int,
    positions: int,
    images_per_row: int,
    generator: torch.Generator,
    packed: bool = False,
) -> dict[str, torch.Tensor]:
    """A batch of the language-model contract (models/vlm.py): `rows` rows of `positions` LM
    positions each (every row full: memory is planned for the longest row), `images_per_row`
    placeholders per row at random places, random labels (-100 at placeholders) and, when
    `packed`, two documents per row (`document_ids`)."""
    d = spec.decoder
    p = spec.image_tokens()
    ids_per_row = positions - images_per_row * max(p - 1, 0)
    if ids_per_row < max(images_per_row, 2):
        raise ValueError(
            f"{positions} positions cannot hold {images_per_row} image(s) of {p} tokens "
            "and a target"
        )
    high = min(d.vocab_size, 256)
    text = torch.randint(1, high, (rows, ids_per_row), generator=generator)
    image_id = spec.projector.image_token_id if spec.projector is not None else None
    if image_id is not None:
        text = torch.where(text == image_id, (image_id + 1) % high, text)
        for r in range(rows):
            slots = torch.randperm(ids_per_row - 1, generator=generator)[:images_per_row]
            text[r, slots] = image_id
    labels = torch.where(text == image_id, -100, text) if image_id is not None else text.clone()
    batch = {"text": text, "labels": labels}
    if spec.projector is not None:
        s = spec.towers[spec.projector.tower].stem
        batch[spec.projector.tower] = torch.randn(
            rows * images_per_row, s.channels, s.image_size, s.image_size, generator=generator
        )
    if packed:
        cut = ids_per_row // 2
        while image_id is not None and bool((text[:, cut - 1] == image_id).any()):
            cut += 1  # an image stays whole in one document (any cut works for the planner)
        batch["document_ids"] = (torch.arange(ids_per_row) >= cut).long().expand(rows, -1)
    return batch


def native_language_batch(
    spec: ModelSpec,
    rows: int,
    positions: int,
    inputs: tuple[tuple[int, int, int], ...],
    generator: torch.Generator,
    packed: bool = False,
) -> dict:
    """A native-resolution VLM's batch (models/visual_inputs.py): `rows` rows of `positions`
    LM positions, each holding `inputs` ((frames, height, width) at the tower's size, frames 1
    an image) in that order at random places: one `image_token_id` per image and one
    `video_token_id` per clip among the ids, "image" [3, H, W] and "video" [T, 3, H, W] lists
    in reading order, labels -100 at placeholders and, when `packed`, two documents a row."""
    v, tokens = spec.vision, spec.vision_tokens
    ids_per_row = positions - sum(v.tokens(h, w, f) - 1 for f, h, w in inputs)
    if ids_per_row < len(inputs) + 2:
        raise ValueError(
            f"{positions} positions cannot hold {len(inputs)} visual input(s) and a target"
        )
    high = min(spec.decoder.vocab_size, 256)
    placeholder = {tokens.image_token_id, tokens.video_token_id}
    text = torch.randint(1, high, (rows, ids_per_row), generator=generator)
    text = torch.where(torch.isin(text, torch.tensor(sorted(placeholder))), 1, text)
    images, videos = [], []
    for r in range(rows):
        slots = torch.randperm(ids_per_row - 1, generator=generator)[: len(inputs)]
        for slot, (frames, height, width) in zip(slots.sort().values.tolist(), inputs, strict=True):
            clip = frames > 1
            text[r, slot] = tokens.video_token_id if clip else tokens.image_token_id
            shape = (v.in_channels, height, width)
            pixels = torch.randn((frames, *shape) if clip else shape, generator=generator)
            (videos if clip else images).append(pixels)
    labels = torch.where(torch.isin(text, torch.tensor(sorted(placeholder))), -100, text)
    batch = {"text": text, "labels": labels, "image": images}
    if videos:
        batch["video"] = videos
    if packed:
        cut = ids_per_row // 2
        batch["document_ids"] = (torch.arange(ids_per_row) >= cut).long().expand(rows, -1)
    return batch


def denoiser_batch(
    spec: ModelSpec, batch: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Clean samples [B, C, H, W] ([B, C, T, H, W] for a video DiT) under the denoiser's input
    key, and its condition: class ids when it is class-conditional, an MMDiT's cached text
    ([B, text_tokens, text_width] hidden states and a [B, pooled_width] pooled vector, the
    length the planner counts): what the trainer's loader hands the diffusion objective."""
    d = spec.denoiser
    shape = (batch, *d.sample_shape())
    out = {d.input: torch.randn(shape, generator=generator)}
    if d.num_classes:
        out[CLASS] = torch.randint(0, d.num_classes, (batch,), generator=generator)
    if d.takes_text():
        hidden = (batch, d.text_tokens, d.text_width)
        out[TEXT_HIDDEN] = torch.randn(hidden, generator=generator)
    if d.pooled_width:
        out[TEXT_POOLED] = torch.randn(batch, d.pooled_width, generator=generator)
    return out


def next_token_loss(out: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """The trainer's next-token objective (train/objectives.py) of a language model's output
    `out`: the summed cross-entropy of each position against the next id's label (the model's
    own chunked "nll_sum" when the batch held the labels, else from "logits"), over the
    target count."""
    nll = out["nll_sum"] if "nll_sum" in out else token_nll_sum(out["logits"], labels)
    return nll / count_targets(labels)


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@contextmanager
def saved_storages(model: nn.Module) -> Iterator[dict[int, tuple[int, StorageWeakRef]]]:
    """The storages autograd saves inside the block, parameters aside, by address: their bytes
    and a weak reference, which tells whether the graph still holds one at the end (a node
    whose output needs no gradient is dropped with what it saved, e.g. a checkpointed sub-block
    without gradient, and its memory may be reused at that address)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, StorageWeakRef]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and (ptr not in saved or saved[ptr][1].expired()):
            saved[ptr] = (st.nbytes(), StorageWeakRef(st))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def held_storages(saved: dict[int, tuple[int, StorageWeakRef]]) -> dict[int, int]:
    """The bytes of each storage of `saved_storages` the graph still holds, by address."""
    return {ptr: n for ptr, (n, ref) in saved.items() if not ref.expired()}


def measure_training_step(
    model_name: str | ModelSpec,
    plan: Plan,
    *,
    image_size: int | None = None,
    frames: int | None = None,
    context: int | None = None,
    images: int | None = None,
    packed: bool = False,
    freeze: list[str] | None = None,
    lora: list[str] | None = None,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] = ("attn", "mlp"),
    freeze_blocks: dict[str, int] | None = None,
    unlocked_blocks: dict[str, int] | None = None,
    visual_inputs: tuple[tuple[int, int, int], ...] | None = None,
    seed: int = 0,
) -> Measured:
    """One training step of the real module at the plan's micro-batch and checkpointing mode,
    with `freeze` towers frozen and `lora` towers LoRA-adapted as the trainer does it. A
    native-resolution VLM's rows hold `visual_inputs` (at the tower's size; default: `images`
    default pages, as the planner's `native_rows` spells them out).

    Under the plan's sequence parallelism (N > 1) the step runs on N gloo ranks of this
    machine, each splitting every row as the trainer does (train/sequence_parallel.py); the
    rank that saves the most is the measurement (the ranks differ only by padding)."""
    split = plan.config.sequence_parallel
    if split > 1 and not torch.distributed.is_initialized():
        options = dict(image_size=image_size, frames=frames, context=context, images=images,
                       packed=packed, freeze=freeze, lora=lora, lora_rank=lora_rank,
                       lora_targets=lora_targets, freeze_blocks=freeze_blocks,
                       unlocked_blocks=unlocked_blocks, visual_inputs=visual_inputs,
                       seed=seed)  # fmt: skip
        ranks = run_on_local_ranks(_measure_on_rank, split, args=(model_name, plan, options))
        return max(ranks, key=lambda m: m.activations_bytes)
    spec = spec_with_overrides(
        model_name, image_size, frames, None if _is_lm(model_name) else context
    )
    model = create_model(spec, seed=seed)
    towers = _towers(freeze or [], lora or [], lora_rank, lora_targets)
    for name, n in (freeze_blocks or {}).items():
        towers[name] = TowerTrainConfig(freeze_blocks=n)
    for name, n in (unlocked_blocks or {}).items():
        towers[name] = TowerTrainConfig(unlocked_blocks=n)
    optimizer = _trainer_set_up(model, spec, towers, seed)
    # As a run sets train.towers.NAME.activation_checkpointing: the towers whose blocks keep
    # activations recompute, those that train and those a gradient passes through (a frozen
    # block with nothing trained before it keeps nothing; checkpointed, it would keep its input).
    apply_activation_checkpointing(model, plan.config.ac, _towers_keeping_activations(model, spec))
    if split > 1:
        apply_sequence_parallel(model, spec, split, plan.config.sequence_parallel_attention)
    generator = torch.Generator().manual_seed(seed)
    if spec.vision is not None:
        positions = context or spec.decoder.max_positions
        inputs = _native_inputs(spec, positions, images, visual_inputs)
        batch = native_language_batch(
            spec, plan.config.micro_batch, positions, inputs, generator, packed
        )
    elif spec.is_language_model():
        positions = context or spec.decoder.max_positions
        per_row = images if images is not None else int(spec.projector is not None)
        batch = language_batch(spec, plan.config.micro_batch, positions, per_row, generator, packed)
    elif spec.is_generator():
        batch = denoiser_batch(spec, plan.config.micro_batch, generator)
        objective = DiffusionObjective(spec, DiffusionConfig(), seed=seed)
        objective.prepare(None, [batch], None, 0)
    else:
        batch = random_batch(spec, plan.config.micro_batch, generator)
    with saved_storages(model) as saved:
        if spec.is_generator():  # the objective's noisy input, timesteps and classes
            out = model(objective.inputs(batch, 0))
            loss = objective.loss(out, batch, 0)
        elif spec.is_language_model():
            out = model(batch)
            loss = next_token_loss(out, batch["labels"])
        else:
            out = model(batch)
            loss = _loss(spec, model, out, generator)
    activations = sum(held_storages(saved).values())
    # The prediction for this very step: planned for the CPU, where packed rows keep a dense
    # mask that flex attention on the plan's GPU does not (models/attention.py).
    cpu = training_memory(plan.model, plan.config, None)
    loss.backward()
    optimizer.step()
    with_grad = [p for p in model.parameters() if p.grad is not None]
    states = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    states += [
        v
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    ]
    return Measured(
        activations_bytes=activations,
        model_state_bytes=_storage_bytes(states),
        predicted_activations_bytes=int(cpu.saved_activations_bytes),
        predicted_model_state_bytes=int(plan.memory.model_state_bytes),
        micro_batch=plan.config.micro_batch,
        ac=plan.config.ac,
        trainable_params=sum(p.numel() for p in with_grad),
        optimizer_state_params=sum(p.numel() for p in optimizer.state if optimizer.state[p]),
        predicted_trainable_params=plan.model.trainable_params(),
    )


def _towers_keeping_activations(model: torch.nn.Module, spec: ModelSpec) -> list[str]:
    """The towers of `model` whose blocks autograd keeps activations of: those with a trained
    parameter and, in a language model, whose towers feed each other in order (an image tower,
    its projector, the decoder), every tower behind a trained part, frozen or not (a LLaVA's
    frozen decoder behind its trained projector). Towers of a contrastive or fusion model are
    independent: only trained ones keep activations."""

    def trains(module: torch.nn.Module | None) -> bool:
        return module is not None and any(p.requires_grad for p in module.parameters())

    keeping, upstream = [], False
    for name, tower in model.towers.items():
        if trains(tower) or upstream:
            keeping.append(name)
        if spec.is_language_model():
            upstream = upstream or trains(tower) or trains(getattr(model, "projector", None))
    return keeping


def _measure_on_rank(model_name: str | ModelSpec, plan: Plan, options: dict) -> Measured:
    return measure_training_step(model_name, plan, **options)


def _native_inputs(
    spec: ModelSpec,
    positions: int,
    images: int | None,
    visual_inputs: tuple[tuple[int, int, int], ...] | None,
) -> tuple[tuple[int, int, int], ...]:
    """The row's inputs as the planner spells them out (`plan.model.native_rows`)."""
    from mmtrain.plan.model import Rows, native_rows

    rows = Rows(positions, images=1 if images is None else images)
    return native_rows(spec, replace(rows, visual_inputs=tuple(visual_inputs or ()))).visual_inputs


def _is_lm(name: str | ModelSpec) -> bool:
    return load_spec(name).is_language_model()


def _towers(
    freeze: list[str], lora: list[str], lora_rank: int, lora_targets: tuple[str, ...]
) -> dict[str, TowerTrainConfig]:
    """The `train.towers` section the planner's --freeze / --lora flags stand for."""
    towers = {name: TowerTrainConfig(freeze=True) for name in freeze}
    for name in lora:
        adapters = LoraConfig(rank=lora_rank, targets=list(lora_targets))
        towers[name] = TowerTrainConfig(lora=adapters)
    return towers


def _trainer_set_up(
    model, spec: ModelSpec, towers: dict[str, TowerTrainConfig], seed: int
) -> torch.optim.Optimizer:
    """Freeze and adapt `model` and build its AdamW through the trainer's own functions."""
    config = TrainConfig(steps=1, batch_size=1, lr=1e-4, towers=towers)
    resolve_optimizer_defaults(config, spec)  # AdamW's state is the same size whatever they are
    apply_lora(model, config, seed=seed)
    freeze_parameters(model, config)
    return make_optimizer(model, config, torch.device("cpu"))


def _loss(spec: ModelSpec, model, out: dict, generator: torch.Generator) -> torch.Tensor:
    """The training objective: contrastive over the pairs, plus the fusion head's
    cross-entropy (classify, random labels) or MSE (regress, random targets)."""
    total = torch.zeros(())
    if "fusion" in out:
        logits = out["fusion"].float()
        if spec.fusion.task == "classify":
            labels = torch.randint(0, logits.shape[1], logits.shape[:1], generator=generator)
            total = F.cross_entropy(logits, labels)
        else:
            total = F.mse_loss(logits, torch.randn(logits.shape, generator=generator))
    if spec.pairs:
        loss = ContrastiveLoss.from_spec(spec, distributed=False)
        value, _ = loss(out, spec.pairs, model.logit_scale, getattr(model, "logit_bias", None))
        total = total + value
    return total
