"""Multimodal chat data -> one normalised `Conversation`, or a reason to reject the record.

Two input formats, both a JSON list (`.json`) or one record per line (`.jsonl`):

- LLaVA: `{"id": ..., "image": "a.jpg" (or a list, or absent for text-only),
  "conversations": [{"from": "human" | "gpt" | "system", "value": "<image>\\n..."}]}`
- ShareGPT "messages", as LLaMA-Factory and ms-swift write it: `{"messages": [{"role":
  "user" | "assistant" | "system", "content": "..."}], "images": [...]}`, with an optional
  top-level `"system"` string.

Videos come the same way: LLaVA's `video` (a path or a list), ShareGPT's `videos`, each
referred to by one `<video>` tag; images and videos may be interleaved in any order.

Both become `Conversation(key, turns, images, videos)` with roles `system`, `user`,
`assistant`. Each image is referred to by exactly one `<image>` tag in the text (the model
splices the image there), so the number of tags must equal the number of images (and of
`<video>` tags the number of videos). Roles must alternate user/assistant, a system
turn may only come first, the conversation must end with a non-empty assistant turn (an answer is
what a sample trains on; a sample without one would train on nothing).

A record that breaks a rule raises `ConversationError`, which names the file, the record index and
its id, and carries a short `kind` and a `reason` for `rejects.jsonl`; one bad record never stops
reading the file (`scan_conversations` yields it in place). Text is kept exactly as written: chat
templates are whitespace-sensitive, so nothing is stripped or normalised here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from mmtrain.structured import FieldError

__all__ = [
    "IMAGE_TAG",
    "VIDEO_TAG",
    "ROLES",
    "Turn",
    "Conversation",
    "ConversationError",
    "parse_conversation",
    "scan_conversations",
    "read_conversations",
]

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
ROLES = ("system", "user", "assistant")
# Speaker names of both formats (and of common ShareGPT variants) -> our roles.
_ROLE_NAMES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


@dataclass(frozen=True)
class Turn:
    """One message: `role` is system, user or assistant; `text` holds `<image>` tags inline."""

    role: str
    text: str


@dataclass
class Conversation:
    """A normalised chat sample: turns in order, the image paths (one per `<image>` tag) and
    the video paths (one per `<video>` tag), each list in the order of its tags."""

    key: str
    turns: list[Turn]
    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)


class ConversationError(FieldError):
    """A record that cannot be trained on. `kind` is a short category (format, roles,
    empty_turn, image_count, image_tag, json), `reason` says what is wrong and where in the
    record; `origin` is `file[index]` (JSON list) or `file:line` (JSONL)."""

    def __init__(self, file: str, index: int, key: str | None, kind: str, reason: str, origin: str):
        self.file, self.index, self.key = file, index, key
        self.kind, self.reason, self.origin = kind, reason, origin
        where = f"{file} record {index}" + (f" (id {key!r})" if key is not None else "")
        super().__init__(where, reason)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields, so it can cross a process boundary (build workers).
        fields = (self.file, self.index, self.key, self.kind, self.reason, self.origin)
        return (type(self), fields)

    def as_reject(self) -> dict[str, Any]:
        """A `rejects.jsonl` line, in the fields `mmtrain data build` writes (plus the key)."""
        return {
            "index": self.index,
            "path": self.origin,
            "key": self.key,
            "kind": self.kind,
            "reason": self.reason,
        }


class _Invalid(Exception):
    """Raised inside parsing with (kind, reason); `parse_conversation` adds file and index."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


# ----------------------------------------------------------------------------- one record
def parse_conversation(
    record: Any, *, file: str = "<record>", index: int = 0, origin: str | None = None
) -> Conversation:
    """Normalise and validate one record of either format; raise `ConversationError`."""
    key = _key(record, index)
    try:
        if not isinstance(record, dict):
            raise _Invalid("format", f"expected a JSON object, got {type(record).__name__}")
        turns = _turns(record)
        images = _paths(record, "image", "images")
        videos = _paths(record, "video", "videos")
        _check_roles(turns)
        _check_texts(turns)
        _check_count(turns, images, IMAGE_TAG, "image")
        _check_count(turns, videos, VIDEO_TAG, "video")
    except _Invalid as err:
        where = origin or f"{Path(file).name}[{index}]"
        raise ConversationError(file, index, key, err.kind, err.reason, where) from None
    return Conversation(key, [turn for _, turn in turns], images, videos)


def _key(record: Any, index: int) -> str:
    """The record's `id` (LLaVA, some ShareGPT dumps), else its position in the file."""
    if isinstance(record, dict) and isinstance(record.get("id"), (str, int)):
        return str(record["id"])
    return str(index)


def _turns(record: dict[str, Any]) -> list[tuple[str, Turn]]:
    """(field path, Turn) pairs; the field path names the spot in the record for errors."""
    if "conversations" in record and "messages" in record:
        raise _Invalid("format", "has both 'conversations' and 'messages'; keep one")
    if "conversations" in record:
        field_name, role_key, text_key = "conversations", "from", "value"
    elif "messages" in record:
        field_name, role_key, text_key = "messages", "role", "content"
    else:
        raise _Invalid("format", "no 'conversations' (LLaVA) or 'messages' (ShareGPT) list")
    raw = record[field_name]
    if not isinstance(raw, list) or not raw:
        raise _Invalid("format", f"'{field_name}' must be a non-empty list")
    turns = [_turn(item, f"{field_name}[{i}]", role_key, text_key) for i, item in enumerate(raw)]
    system = record.get("system")
    if system is not None:  # LLaMA-Factory's top-level system prompt
        if not isinstance(system, str):
            raise _Invalid("format", "'system' must be a string")
        if turns[0][1].role == "system":
            raise _Invalid("format", f"both 'system' and a system turn in '{field_name}'")
        turns.insert(0, ("system", Turn("system", system)))
    return turns


def _turn(item: Any, where: str, role_key: str, text_key: str) -> tuple[str, Turn]:
    if not isinstance(item, dict):
        raise _Invalid("format", f"{where}: expected an object with '{role_key}' and '{text_key}'")
    name, text = item.get(role_key), item.get(text_key)
    role = _ROLE_NAMES.get(name) if isinstance(name, str) else None
    if role is None:
        known = ", ".join(sorted(_ROLE_NAMES))
        raise _Invalid("format", f"{where}.{role_key}: {name!r} is not a known role ({known})")
    if not isinstance(text, str):
        # Content given as a list of typed parts (OpenAI style) is not read: say so plainly.
        raise _Invalid(
            "format", f"{where}.{text_key}: expected a string, got {type(text).__name__}"
        )
    return where, Turn(role, text)


def _paths(record: dict[str, Any], single: str, plural: str) -> list[str]:
    """LLaVA's `image` / `video` (a path or a list) or ShareGPT's `images` / `videos`;
    absent means none."""
    if single in record and plural in record:
        raise _Invalid("format", f"has both '{single}' and '{plural}'; keep one")
    name = single if single in record else plural
    value = record.get(name)
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list):
        raise _Invalid("format", f"'{name}' must be a path or a list of paths")
    for i, path in enumerate(paths):
        if not isinstance(path, str) or not path.strip():
            raise _Invalid("format", f"'{name}'[{i}]: expected a non-empty path, got {path!r}")
    return list(paths)


def _check_roles(turns: list[tuple[str, Turn]]) -> None:
    """Optional system first, then user, assistant, user, ... ending with assistant."""
    body = turns[1:] if turns[0][1].role == "system" else turns
    if not body:
        raise _Invalid("roles", "only a system turn; a sample needs a user and an assistant turn")
    for i, (where, turn) in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if turn.role != expected:
            detail = "system only first" if turn.role == "system" else "roles must alternate"
            article = "an" if expected == "assistant" else "a"
            raise _Invalid(
                "roles", f"{where}: expected {article} {expected} turn, got {turn.role} ({detail})"
            )
    if body[-1][1].role != "assistant":
        raise _Invalid(
            "roles",
            f"{body[-1][0]}: ends with a user turn, which no answer follows (nothing to train on)",
        )


def _check_texts(turns: list[tuple[str, Turn]]) -> None:
    for where, turn in turns:
        if turn.role != "assistant":
            continue
        if not turn.text.strip():
            raise _Invalid("empty_turn", f"{where}: empty assistant turn (no target to learn)")
        for tag, kind in ((IMAGE_TAG, "image"), (VIDEO_TAG, "video")):
            if tag in turn.text:
                # The placeholder would become a label the model cannot predict.
                raise _Invalid(f"{kind}_tag", f"{where}: {tag} in an assistant turn")


def _check_count(turns: list[tuple[str, Turn]], paths: list[str], tag: str, kind: str) -> None:
    tags = sum(turn.text.count(tag) for _, turn in turns)
    if tags != len(paths):
        raise _Invalid(
            f"{kind}_count",
            f"{tags} {tag} tag(s) in the text but {len(paths)} {kind}(s); each {kind} needs "
            f"exactly one {tag} where it goes",
        )


# ----------------------------------------------------------------------------- files
def scan_conversations(path: str | Path) -> Iterator[Conversation | ConversationError]:
    """Each record of a `.json` list or a `.jsonl` file, in order: a `Conversation`, or the
    `ConversationError` that rejects it (returned, not raised, so a build can log and go on).

    A file that cannot be read at all (missing, not JSON, not a list) raises `FieldError` here,
    before the first record.
    """
    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        return _scan_jsonl(path, _open_text(path))
    records = _load_json_list(path)
    return (
        _parse_or_error(record, str(path), index, f"{path.name}[{index}]")
        for index, record in enumerate(records)
    )


def read_conversations(path: str | Path) -> list[Conversation]:
    """All records of a file, raising the first `ConversationError` (for small, curated sets)."""
    conversations = []
    for item in scan_conversations(path):
        if isinstance(item, ConversationError):
            raise item
        conversations.append(item)
    return conversations


def _parse_or_error(
    record: Any, file: str, index: int, origin: str
) -> Conversation | ConversationError:
    try:
        return parse_conversation(record, file=file, index=index, origin=origin)
    except ConversationError as err:
        return err


def _load_json_list(path: Path) -> list[Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise FieldError(str(path), f"cannot read: {err.strerror or err}") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise FieldError(str(path), f"not valid JSON: {err}") from None
    if not isinstance(data, list):
        raise FieldError(
            str(path),
            f"expected a JSON list of records, got {type(data).__name__} (use .jsonl "
            "for one record per line)",
        )
    return data


def _open_text(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")  # bytes: a line of bad UTF-8 is one reject, not a crash
    except OSError as err:
        raise FieldError(str(path), f"cannot read: {err.strerror or err}") from None


def _scan_jsonl(path: Path, f: BinaryIO) -> Iterator[Conversation | ConversationError]:
    with f:
        index = 0
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines are not records (and do not shift record indices)
            origin = f"{path.name}:{line_number}"
            try:
                record = json.loads(line)  # UTF-8 bytes; a decoding error is a ValueError
            except ValueError as err:
                yield ConversationError(
                    str(path), index, None, "json", f"line {line_number}: {err}", origin
                )
            else:
                yield _parse_or_error(record, str(path), index, origin)
            index += 1
