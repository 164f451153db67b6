"""`mmtrain generate RUN_DIR --image X.jpg --prompt "..."`: ask a (vision-)language model.

Loads the model (a model folder, a finished run, or a run's newest checkpoint), the tokenizer
and chat template the run trained with (its config.yaml: `data.tokenizer`,
`data.chat_template`; flags override them), renders the prompt as one user turn with the
template's generation prompt, and prints the answer. Each `--image` takes one `<image>` tag in
the prompt; a prompt without tags gets one per image in front of it, as LLaVA's data has them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mmtrain.cli import UsageError
from mmtrain.commands._args import count

ORDER = 45
IMAGE_TAG = (
    "<image>"  # mmtrain.data.stream.conversations.IMAGE_TAG (not imported: --help stays fast)
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="answer a prompt (about images) with a trained language or vision-language model",
        description=(
            "Generate an answer with the language model in RUN_DIR (or a model folder). Each "
            "--image fills one <image> tag of the prompt (a prompt without tags gets one per "
            "image in front). Greedy by default; --temperature > 0 samples (nucleus: --top-p). "
            "Exit code 2 on bad input."
        ),
    )
    p.add_argument(
        "model",
        metavar="RUN_DIR|MODEL_DIR|CHECKPOINT",
        help="a run folder, a model folder (model.safetensors + spec.yaml) or a checkpoint",
    )
    p.add_argument("--prompt", required=True, help="the user's message")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image (repeat for several, in the order of the prompt's <image> tags)",
    )
    p.add_argument("--system", help="system prompt (default: the template's own)")
    p.add_argument(
        "--max-new-tokens", type=count, default=128, help="answer length limit (default 128)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling"
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: all tokens)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument(
        "--tokenizer", help="tokenizer.json or its folder (default: the run's data.tokenizer)"
    )
    p.add_argument(
        "--chat-template",
        help="plain, chatml, llama-3, vicuna-v1 or a tokenizer_config.json / .jinja "
        "(default: the run's data.chat_template, else the tokenizer folder's)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from mmtrain.commands.eval import _load_model

    _check_numbers(args)
    images = [Path(p) for p in args.image]
    for path in images:
        if not path.is_file():
            raise UsageError(f"--image {path}: no such file")
    prompt = _prompt_with_tags(args.prompt, len(images))
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise UsageError(f"{model_dir}: not a folder (expected RUN_DIR or a model folder)")
    device = _device(args.device, torch)
    model, run_dir, _ = _load_model(model_dir, device)
    spec = model.spec
    if spec.decoder is None:
        raise UsageError(
            f"{model_dir}: {spec.name} is not a language model (it has no decoder); "
            "`mmtrain generate` needs an LM or a vision-language model"
        )
    if images and spec.projector is None:
        raise UsageError(f"{spec.name} is a text-only language model; it takes no --image")
    tokenizer, template = _tokenizer_and_template(args, run_dir, model_dir)
    answer = generate_answer(
        model,
        tokenizer,
        template,
        prompt,
        images,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(answer)
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be 0 or more, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")


def _prompt_with_tags(prompt: str, images: int) -> str:
    """The prompt with one <image> tag per image: added in front when it has none."""
    tags = prompt.count(IMAGE_TAG)
    if tags == 0:
        return IMAGE_TAG * images + ("\n" if images else "") + prompt
    if tags != images:
        raise UsageError(
            f"--prompt has {tags} {IMAGE_TAG} tag(s) but {images} --image given: give one image "
            f"per tag, or no tags to put the images in front of the prompt"
        )
    return prompt


def _device(name: str | None, torch: Any) -> Any:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise UsageError(f"--device {name!r}: {err}") from None


def _run_data_config(run_dir: Path) -> dict[str, Any]:
    """The `data` section of the run's config.yaml ({} without one)."""
    import yaml

    config = run_dir / "config.yaml"
    if not config.is_file():
        return {}
    try:
        data = (yaml.safe_load(config.read_text()) or {}).get("data")
    except (yaml.YAMLError, AttributeError) as err:
        raise UsageError(f"{config}: not a readable run config ({err})") from None
    return data if isinstance(data, dict) else {}


def _in_run(value: str, run_dir: Path) -> str:
    """A relative path from the run's config, resolved against the run folder when it exists
    there (the run may be read from another working directory)."""
    path = Path(value)
    if not path.is_absolute() and not path.exists() and (run_dir / path).exists():
        return str(run_dir / path)
    return value


def _tokenizer_and_template(args: argparse.Namespace, run_dir: Path, model_dir: Path) -> tuple:
    from mmtrain.data.stream.conversation_batches import resolve_chat_template
    from mmtrain.data.stream.tokenizer import get_tokenizer

    data = _run_data_config(run_dir)
    tokenizer = args.tokenizer or data.get("tokenizer")
    if tokenizer is None and (model_dir / "tokenizer.json").is_file():
        tokenizer = str(model_dir)  # a converted model folder keeps its tokenizer beside it
    if tokenizer is None:
        raise UsageError(
            f"{run_dir}: no config.yaml naming data.tokenizer and no tokenizer.json; "
            "give --tokenizer"
        )
    tokenizer = _in_run(str(tokenizer), run_dir)
    template = args.chat_template or data.get("chat_template")
    template = _in_run(str(template), run_dir) if template is not None else None
    return get_tokenizer(tokenizer, language_model=True), resolve_chat_template(template, tokenizer)


def generate_answer(
    model: Any,
    tokenizer: Any,
    template: Any,
    prompt: str,
    images: list[Path],
    *,
    system: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> str:
    """The model's answer to one user turn `prompt` (its <image> tags matching `images`)."""
    import torch

    from mmtrain.data.stream.chat_templates import encode_segments
    from mmtrain.data.stream.conversations import Conversation, Turn
    from mmtrain.data.stream.media import MediaError
    from mmtrain.data.stream.transforms import ImageTransform
    from mmtrain.eval.generation import prompt_and_reference, stop_ids

    spec = model.spec
    turns = [Turn("system", system)] if system is not None else []
    # A stand-in answer: the segments before it are the prompt with the generation prompt,
    # found the same way for named and Jinja templates (eval.generation).
    turns += [Turn("user", prompt), Turn("assistant", "answer")]
    segments, _ = prompt_and_reference(
        Conversation("prompt", turns, list(map(str, images))), template
    )
    image_token_id = spec.projector.image_token_id if spec.projector is not None else -1
    ids = encode_segments(segments, tokenizer, image_token_id).input_ids
    param = next(model.parameters())
    batch = {"text": torch.tensor([ids], dtype=torch.long, device=param.device)}
    if spec.projector is not None:
        transform = ImageTransform.from_stem(spec.towers[spec.projector.tower].stem, False)
        pixels = []
        for path in images:
            try:
                pixels.append(transform.decode(path.read_bytes()))
            except (MediaError, OSError, ValueError) as err:
                raise UsageError(f"--image {path}: cannot be read as an image ({err})") from None
        size, channels = transform.size, transform.channels
        stacked = torch.stack(pixels) if pixels else torch.zeros(0, channels, size, size)
        batch["image"] = stacked.to(param.device, param.dtype)
    stops = stop_ids(template, tokenizer, spec.decoder.eos_ids)
    generator = torch.Generator(param.device).manual_seed(seed)
    model.eval()
    new = model.generate(
        batch,
        max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        generator=generator,
        eos_ids=stops,
    )[0].tolist()
    end = next((i for i, token in enumerate(new) if token in stops), len(new))
    return tokenizer.decode(new[:end]).strip()
