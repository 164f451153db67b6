"""Chat data: LLaVA / ShareGPT parsing, chat templates, label masks, refusals."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer

from mmtrain.data.stream.chat_templates import (
    IGNORE_INDEX,
    TEMPLATES,
    VICUNA_SYSTEM,
    EncodedSample,
    RefusedSample,
    encode_conversation,
    get_template,
    holds_chat_template,
    load_jinja_template,
    render_text,
)
from mmtrain.data.stream.conversations import (
    Conversation,
    ConversationError,
    Turn,
    parse_conversation,
    read_conversations,
    scan_conversations,
)
from mmtrain.data.stream.tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer, train_bpe
from mmtrain.structured import FieldError

# ----------------------------------------------------------------------------- data
LLAVA = {
    "id": "cat-1",
    "image": "images/cat.jpg",
    "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "A cat on a sofa."},
        {"from": "human", "value": "What colour is it?"},
        {"from": "gpt", "value": "It is grey."},
    ],
}
SHAREGPT = {
    "id": "cat-1",
    "messages": [
        {"role": "user", "content": "<image>\nWhat is in the picture?"},
        {"role": "assistant", "content": "A cat on a sofa."},
        {"role": "user", "content": "What colour is it?"},
        {"role": "assistant", "content": "It is grey."},
    ],
    "images": ["images/cat.jpg"],
}
CONV = Conversation(
    "cat-1",
    [
        Turn("user", "<image>\nWhat is in the picture?"),
        Turn("assistant", "A cat on a sofa."),
        Turn("user", "What colour is it?"),
        Turn("assistant", "It is grey."),
    ],
    ["images/cat.jpg"],
)
CAPTION = Conversation(
    "cap-1",
    [Turn("user", "Describe the image briefly.\n<image>"), Turn("assistant", "A cat on a sofa.")],
    ["cat.jpg"],
)

# Written by hand from each format's public definition.
EXPECTED = {
    "chatml": (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n"
        "<|im_start|>assistant\nA cat on a sofa.<|im_end|>\n"
        "<|im_start|>user\nWhat colour is it?<|im_end|>\n"
        "<|im_start|>assistant\nIt is grey.<|im_end|>\n"
    ),
    "llama-3": (
        "<|begin_of_text|>"
        "<|start_header_id|>user<|end_header_id|>\n\n<image>\nWhat is in the picture?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA cat on a sofa.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat colour is it?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is grey.<|eot_id|>"
    ),
    "vicuna-v1": (
        "<s>A chat between a curious user and an artificial intelligence assistant. The "
        "assistant gives helpful, detailed, and polite answers to the user's questions. "
        "USER: <image>\nWhat is in the picture? ASSISTANT: A cat on a sofa.</s>"
        "USER: What colour is it? ASSISTANT: It is grey.</s>"
    ),
}
# What the labels keep, per template: each assistant answer with its end of turn.
ANSWERS = {
    "chatml": ["A cat on a sofa.<|im_end|>", "It is grey.<|im_end|>"],
    "llama-3": ["A cat on a sofa.<|eot_id|>", "It is grey.<|eot_id|>"],
    "vicuna-v1": [" A cat on a sofa.</s>", " It is grey.</s>"],
}

SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "<image>",
]
CORPUS = [
    "What is in the picture?",
    "A cat on a sofa.",
    "What colour is it? It is grey.",
    "USER: ASSISTANT: system user assistant",
    "You are a helpful assistant.",
    "Describe the image briefly.",
    VICUNA_SYSTEM,
] * 10


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A tiny byte-level BPE with the chat templates' special tokens added, as a model's
    tokenizer.json has them."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(CORPUS, vocab_size=400, out_path=path)
    raw = RawTokenizer.from_file(str(path))
    raw.add_special_tokens(SPECIALS)
    raw.save(str(path))
    return path


@pytest.fixture(scope="module")
def hf(tok_path) -> HFTokenizer:
    return HFTokenizer(tok_path)


@pytest.fixture(scope="module")
def raw(tok_path) -> RawTokenizer:
    return RawTokenizer.from_file(str(tok_path))


def image_id(raw: RawTokenizer) -> int:
    return raw.token_to_id("<image>")


def decode(raw: RawTokenizer, ids: list[int]) -> str:
    return raw.decode(ids, skip_special_tokens=False)


def trained_spans(sample: EncodedSample) -> list[list[int]]:
    """The runs of consecutive positions whose label is a target."""
    spans: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in sample.labels:
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                spans.append([])
            spans[-1].append(label)
        previous = label
    return spans


# ----------------------------------------------------------------------------- parsing
def test_both_formats_parse_to_the_same_conversation(tmp_path):
    llava_file = tmp_path / "llava.json"
    llava_file.write_text(json.dumps([LLAVA]))
    sharegpt_file = tmp_path / "sharegpt.jsonl"
    sharegpt_file.write_text(json.dumps(SHAREGPT) + "\n\n")
    assert read_conversations(llava_file) == [CONV]
    assert read_conversations(sharegpt_file) == [CONV]

    with_system = {**LLAVA, "conversations": [{"from": "system", "value": "Be brief."}]}
    with_system["conversations"] += LLAVA["conversations"]
    top_level = {**SHAREGPT, "system": "Be brief."}
    assert parse_conversation(with_system) == parse_conversation(top_level)
    assert parse_conversation(top_level).turns[0] == Turn("system", "Be brief.")

    text_only = {
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hi."}]
    }
    conv = parse_conversation(text_only, index=7)
    assert (conv.key, conv.images) == ("7", [])  # no id: the record's position


def test_images_and_videos_interleave_in_any_order():
    record = {
        "id": "v1",
        "messages": [
            {"role": "user", "content": "<video>\nThen <image>, then <video>?"},
            {"role": "assistant", "content": "Both."},
        ],
        "images": ["page.png"],
        "videos": ["a.mp4", "b.mp4"],
    }
    conv = parse_conversation(record)
    assert (conv.images, conv.videos) == (["page.png"], ["a.mp4", "b.mp4"])
    llava = with_turns(("human", "<image><video>"), ("gpt", "Yes."), image="p.png")
    assert parse_conversation({**llava, "video": "c.mp4"}).videos == ["c.mp4"]


# The Hugging Face / TRL form of CONV: content as typed parts, joined as written (no separator:
# LLaVA's "<image>\nWhat ..." is an image part followed by the text "\nWhat ...").
HF_PARTS = {
    "id": "cat-1",
    "messages": [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is in the picture?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A cat on a sofa."}]},
        {"role": "user", "content": "What colour is it?"},  # a plain string may stand beside parts
        {"role": "assistant", "content": [{"type": "text", "text": "It is grey."}]},
    ],
    "images": ["images/cat.jpg"],
}


def hf_inline(key: str) -> dict:
    """HF_PARTS with its image named inside the part (as processors accept for local files)."""
    record = json.loads(json.dumps(HF_PARTS))
    del record["images"]
    record["messages"][0]["content"][0][key] = "images/cat.jpg"
    return record


def test_hugging_face_typed_parts_parse_to_the_same_conversation(tmp_path):
    assert parse_conversation(HF_PARTS) == CONV
    for key in ("image", "path", "url"):
        assert parse_conversation(hf_inline(key)) == CONV
    # TRL's conversational prompt / completion: the prompt's turns, then the completion's.
    trl = {"id": "cat-1", "prompt": HF_PARTS["messages"][:3], "images": ["images/cat.jpg"]}
    trl["completion"] = HF_PARTS["messages"][3:]
    assert parse_conversation(trl) == CONV
    path = tmp_path / "hf.jsonl"
    path.write_text(json.dumps(HF_PARTS) + "\n" + json.dumps(trl) + "\n")
    assert read_conversations(path) == [CONV, CONV]

    # Datasets written through Arrow give every part every field, absent ones as null.
    arrow = json.loads(json.dumps(HF_PARTS))
    for message in arrow["messages"]:
        if isinstance(message["content"], list):
            message["content"] = [
                {"type": None, "text": None, "image": None} | part for part in message["content"]
            ]
    assert parse_conversation(arrow) == CONV

    interleaved = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": "a.mp4"},
                    {"type": "text", "text": "Then "},
                    {"type": "image", "image": "p.png"},
                    {"type": "text", "text": ", then "},
                    {"type": "video", "path": "b.mp4"},
                    {"type": "text", "text": "?"},
                ],
            },
            {"role": "assistant", "content": "Both."},
        ]
    }
    conv = parse_conversation(interleaved)
    assert conv.turns[0].text == "<video>Then <image>, then <video>?"
    assert (conv.images, conv.videos) == (["p.png"], ["a.mp4", "b.mp4"])


def hf_record(*contents: object, **extra: object) -> dict:
    """A user turn of `contents[0]`, then an assistant turn of `contents[1]` (or "Yes.")."""
    user, answer = (*contents, "Yes.")[:2]
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"id": "r3", "messages": messages, **extra}


IMAGE_PART = {"type": "image"}
TEXT_PART = {"type": "text", "text": "What is it?"}


def reject(record, **kwargs) -> ConversationError:
    with pytest.raises(ConversationError) as info:
        parse_conversation(record, file="data/llava.json", index=3, **kwargs)
    return info.value


def with_turns(*turns: tuple[str, str], image: object = None) -> dict:
    record: dict = {"id": "r3", "conversations": [{"from": f, "value": v} for f, v in turns]}
    if image is not None:
        record["image"] = image
    return record


@pytest.mark.parametrize(
    ("record", "kind", "words"),
    [
        (
            with_turns(("human", "<image>\nHi"), ("gpt", "Yes.")),
            "image_count",
            "1 <image> tag(s) in the text but 0 image",
        ),
        (
            with_turns(("human", "Hi"), ("gpt", "Yes."), image="a.jpg"),
            "image_count",
            "0 <image> tag(s) in the text but 1 image",
        ),
        (
            with_turns(("human", "<image><image>"), ("gpt", "Two."), image=["a.jpg"]),
            "image_count",
            "2 <image>",
        ),
        (
            with_turns(("gpt", "Hello."), ("human", "Hi")),
            "roles",
            "conversations[0]: expected a user turn",
        ),
        (
            with_turns(("human", "a"), ("human", "b")),
            "roles",
            "conversations[1]: expected an assistant turn",
        ),
        (
            with_turns(("human", "a"), ("gpt", "b"), ("system", "c"), ("gpt", "d")),
            "roles",
            "system only first",
        ),
        (
            with_turns(("human", "a"), ("gpt", "b"), ("human", "c")),
            "roles",
            "ends with a user turn",
        ),
        (
            with_turns(("human", "a"), ("gpt", "  \n")),
            "empty_turn",
            "conversations[1]: empty assistant",
        ),
        (
            with_turns(("human", "a"), ("gpt", "<image>"), image="a.jpg"),
            "image_tag",
            "<image> in an assistant",
        ),
        (with_turns(("human", "a"), ("bot", "b")), "format", "conversations[1].from: 'bot'"),
        (
            hf_record(["x"]),
            "format",
            "messages[0].content[0]: expected a part object with a 'type'",
        ),
        (
            hf_record(7),
            "format",
            "messages[0].content: expected a string or a list of typed parts, got int",
        ),
        (
            hf_record([{"type": "image_url", "image_url": {"url": "a.jpg"}}], images=["a.jpg"]),
            "format",
            "messages[0].content[0].type: 'image_url' is not a part type this reads "
            "(text, image, video)",
        ),
        (hf_record([{"text": "Hi"}]), "format", "messages[0].content[0].type: None is not"),
        (
            hf_record([{"type": "text", "text": 3}]),
            "format",
            "messages[0].content[0].text: expected a string, got int",
        ),
        (
            hf_record([IMAGE_PART, {"type": "text", "text": "<image> too"}], images=["a.jpg"]),
            "format",
            "messages[0].content[1].text: holds <image>; in a list of parts each image or "
            "video is a part of its own",
        ),
        (
            hf_record([IMAGE_PART, IMAGE_PART, TEXT_PART], images=["a.jpg"]),
            "image_count",
            "2 image placeholder(s) (2 image part(s), 0 <image> tag(s)) but 1 image(s) in 'images'",
        ),
        (
            hf_record([{"type": "video"}, TEXT_PART]),
            "video_count",
            "1 video placeholder(s) (1 video part(s), 0 <video> tag(s)) but 0 video(s) in 'videos'",
        ),
        (
            hf_record([{"type": "image", "image": "a.jpg"}, TEXT_PART], images=["a.jpg"]),
            "format",
            "messages[0].content[0]: image given inline and in 'images'; keep one",
        ),
        (
            hf_record([{"type": "image", "path": "a.jpg"}, IMAGE_PART, TEXT_PART]),
            "format",
            "messages[0].content[1]: an image part without a file while "
            "messages[0].content[0] names its own",
        ),
        (
            hf_record([{"type": "image", "url": "https://x.org/a.jpg"}, TEXT_PART]),
            "format",
            "messages[0].content[0].url: 'https://x.org/a.jpg' is a URL; mmtrain data build "
            "reads local files: download it and give its path",
        ),
        (
            hf_record([{"type": "image", "base64": "iVBORw0KGgo="}, TEXT_PART]),
            "format",
            "messages[0].content[0].base64: embedded image data is not read",
        ),
        (
            hf_record([{"type": "image", "image": "a.jpg", "path": "b.jpg"}, TEXT_PART]),
            "format",
            "messages[0].content[0]: the file is named twice (image, path); keep one",
        ),
        (
            hf_record([{"type": "image", "image": {"bytes": b"\xff" * 99}}, TEXT_PART]),
            "format",
            "messages[0].content[0].image: image bytes inside the record are not read; save",
        ),
        (
            hf_record([{"type": "video", "path": 5}, TEXT_PART]),
            "format",
            "messages[0].content[0].path: expected a file path, got int",
        ),
        (
            hf_record([TEXT_PART], [IMAGE_PART, TEXT_PART], images=["a.jpg"]),
            "image_tag",
            "messages[1]: <image> in an assistant turn",
        ),
        (
            {"id": "r3", "prompt": "What is it?", "completion": "A cat."},
            "format",
            "'prompt' is a string (TRL's standard form)",
        ),
        (
            {"id": "r3", "prompt": [{"role": "user", "content": "Hi"}]},
            "format",
            "'prompt' without 'completion'",
        ),
        (
            {
                "id": "r3",
                "prompt": [{"role": "user", "content": "Hi"}],
                "completion": [{"role": "user", "content": "Hi"}],
            },
            "roles",
            "completion[0]: expected an assistant turn",
        ),
        (
            {**hf_record("Hi"), "prompt": [{"role": "user", "content": "Hi"}]},
            "format",
            "has both 'messages' and 'prompt'; keep one",
        ),
        (
            {**SHAREGPT, "images": [{"bytes": b"\xff" * 99, "path": None}]},
            "format",
            "'images'[0]: image bytes inside the record are not read",
        ),
        ({"id": "r3", "text": "hello"}, "format", "no 'conversations'"),
        (
            {**SHAREGPT, "images": "cat.jpg", "image": "cat.jpg"},
            "format",
            "both 'image' and 'images'",
        ),
        ({**SHAREGPT, "images": [""]}, "format", "'images'[0]"),
        (
            {**with_turns(("human", "<video> and <video>"), ("gpt", "b")), "video": "a.mp4"},
            "video_count",
            "2 <video> tag(s) in the text but 1 video",
        ),
        (
            {**with_turns(("human", "a"), ("gpt", "<video>")), "video": "a.mp4"},
            "video_tag",
            "<video> in an assistant",
        ),
        (
            {**SHAREGPT, "videos": ["a.mp4"], "video": "a.mp4"},
            "format",
            "both 'video' and 'videos'",
        ),
    ],
)
def test_invalid_records_are_refused_with_a_reason(record, kind, words):
    err = reject(record)
    assert err.kind == kind
    assert words in err.reason
    assert str(err).startswith("data/llava.json record 3 (id ")  # names the file, index and id
    assert err.as_reject() == {
        "index": 3,
        "path": "llava.json[3]",
        "key": err.key,
        "kind": kind,
        "reason": err.reason,
    }
    assert isinstance(err, FieldError)  # the CLI turns it into exit code 2
    assert pickle.loads(pickle.dumps(err)).as_reject() == err.as_reject()  # crosses processes


def test_scan_reports_bad_records_in_place_and_goes_on(tmp_path):
    path = tmp_path / "chats.jsonl"
    bad_count = with_turns(("human", "<image> <image>"), ("gpt", "Two."), image="a.jpg")
    path.write_text("\n".join([json.dumps(SHAREGPT), "{broken", json.dumps(bad_count), ""]))
    got = list(scan_conversations(path))
    assert got[0] == CONV
    assert isinstance(got[1], ConversationError) and got[1].kind == "json"
    assert got[1].origin == "chats.jsonl:2"
    assert (got[2].kind, got[2].index, got[2].key, got[2].origin) == (
        "image_count",
        2,
        "r3",
        "chats.jsonl:3",
    )
    with pytest.raises(ConversationError, match=r"chats.jsonl record 1: line 2"):
        read_conversations(path)

    not_a_list = tmp_path / "one.json"
    not_a_list.write_text(json.dumps(LLAVA))
    with pytest.raises(FieldError, match="one.json: expected a JSON list"):
        read_conversations(not_a_list)
    with pytest.raises(FieldError, match="cannot read"):
        read_conversations(tmp_path / "missing.json")


# ----------------------------------------------------------------------------- templates
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_templates_render_the_published_format(name):
    assert render_text(CONV, get_template(name)) == EXPECTED[name]


def test_plain_template_is_image_then_caption():
    assert render_text(CAPTION, get_template("plain")) == "<image>A cat on a sofa.\n"


def test_system_turn_replaces_the_default_prompt():
    conv = Conversation("s", [Turn("system", "Be brief."), *CONV.turns], CONV.images)
    assert render_text(conv, TEMPLATES["chatml"]).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )
    assert render_text(conv, TEMPLATES["vicuna-v1"]).startswith("<s>Be brief. USER: <image>\n")
    assert render_text(conv, TEMPLATES["llama-3"]).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    )


def test_unknown_template_name_suggests_the_closest():
    with pytest.raises(FieldError, match="did you mean 'chatml'"):
        get_template("chatm")


# ----------------------------------------------------------------------------- ids and labels
@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_labels_cover_exactly_the_assistant_answers(name, hf, raw):
    sample = encode_conversation(CONV, get_template(name), hf, 4096, image_id(raw))
    assert len(sample.input_ids) == len(sample.labels)
    assert [decode(raw, span) for span in trained_spans(sample)] == ANSWERS[name]
    # Targets are the ids themselves; everything else, the image placeholder included, is -100.
    for token, label in zip(sample.input_ids, sample.labels, strict=True):
        assert label in (token, IGNORE_INDEX)
    position = sample.input_ids.index(image_id(raw))
    assert sample.input_ids.count(image_id(raw)) == 1 and sample.labels[position] == IGNORE_INDEX
    assert decode(raw, sample.input_ids) == EXPECTED[name]


def test_plain_labels_are_the_caption_and_its_newline(hf, raw):
    sample = encode_conversation(CAPTION, get_template("plain"), hf, 4096, image_id(raw))
    assert sample.input_ids[0] == image_id(raw) and sample.labels[0] == IGNORE_INDEX
    assert [decode(raw, span) for span in trained_spans(sample)] == ["A cat on a sofa.\n"]


@pytest.mark.parametrize("name", ["chatml", "vicuna-v1", "plain"])
def test_segment_ids_equal_whole_string_ids(name, hf, raw):
    """Where the module docstring says they match: segments tokenized apart give the ids of
    the whole rendered string (the tokenizer has <image> as an added token)."""
    conv = CAPTION if name == "plain" else CONV
    template = get_template(name)
    sample = encode_conversation(conv, template, hf, 4096, image_id(raw))
    assert sample.input_ids == hf.encode(render_text(conv, template))


def test_llama3_segment_ids_decode_to_the_whole_string(hf, raw):
    """Llama-3's "\\n\\n" before an answer may tokenize differently with GPT-2's pre-tokenizer
    (documented); the text the ids stand for is the same."""
    template = get_template("llama-3")
    sample = encode_conversation(CONV, template, hf, 4096, image_id(raw))
    whole = hf.encode(render_text(CONV, template))
    assert decode(raw, sample.input_ids) == decode(raw, whole)


# ----------------------------------------------------------------------------- Jinja
CHATML_JINJA = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def write_config(folder: Path, template: str, **tokens) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"chat_template": template, "add_bos_token": False, **tokens}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer_config.json"


@pytest.mark.parametrize(
    ("name", "source", "tokens"),
    [
        ("chatml", CHATML_JINJA, {"eos_token": "<|im_end|>"}),
        (
            "llama-3",
            LLAMA3_JINJA,
            {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>"},
        ),
    ],
)
def test_jinja_chat_template_matches_the_named_template(tmp_path, hf, raw, name, source, tokens):
    config = write_config(tmp_path / name, source, **tokens)
    jinja = get_template(config)
    named = get_template(name)
    for conv in (CONV, Conversation("s", [Turn("system", "Be brief."), *CONV.turns], CONV.images)):
        assert render_text(conv, jinja) == render_text(conv, named)
        ours = encode_conversation(conv, jinja, hf, 4096, image_id(raw))
        theirs = encode_conversation(conv, named, hf, 4096, image_id(raw))
        assert ours == theirs
    # A chat_template.jinja beside the config wins, as in newer model folders.
    (tmp_path / name / "chat_template.jinja").write_text(CHATML_JINJA)
    assert render_text(CONV, load_jinja_template(tmp_path / name)) == EXPECTED["chatml"]


def test_a_folder_holds_a_chat_template_where_load_jinja_template_finds_one(tmp_path):
    """The folder test the config's starting-folder default and data.chat_template's default
    use agrees with the reader: a chat_template.jinja, or a tokenizer_config.json whose
    `chat_template` is a string or a list with a `default`."""
    source = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    configs = {
        "string": ({"chat_template": source}, True),
        "default": ({"chat_template": [{"name": "default", "template": source}]}, True),
        "no-default": ({"chat_template": [{"name": "tool_use", "template": source}]}, False),
        "none": ({"eos_token": "</s>"}, False),
        "empty": ({"chat_template": ""}, False),
    }
    for name, (config, holds) in configs.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        assert holds_chat_template(folder) is holds, name
        if holds:
            load_jinja_template(folder)
        else:
            with pytest.raises(FieldError, match="no 'chat_template' string"):
                load_jinja_template(folder)
    (tmp_path / "jinja").mkdir()
    (tmp_path / "jinja" / "chat_template.jinja").write_text(source)
    assert holds_chat_template(tmp_path / "jinja")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{not json")
    assert not holds_chat_template(tmp_path / "broken") and not holds_chat_template(tmp_path)


def test_jinja_templates_that_cannot_give_exact_masks_are_refused(tmp_path):
    no_prompt = CHATML_JINJA.replace("{{ '<|im_start|>assistant\\n' }}", "")
    jinja = get_template(write_config(tmp_path / "a", no_prompt))
    with pytest.raises(FieldError, match="generation prompt does not end where"):
        jinja.segments(CONV)
    failing = "{{ raise_exception('only user and assistant roles') }}"
    with pytest.raises(FieldError, match="only user and assistant roles"):
        get_template(write_config(tmp_path / "b", failing)).segments(CONV)
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"  # the sandbox stops this
    with pytest.raises(FieldError, match="chat_template"):
        get_template(write_config(tmp_path / "c", escape)).segments(CONV)
    with pytest.raises(FieldError, match="no 'chat_template'"):
        get_template(write_config(tmp_path / "d", ""))


# ----------------------------------------------------------------------------- refusals
def test_all_masked_sample_is_refused(hf, raw):
    no_answer = Conversation("q", [Turn("user", "<image>\nHello?")], ["a.jpg"])  # built by hand
    with pytest.raises(RefusedSample) as info:
        encode_conversation(no_answer, get_template("chatml"), hf, 4096, image_id(raw))
    assert info.value.kind == "no_targets" and "q: every label is masked" in info.value.reason
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
    wrong_count = Conversation("h", CONV.turns, [])  # a tag without its image
    with pytest.raises(RefusedSample) as info:
        encode_conversation(wrong_count, get_template("chatml"), hf, 4096, image_id(raw))
    assert info.value.kind == "image_count"


def test_truncation_never_cuts_an_image_or_returns_no_target(hf, raw):
    template = get_template("chatml")
    full = encode_conversation(CONV, template, hf, 4096, image_id(raw), image_length=5)
    needed = len(full.input_ids) + 4
    image_at = full.input_ids.index(image_id(raw))
    first_target = next(i for i, label in enumerate(full.labels) if label != IGNORE_INDEX)
    kinds = set()
    for max_length in range(1, needed + 2):
        try:
            sample = encode_conversation(
                CONV, template, hf, max_length, image_id(raw), image_length=5
            )
        except RefusedSample as err:
            kinds.add(err.kind)
            if max_length < image_at + 5:
                assert err.kind == "image_cut" and "cuts image 1 of 1" in err.reason
            else:
                assert err.kind == "truncated_no_targets"
            continue
        assert sample.targets > 0
        assert len(sample.input_ids) + 4 <= max_length  # the image counts 5 positions
        assert sample.input_ids == full.input_ids[: len(sample.input_ids)]
        assert max_length >= first_target + 5
    assert kinds == {"image_cut", "truncated_no_targets"}
    assert encode_conversation(CONV, template, hf, needed, image_id(raw), image_length=5) == full


def test_tokenizer_that_does_not_fit_the_template_is_refused(hf, raw):
    with pytest.raises(FieldError, match=r"chatml needs '<\|im_start\|>' as one token"):
        encode_conversation(CONV, get_template("chatml"), ByteTokenizer(), 4096, 300)
    colliding = hf.encode("A")[0]  # an id text also produces
    with pytest.raises(FieldError, match="image_token_id"):
        encode_conversation(CONV, get_template("chatml"), hf, 4096, colliding)
    with pytest.raises(FieldError, match="max_length"):
        encode_conversation(CONV, get_template("chatml"), hf, 0, image_id(raw))


def test_end_to_end_from_files(tmp_path, tok_path, raw):
    """A LLaVA json and a tokenizer folder -> encoded samples, bad records kept as rejects."""
    data = tmp_path / "llava.json"
    broken = with_turns(("human", "Hi"), ("gpt", "Hello."), image="x.jpg")
    text_only = with_turns(("human", "What colour is it?"), ("gpt", "It is grey."))
    data.write_text(json.dumps([LLAVA, broken, {**LLAVA, "id": "cat-2"}, text_only]))
    tokenizer = get_tokenizer(tok_path.parent)
    template = get_template("vicuna-v1")
    samples, rejects = [], []
    for item in scan_conversations(data):
        if isinstance(item, ConversationError):
            rejects.append(item.as_reject())
            continue
        samples.append(encode_conversation(item, template, tokenizer, 1024, image_id(raw)))
    assert [r["kind"] for r in rejects] == ["image_count"] and rejects[0]["path"] == "llava.json[1]"
    assert len(samples) == 3 and samples[0] == samples[1]
    assert [decode(raw, s) for s in trained_spans(samples[0])] == ANSWERS["vicuna-v1"]
    assert image_id(raw) not in samples[2].input_ids
    assert [decode(raw, s) for s in trained_spans(samples[2])] == [" It is grey.</s>"]
