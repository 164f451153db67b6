"""`mmtrain eval RUN_DIR|WEIGHTS_DIR --data PATTERN`: retrieval, CLIP score, zero-shot, probe;
for a language model (a spec with a decoder): perplexity and generated answers on conversations.

Loads a model folder (model.safetensors + spec.yaml) or a training checkpoint (full or sharded),
streams the data in eval mode, and writes `eval.json` (into the model folder, or
RUN_DIR/eval-step_N.json for a checkpoint, unless `--out` says otherwise) and a table. Under
torchrun every rank embeds and scores its share; rank 0 writes and prints. A hub model (a hub
run's folder, or any transformers folder of a class mmtrain trains as it is) is evaluated
with the metrics of a native language model, through its folder's processor and its class's
own generate (eval/hub.py).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from mmtrain.cli import UsageError
from mmtrain.commands._args import count
from mmtrain.folders import EVAL_FILE

ORDER = 40
SCHEMA_VERSION = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a trained model: retrieval, CLIP score, zero-shot, linear probe; "
        "perplexity and answers for language models",
        description=(
            "Evaluate the model in RUN_DIR (or a folder written by save_model / convert) on "
            "shards: retrieval R@1/5/10 and ranks in both directions of each pair, CLIP score, "
            "zero-shot classification with class names, a linear probe on labels. For a "
            "language or vision-language model, on conversation shards: perplexity of the "
            "answers, greedy answers scored against the references (token F1, exact match), "
            "also with the images shuffled between samples, and a few examples. Writes "
            "eval.json. Exit code 2 on bad input."
        ),
    )
    p.add_argument(
        "model",
        metavar="RUN_DIR|WEIGHTS_DIR|CHECKPOINT",
        help="a model folder (model.safetensors + spec.yaml), a run (its final weights, else its "
        "newest valid checkpoint) or a checkpoint folder RUN_DIR/checkpoints/step_N",
    )
    p.add_argument("--data", required=True, help="shard folder, .tar, glob or brace pattern")
    p.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )
    p.add_argument(
        "--batch-size",
        type=count,
        default=64,
        help="samples per forward pass per rank (default 64)",
    )
    p.add_argument(
        "--pairs",
        help="tower pairs to score, e.g. image-text or image-text,audio-text (default: the model's pairs)",
    )
    p.add_argument(
        "--zeroshot",
        action="store_true",
        help="zero-shot classification with class names from the data's manifest.json ('classes')",
    )
    p.add_argument(
        "--zeroshot-classes",
        metavar="FILE",
        help="class names, one per line (or a JSON list); implies --zeroshot",
    )
    p.add_argument(
        "--templates",
        metavar="FILE",
        help="prompt templates, one per line with {} for the class name",
    )
    p.add_argument(
        "--label-field",
        default="label",
        help="json field holding the label when a sample has no .cls (default: label)",
    )
    p.add_argument(
        "--probe", action="store_true", help="linear probe on the labels (accuracy, macro-F1)"
    )
    p.add_argument(
        "--probe-train",
        metavar="PATTERN",
        help="shards to fit the probe on (default: 4 in 5 samples of --data, by key hash)",
    )
    p.add_argument(
        "--tokenizer",
        help="'byte', a tokenizer.json or CLIP merges file (default: the run's config, else byte)",
    )
    p.add_argument(
        "--chat-template",
        help="language models: plain, chatml, llama-3, vicuna-v1 or a tokenizer_config.json "
        "(default: the run's data.chat_template, else the tokenizer folder's)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=count,
        default=32,
        help="language models: length limit of each generated answer (default 32)",
    )
    p.add_argument(
        "--examples",
        type=count,
        default=8,
        help="language models: generated answers kept in the report (default 8)",
    )
    p.add_argument("--workers", type=count, default=0, help="decode processes per rank (default 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    gen = p.add_argument_group("denoisers (a DiT)")
    gen.add_argument(
        "--extractor",
        metavar="MODEL_DIR",
        help="a model with an image tower whose features the Fréchet distance is taken in",
    )
    gen.add_argument(
        "--vae",
        metavar="VAE_DIR",
        help="a latent denoiser's VAE (a diffusers AutoencoderKL folder): samples and held-out "
        "latents are decoded through it before the extractor sees them",
    )
    gen.add_argument(
        "--extractor-tokenizer",
        default="byte",
        help="the extractor's text tokenizer, for the conditional accuracy (default byte)",
    )
    gen.add_argument(
        "--samples", type=count, default=256, help="images generated for the FD (default 256)"
    )
    gen.add_argument("--steps", type=count, default=25, help="sampling steps (default 25)")
    gen.add_argument("--cfg", type=float, default=1.0, help="guidance scale (default 1)")
    p.add_argument(
        "--out",
        metavar="FILE",
        help=f"where to write the report (default: MODEL_DIR/{EVAL_FILE}, RUN_DIR/eval-step_N.json)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch  # imported here so `mmtrain --help` stays fast

    from mmtrain.eval.run import ZeroShotConfig, parse_pairs
    from mmtrain.eval.zeroshot import DEFAULT_TEMPLATES, read_class_names, read_templates

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise UsageError(f"{model_dir}: not a folder (expected RUN_DIR or a model folder)")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {args.batch_size}")
    if args.workers < 0:
        raise UsageError(f"--workers must be 0 or more, got {args.workers}")
    device = _init_distributed(args.device, torch)
    model, run_dir, source = _load_model(model_dir, device)
    spec = model.spec
    if spec.hub is not None:
        return _write(_hub_report(model, run_dir, args), model, run_dir, source, args)
    if spec.decoder is not None:
        report = _language_model_report(model, run_dir, args)
        return _write(report, model, run_dir, source, args)
    if spec.denoiser is not None:
        report = _denoiser_report(model, run_dir, args, device)
        return _write(report, model, run_dir, source, args)
    try:
        pairs = parse_pairs(args.pairs, spec) if args.pairs else [tuple(p) for p in spec.pairs]
    except ValueError as err:
        raise UsageError(f"--pairs: {getattr(err, 'message', err)}") from None
    tokenizer = args.tokenizer or _run_tokenizer(run_dir)
    zeroshot = None
    if args.zeroshot or args.zeroshot_classes:
        names = (
            read_class_names(args.zeroshot_classes)
            if args.zeroshot_classes
            else _manifest_classes(args.data)
        )
        templates = read_templates(args.templates) if args.templates else list(DEFAULT_TEMPLATES)
        zeroshot = ZeroShotConfig(names, templates, tokenizer)
    elif args.templates:
        raise UsageError("--templates needs --zeroshot or --zeroshot-classes")
    if args.probe_train and not args.probe:
        raise UsageError("--probe-train needs --probe")
    evaluator = _evaluator(
        spec,
        args.data,
        batch_size=args.batch_size,
        tokenizer=tokenizer,
        pairs=pairs,
        zeroshot=zeroshot,
        probe=args.probe,
        probe_data=args.probe_train,
        label_field=args.label_field,
        class_names=_manifest_class_names(args.data),
        num_workers=args.workers,
    )
    report = evaluator.report(model)
    evaluator.close()
    return _write(report, model, run_dir, source, args)


def _write(report: dict[str, Any], model: Any, run_dir: Path, source: Path, args: Any) -> int:
    """eval.json (rank 0) and the table or JSON on stdout; leaves the process group."""
    import mmtrain
    from mmtrain import distributed
    from mmtrain.atomic import atomic_write_text

    spec = model.spec
    report = {
        "schema_version": SCHEMA_VERSION,
        "model": str(source),
        "model_name": spec.name,
        "data": args.data,
        "world_size": distributed.world_size(),
        "mmtrain_version": mmtrain.__version__,
        **report,
    }
    if distributed.rank() == 0:
        out = Path(args.out) if args.out else _default_out(run_dir, source)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2) if args.json else format_report(report, out))
    distributed.leave_process_group()
    return 0


def _check_language_model_flags(spec: Any, args: argparse.Namespace) -> None:
    clip_only = {
        "--pairs": args.pairs,
        "--zeroshot": args.zeroshot or args.zeroshot_classes,
        "--templates": args.templates,
        "--probe": args.probe or args.probe_train,
    }
    used = [flag for flag, value in clip_only.items() if value]
    if used:
        raise UsageError(f"{', '.join(used)}: not for a language model ({spec.name})")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.examples < 0:
        raise UsageError(f"--examples must be 0 or more, got {args.examples}")


def _language_model_report(model: Any, run_dir: Path, args: argparse.Namespace) -> dict:
    """Perplexity and generated answers (eval.generation) for a model with a decoder."""
    from mmtrain.data.stream.conversation_batches import resolve_chat_template
    from mmtrain.eval.generation import VLMEvaluator
    from mmtrain.structured import FieldError

    _check_language_model_flags(model.spec, args)
    tokenizer = args.tokenizer or _run_tokenizer(run_dir)
    template = args.chat_template or _run_data_field(run_dir, "chat_template")
    try:
        evaluator = VLMEvaluator(
            model.spec,
            args.data,
            batch_size=args.batch_size,
            tokenizer=tokenizer,
            chat_template=resolve_chat_template(template, tokenizer),
            max_length=_run_data_field(run_dir, "sequence_length"),
            max_new_tokens=args.max_new_tokens,
            examples=args.examples,
            budget=_run_budget(model.spec, run_dir),
        )
    except FieldError as err:
        flags = {
            "data": "--data",
            "chat_template": "--chat-template",
            "data.chat_template": "--chat-template",
            "tokenizer": "--tokenizer",
        }
        if err.path in flags:
            raise UsageError(f"{flags[err.path]} {err.message}") from None
        raise
    return _report_and_close(evaluator, model)


def _hub_report(model: Any, run_dir: Path, args: argparse.Namespace) -> dict:
    """A hub model's perplexity and answers (eval/hub.py): the batches training made, with
    the processor the run folder holds, and the class's own generate."""
    from mmtrain.eval.hub import HubEvaluator, hub_batcher, processor_folder
    from mmtrain.structured import FieldError

    _check_language_model_flags(model.spec, args)
    folder = processor_folder(run_dir, model.spec)
    native_only = {"--tokenizer": args.tokenizer, "--chat-template": args.chat_template}
    used = [flag for flag, value in native_only.items() if value]
    if used:
        raise UsageError(
            f"{', '.join(used)}: {model.spec.name} is a hub model; its inputs are made by the "
            f"processor of {folder} (its tokenizer and chat template): leave them out"
        )
    try:
        batcher = hub_batcher(model.spec, folder, _run_data_field(run_dir, "sequence_length"))
        evaluator = HubEvaluator(model.spec, args.data, batcher=batcher,
                                 batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                 examples=args.examples)  # fmt: skip
    except FieldError as err:
        if err.path == "data":
            raise UsageError(f"--data {err.message}") from None
        raise
    return _report_and_close(evaluator, model)


def _denoiser_report(model: Any, run_dir: Path, args: argparse.Namespace, device: Any) -> dict:
    """Loss at fixed timesteps and, with --extractor, the FD of samples (eval/diffusion.py),
    with the run's `train.diffusion` settings."""
    import mmtrain
    from mmtrain.eval.diffusion import DenoiserEvaluator
    from mmtrain.structured import FieldError

    config = run_diffusion_config(run_dir)
    extractor = None
    if args.extractor:
        try:
            extractor = mmtrain.load_model(args.extractor, device=device).eval()
        except (OSError, ValueError) as err:
            raise UsageError(f"--extractor {args.extractor}: {err}") from None
    vae = _vae(args.vae, device)
    try:
        evaluator = DenoiserEvaluator(
            model.spec, args.data, batch_size=args.batch_size, config=config,
            label_field=args.label_field, class_names=_manifest_class_names(args.data) or (),
            extractor=extractor, samples=args.samples, steps=args.steps, cfg=args.cfg,
            num_workers=args.workers, extractor_tokenizer=args.extractor_tokenizer,
            video_stride=_run_data_field(run_dir, "video_stride"),  # the run's middle window
            vae=vae,
        )  # fmt: skip
    except FieldError as err:
        raise UsageError(
            f"--{err.path} {err.message}" if err.path in ("data", "extractor") else str(err)
        ) from None
    try:
        report = evaluator.report(model.eval())
    finally:
        evaluator.close()
    return {"n_samples": report["diffusion"]["n"], **report}


def _vae(folder: str | None, device: Any) -> Any:
    """The diffusers VAE of --vae (None without the flag), as `generate --vae` reads it."""
    if folder is None:
        return None
    from mmtrain.models.formats.diffusers import read_diffusers_vae
    from mmtrain.structured import FieldError

    try:
        return read_diffusers_vae(folder).to(device).eval()
    except (OSError, FieldError) as err:
        raise UsageError(f"--vae {folder}: {err}") from None


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml as a mapping ({} without one); UsageError naming it if unreadable."""
    import yaml

    config = run_dir / "config.yaml"
    if not config.is_file():
        return {}
    try:
        data = yaml.safe_load(config.read_text()) or {}
    except yaml.YAMLError as err:
        raise UsageError(f"{config}: not a readable run config ({err})") from None
    return data if isinstance(data, dict) else {}


def run_diffusion_config(run_dir: Path) -> Any:
    """The run's `train.diffusion` (the defaults without a config.yaml): how its denoiser was
    trained is how it is sampled and evaluated."""
    from mmtrain.config import DiffusionConfig
    from mmtrain.structured import FieldError, from_dict

    train = run_config(run_dir).get("train") or {}
    try:
        return from_dict(DiffusionConfig, train.get("diffusion") or {}, "train.diffusion")
    except (FieldError, AttributeError) as err:
        raise UsageError(f"{run_dir / 'config.yaml'}: {err}") from None


def _run_budget(spec: Any, run_dir: Path) -> Any:
    """A native-resolution VLM's pixel budget as the run trained with it (data.vision), so
    validation pages get the sizes and tokens training gave them; None otherwise."""
    if spec.vision is None:
        return None
    from mmtrain.config import VisionDataConfig
    from mmtrain.structured import from_dict
    from mmtrain.visual_budget import budget_of

    values = _run_data_field(run_dir, "vision")
    settings = None if values is None else from_dict(VisionDataConfig, values, "data.vision")
    return budget_of(spec.vision, settings)


def _run_data_field(run_dir: Path, name: str) -> Any:
    """`data.NAME` of the run's config.yaml (a relative path resolved in the run folder when it
    exists there), or None."""
    import yaml

    config = run_dir / "config.yaml"
    try:
        value = yaml.safe_load(config.read_text())["data"][name]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    if isinstance(value, str) and not Path(value).is_absolute() and (run_dir / value).exists():
        return str(run_dir / value)
    return value


def _evaluator(spec: Any, data: str, **options: Any) -> Any:
    """An `Evaluator`; errors about the data name the flag that gave it."""
    from mmtrain.eval.run import Evaluator
    from mmtrain.structured import FieldError

    flags = {"data": "--data", "probe_data": "--probe-train"}
    try:
        return Evaluator(spec, data, **options)
    except FieldError as err:
        if err.path in flags:
            raise UsageError(f"{flags[err.path]} {err.message}") from None
        raise


def _init_distributed(device_arg: str | None, torch: Any) -> Any:
    """Join torchrun's process group when launched by it; the device this rank uses."""
    from mmtrain import distributed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and (device_arg is None or device_arg.startswith("cuda"))
    if world > 1 and not torch.distributed.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(distributed.backend_for(cuda))
    if device_arg and not (world > 1 and cuda):
        try:
            return torch.device(device_arg)
        except RuntimeError as err:
            raise UsageError(f"--device {device_arg!r}: {err}") from None
    if cuda:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load_model(folder: Path, device: Any) -> tuple[Any, Path, Path]:
    """The model to evaluate, the run folder it came from and the folder its weights came
    from (`folder` itself, or a checkpoint of it). `folder` is a model folder
    (model.safetensors + spec.yaml: a finished run, `mmtrain convert`'s output; a hub run's or
    any transformers folder of a hub class: eval/hub.py), a checkpoint
    (RUN_DIR/checkpoints/step_N, full or sharded under FSDP), or a run still training (its
    newest valid checkpoint)."""
    import mmtrain
    from mmtrain.checkpoint import (
        MANIFEST_FILE,
        CheckpointError,
        latest_checkpoint,
        load_weights,
        read_meta,
    )
    from mmtrain.eval.hub import is_hub_folder, load_hub_model
    from mmtrain.folders import SPEC_FILE, WEIGHTS_FILE
    from mmtrain.models.build import is_model_folder
    from mmtrain.spec import ModelSpec

    if is_hub_folder(folder):  # a hub run's folder is its class's transformers folder
        return load_hub_model(folder, device), folder, folder
    if is_model_folder(folder):  # final weights: one file, or shards + index
        return mmtrain.load_model(folder, device=device), folder, folder
    checkpoint, verified = folder, False
    if not (folder / MANIFEST_FILE).is_file():
        checkpoint, verified = latest_checkpoint(folder / "checkpoints"), True
        if checkpoint is None:
            raise UsageError(
                f"{folder}: no {WEIGHTS_FILE} + {SPEC_FILE} and no valid checkpoint in "
                f"{folder / 'checkpoints'}: give a finished run, a model folder or a checkpoint"
            )
    try:
        meta = read_meta(checkpoint, verify=not verified)
        if "spec" not in meta:
            raise UsageError(
                f"{checkpoint / 'meta.json'}: no model spec (written by an older mmtrain); "
                "evaluate the run's final model folder instead"
            )
        model = mmtrain.create_model(ModelSpec.from_dict(meta["spec"]))
        model.load_state_dict(load_weights(checkpoint, verify=False))  # verified above
    except CheckpointError as err:
        raise UsageError(str(err)) from None
    return model.to(device), checkpoint.parent.parent, checkpoint


def _default_out(run_dir: Path, source: Path) -> Path:
    """RUN_DIR/eval.json for a model folder; RUN_DIR/eval-step_N.json for a checkpoint (whose
    folder stays exactly as its manifest lists it)."""
    return run_dir / (EVAL_FILE if source == run_dir else f"eval-{source.name}.json")


def _run_tokenizer(model_dir: Path) -> str:
    """The tokenizer a run trained with (its config.yaml `data.tokenizer`), else 'byte'."""
    import yaml

    config = model_dir / "config.yaml"
    if not config.is_file():
        return "byte"
    try:
        data = yaml.safe_load(config.read_text())
        value = data["data"]["tokenizer"]
    except (yaml.YAMLError, KeyError, TypeError):
        return "byte"
    if not isinstance(value, str):
        return "byte"
    if value != "byte" and not Path(value).is_absolute() and (model_dir / value).exists():
        return str(model_dir / value)
    return value


def _manifest_class_names(data: str) -> list[str] | None:
    """The `classes` list of the data folder's manifest.json, if it has one."""
    from mmtrain.data.storage.manifest import read_manifest

    folder = Path(data)
    if not (folder / "manifest.json").is_file():
        return None
    names = read_manifest(folder).get("classes")
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        return names
    return None


def _manifest_classes(data: str) -> list[str]:
    names = _manifest_class_names(data)
    if names is None:
        raise UsageError(
            f"--zeroshot: {data} is not a shard folder whose manifest.json lists 'classes'; give "
            "the class names with --zeroshot-classes FILE"
        )
    return names


def format_report(report: dict[str, Any], out: Path) -> str:
    """A plain-text table of the report's main numbers."""
    lines = [f"{report['model_name']} on {report['data']}: {report['n_samples']} samples"]
    retrieval = report.get("retrieval", {})
    if retrieval:
        ks = [k for k in next(iter(retrieval.values())) if k.startswith("R@")]
        header = (
            f"{'direction':<22}"
            + "".join(f"{k:>8}" for k in ks)
            + f"{'mean rank':>11}{'median':>8}{'queries':>9}"
        )
        lines += ["", header]
        for direction, m in retrieval.items():
            row = f"{direction:<22}" + "".join(f"{m[k]:>8.3f}" for k in ks)
            lines.append(
                row + f"{m['mean_rank']:>11.1f}{m['median_rank']:>8.1f}{m['n_queries']:>9d}"
            )
    if "diffusion" in report:
        d = report["diffusion"]
        at = ", ".join(f"t={t} {v:.4f}" for t, v in d["loss_at"].items())
        lines.append(f"loss at fixed timesteps: mean {d['loss']:.4f} ({at})")
        if "fd" in d:
            lines.append(
                f"FD in {d['extractor']}'s features: {d['fd']:.4f} ({d['fd_n']} images); at "
                f"half of them {d['fd_half']:.4f} against the real-vs-real floor "
                f"{d['fd_real_floor']:.4f}"
            )
        if "cond_accuracy" in d:
            lines.append(
                f"conditional accuracy {d['cond_accuracy']:.3f} (real images "
                f"{d['real_accuracy']:.3f}); CLIP score {d['clip_score']:.2f}"
            )
    for pair, s in report.get("clip_score", {}).items():
        lines.append(
            f"CLIP score {pair}: mean {s['mean']:.2f}, median {s['median']:.2f} ({s['n_pairs']} pairs)"
        )
    for tower, z in report.get("zeroshot", {}).items():
        tops = ", ".join(f"{k} {v:.3f}" for k, v in z.items() if k.startswith("top"))
        lines.append(
            f"zero-shot {tower}: {tops} ({z['n_classes']} classes, {z['n_samples']} samples)"
        )
    if "probe" in report:
        p = report["probe"]
        lines.append(
            f"linear probe ({'+'.join(p['towers'])}): accuracy {p['accuracy']:.3f}, macro-F1 "
            f"{p['macro_f1']:.3f} ({p['n_train']} train / {p['n_test']} test)"
        )
    if "fusion" in report:
        f = report["fusion"]
        lines.append(f"fusion head: accuracy {f['accuracy']:.3f}, macro-F1 {f['macro_f1']:.3f}")
    lines += _language_model_lines(report)
    if report.get("corrupt_samples"):
        lines.append(f"skipped {report['corrupt_samples']} corrupt samples")
    lines += ["", f"wrote {out}"]
    return "\n".join(lines)


def _language_model_lines(report: dict[str, Any]) -> list[str]:
    """Perplexity, answer scores and a few examples of a language model's report."""
    lines = []
    if "perplexity" in report:
        lines.append(
            f"perplexity {report['perplexity']:.3f} over {report['target_tokens']} answer tokens"
        )
    generation = report.get("generation") or {}
    if "skipped" in generation:
        lines.append(f"generation skipped: {generation['skipped']}")
    elif generation:

        def score(value: Any) -> str:
            return "-" if value is None else f"{value:.3f}"

        lines.append(
            f"answers ({generation['n']}, greedy, up to {generation['max_new_tokens']} tokens): "
            f"token F1 {score(generation['token_f1'])}, exact match "
            f"{score(generation['exact_match'])}; with shuffled images ({generation['n_shuffled']}): "
            f"token F1 {score(generation['token_f1_shuffled_images'])}"
        )
        choice = (
            f", multiple choice {score(generation.get('choice_accuracy'))} of "
            f"{generation.get('n_choice', 0)}"
            if generation.get("n_choice")
            else ""
        )
        lines.append(
            f"documents: ANLS {score(generation.get('anls'))}, relaxed accuracy "
            f"{score(generation.get('relaxed_accuracy'))}, CER {score(generation.get('cer'))}"
            f"{choice}"
        )
    for example in report.get("examples", [])[:3]:
        lines.append(
            f"  {example['key']}: {example['generated']!r} (reference {example['reference']!r})"
        )
    if report.get("skipped_samples"):
        lines.append(f"skipped {report['skipped_samples']} conversations that cannot be scored")
    return lines


def _report_and_close(evaluator: Any, model: Any) -> dict:
    try:
        return evaluator.report(model)
    finally:
        evaluator.close()
