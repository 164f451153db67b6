"""Checking a state dict against the keys and shapes a mapping expects, shared by every format.

A state dict with an unknown, a missing or a mis-shaped key is rejected with one
`CheckpointMismatch` listing all of them, so a user who picked the wrong model sees the whole
picture at once instead of fixing keys one run at a time.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

Shape = tuple[int, ...]


class CheckpointMismatch(ValueError):
    """A state dict does not fit the model spec: lists every missing, unknown and mis-shaped key."""

    def __init__(
        self,
        what: str,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[str],
        hint: str,
    ):
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
        lines = [f"{what} ({len(missing) + len(unexpected) + len(mismatched)} problems):"]
        lines += [f"  missing key: {k}" for k in missing]
        lines += [f"  unexpected key: {k}" for k in unexpected]
        lines += [f"  wrong shape: {k}" for k in mismatched]
        lines.append(hint)
        super().__init__("\n".join(lines))


def check_keys(
    state: Mapping[str, Tensor], expected: Mapping[str, Shape], what: str, hint: str
) -> None:
    """Raise one CheckpointMismatch (`what`, then every problem, then `hint`) unless `state`
    has exactly the keys of `expected`, each a tensor of its shape (meta tensors will do)."""
    missing = [f"{k} {list(s)}" for k, s in expected.items() if k not in state]
    unexpected = [f"{k} {_describe(v)}" for k, v in state.items() if k not in expected]
    mismatched = [
        f"{k} is {_describe(state[k])}, expected {list(s)}"
        for k, s in expected.items()
        if k in state and (not isinstance(state[k], Tensor) or tuple(state[k].shape) != s)
    ]
    if missing or unexpected or mismatched:
        raise CheckpointMismatch(what, missing, unexpected, mismatched, hint)


def _describe(value: object) -> str:
    return (
        str(list(value.shape))
        if isinstance(value, Tensor)
        else f"({type(value).__name__}, not a tensor)"
    )
