"""A sample's label: its `.cls` member (WebDataset's convention: a number, a list of numbers
or a class name) or else a field of its `.json` member, and the class id it stands for.

Anything missing or out of range raises `MediaError`, which the streaming loader counts as a
corrupt sample and skips.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmtrain.data.stream.media import MediaError, decode_text


def label_value(sample: Mapping[str, Any], label_field: str = "label") -> Any:
    """The `.cls` member, parsed as JSON when it is ("3", "0.5", "[0.1, 2]"), else the text (a
    class name); without one, field `label_field` of the `.json` member."""
    if "cls" in sample:
        text = decode_text(sample["cls"], what="label").strip()
        try:
            return json.loads(text)
        except ValueError:
            return text
    if "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except ValueError as err:
            raise MediaError(f"json member is not valid JSON: {err}") from None
        if not isinstance(meta, dict) or label_field not in meta:
            raise MediaError(f"no .cls member and the json member has no field {label_field!r}")
        return meta[label_field]
    raise MediaError(f"no label: neither a .cls member nor a .json with {label_field!r}")


def class_index(
    value: Any, classes: int, class_names: Sequence[str] = (), what: str = "the model's"
) -> int:
    """The class id in [0, classes) of a label value: an integer, or a name of `class_names`;
    `what` names whose classes they are in the error ("the fusion head's")."""
    if isinstance(value, str):
        if value not in class_names:
            raise MediaError(f"label {value!r} is not one of data.class_names")
        return list(class_names).index(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MediaError(f"label {value!r} is not an integer class or a class name")
    if not 0 <= value < classes:
        raise MediaError(f"label {value} is outside {what} {classes} classes")
    return value


def read_class(
    sample: Mapping[str, Any],
    classes: int,
    label_field: str = "label",
    class_names: Sequence[str] = (),
    what: str = "the model's",
) -> torch.Tensor:
    """The sample's class id as an int64 scalar."""
    value = label_value(sample, label_field)
    return torch.tensor(class_index(value, classes, class_names, what), dtype=torch.long)
