"""Multimodal chat data -> one normalised `Conversation`, or a reason to reject the record.

Three input formats, each a JSON list (`.json`), one record per line (`.jsonl`) or, through
`scan_records`, the rows of a table (parquet):

- LLaVA: `{"id": ..., "image": "a.jpg" (or a list, or absent for text-only),
  "conversations": [{"from": "human" | "gpt" | "system", "value": "<image>\\n..."}]}`
- ShareGPT "messages", as LLaMA-Factory and ms-swift write it: `{"messages": [{"role":
  "user" | "assistant" | "system", "content": "..."}], "images": [...]}`, with an optional
  top-level `"system"` string.
- Hugging Face / TRL: the same `messages`, with a `content` that is a list of typed parts,
  `[{"type": "image"}, {"type": "text", "text": "..."}]`, as processors' chat templates and
  TRL's trainers take it; or TRL's conversational `{"prompt": [messages], "completion":
  [messages]}` (the prompt's turns, then the completion's). Each `image` / `video` part is
  the placeholder at its place in the text, the same `<image>` / `<video>` a LLaVA tag is;
  the parts are joined as written, with no separator. The files come from the record's
  `images` / `videos` list in order, or each part names its own local file in `image` (or
  `video`), `path` or `url` (every part of a record, or none). Remote URLs and base64 data are
  refused: a build reads local files. A content may also be a plain string, turn by turn.

Videos come the same way: LLaVA's `video` (a path or a list), ShareGPT's `videos`, each
referred to by one `<video>` tag; images and videos may be interleaved in any order.

Preference pairs (DPO, `train.objective: dpo`) come in the same formats with a `chosen` and a
`rejected` answer to the same prompt: TRL's standard `{"prompt": "...", "chosen": "...",
"rejected": "...", "images": [...]}`, its conversational form (`prompt` a list of messages,
`chosen` / `rejected` each a list of one assistant message), or LLaVA / ShareGPT turns that end
with the user's turn plus `chosen` / `rejected` strings (RLAIF-V, LLaVA-RLHF). The prompt's
turns become the conversation's turns and each answer the assistant's last turn of its side;
a pair whose answers are equal (nothing to prefer), or with an empty side, is refused.

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
from collections.abc import Iterable, Iterator
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
    "scan_records",
    "read_conversations",
]

PAIR = ("chosen", "rejected")  # a preference record's answers
IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
ROLES = ("system", "user", "assistant")
_TAGS = {"image": IMAGE_TAG, "video": VIDEO_TAG}
_LISTS = {"image": "images", "video": "videos"}  # the record's list of each modality's files
# Where a typed part may name its own file (the keys transformers' processors read for local
# files); `base64` is the one more they read, refused below.
_INLINE_KEYS = {"image": ("image", "path", "url"), "video": ("video", "path", "url")}
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
    # A preference pair: `turns` is the prompt (ending with the user's turn), these the two
    # answers to it.
    chosen: str | None = None
    rejected: str | None = None

    def is_preference(self) -> bool:
        return self.chosen is not None

    def answered(self, answer: str) -> Conversation:
        """The prompt with `answer` as the assistant's last turn (one side of a pair)."""
        return Conversation(self.key, [*self.turns, Turn("assistant", answer)], self.images,
                            self.videos)  # fmt: skip


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


@dataclass(frozen=True)
class _Placeholder:
    """An `image` or `video` part: where it is in the record, and its inline file (or None)."""

    modality: str
    where: str
    path: str | None


@dataclass(frozen=True)
class _Message:
    where: str  # the field path in the record, for errors ("messages[2]")
    turn: Turn
    placeholders: tuple[_Placeholder, ...] = ()  # of typed parts, in order


# ----------------------------------------------------------------------------- one record
def parse_conversation(
    record: Any, *, file: str = "<record>", index: int = 0, origin: str | None = None
) -> Conversation:
    """Normalise and validate one record of any format; raise `ConversationError`."""
    key = _key(record, index)
    try:
        if not isinstance(record, dict):
            raise _Invalid("format", f"expected a JSON object, got {type(record).__name__}")
        pair = _preference(record)
        messages = _messages(record, preference=pair is not None)
        turns = [(message.where, message.turn) for message in messages]
        images = _files(record, messages, "image")
        videos = _files(record, messages, "video")
        answers = [] if pair is None else [
            (name, Turn("assistant", text)) for name, text in zip(PAIR, pair, strict=True)
        ]
        if pair is not None and turns[-1][1].role == "assistant":
            raise _Invalid("roles", f"{turns[-1][0]}: a preference prompt ends with the user's "
                           "turn; the answers to it are 'chosen' and 'rejected'")  # fmt: skip
        _check_roles(turns + answers[:1])
        _check_texts(turns + answers)
        if pair is not None and pair[0] == pair[1]:
            raise _Invalid("equal_answers", "'chosen' and 'rejected' are the same answer: the "
                           "pair prefers nothing")  # fmt: skip
        _check_count(record, messages, images, "image")
        _check_count(record, messages, videos, "video")
    except _Invalid as err:
        where = origin or f"{Path(file).name}[{index}]"
        raise ConversationError(file, index, key, err.kind, err.reason, where) from None
    chosen, rejected = pair or (None, None)
    return Conversation(key, [turn for _, turn in turns], images, videos, chosen, rejected)


def _preference(record: Any) -> tuple[str, str] | None:
    """(chosen, rejected) answers of a preference record; None for a plain conversation."""
    if not isinstance(record, dict):
        return None
    given = [name for name in PAIR if name in record]
    if not given:
        return None
    if len(given) == 1:
        other = PAIR[1 - PAIR.index(given[0])]
        raise _Invalid("format", f"'{given[0]}' without '{other}': a preference pair needs both")
    if "completion" in record:
        raise _Invalid("format", "has 'completion' beside 'chosen' / 'rejected'; keep the pair")
    return _answer(record["chosen"], "chosen"), _answer(record["rejected"], "rejected")


def _answer(value: Any, name: str) -> str:
    """One side's answer: a string, or TRL's conversational list of one assistant message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1:
        message = _message(value[0], f"{name}[0]", "role", "content")
        if message.turn.role != "assistant":
            raise _Invalid("roles", f"{name}[0]: expected the assistant's answer, got "
                           f"{message.turn.role}")  # fmt: skip
        return message.turn.text
    raise _Invalid(
        "format",
        f"'{name}': expected the answer as a string or a list of one assistant message (with "
        "the shared prompt in 'prompt' or the turns; TRL's implicit-prompt form, whole "
        "conversations per side, is not read)",
    )


def _key(record: Any, index: int) -> str:
    """The record's `id` (LLaVA, some ShareGPT dumps), else its position in the file."""
    if isinstance(record, dict) and isinstance(record.get("id"), (str, int)):
        return str(record["id"])
    return str(index)


def _messages(record: dict[str, Any], preference: bool = False) -> list[_Message]:
    """The record's turns in order, with the optional top-level system prompt first (a
    preference record's prompt may be TRL's plain string: one user turn)."""
    if preference and isinstance(record.get("prompt"), str):
        lists, messages = [], [_Message("prompt", Turn("user", record["prompt"]))]
    else:
        lists = _message_lists(record, preference)
        messages = []
    messages += [
        _message(item, f"{name}[{i}]", role_key, text_key)
        for name, role_key, text_key in lists
        for i, item in enumerate(record[name])
    ]
    system = record.get("system")
    if system is not None:  # LLaMA-Factory's top-level system prompt
        if not isinstance(system, str):
            raise _Invalid("format", "'system' must be a string")
        if messages[0].turn.role == "system":
            first = lists[0][0] if lists else "prompt"
            raise _Invalid("format", f"both 'system' and a system turn in '{first}'")
        messages.insert(0, _Message("system", Turn("system", system)))
    return messages


def _message_lists(record: dict[str, Any], preference: bool = False) -> list[tuple[str, str, str]]:
    """(field, role key, text key) of each list of turns the record's format holds (of a
    preference record: the prompt's turns, `prompt` needing no `completion`)."""
    formats = [name for name in ("conversations", "messages", "prompt") if name in record]
    if "completion" in record and "prompt" not in record:
        raise _Invalid("format", "'completion' without 'prompt' (TRL's prompt / completion)")
    if len(formats) > 1:
        raise _Invalid("format", f"has both '{formats[0]}' and '{formats[1]}'; keep one")
    if not formats:
        raise _Invalid(
            "format",
            "no 'conversations' (LLaVA), 'messages' (ShareGPT, Hugging Face) or 'prompt' + "
            "'completion' (TRL) list",
        )
    if formats[0] == "conversations":
        lists = [("conversations", "from", "value")]
    elif formats[0] == "messages":
        lists = [("messages", "role", "content")]
    elif preference:
        lists = [("prompt", "role", "content")]
    else:
        if "completion" not in record:
            raise _Invalid("format", "'prompt' without 'completion' (TRL's prompt / completion)")
        lists = [("prompt", "role", "content"), ("completion", "role", "content")]
    for name, _, _ in lists:
        raw = record[name]
        if isinstance(raw, str) and name in ("prompt", "completion"):
            raise _Invalid(
                "format",
                f"'{name}' is a string (TRL's standard form): without roles there is no chat "
                "to template; give 'prompt' and 'completion' as lists of messages",
            )
        if not isinstance(raw, list) or not raw:
            raise _Invalid("format", f"'{name}' must be a non-empty list")
    return lists


def _message(item: Any, where: str, role_key: str, text_key: str) -> _Message:
    if not isinstance(item, dict):
        raise _Invalid("format", f"{where}: expected an object with '{role_key}' and '{text_key}'")
    name, text = item.get(role_key), item.get(text_key)
    role = _ROLE_NAMES.get(name) if isinstance(name, str) else None
    if role is None:
        known = ", ".join(sorted(_ROLE_NAMES))
        raise _Invalid("format", f"{where}.{role_key}: {name!r} is not a known role ({known})")
    if isinstance(text, str):
        return _Message(where, Turn(role, text))
    if text_key == "content" and isinstance(text, list):
        joined, placeholders = _typed_parts(text, f"{where}.{text_key}")
        return _Message(where, Turn(role, joined), placeholders)
    wanted = "a string or a list of typed parts" if text_key == "content" else "a string"
    raise _Invalid("format", f"{where}.{text_key}: expected {wanted}, got {type(text).__name__}")


def _typed_parts(parts: list[Any], where: str) -> tuple[str, tuple[_Placeholder, ...]]:
    """Hugging Face content parts -> the text with a tag at each image / video part, and those
    parts in order."""
    pieces, placeholders = [], []
    for i, part in enumerate(parts):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise _Invalid(
                "format",
                f"{at}: expected a part object with a 'type' (text, image, video), got "
                f"{type(part).__name__}",
            )
        kind = part.get("type")
        if kind == "text":
            pieces.append(_text_part(part, at))
        elif kind in _TAGS:
            pieces.append(_TAGS[kind])
            placeholders.append(_Placeholder(kind, at, _inline_file(part, kind, at)))
        else:
            raise _Invalid(
                "format", f"{at}.type: {kind!r} is not a part type this reads (text, image, video)"
            )
    return "".join(pieces), tuple(placeholders)


def _text_part(part: dict[str, Any], at: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise _Invalid("format", f"{at}.text: expected a string, got {type(text).__name__}")
    for tag in _TAGS.values():
        if tag in text:
            # A tag in a part's text would be one more placeholder than the parts say.
            raise _Invalid(
                "format",
                f"{at}.text: holds {tag}; in a list of parts each image or video is a part of "
                "its own",
            )
    return text


def _inline_file(part: dict[str, Any], kind: str, at: str) -> str | None:
    """The local file an image / video part names itself, or None (taken from the list).
    Absent keys may be null: Arrow gives every part of a column every part's fields."""
    if part.get("base64") is not None:
        raise _Invalid(
            "format",
            f"{at}.base64: embedded {kind} data is not read; write it to a file and give its path",
        )
    named = [key for key in _INLINE_KEYS[kind] if part.get(key) is not None]
    if not named:
        return None
    if len(named) > 1:
        raise _Invalid("format", f"{at}: the file is named twice ({', '.join(named)}); keep one")
    value = part[named[0]]
    if isinstance(value, dict) and value.get("bytes") is not None:  # a datasets Image feature
        raise _Invalid(
            "format",
            f"{at}.{named[0]}: {kind} bytes inside the record are not read; save the file and "
            "give its path",
        )
    if not isinstance(value, str) or not value.strip():
        shown = repr(value) if isinstance(value, str) else type(value).__name__
        raise _Invalid("format", f"{at}.{named[0]}: expected a file path, got {shown}")
    if "://" in value or value.startswith("data:"):
        raise _Invalid(
            "format",
            f"{at}.{named[0]}: {value[:80]!r} is a URL; mmtrain data build reads local files: "
            "download it and give its path",
        )
    return value


def _files(record: dict[str, Any], messages: list[_Message], kind: str) -> list[str]:
    """A modality's files in placeholder order: the record's list, or the parts' own files."""
    listed = _paths(record, kind, _LISTS[kind])
    parts = [p for message in messages for p in message.placeholders if p.modality == kind]
    inline = [p for p in parts if p.path is not None]
    if not inline:
        return listed
    if listed:  # an empty list beside inline files is no conflict (a table's empty cell)
        name = kind if kind in record else _LISTS[kind]
        raise _Invalid(
            "format", f"{inline[0].where}: {kind} given inline and in '{name}'; keep one"
        )
    bare = next((p for p in parts if p.path is None), None)
    if bare is not None:
        raise _Invalid(
            "format",
            f"{bare.where}: {'an' if kind == 'image' else 'a'} {kind} part without a file while "
            f"{inline[0].where} names its own; name each {kind} in its part, or list them all "
            f"in '{_LISTS[kind]}'",
        )
    return [p.path for p in inline if p.path is not None]


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
        if isinstance(path, dict) and path.get("bytes") is not None:
            # A Hugging Face datasets Image column: {"bytes": ..., "path": ...}.
            raise _Invalid(
                "format",
                f"'{name}'[{i}]: {single} bytes inside the record are not read; save the files "
                f"and list their paths in '{name}'",
            )
        if not isinstance(path, str) or not path.strip():
            shown = repr(path) if isinstance(path, (str, type(None))) else type(path).__name__
            raise _Invalid("format", f"'{name}'[{i}]: expected a non-empty path, got {shown}")
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


def _check_count(
    record: dict[str, Any], messages: list[_Message], paths: list[str], kind: str
) -> None:
    tag = _TAGS[kind]
    tags = sum(message.turn.text.count(tag) for message in messages)
    if tags == len(paths):
        return
    parts = sum(p.modality == kind for message in messages for p in message.placeholders)
    if not parts:
        raise _Invalid(
            f"{kind}_count",
            f"{tags} {tag} tag(s) in the text but {len(paths)} {kind}(s); each {kind} needs "
            f"exactly one {tag} where it goes",
        )
    name = kind if kind in record else _LISTS[kind]
    raise _Invalid(
        f"{kind}_count",
        f"{tags} {kind} placeholder(s) ({parts} {kind} part(s), {tags - parts} {tag} tag(s)) "
        f"but {len(paths)} {kind}(s) in '{name}'; each {kind} part takes the next file of "
        f"'{name}', in order",
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


def scan_records(
    records: Iterable[Any], path: str | Path
) -> Iterator[Conversation | ConversationError]:
    """`scan_conversations` for records already read from a table (the rows of a parquet
    file): each is named `file:row` (from 1), as table rows are."""
    path = Path(path)
    for index, record in enumerate(records):
        yield _parse_or_error(record, str(path), index, f"{path.name}:{index + 1}")


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
