"""Zero-shot classification: classify embeddings by their nearest class-name embedding.

Each class name is written into every prompt template ("a photo of a {}."); the text tower
embeds the prompts; a class's embedding is the mean of its normalised prompt embeddings,
normalised again (averaging over phrasings makes the classifier less sensitive to any one
wording). A sample is correct at K when its label's embedding ranks among the K best, with the
tie rule of `mmtrain.eval.retrieval` (a lower class index wins a tie), so the result never
depends on `topk`'s handling of equal scores.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from mmtrain.eval.retrieval import DEFAULT_CHUNK_ELEMENTS, check_finite, distributed_ranks
from mmtrain.structured import FieldError

# A few generic phrasings; a user with a domain (satellite images, sketches) passes their own.
DEFAULT_TEMPLATES = (
    "{}",
    "a photo of a {}.",
    "a picture of the {}.",
    "an image showing a {}.",
    "a close-up photo of a {}.",
    "a drawing of a {}.",
)

__all__ = [
    "DEFAULT_TEMPLATES",
    "prompts",
    "class_embeddings",
    "zeroshot_metrics",
    "read_class_names",
    "read_templates",
]


def prompts(class_name: str, templates: Sequence[str]) -> list[str]:
    """The prompts of one class: each template with `{}` replaced by the class name."""
    return [t.replace("{}", class_name) for t in templates]


def class_embeddings(
    embed_texts: Callable[[list[str]], torch.Tensor],
    class_names: Sequence[str],
    templates: Sequence[str] = DEFAULT_TEMPLATES,
) -> torch.Tensor:
    """float32 [C, D] unit vectors: per class, the renormalised mean of its normalised prompt
    embeddings. `embed_texts(list of str) -> [n, D]` runs the text tower (any batching)."""
    if not class_names:
        raise ValueError("no class names")
    if not templates:
        raise ValueError("no prompt templates")
    texts = [p for name in class_names for p in prompts(name, templates)]
    emb = F.normalize(embed_texts(texts).float(), dim=-1)
    emb = emb.view(len(class_names), len(templates), -1).mean(dim=1)
    return F.normalize(emb, dim=-1)


def zeroshot_metrics(
    features: torch.Tensor,
    labels: torch.Tensor,
    classes: torch.Tensor,
    ks: Sequence[int] = (1, 5),
    *,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> dict[str, float | int]:
    """`top1`, `top5` (fractions; one key per k in `ks`) and `n_samples`.

    features [N, D] sample embeddings, labels int64 [N] class indices, classes [C, D] class
    embeddings. Under torch.distributed every rank passes the same tensors and scores a share.
    """
    labels = labels.long().to(features.device)
    if labels.shape != (features.shape[0],):
        raise ValueError(f"labels {list(labels.shape)} do not fit features {list(features.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes.shape[0]):
        raise ValueError(
            f"labels must be class indices in 0..{classes.shape[0] - 1}, got "
            f"{int(labels.min())}..{int(labels.max())}"
        )
    check_finite(features, "zero-shot features")
    candidate_ids = torch.arange(classes.shape[0], device=features.device)
    ranks = distributed_ranks(
        features, classes.to(features), labels, candidate_ids, chunk_elements=chunk_elements
    )
    out: dict[str, float | int] = {f"top{k}": float((ranks < k).double().mean()) for k in ks}
    out["n_samples"] = int(labels.numel())
    return out


def read_class_names(path: str | Path) -> list[str]:
    """Class names from a text file (one per line, blank lines ignored) or a JSON list."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: class names file not found")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            names = json.loads(text)
        except json.JSONDecodeError as err:
            raise FieldError(str(path), f"not valid JSON: {err}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise FieldError(str(path), "expected a JSON list of class-name strings")
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise FieldError(str(path), "no class names in the file")
    return names


def read_templates(path: str | Path) -> list[str]:
    """Prompt templates, one per line, each with `{}` where the class name goes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: templates file not found")
    templates = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    templates = [t for t in templates if t]
    if not templates:
        raise FieldError(str(path), "no templates in the file")
    bad = [t for t in templates if "{}" not in t]
    if bad:
        raise FieldError(str(path), f"template {bad[0]!r} has no '{{}}' for the class name")
    return templates
