"""`mmtrain convert`: OpenCLIP checkpoints and Hugging Face folders <-> mmtrain model folders.

    mmtrain convert --from openclip FILE.pt|FILE.safetensors --model NAME|spec.yaml --out DIR
    mmtrain convert --to openclip DIR [--model NAME|spec.yaml] --out FILE.safetensors|FILE.pt
    mmtrain convert --from hf HF_DIR --out DIR
    mmtrain convert --to hf DIR --out HF_DIR
    mmtrain convert --from diffusers DIT_DIR|SD3_DIR --out DIR
    mmtrain convert --to diffusers DIR --out DIT_DIR|SD3_DIR|PIPELINE_DIR
    mmtrain convert --to diffusers DIR --pipeline SOURCE_PIPELINE_DIR --out PIPELINE_DIR

DIR holds spec.yaml + model.safetensors, or shards listed in model.safetensors.index.json past
5 GB (what `mmtrain.load_model(DIR)` reads). `--to hf` reads DIR one tensor at a time and writes
HF_DIR the same way (shards past 5 GB), so a model bigger than memory converts. The OpenCLIP file
written by `--to` is a bare state dict that OpenCLIP's `CLIP` loads with `strict=True`. HF_DIR is a
transformers folder (config.json + model.safetensors, or shards with model.safetensors.index.json)
of CLIPModel, SiglipModel, CLIPVisionModel, CLIPVisionModelWithProjection, SiglipVisionModel,
LlamaForCausalLM, Qwen2ForCausalLM, LlavaForConditionalGeneration,
Qwen2VLForConditionalGeneration or Qwen2_5_VLForConditionalGeneration (config.json's
`architectures` decides); its config.json gives the model's shape, so --model is not used with
hf. A language model's folder holds the decoder under `towers.text.*` (and a LLaVA's image tower
under `towers.image.*`, its projector under `projector.*`; a Qwen2-VL's vision tower and merger
under `towers.vision.*`). The tokenizer, processor, chat template and generation files of a HF
folder are copied through, both ways; `--to hf` of a run folder (`mmtrain train`'s OUT) carries
its own, else those of the folder it started from (`init`, else `data.tokenizer`'s, as its
config.yaml records them) and the chat template it trained with, and refuses a tokenizer that
does not fit the model's vocabulary (models/formats/hf_processor_files.py). DIT_DIR is a diffusers
`DiTTransformer2DModel` or SD3 `SD3Transformer2DModel` folder (config.json +
diffusion_pytorch_model.safetensors, or shards); the denoiser lies under `towers.denoiser.*` (an SD3 folder's is an MMDiT). `--to diffusers` of a
hub denoiser's run (`init: PIPELINE_DIR`, FLUX.1) copies the pipeline folder the run became
(model_index.json, its components, a LoRA run's adapter/) to PIPELINE_DIR; `--pipeline` makes
a DiT or MMDiT folder (SD3 trained as the native MMDiT) a whole pipeline folder: the pipeline it
started from with the trained transformer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmtrain.cli import UsageError
from mmtrain.folders import SPEC_FILE
from mmtrain.spec import ModelSpec, load_spec

# torch and the model code are imported inside the functions: every `mmtrain` command registers
# its parser at start-up, and `mmtrain spec` should not pay for importing torch.

ORDER = 70
FORMATS = ("openclip", "hf", "diffusers")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert weights between OpenCLIP / Hugging Face and mmtrain model folders",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument(
        "--from",
        dest="from_format",
        choices=FORMATS,
        help="read SOURCE in this format, write an mmtrain model folder",
    )
    direction.add_argument(
        "--to",
        dest="to_format",
        choices=FORMATS,
        help="read an mmtrain model folder, write this format",
    )
    p.add_argument(
        "source",
        help="--from: the OpenCLIP checkpoint file or HF folder; --to: the mmtrain model folder "
        "or run folder",
    )
    p.add_argument(
        "--model",
        help="openclip only: preset name (e.g. ViT-B-32) or spec YAML/JSON; required with "
        "--from, with --to it checks that the folder holds a model of this shape",
    )
    p.add_argument(
        "--pipeline",
        type=Path,
        help="--to diffusers of a DiT or MMDiT (SD3) folder: the diffusers pipeline folder it "
        "was started from (or whose encode-latents made its data); OUT becomes that pipeline "
        "with the trained transformer (its VAE, text encoders, tokenizers and scheduler "
        "copied), which DiffusionPipeline.from_pretrained runs",
    )
    p.add_argument(
        "--out",
        required=True,
        help="--from: the output folder; --to openclip: FILE.safetensors or FILE.pt; "
        "--to hf: the output folder",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    source, out = Path(args.source), Path(args.out)
    folder_format = next(
        (f for f in ("hf", "diffusers") if f in (args.from_format, args.to_format)), None
    )
    if folder_format is not None:
        if args.model is not None:
            raise UsageError(
                f"--model is for openclip; with {folder_format}, config.json gives the model"
            )
        if args.pipeline is not None and args.to_format != "diffusers":
            raise UsageError("--pipeline goes with --to diffusers")
        if folder_format == "diffusers":
            if args.from_format:
                return _from_diffusers(source, out)
            return _to_diffusers(source, out, args.pipeline)
        return _from_hf(source, out) if args.from_format else _to_hf(source, out)
    if args.from_format:
        return _from_openclip(source, args.model, out)
    return _to_openclip(source, args.model, out)


def _from_hf(source: Path, out: Path) -> int:
    from mmtrain.models.formats.hf import read_hf_model
    from mmtrain.models.formats.hf_processor_files import folder_processor_files

    code = _from_folder(source, out, read_hf_model)
    copied = folder_processor_files(source).write(out)
    if copied:
        print(f"copied {', '.join(copied)}")
    return code


def _from_diffusers(source: Path, out: Path) -> int:
    from mmtrain.models.formats.diffusers import read_diffusers_dit

    return _from_folder(source, out, read_diffusers_dit)


def _from_folder(source: Path, out: Path, read) -> int:
    """An mmtrain model folder from an external one, `read` giving (spec, state dict)."""
    from mmtrain.models.build import model_with_weights, save_model

    spec, state = read(source)  # HFFolderError (a FieldError) names file and field
    model = model_with_weights(spec, state)
    save_model(model, out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({model.spec.name}, {params:,} parameters from {source})")
    return 0


def _to_hf(source: Path, out: Path) -> int:
    from mmtrain.models.build import read_model_folder
    from mmtrain.models.formats.hf import NoHFCounterpart, hf_counterpart, write_hf_state
    from mmtrain.models.formats.keys import CheckpointMismatch

    if (source / SPEC_FILE).is_file() and load_spec(source / SPEC_FILE).hub is not None:
        return _copy_hub_folder(source, out)
    # The folder is read one tensor at a time and written shard by shard: a 70B model never
    # needs its whole state dict in memory.
    spec, weights = read_model_folder(source)
    with weights:
        try:
            arch = hf_counterpart(spec)
        except NoHFCounterpart as err:
            raise UsageError(f"{source}: {err}") from None
        extras = _processor_files(source, spec)  # found and checked before anything is written
        try:
            write_hf_state(spec, weights, out)
        except CheckpointMismatch as err:
            raise UsageError(f"{weights.source}: {err}") from None
    extras.write(out)
    print(f"wrote {out} ({arch} for transformers, from {source})")
    for origin, names in extras.by_source().items():
        print(f"copied {', '.join(names)} from {origin}")
    for note in extras.notes:
        print(f"note: {note}")
    return 0


def _copy_hub_folder(source: Path, out: Path) -> int:
    """A hub model's run folder is its transformers class's folder already (train/export_hub.py):
    its config, weights and processor files, copied as they are (mmtrain's own files left)."""
    import shutil

    from mmtrain.model_sources import HF_CONFIG_FILE

    if not (source / HF_CONFIG_FILE).is_file():
        raise UsageError(f"{source}: no {HF_CONFIG_FILE}: the run has not finished")
    own = {"spec.yaml", "config.yaml", "metrics.jsonl", "eval.json", "lora.safetensors"}
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in own:
            shutil.copy2(path, out / path.name)
            copied.append(path.name)
        elif path.is_dir() and path.name == "adapter":
            shutil.copytree(path, out / path.name, dirs_exist_ok=True)
            copied.append(path.name + "/")
    print(f"wrote {out} (a transformers folder, from {source}): {', '.join(copied)}")
    return 0


def _into_pipeline(source: Path, pipeline: Path, out: Path) -> int:
    """OUT as `pipeline` with the DiT / MMDiT of `source` as its transformer: the transformer
    written by `--to diffusers`, every other component copied; refused when the pipeline's
    transformer is of another class or shape (its config.json differs in a setting)."""
    import json
    import shutil

    from mmtrain.models.hub.pipeline import TRANSFORMER_DIR, is_pipeline_folder
    from mmtrain.train.export_hub_denoiser import copy_pipeline_components

    if not is_pipeline_folder(pipeline):
        raise UsageError(f"--pipeline {pipeline}: no model_index.json, not a pipeline folder")
    staged = out / TRANSFORMER_DIR
    if staged.exists():
        shutil.rmtree(staged)
    _to_diffusers(source, staged)
    theirs_file = pipeline / TRANSFORMER_DIR / "config.json"
    theirs = json.loads(theirs_file.read_text()) if theirs_file.is_file() else {}
    ours = json.loads((staged / "config.json").read_text())
    differ = sorted(k for k in ours if not k.startswith("_") and k in theirs and theirs[k] != ours[k])
    if ours.get("_class_name") != theirs.get("_class_name") or differ:
        shutil.rmtree(staged)
        what = (f"holds a {theirs.get('_class_name')}" if not differ
                else f"differs in {', '.join(differ)}")  # fmt: skip
        raise UsageError(
            f"--pipeline {pipeline}: its transformer {what}, {source} is a "
            f"{ours.get('_class_name')} of another shape: give the pipeline it was started from"
        )
    copy_pipeline_components(pipeline, out)
    print(f"wrote {out} (the pipeline {pipeline} with the transformer of {source})")
    return 0


def _copy_pipeline_folder(source: Path, out: Path) -> int:
    """A hub denoiser's run folder (train/export_hub_denoiser.py): model_index.json, every
    component folder and a LoRA run's adapter/, copied as they are (checkpoints, mmtrain's own
    files and any other folder left)."""
    import json
    import shutil

    from mmtrain.models.formats.peft_adapter import ADAPTER_DIR
    from mmtrain.models.hub.pipeline import PIPELINE_INDEX, TRANSFORMER_DIR

    if not (source / TRANSFORMER_DIR / "config.json").is_file():
        raise UsageError(f"{source}: no {TRANSFORMER_DIR}/config.json: the run has not finished")
    index = json.loads((source / PIPELINE_INDEX).read_text(encoding="utf-8"))
    parts = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)]
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / PIPELINE_INDEX, out / PIPELINE_INDEX)
    copied = [PIPELINE_INDEX]
    for name in [*parts, ADAPTER_DIR]:
        if (source / name).is_dir():
            shutil.copytree(source / name, out / name, dirs_exist_ok=True)
            copied.append(name + "/")
    print(f"wrote {out} (a diffusers pipeline folder, from {source}): {', '.join(copied)}")
    return 0


def _processor_files(source: Path, spec: ModelSpec):
    """The tokenizer, chat template, processor and generation files the export carries: a
    model folder's own, or for a run folder (config.yaml beside the weights) its own, else
    those of its `init` and `data.tokenizer` (hf_processor_files.py); the tokenizer checked
    against the model's vocabulary."""
    from mmtrain.folders import CONFIG_FILE
    from mmtrain.models.formats.hf import export_vocab_size
    from mmtrain.models.formats.hf_processor_files import (
        TOKENIZER_FILES,
        check_vocabulary,
        folder_processor_files,
        processor_files_of_run,
    )

    if (source / CONFIG_FILE).is_file():
        extras = processor_files_of_run(source)
    else:
        extras = folder_processor_files(source)
    check_vocabulary(extras, export_vocab_size(spec))
    if spec.decoder is not None and not set(TOKENIZER_FILES) & set(extras.names()):
        extras.notes.append(
            f"no tokenizer in {source}, nor where its config.yaml says it started (init, "
            "data.tokenizer): transformers needs one beside the weights"
        )
    return extras


def _to_diffusers(source: Path, out: Path, pipeline: Path | None = None) -> int:
    from mmtrain.models.hub.pipeline import is_pipeline_folder

    if is_pipeline_folder(source):  # a hub denoiser's run folder is its pipeline already
        if pipeline is not None:
            raise UsageError(f"{source} is a pipeline folder already: --pipeline is not needed")
        return _copy_pipeline_folder(source, out)
    if pipeline is not None:
        return _into_pipeline(source, pipeline, out)
    from mmtrain.models.build import read_model_folder
    from mmtrain.models.formats.diffusers import DIT_CLASS, write_diffusers_dit
    from mmtrain.models.formats.diffusers_sd3 import SD3_CLASS
    from mmtrain.models.formats.hf_common import NoHFCounterpart
    from mmtrain.models.formats.keys import CheckpointMismatch

    spec, weights = read_model_folder(source)  # read one tensor at a time
    with weights:
        try:
            write_diffusers_dit(spec, weights, out)
        except (NoHFCounterpart, CheckpointMismatch) as err:
            raise UsageError(f"{source}: {err}") from None
    mmdit = spec.denoiser is not None and spec.denoiser.is_mmdit()
    print(f"wrote {out} ({SD3_CLASS if mmdit else DIT_CLASS} for diffusers, from {source})")
    return 0


def _from_openclip(source: Path, model_arg: str | None, out: Path) -> int:
    from mmtrain.models.build import save_model
    from mmtrain.models.formats.keys import CheckpointMismatch
    from mmtrain.models.formats.openclip import model_from_openclip, read_openclip_checkpoint

    if model_arg is None:
        raise UsageError(
            "--from openclip needs --model: the OpenCLIP model the checkpoint belongs to "
            "(a preset such as ViT-B-32, or a spec YAML)"
        )
    spec = _clip_spec(model_arg)
    try:
        state = read_openclip_checkpoint(source)
    except ValueError as err:  # its message names the file
        raise UsageError(str(err)) from None
    try:
        model = model_from_openclip(state, spec)
    except CheckpointMismatch as err:
        raise UsageError(f"{source}: {err}") from None
    save_model(model, out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({spec.name}, {params:,} parameters from {source})")
    return 0


def _to_openclip(source: Path, model_arg: str | None, out: Path) -> int:
    from mmtrain.models.build import load_model
    from mmtrain.models.formats.keys import CheckpointMismatch
    from mmtrain.models.formats.openclip import (
        OPENCLIP_SUFFIXES,
        IncompatibleSpec,
        clip_towers,
        mmtrain_to_openclip,
        openclip_differences,
        write_state_dict,
    )

    if out.suffix not in OPENCLIP_SUFFIXES:
        raise UsageError(f"--out {out}: name the OpenCLIP file FILE.safetensors or FILE.pt")
    model = load_model(source)
    spec: ModelSpec = model.spec
    try:
        clip_towers(spec)
    except IncompatibleSpec as err:
        raise UsageError(f"{source}: {err}") from None
    if model_arg is not None:
        diffs = openclip_differences(spec, _clip_spec(model_arg))
        if diffs:
            raise UsageError(
                f"{source} holds model {spec.name!r}, which is not OpenCLIP's --model {model_arg} "
                "(left: the folder, right: --model):\n  " + "\n  ".join(diffs)
            )
    try:
        state = mmtrain_to_openclip(model.state_dict(), spec)
    except CheckpointMismatch as err:
        raise UsageError(f"{source}: {err}") from None
    write_state_dict(state, out)
    print(f"wrote {out} ({spec.name}, {len(state)} tensors in OpenCLIP's names, from {source})")
    return 0


def _clip_spec(model_arg: str) -> ModelSpec:
    from mmtrain.models.formats.openclip import IncompatibleSpec, clip_towers

    spec = load_spec(model_arg)
    try:
        clip_towers(spec)
    except IncompatibleSpec as err:
        raise UsageError(f"--model {model_arg}: {err}") from None
    return spec
