"""The `--vlm` quickstart's data: emoji conversations in LLaVA's format, and the tokenizer that
reads them (a BPE trained on the training conversations, with its chat template).

Each emoji becomes one conversation: a user turn holding the image and a question ("What is
this?" or another phrasing, one per emoji by a hash of its key), and the emoji's name as the
answer:

    {"id": "1f44d-1f3fd", "image": "1f44d-1f3fd.png",
     "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                       {"from": "gpt", "value": "thumbs up, medium skin tone"}]}

The training emoji get the phrasings in turn, so the model learns to answer the question
rather than one string; the held-out emoji (the image-text quickstart's validation split, by
key) are all asked "What is this?", the question the README's figures are about.

The tokenizer is a byte-level BPE (`data.tokenizer.train_bpe`) trained on the training
conversations only, so a held-out name is encoded from pieces seen in training. Its folder
also holds `tokenizer_config.json` with the chat template, as a Hugging Face model folder does,
so training and evaluation read the same template from `data.tokenizer` and cannot disagree:

    [SOT]USER: <image>\\nWhat is this?\\nASSISTANT: thumbs up, medium skin tone[EOT]

The answer follows "ASSISTANT:" after a space, as every word inside a name does, so a word has
one spelling in tokens wherever it stands in a name. [SOT] and [EOT] are the BPE's own special
tokens (one id each, which the template check requires); only the answer and [EOT] are trained.
The image placeholder is one id past the tokenizer's vocabulary, which no text can produce.

The tokenizer folder (`write_bpe_folder`) and the writer of a split's media files beside its
conversations.json (`write_llava_split`) also serve `--vlm-docs` and `--vlm-video`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmtrain.atomic import atomic_write_bytes, atomic_write_text

PROMPTS = ("What is this?", "What is in this picture?", "Which emoji is this?", "Name this emoji.")
EVAL_PROMPT = PROMPTS[0]  # what every held-out emoji is asked
CONVERSATIONS_FILE = "conversations.json"  # written next to the images it names

BOS, EOS = "[SOT]", "[EOT]"  # train_bpe's special tokens (ids 1 and 2)
# Jinja, as tokenizer_config.json stores it; `bos_token` / `eos_token` come from the config.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{{ message.content }}\n"
    "{% elif message.role == 'user' %}USER: {{ message.content }}\n"
    "{% else %}ASSISTANT: {{ message.content }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def prompt_for(key: str) -> str:
    """The question a training emoji is asked: one of PROMPTS, by sha256 of its key (the same
    on every machine)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return PROMPTS[digest[0] % len(PROMPTS)]


def conversation(key: str, name: str, image: str, prompt: str) -> dict[str, Any]:
    """One LLaVA record: the image and a question, answered with the emoji's name."""
    return {
        "id": key,
        "image": image,
        "conversations": [
            {"from": "human", "value": f"<image>\n{prompt}"},
            {"from": "gpt", "value": name},
        ],
    }


def write_conversations(folder: Path, held_out: bool) -> tuple[Path, list[dict[str, Any]]]:
    """`folder/conversations.json` for the `KEY.png` + `KEY.txt` pairs in `folder` (what
    `emoji_data.write_raw` writes); returns its path and the records, in key order. Held-out
    emoji are all asked EVAL_PROMPT, training emoji `prompt_for(key)`."""
    records = []
    for png in sorted(folder.glob("*.png")):
        key = png.stem
        name = (folder / f"{key}.txt").read_text(encoding="utf-8").strip()
        prompt = EVAL_PROMPT if held_out else prompt_for(key)
        records.append(conversation(key, name, png.name, prompt))
    if not records:
        raise FileNotFoundError(f"{folder} holds no KEY.png images to ask about")
    path = folder / CONVERSATIONS_FILE
    atomic_write_text(path, json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    return path, records


@dataclass
class TokenizerFolder:
    """Where `write_tokenizer` put the tokenizer, and the ids the model needs from it."""

    folder: Path  # tokenizer.json + tokenizer_config.json (the chat template)
    vocab_size: int  # ids the tokenizer gives; the image placeholder is this one
    bos_id: int
    eos_id: int

    @property
    def tokenizer(self) -> Path:
        return self.folder / "tokenizer.json"

    @property
    def image_token_id(self) -> int:
        return self.vocab_size


def training_texts(records: list[dict[str, Any]], tag: str = "<image>") -> list[str]:
    """What the BPE learns from: every training conversation as the template renders it, less
    the special tokens and the media tag `tag` (neither is text for the BPE to split). The
    prompts and role names come once per conversation, as in training, so they merge into few
    ids."""
    texts = []
    for record in records:
        question, answer = (turn["value"] for turn in record["conversations"])
        texts.append(f"USER: {question.replace(tag, '')}\nASSISTANT: {answer}\n")
    return texts


def write_tokenizer(
    folder: Path, records: list[dict[str, Any]], vocab_size: int
) -> TokenizerFolder:
    """Train the BPE on the training conversations and write it with its chat template."""
    return write_bpe_folder(folder, training_texts(records), vocab_size)


def write_bpe_folder(folder: Path, texts: list[str], vocab_size: int) -> TokenizerFolder:
    """A byte-level BPE of `texts` (at most `vocab_size` ids) in `folder`, with the chat
    template beside it in `tokenizer_config.json`: the tokenizer folder of every VLM demo."""
    from mmtrain.data.stream.tokenizer import train_bpe

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(texts, vocab_size, folder / "tokenizer.json")
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return TokenizerFolder(folder, tokenizer.vocab_size, tokenizer.sot_id, tokenizer.eot_id)


def write_llava_split(
    folder: Path, samples: Iterable[tuple[str, bytes, dict[str, Any]]]
) -> tuple[Path, list[dict[str, Any]]]:
    """Each sample's media file (its name and bytes) and `folder/conversations.json` of their
    LLaVA records, in the order given; returns its path and the records. The records name
    their files (`"image"` / `"video"`)."""
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for name, data, record in samples:
        atomic_write_bytes(folder / name, data)
        records.append(record)
    path = folder / CONVERSATIONS_FILE
    atomic_write_text(path, json.dumps(records, indent=1) + "\n")
    return path, records


__all__ = [
    "CHAT_TEMPLATE",
    "CONVERSATIONS_FILE",
    "EVAL_PROMPT",
    "PROMPTS",
    "TokenizerFolder",
    "conversation",
    "prompt_for",
    "training_texts",
    "write_bpe_folder",
    "write_conversations",
    "write_llava_split",
    "write_tokenizer",
]
