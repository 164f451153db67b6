"""Typed dataclasses from plain dicts (YAML/JSON), with errors that name the field.

Used by the model description (`spec.py`) and the run config: one place decides what a
wrong key or a wrong type looks like to the user.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class FieldError(ValueError):
    """A config or spec value is wrong; `path` is the dotted field name (e.g. `towers.image.width`)."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def closest(name: str, choices: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest valid name, or '' when nothing is close."""
    by_lower = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.5)
    return f" (did you mean {by_lower[match[0]]!r}?)" if match else ""


def check_choice(path: str, value: str, allowed: typing.Sequence[str]) -> None:
    if value not in allowed:
        raise FieldError(
            path, f"{value!r} is not one of {', '.join(allowed)}{closest(str(value), allowed)}"
        )


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from `data`, converting nested dataclasses, lists, tuples and dicts.

    Unknown keys and wrong types raise FieldError naming the dotted path of the field.
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise FieldError(path, f"expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in known:
            raise FieldError(
                sub, f"unknown key{closest(str(key), known)}; valid keys: {', '.join(known)}"
            )
        kwargs[key] = convert(hints[key], value, sub)
    missing = [
        name
        for name, f in known.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = f"{path}." if path else ""
        raise FieldError(path, f"missing required key(s): {', '.join(where + m for m in missing)}")
    try:
        return cls(**kwargs)
    except FieldError as err:
        # __post_init__ validates without knowing where the dataclass sits in a file: add it.
        if not path or err.path == path or err.path.startswith(f"{path}."):
            raise
        raise FieldError(f"{path}.{err.path}", err.message) from None


def convert(tp: Any, value: Any, path: str) -> Any:
    """Convert `value` to type `tp` (a type hint), or raise FieldError naming `path`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(arg, value, path)
            except FieldError as err:
                errors.append(str(err))
        raise FieldError(path, f"{value!r} does not match {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise FieldError(path, f"expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise FieldError(path, f"expected {len(args)} items, got {len(value)}")
            return tuple(
                convert(a, v, f"{path}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            )
        item = args[0] if args else Any
        items = [convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise FieldError(path, f"expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {convert(kt, k, path): convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise FieldError(path, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise FieldError(path, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise FieldError(path, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise FieldError(path, f"expected a string, got {value!r}")
    return value


def to_dict(obj: Any) -> Any:
    """Plain dicts/lists of a dataclass tree, tuples as lists (YAML- and JSON-friendly)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
