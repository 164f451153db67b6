"""Chat templates: a `Conversation` -> text segments -> token ids and a label mask.

A template renders a conversation as a list of `Segment(text, train)`: the assistant's answers
(with their end-of-turn token) are trained, everything else (system prompt, user turns, role
headers, separators) is not. Ids are built by tokenizing each run of segments with the same
`train` flag on its own, so the mask is exact by construction: no character offsets, no guessing
where a prompt ends. Each `<image>` tag becomes ONE placeholder id (`image_token_id`, -100 in
the labels), each `<video>` tag one `video_token_id`; the model later splices the input's
tokens in at that position. A fixed-size tower's images all take `image_length` positions; a
native-resolution tower's inputs each take their own (`image_lengths`, `video_lengths`, in tag
order), which the encoded sample keeps as its `spans`.

Templates:
- `llama-3`: `<|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\n{text}<|eot_id|>`,
  contents trimmed; no default system prompt.
- `chatml` (Qwen2): `<|im_start|>role\\n{text}<|im_end|>\\n`, default system prompt "You are a
  helpful assistant."; the newline after an assistant's `<|im_end|>` is not trained.
- `vicuna-v1` (LLaVA-1.5): `<s>{system} USER: {text} ASSISTANT: {text}</s>USER: ...`.
- `plain` (LLaVA stage-1 captioning): the user turn's images only (its text is dropped, as
  stage-1 prompts carry nothing), then the answer and a newline, which is trained.
- A tokenizer's own Jinja `chat_template` (`tokenizer_config.json`, `chat_template.jinja`),
  rendered in a sandbox; its segments come from rendering growing prefixes of the conversation.

Segment-wise ids versus the ids of the whole rendered string (with `<image>` an added token of
the tokenizer): with a byte-level BPE on GPT-2's pre-tokenizer pattern they are equal for
`chatml`, `vicuna-v1` and `plain` (tested) as long as an answer does not start with whitespace,
because each train/no-train boundary falls at a special token, after a lone newline, or before
a space-led word, where the pattern splits a whole string too. For `llama-3` the prompt ends in
"\\n\\n" before a letter: GPT-2's pattern splits "\\n\\nA" as "\\n", "\\n", "A" in a whole string,
while the prompt run alone ends in the piece "\\n\\n" (the same ids unless the BPE merged "\\n\\n";
the decoded text is the same either way, which is tested). Llama-3's own tokenizer is not
checked here. SentencePiece tokenizers (Llama-2, Vicuna) add a word-start marker at the start
of each encode call, so there an answer's first token can differ from whole-string encoding.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mmtrain.data.stream.conversations import IMAGE_TAG, VIDEO_TAG, Conversation
from mmtrain.hf_chat_template import stored_chat_template
from mmtrain.structured import FieldError, closest

__all__ = [
    "IGNORE_INDEX",
    "Segment",
    "ChatTemplate",
    "NamedTemplate",
    "JinjaTemplate",
    "TEMPLATES",
    "VICUNA_SYSTEM",
    "get_template",
    "load_jinja_template",
    "holds_chat_template",
    "render_text",
    "EncodedSample",
    "RefusedSample",
    "encode_segments",
    "encode_conversation",
    "id_positions",
]

_TAG_PATTERN = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")
IGNORE_INDEX = -100  # the label of a position without a target (PyTorch's cross-entropy default)


@dataclass(frozen=True)
class Segment:
    """A piece of the rendered conversation; `train` marks the assistant's answer tokens."""

    text: str
    train: bool


class ChatTemplate(Protocol):
    """What `encode_conversation` needs from a template."""

    name: str

    def segments(self, conv: Conversation) -> list[Segment]: ...

    def single_tokens(self) -> tuple[str, ...]:
        """Strings the tokenizer must map to exactly one id (special tokens, end of turn)."""
        ...


class TextEncoder(Protocol):
    """The part of a tokenizer used here (`HFTokenizer`, `OpenClipBPE`, ... have it)."""

    def encode(self, text: str) -> list[int]: ...


def render_text(conv: Conversation, template: ChatTemplate) -> str:
    """The whole conversation as the template writes it, `<image>` tags left in place."""
    return "".join(segment.text for segment in template.segments(conv))


# ----------------------------------------------------------------------------- named templates
@dataclass(frozen=True)
class NamedTemplate:
    """A fixed chat format. Patterns hold `{text}` where a turn's text goes.

    Rendering: `prefix`, the system turn (or `default_system`) through `system`, then per round
    `user`, `assistant_prompt` (not trained), `assistant` (trained: answer and end of turn) and
    `after_assistant` (not trained).
    """

    name: str
    prefix: str
    system: str
    default_system: str | None
    user: str
    assistant_prompt: str
    assistant: str
    after_assistant: str
    specials: tuple[str, ...]
    strip: bool = False  # trim each turn's text (Llama-3 does)
    user_images_only: bool = False  # `plain`: a user turn becomes its `<image>` tags

    def single_tokens(self) -> tuple[str, ...]:
        return self.specials

    def segments(self, conv: Conversation) -> list[Segment]:
        out = [Segment(self.prefix, False)]
        turns = conv.turns
        system = self.default_system
        if turns and turns[0].role == "system":
            system, turns = turns[0].text, turns[1:]
        if system is not None and self.system:
            out.append(Segment(_fill(self.system, self._text(system)), False))
        for turn in turns:
            if turn.role == "user":
                text = _tags_only(turn.text) if self.user_images_only else turn.text
                out.append(Segment(_fill(self.user, self._text(text)), False))
            elif turn.role == "assistant":
                out.append(Segment(self.assistant_prompt, False))
                out.append(Segment(_fill(self.assistant, self._text(turn.text)), True))
                out.append(Segment(self.after_assistant, False))
            else:
                raise FieldError("turns", f"{conv.key}: a {turn.role} turn after the first turn")
        return [s for s in out if s.text]

    def _text(self, text: str) -> str:
        return text.strip() if self.strip else text


def _tags_only(text: str) -> str:
    """The `<image>` and `<video>` tags of a text, in order (the `plain` template's user turn)."""
    return "".join(_TAG_PATTERN.findall(text))


def _fill(pattern: str, text: str) -> str:
    # Not str.format: braces in the pattern's fixed text would need escaping.
    return pattern.replace("{text}", text)


VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

TEMPLATES: dict[str, NamedTemplate] = {
    "llama-3": NamedTemplate(
        name="llama-3",
        prefix="<|begin_of_text|>",
        system="<|start_header_id|>system<|end_header_id|>\n\n{text}<|eot_id|>",
        default_system=None,
        user="<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>",
        assistant_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
        assistant="{text}<|eot_id|>",
        after_assistant="",
        specials=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        strip=True,
    ),
    "chatml": NamedTemplate(
        name="chatml",
        prefix="",
        system="<|im_start|>system\n{text}<|im_end|>\n",
        default_system="You are a helpful assistant.",
        user="<|im_start|>user\n{text}<|im_end|>\n",
        assistant_prompt="<|im_start|>assistant\n",
        assistant="{text}<|im_end|>",
        after_assistant="\n",
        specials=("<|im_start|>", "<|im_end|>"),
    ),
    # The space before the answer is trained: byte-level BPEs attach it to the answer's first
    # word, so the prompt ends at "ASSISTANT:" and segment ids match whole-string ids.
    "vicuna-v1": NamedTemplate(
        name="vicuna-v1",
        prefix="<s>",
        system="{text} ",
        default_system=VICUNA_SYSTEM,
        user="USER: {text} ",
        assistant_prompt="ASSISTANT:",
        assistant=" {text}</s>",
        after_assistant="",
        specials=("<s>", "</s>"),
    ),
    "plain": NamedTemplate(
        name="plain",
        prefix="",
        system="",
        default_system=None,
        user="{text}",
        assistant_prompt="",
        assistant="{text}\n",
        after_assistant="",
        specials=("\n",),
        user_images_only=True,
    ),
}


# ----------------------------------------------------------------------------- Jinja templates
class JinjaTemplate:
    """A tokenizer's own `chat_template` (Jinja), rendered in a sandbox.

    The template sees `messages` (role and string content, `<image>` tags inline),
    `add_generation_prompt` and the config's special tokens (`bos_token`, `eos_token`, ...).
    Segments: for the assistant turn i, the text rendered for turns < i with the generation
    prompt ends the untrained part; the text rendered for turns <= i, less trailing whitespace,
    ends the trained part. That needs a template whose renderings of growing prefixes are
    prefixes of each other, which is checked, as is that the generation prompt ends right before
    the answer (otherwise role headers would be trained silently).
    """

    def __init__(self, source: str, tokens: dict[str, str], name: str = "jinja"):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The usual settings of HF chat templates; the sandbox stops attribute tricks.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_from_template
        try:
            self._template = env.from_string(source)
        except TemplateError as err:
            raise FieldError("chat_template", f"{name}: {err}") from None
        self.name = name
        self.tokens = dict(tokens)

    def single_tokens(self) -> tuple[str, ...]:
        return tuple(t for key in ("bos_token", "eos_token") if (t := self.tokens.get(key)))

    def render(self, turns: Sequence[Any], generation_prompt: bool) -> str:
        from jinja2.exceptions import TemplateError

        messages = [{"role": t.role, "content": t.text} for t in turns]
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=generation_prompt, **self.tokens
            )
        # A template is code from a model folder: any failure in it is a bad input, named.
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as err:
            raise FieldError("chat_template", f"{self.name}: {err}") from None

    def segments(self, conv: Conversation) -> list[Segment]:
        full = self.render(conv.turns, False)
        out: list[Segment] = []
        done = 0  # characters of `full` already in segments
        for i, turn in enumerate(conv.turns):
            if turn.role != "assistant":
                continue
            prompt = self.render(conv.turns[:i], True)
            upto = self.render(conv.turns[: i + 1], False)
            if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= done):
                raise FieldError(
                    "chat_template",
                    f"{self.name}: rendering turns 0..{i} is not a prefix of the whole "
                    "conversation, so the answer's span cannot be found; use a named template",
                )
            answer = upto[len(prompt) :].rstrip()  # the newline after end of turn is a prompt's
            self._check_answer_start(answer, turn.text, i)
            out.append(Segment(full[done : len(prompt)], False))
            out.append(Segment(answer, True))
            done = len(prompt) + len(answer)
        out.append(Segment(full[done:], False))
        return [s for s in out if s.text]

    def _check_answer_start(self, answer: str, text: str, turn: int) -> None:
        start = answer.find(text.strip())
        if start < 0 or answer[:start].strip():
            raise FieldError(
                "chat_template",
                f"{self.name}: turn {turn}: the generation prompt does not end where the "
                f"assistant's answer starts (the trained span would begin {answer[:40]!r})",
            )


def _raise_from_template(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def load_jinja_template(path: str | Path) -> JinjaTemplate:
    """The chat template of a `tokenizer_config.json`, a `.jinja` file, or a folder with either
    (a `chat_template.jinja` next to the config wins, as newer HF folders store it there)."""
    path = Path(path)
    if path.is_file() and path.suffix not in (".json", ".jinja"):
        raise FieldError(
            "chat_template", f"{path}: expected a tokenizer_config.json, a .jinja file or a folder"
        )
    folder = path if path.is_dir() else path.parent
    config_path = path if path.suffix == ".json" else folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    # The config's special tokens (bos_token, eos_token, ...) are variables of the template.
    tokens = {k: _token_text(v) for k, v in config.items() if k.endswith("_token")}
    tokens = {k: v for k, v in tokens.items() if v is not None}
    jinja = path if path.suffix == ".jinja" else folder / "chat_template.jinja"
    if path.suffix != ".json" and jinja.is_file():
        return JinjaTemplate(jinja.read_text(encoding="utf-8"), tokens, name=str(jinja))
    source = _config_template(config, config_path)
    return JinjaTemplate(source, tokens, name=str(config_path))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise FieldError("chat_template", f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise FieldError("chat_template", f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as a config stores it: a string, or an object with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _config_template(config: dict[str, Any], path: Path) -> str:
    """`chat_template`: a string, or a list of {name, template} (the one named `default`)."""
    value = stored_chat_template(config)
    if value is None:
        raise FieldError(
            "chat_template", f"{path}: no 'chat_template' string (and no chat_template.jinja)"
        )
    return value


def holds_chat_template(folder: str | Path) -> bool:
    """Whether a model folder holds a chat template `load_jinja_template` reads: a
    chat_template.jinja, or a tokenizer_config.json with a `chat_template`."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return True
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return False
    try:
        return stored_chat_template(_read_json(config_path)) is not None
    except FieldError:  # unreadable: no template to take from it
        return False


def get_template(name_or_path: str | Path) -> ChatTemplate:
    """A named template (`llama-3`, `chatml`, `vicuna-v1`, `plain`) or a tokenizer's Jinja
    template (`tokenizer_config.json`, `*.jinja`, or the model folder holding them)."""
    text = str(name_or_path)
    if text in TEMPLATES:
        return TEMPLATES[text]
    path = Path(text)
    if path.exists():
        return load_jinja_template(path)
    raise FieldError(
        "chat_template",
        f"{text!r} is neither a template name ({', '.join(TEMPLATES)}){closest(text, TEMPLATES)} "
        "nor an existing tokenizer_config.json, .jinja file or model folder",
    )


# ----------------------------------------------------------------------------- ids and labels
@dataclass(frozen=True)
class EncodedSample:
    """Token ids with one placeholder id per image or clip, and labels aligned with them (the
    id to predict at that position's output after the usual one-step shift, or -100).

    `spans`: (index in `input_ids`, LM positions) of each placeholder whose input takes its own
    number of positions (a native-resolution tower); empty: every `image_token_id` takes the
    one `image_length` of the model (`id_positions`)."""

    input_ids: list[int]
    labels: list[int]
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def targets(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def id_positions(sample: EncodedSample, image_token_id: int, image_length: int) -> list[int]:
    """LM positions each id of the sample takes once its inputs are spliced in."""
    if sample.spans:
        sizes = [1] * len(sample.input_ids)
        for index, positions in sample.spans:
            sizes[index] = positions
        return sizes
    return [image_length if t == image_token_id else 1 for t in sample.input_ids]


# Refusals of a conversation that does not fit the row (`max_length`): the loader counts them
# as too long for `data.sequence_length`, apart from corrupt samples.
TOO_LONG_KINDS = frozenset({"image_cut", "video_cut", "truncated_no_targets"})


class RefusedSample(ValueError):
    """A conversation that must not be trained on: `kind` (image_count, no_targets, image_cut,
    video_cut, truncated_no_targets) and `reason`, as a `rejects.jsonl` line wants them.
    `detail`: numbers a summary of many refusals needs (a too-long one's `needed_positions`,
    `max_length` and `largest_input_positions`)."""

    def __init__(self, kind: str, reason: str, detail: dict[str, Any] | None = None):
        self.kind, self.reason, self.detail = kind, reason, detail
        super().__init__(f"{kind}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kind, self.reason, self.detail))  # rebuilt from its fields


def encode_segments(
    segments: Iterable[Segment],
    tokenizer: TextEncoder,
    image_token_id: int,
    video_token_id: int | None = None,
    wrap: tuple[int, int] | None = None,
) -> EncodedSample:
    """Ids and labels of the segments; each `<image>` tag becomes one `image_token_id`, each
    `<video>` tag one `video_token_id` (None: `<video>` stays text), between the `wrap` ids
    when given (Qwen2-VL's `<|vision_start|>` and `<|vision_end|>`, never trained)."""
    before, after = ([wrap[0]], [wrap[1]]) if wrap is not None else ([], [])
    ids: list[int] = []
    labels: list[int] = []
    tags = {IMAGE_TAG: image_token_id}
    if video_token_id is not None:
        tags[VIDEO_TAG] = video_token_id
    pattern = re.compile("(" + "|".join(re.escape(tag) for tag in tags) + ")")
    for text, train in _merged(segments):
        for piece in pattern.split(text):
            if piece in tags:
                placed = [*before, tags[piece], *after]
                ids += placed
                labels += [IGNORE_INDEX] * len(placed)
                continue
            tokens = tokenizer.encode(piece) if piece else []
            ids += tokens
            labels += tokens if train else [IGNORE_INDEX] * len(tokens)
    return EncodedSample(ids, labels)


def _merged(segments: Iterable[Segment]) -> list[tuple[str, bool]]:
    """Neighbouring segments with the same flag joined: they are tokenized as one text, so a
    split inside a prompt never changes its ids (only train/no-train boundaries remain)."""
    runs: list[tuple[str, bool]] = []
    for segment in segments:
        if runs and runs[-1][1] == segment.train:
            runs[-1] = (runs[-1][0] + segment.text, segment.train)
        else:
            runs.append((segment.text, segment.train))
    return runs


@dataclass(frozen=True)
class Placeholders:
    """The placeholder ids of a model and the positions their inputs take: `image_length` for
    every image (a fixed-size tower), or each input's own (`image_lengths` / `video_lengths`
    in tag order: a native-resolution tower)."""

    image_token_id: int
    image_length: int = 1
    video_token_id: int | None = None
    image_lengths: Sequence[int] | None = None
    video_lengths: Sequence[int] = ()
    wrap: tuple[int, int] | None = None  # ids around each placeholder (VisionTokens.start_id)

    def spans(self, ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """(index, positions) of each placeholder in `ids` (empty for a fixed-size tower)."""
        if self.image_lengths is None:
            return ()
        lengths = {self.image_token_id: iter(self.image_lengths),
                   self.video_token_id: iter(self.video_lengths)}  # fmt: skip
        return tuple((i, next(lengths[t])) for i, t in enumerate(ids) if t in lengths)


def encode_conversation(
    conv: Conversation,
    template: ChatTemplate,
    tokenizer: TextEncoder,
    max_length: int,
    image_token_id: int,
    *,
    image_length: int = 1,
    placeholders: Placeholders | None = None,
) -> EncodedSample:
    """Render, tokenize and truncate one conversation; never a sample without a target.

    `max_length` counts positions in the language model, where each image takes
    `image_length` positions once spliced in (1: count placeholders only), or what
    `placeholders` says per image and clip. Raises `RefusedSample` when no label is a target,
    when truncation would cut an image or a clip, or when it would leave no target;
    `FieldError` when the tokenizer does not fit the template.
    """
    marks = placeholders or Placeholders(image_token_id, image_length)
    _check_settings(max_length, marks)
    _check_tokenizer(template, tokenizer)
    segments = template.segments(conv)
    _check_tag_counts(conv, segments, marks)
    sample = encode_segments(
        segments, tokenizer, marks.image_token_id, marks.video_token_id, marks.wrap
    )
    _check_placeholder_ids(conv, sample, marks)
    if sample.targets == 0:
        raise RefusedSample(
            "no_targets", f"{conv.key}: every label is masked (no assistant tokens)"
        )
    sample = EncodedSample(sample.input_ids, sample.labels, marks.spans(sample.input_ids))
    return _truncate(conv, sample, max_length, marks)


def _check_settings(max_length: int, marks: Placeholders) -> None:
    if max_length < 1:
        raise FieldError("max_length", f"must be at least 1, got {max_length}")
    if marks.image_length < 1:
        raise FieldError("image_length", f"must be at least 1, got {marks.image_length}")
    for name, token in (("image_token_id", marks.image_token_id),
                        ("video_token_id", marks.video_token_id)):  # fmt: skip
        if token == IGNORE_INDEX:
            raise FieldError(name, f"{IGNORE_INDEX} is the ignored label; use another id")


def _check_tokenizer(template: ChatTemplate, tokenizer: TextEncoder) -> None:
    """A special token split into pieces would train the model on a different end of turn
    than the one generation stops at: the classic silent template mismatch."""
    for text in template.single_tokens():
        ids = tokenizer.encode(text)
        if len(ids) != 1:
            raise FieldError(
                "chat_template",
                f"{template.name} needs {text!r} as one token, but the tokenizer gives "
                f"{len(ids)} ids {ids[:8]}; use the model's own tokenizer or another template",
            )


def _kinds(conv: Conversation, marks: Placeholders) -> list[tuple[str, str, int | None, int]]:
    """(kind, tag, placeholder id, inputs) of the inputs a conversation has."""
    kinds = [("image", IMAGE_TAG, marks.image_token_id, len(conv.images))]
    if marks.video_token_id is not None or conv.videos:
        kinds.append(("video", VIDEO_TAG, marks.video_token_id, len(conv.videos)))
    return kinds


def _check_tag_counts(conv: Conversation, segments: list[Segment], marks: Placeholders) -> None:
    """A hand-built conversation, or a template dropping tags, has tags for other inputs."""
    for kind, tag, token, inputs in _kinds(conv, marks):
        tags = sum(segment.text.count(tag) for segment in segments)
        if tags != inputs:
            raise RefusedSample(
                f"{kind}_count", f"{conv.key}: {tags} {tag} tag(s) rendered for {inputs} {kind}(s)"
            )
        if token is None and inputs:
            raise RefusedSample(
                "videos_without_tower",
                f"{conv.key}: {inputs} video(s), but the model takes no video",
            )


def _check_placeholder_ids(conv: Conversation, sample: EncodedSample, marks: Placeholders) -> None:
    for kind, tag, token, inputs in _kinds(conv, marks):
        count = sample.input_ids.count(token)
        if count != inputs:
            # Text tokens with the placeholder's id would each be taken for an input.
            raise FieldError(
                f"{kind}_token_id",
                f"{conv.key}: {count} ids equal {kind}_token_id {token} for {inputs} "
                f"{tag} tag(s); pick an id the tokenizer never gives to text",
            )


def _truncate(
    conv: Conversation, sample: EncodedSample, max_length: int, marks: Placeholders
) -> EncodedSample:
    """Keep the longest prefix that fits; refuse if it drops an image, a clip or every target."""
    sizes = id_positions(sample, marks.image_token_id, marks.image_length)
    used = keep = 0
    for size in sizes:
        if used + size > max_length:
            break
        used += size
        keep += 1
    if keep == len(sample.input_ids):
        return sample
    ids, labels = sample.input_ids[:keep], sample.labels[:keep]
    needed = sum(sizes)
    input_sizes = [size for size, token in zip(sizes, sample.input_ids, strict=True)
                   if token in (marks.image_token_id, marks.video_token_id)]  # fmt: skip
    detail = {"needed_positions": needed, "max_length": max_length,
              "largest_input_positions": max(input_sizes, default=0)}  # fmt: skip
    for kind, _, token, inputs in _kinds(conv, marks):
        kept = ids.count(token)
        if kept < inputs:
            raise RefusedSample(
                f"{kind}_cut",
                f"{conv.key}: max_length {max_length} cuts {kind} {kept + 1} of {inputs} (the "
                f"conversation needs {needed} positions)",
                detail,
            )
    truncated = EncodedSample(ids, labels, sample.spans)
    if truncated.targets == 0:
        raise RefusedSample(
            "truncated_no_targets",
            f"{conv.key}: max_length {max_length} leaves no assistant token (the conversation "
            f"needs {needed} positions)",
            detail,
        )
    return truncated
