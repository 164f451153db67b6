"""Validation during training: `data.val` evaluated every `eval.every_steps` and at the end;
rows get `val/...` metrics and the run folder gets eval.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from mmtrain import __version__
from mmtrain.atomic import atomic_write_text
from mmtrain.config import RunConfig
from mmtrain.data.storage.shards import ShardSet
from mmtrain.folders import EVAL_FILE, SAMPLES_DIR
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train.data import source_towers

EVAL_SCHEMA_VERSION = 1


def _pairs_held_by(path: str, spec: ModelSpec) -> list[tuple[str, str]] | None:
    """The pairs of `spec` whose towers the shards at `path` both hold (a validation set of
    one modality pair, as when training mixes sources of different modalities); None when the
    model has no pairs (a fusion head is evaluated instead)."""
    if not spec.pairs:
        return None
    try:
        towers = source_towers(ShardSet.open(path), spec)
    except (FileNotFoundError, ValueError) as err:
        raise FieldError("", f"{path!r}: {err}") from None
    held = [(a, b) for a, b in spec.pairs if a in towers and b in towers]
    if not held:
        raise FieldError("", f"holds only {', '.join(towers)}: no pair of the model to evaluate")
    return held


def _conversation_settings(config: RunConfig, spec: ModelSpec) -> Any:
    """A native language model's ConversationBatcher; a hub model's ProcessorBatcher (the
    folder's own processor), as training makes its batches."""
    if spec.hub is not None:
        from mmtrain.data.stream.processor_batches import ProcessorBatcher

        return ProcessorBatcher(config.data, spec)
    from mmtrain.data.stream.conversation_batches import ConversationBatcher

    return ConversationBatcher(config.data, spec)


def _language_model_evaluator(
    config: RunConfig, spec: ModelSpec, settings: Any, path: str, rank: int, world: int
) -> Any:
    """Perplexity and generated answers on validation conversations, with the run's tokenizer,
    chat template and sequence length (`settings`: a ConversationBatcher)."""
    from mmtrain.eval.generation import VLMEvaluator

    return VLMEvaluator(
        spec,
        path,
        batch_size=config.eval.batch_size,
        tokenizer=settings.tokenizer,
        chat_template=settings.template,
        max_length=settings.sequence_length,
        seed=config.seed,
        rank=rank,
        world_size=world,
        budget=settings.budget,
    )


def _hub_evaluator(config: RunConfig, spec: ModelSpec, settings: Any, path: str, rank: int,
                   world: int) -> Any:  # fmt: skip
    """A hub model's perplexity and answers (eval/hub.py), with training's batches
    (`settings`: the run's ProcessorBatcher) and the class's own generate."""
    from mmtrain.eval.hub import HubEvaluator

    return HubEvaluator(spec, path, batcher=settings, batch_size=config.eval.batch_size,
                        seed=config.seed, rank=rank, world_size=world)  # fmt: skip


def _denoiser_evaluator(config: RunConfig, spec: ModelSpec, path: str, rank: int, world: int):
    """Loss at fixed timesteps and, with `eval.extractor`, the FD of samples (eval/diffusion.py)."""
    from mmtrain.eval.diffusion import DenoiserEvaluator
    from mmtrain.models.build import load_model

    e = config.eval
    extractor = vae = None
    if e.extractor is not None:
        try:
            extractor = load_model(e.extractor).eval()
        except (OSError, ValueError) as err:
            raise FieldError("eval.extractor", f"{e.extractor}: {err}") from None
    if e.vae is not None:
        from mmtrain.models.formats.diffusers import read_diffusers_vae

        try:
            vae = read_diffusers_vae(e.vae).eval()
        except (OSError, FieldError) as err:
            raise FieldError("eval.vae", f"{e.vae}: {err}") from None
    return DenoiserEvaluator(
        spec, path, batch_size=e.batch_size, config=config.train.diffusion,
        label_field=config.data.label_field, class_names=config.data.class_names,
        seed=config.seed, extractor=extractor, samples=e.samples, steps=e.sample_steps,
        cfg=e.cfg, num_workers=config.data.workers, rank=rank, world_size=world,
        extractor_tokenizer=e.extractor_tokenizer, video_stride=config.data.video_stride,
        vae=vae,
    )  # fmt: skip


class Validator:
    """Periodic evaluation on `data.val` with the eval package's `Evaluator`, on every rank
    (each embeds its share); rows get `val/...` metrics, the run folder gets eval.json."""

    def __init__(self, config: RunConfig, spec: ModelSpec, out: Path, rank: int, world: int):
        from mmtrain.eval.run import Evaluator

        self.every = config.eval.every_steps
        self.out, self.rank, self.world = out, rank, world
        self.sources = [source.path for source in config.data.val]
        self.evaluators = []
        # A language model's settings (tokenizer, chat template) are checked once, naming
        # their own fields; each evaluator then reads its conversations.
        settings = _conversation_settings(config, spec) if spec.is_language_model() else None
        for i, path in enumerate(self.sources):
            try:
                if spec.hub is not None and spec.is_language_model():
                    self.evaluators.append(
                        _hub_evaluator(config, spec, settings, path, rank, world)
                    )
                    continue
                if settings is not None:
                    self.evaluators.append(
                        _language_model_evaluator(config, spec, settings, path, rank, world)
                    )
                    continue
                if spec.denoiser is not None:
                    self.evaluators.append(_denoiser_evaluator(config, spec, path, rank, world))
                    continue
                self.evaluators.append(
                    Evaluator(
                        spec,
                        path,
                        pairs=_pairs_held_by(path, spec),
                        batch_size=config.eval.batch_size,
                        tokenizer=config.data.tokenizer,
                        label_field=config.data.label_field,
                        num_workers=config.data.workers,
                        rank=rank,
                        world_size=world,
                    )  # fmt: skip
                )
            except FieldError as err:
                raise FieldError(f"data.val[{i}].path", err.message) from None
        self.last: tuple[int, list[dict[str, Any]]] | None = None

    def due(self, step: int, total: int) -> bool:
        return step == total or bool(self.every and step % self.every == 0)

    def run(self, model: nn.Module, step: int) -> dict[str, float]:
        """Evaluate now; flat `val/...` metrics (`val/N/...` for the N-th of several sets)."""
        from mmtrain.eval.run import flatten_metrics

        reports = [evaluator.report(model) for evaluator in self.evaluators]
        self.last = (step, reports)
        self._sample_grids(model, step)
        flat: dict[str, float] = {}
        for i, report in enumerate(reports):
            prefix = "val" if len(reports) == 1 else f"val/{i}"
            flat.update(flatten_metrics(report, prefix))
        return flat

    def _sample_grids(self, model: nn.Module, step: int) -> None:
        """A denoiser's samples at this step, OUT/samples/step_N.png (the report shows them);
        every rank samples (a collective under FSDP), rank 0 writes."""
        grids = [e.sample_grid(model) for e in self.evaluators if hasattr(e, "sample_grid")]
        grid = next((g for g in grids if g is not None), None)
        if grid is None or self.rank != 0:
            return
        import io

        from PIL import Image

        from mmtrain.atomic import atomic_write_bytes

        buffer = io.BytesIO()
        Image.fromarray(grid).save(buffer, format="PNG")
        (self.out / SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.out / SAMPLES_DIR / f"step_{step:08d}.png", buffer.getvalue())

    def write_report(self, spec: ModelSpec) -> dict[str, Any] | None:
        """OUT/eval.json from the evaluation at the final step (rank 0 writes; all return it)."""
        if self.last is None:
            return None
        step, reports = self.last
        sets = [
            {
                "schema_version": EVAL_SCHEMA_VERSION,
                "model": str(self.out),
                "model_name": spec.name,
                "data": path,
                "world_size": self.world,
                "mmtrain_version": __version__,
                "step": step,
                **report,
            }  # fmt: skip
            for path, report in zip(self.sources, reports, strict=True)
        ]
        document = dict(sets[0])
        if len(sets) > 1:
            document["other_sets"] = sets[1:]
        if self.rank == 0:
            text = json.dumps(document, indent=2, default=str) + "\n"
            atomic_write_text(self.out / EVAL_FILE, text)
        return document

    def close(self) -> None:
        for evaluator in self.evaluators:
            evaluator.close()
