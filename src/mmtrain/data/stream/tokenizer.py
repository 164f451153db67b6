"""Text -> token ids for the text tower: one protocol, three implementations.

Every tokenizer returns `[N, context_length]` int64 ids laid out as the text stem expects
(see the shared contract): start-of-text, the text's tokens, end-of-text, then zeros. Pad id is
always 0, so "eot" pooling can take the last non-padding position for any tokenizer. Text that
does not fit is truncated and its last position overwritten with end-of-text, so the pooled token
is always an end-of-text token.

- `ByteTokenizer`: UTF-8 bytes as ids (vocab 258), no vocabulary file; the demos' default.
- `HFTokenizer`: a local `tokenizer.json` (HF `tokenizers`); `train_bpe` makes one from captions.
- `OpenClipBPE`: CLIP's lower-cased byte-level BPE, built from the merges file the user provides
  (`bpe_simple_vocab_16e6.txt.gz`), so converted OpenCLIP checkpoints see the ids they were
  trained with.
"""

from __future__ import annotations

import gzip
import html
import os
import tempfile
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from mmtrain.structured import FieldError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "OpenClipBPE",
    "train_bpe",
    "get_tokenizer",
    "pack_ids",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the evaluators need from a tokenizer."""

    vocab_size: int
    pad_id: int  # always 0
    sot_id: int
    eot_id: int

    def __call__(self, texts: Sequence[str], context_length: int) -> torch.Tensor:
        """int64 [len(texts), context_length]: SOT, tokens, EOT, then zeros."""
        ...

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """The text of `ids`, special and padding ids left out."""
        ...


def pack_ids(
    token_lists: Sequence[Sequence[int]], context_length: int, sot_id: int, eot_id: int
) -> torch.Tensor:
    """Lay out token lists as SOT + tokens + EOT + zero padding, truncating with EOT kept last."""
    if context_length < 2:
        raise FieldError(
            "context_length", f"must be at least 2 (SOT and EOT), got {context_length}"
        )
    out = torch.zeros(len(token_lists), context_length, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        ids = [sot_id, *tokens, eot_id]
        if len(ids) > context_length:
            ids = ids[:context_length]
            ids[-1] = eot_id
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _as_id_list(ids: Iterable[int] | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return [int(i) for i in ids.reshape(-1).tolist()]
    return [int(i) for i in ids]


def _check_texts(texts: Sequence[str]) -> None:
    if isinstance(texts, str):
        raise TypeError("tokenizers take a list of texts; wrap a single text as [text]")


# ----------------------------------------------------------------------------- bytes
class ByteTokenizer:
    """UTF-8 bytes as token ids: byte b (1..255) -> id b, pad 0, SOT 256, EOT 257.

    Text is NFC-normalised (so "e" + combining accent and "é" give the same ids), runs of
    whitespace become one space, and control characters (NUL included) are dropped: they carry
    no meaning in captions and would otherwise collide with the padding id.
    """

    vocab_size = 258
    pad_id = 0
    sot_id = 256
    eot_id = 257

    def __init__(self, keep_layout: bool = False):
        # A language model reads chat templates whose newlines and spaces are part of the
        # format: `keep_layout` keeps every character but NUL (the padding id).
        self.keep_layout = keep_layout

    def normalize(self, text: str) -> str:
        text = unicodedata.normalize("NFC", text)
        if self.keep_layout:
            return text.replace("\0", "")
        # Control characters that are whitespace (tab, newline) separate words; others go.
        kept = (ch for ch in text if ch.isspace() or unicodedata.category(ch) != "Cc")
        return " ".join("".join(kept).split())

    def encode(self, text: str) -> list[int]:
        return list(self.normalize(text).encode("utf-8"))

    def __call__(self, texts: Sequence[str], context_length: int) -> torch.Tensor:
        _check_texts(texts)
        return pack_ids([self.encode(t) for t in texts], context_length, self.sot_id, self.eot_id)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        # A truncated sequence can end inside a multi-byte character: replace, never raise.
        data = bytes(i for i in _as_id_list(ids) if 0 < i < 256)
        return data.decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- HF tokenizers
# Names accepted for the three special tokens of a tokenizer.json, first match wins.
_PAD_NAMES = ("[PAD]", "<pad>", "<|pad|>")
_SOT_NAMES = ("[SOT]", "<start_of_text>", "<|startoftext|>", "<s>", "[CLS]", "<bos>")
_EOT_NAMES = ("[EOT]", "<end_of_text>", "<|endoftext|>", "</s>", "[SEP]", "<eos>")


class HFTokenizer:
    """A local `tokenizer.json` read with the HF `tokenizers` library.

    For a text encoder (CLIP-style rows) the file must define a padding token with id 0 and
    start/end-of-text tokens (`[PAD]`, `[SOT]`, `[EOT]` as `train_bpe` writes them, or the usual
    alternatives such as `<pad>`, `<s>`, `</s>`). Special tokens are added here, not by the
    file's post-processor, so the layout matches every other tokenizer.

    A decoder LM's tokenizer (Llama, Qwen2, Vicuna: `language_model=True`) only encodes and
    decodes: its chat template places the special tokens, and batches mask padding whatever
    its id. Its specials are not required; `decode` leaves them out.
    """

    pad_id = 0

    def __init__(self, path: str | Path, language_model: bool = False):
        from tokenizers import Tokenizer as _HFTokenizer  # heavy import, only when used

        self.path = Path(path)
        try:
            tok = _HFTokenizer.from_file(str(self.path))
        except Exception as err:  # tokenizers raises its own Exception type with the reason
            raise FieldError("tokenizer", f"cannot load {self.path}: {err}") from None
        tok.no_padding()
        tok.no_truncation()
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.language_model = language_model
        if language_model:
            return
        pad_id = self._find_special(_PAD_NAMES, "padding")
        if pad_id != 0:
            raise FieldError(
                "tokenizer",
                f"{self.path}: padding token {tok.id_to_token(pad_id)!r} has id {pad_id}; mmtrain "
                "needs pad id 0 (retrain with `train_bpe`, which puts [PAD] first)",
            )
        self.sot_id = self._find_special(_SOT_NAMES, "start-of-text")
        self.eot_id = self._find_special(_EOT_NAMES, "end-of-text")

    def _find_special(self, names: Sequence[str], role: str) -> int:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        raise FieldError(
            "tokenizer", f"{self.path} has no {role} token; expected one of {', '.join(names)}"
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def __call__(self, texts: Sequence[str], context_length: int) -> torch.Tensor:
        if self.language_model:
            raise TypeError(f"{self.path} was loaded for a language model: encode() only")
        _check_texts(texts)
        # One text at a time: `encode_batch` starts the library's thread pool, which then makes
        # every fork of a DataLoader worker print a parallelism warning and run single-threaded.
        ids = [self.encode(t) for t in texts]
        return pack_ids(ids, context_length, self.sot_id, self.eot_id)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        if self.language_model:
            return self._tok.decode(_as_id_list(ids), skip_special_tokens=True)
        special = {self.pad_id, self.sot_id, self.eot_id}
        return self._tok.decode([i for i in _as_id_list(ids) if i not in special])


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | Path) -> HFTokenizer:
    """Train a byte-level BPE on `texts` and save it as `out_path` (a tokenizer.json).

    Special tokens: [PAD] = 0, [SOT] = 1, [EOT] = 2. Byte-level pre-tokenisation means any text
    can be encoded later (no unknown token). The vocabulary can end up smaller than `vocab_size`
    on a small corpus; read `.vocab_size` of the result. The file is written atomically.
    """
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + 3
    if vocab_size < minimum:
        raise FieldError(
            "vocab_size", f"{vocab_size} is too small for a byte-level BPE; use >= {minimum}"
        )
    tok = _HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["[PAD]", "[SOT]", "[EOT]"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _save_atomic(tok.to_str(), out_path)
    return HFTokenizer(out_path)


def _save_atomic(text: str, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- CLIP BPE
# CLIP's vocabulary: 49152 - 256 - 2 = 48894 merges of the published file are used.
CLIP_MAX_MERGES = 48894
_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


def byte_to_unicode_table() -> dict[int, str]:
    """A reversible map of the 256 byte values to printable characters (GPT-2/CLIP's scheme).

    Bytes that are printable Latin-1 characters map to themselves; the remaining 68 bytes
    (controls, space, a few others) map, in byte order, to code points 256, 257, ... so BPE
    never sees whitespace or control characters. The dict's order (printable bytes first, then
    the others) is the order of the first 256 vocabulary entries: id 0 is "!".
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table  # insertion order (printable bytes first) fixes the vocabulary ids


def _char_class(ch: str) -> str:
    """L(etter), N(umber), S(pace) or O(ther), the classes of CLIP's pre-tokeniser."""
    if ch.isspace():
        return "S"
    return {"L": "L", "N": "N"}.get(unicodedata.category(ch)[0], "O")


def clip_pre_tokenize(text: str) -> list[str]:
    """Split cleaned text into words the way CLIP's pattern does.

    At each position, in order: an English contraction ('s 't 're 've 'm 'll 'd), a run of
    letters, a single number character, or a run of other non-space characters; spaces
    separate words and are dropped. (A hand-written scanner: the stdlib `re` has no \\p{L}.)
    """
    words: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        kind = _char_class(ch)
        if kind == "S":
            i += 1
            continue
        if ch == "'":
            match = next((c for c in _CONTRACTIONS if text.startswith(c, i)), None)
            if match:
                words.append(match)
                i += len(match)
                continue
        j = i + 1
        if kind in ("L", "O"):
            while j < n and _char_class(text[j]) == kind:
                j += 1
        words.append(text[i:j])
        i = j
    return words


def _typography_table() -> dict[int, str | None]:
    """Character-level clean-ups that CLIP's ftfy pass applies to every caption.

    Curly quotes become straight ones, full-width forms (and the ideographic space) their
    ordinary-width equivalents, Latin ligatures their letters, and invisible control
    characters (C0 controls other than whitespace, DEL, deprecated format controls, the BOM,
    interlinear annotation marks) disappear. ftfy's mojibake repair is not reproduced: it is
    a heuristic that belongs in ingest, where it runs once per caption.
    """
    table: dict[int, str | None] = {0x02BC: "'", 0x3000: " "}
    table.update({c: "'" for c in range(0x2018, 0x201C)})
    table.update({c: '"' for c in range(0x201C, 0x2020)})
    for c in range(0xFF01, 0xFFF0):
        folded = unicodedata.normalize("NFKC", chr(c))
        if folded != chr(c):
            table[c] = folded
    ligatures = {"ﬀ": "ff", "ﬁ": "fi", "ﬂ": "fl", "ﬃ": "ffi", "ﬄ": "ffl", "ﬅ": "ſt", "ﬆ": "st"}
    ligatures.update({"Ĳ": "IJ", "ĳ": "ij", "ŉ": "ʼn", "Ǳ": "DZ", "ǲ": "Dz", "ǳ": "dz"})
    ligatures.update({"Ǆ": "DŽ", "ǅ": "Dž", "ǆ": "dž", "Ǉ": "LJ", "ǈ": "Lj", "ǉ": "lj"})
    ligatures.update({"Ǌ": "NJ", "ǋ": "Nj", "ǌ": "nj"})
    table.update({ord(k): v for k, v in ligatures.items()})
    controls = [*range(0x00, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F, *range(0x206A, 0x2070)]
    controls += [0xFEFF, *range(0xFFF9, 0xFFFD)]
    table.update({c: None for c in controls})
    return table


_TYPOGRAPHY = _typography_table()


def clip_clean(text: str) -> str:
    """CLIP's caption clean-up: typography folded (see `_typography_table`), NFC, HTML
    entities resolved, whitespace collapsed, lower-cased."""
    text = unicodedata.normalize("NFC", text.translate(_TYPOGRAPHY))
    text = html.unescape(html.unescape(text))
    text = " ".join(text.split())
    return text.lower()


class OpenClipBPE:
    """CLIP's byte-level BPE (49408 ids with the published merges file).

    Vocabulary order, which fixes the ids: the 256 byte characters, the same followed by
    `</w>` (end of word), one entry per merge (the two halves joined), then `<start_of_text>`
    and `<end_of_text>`. Ids 0.. are byte characters, so CLIP's pad id 0 is the character "!";
    padding is still unambiguous because it only ever follows the end-of-text token.

    Literal "<start_of_text>" in a caption is encoded as text, not as the special token, so
    captions cannot inject control tokens.
    """

    pad_id = 0

    def __init__(self, merges_path: str | Path, max_merges: int = CLIP_MAX_MERGES):
        self.path = Path(merges_path)
        merges = _read_merges(self.path, max_merges)
        self._byte_char = byte_to_unicode_table()
        self._char_byte = {c: b for b, c in self._byte_char.items()}
        chars = list(self._byte_char.values())
        vocab = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges]
        vocab += ["<start_of_text>", "<end_of_text>"]
        self._id_of = {tok: i for i, tok in enumerate(vocab)}
        if len(self._id_of) != len(vocab):
            raise FieldError(
                "tokenizer", f"{self.path}: merges produce duplicate vocabulary entries"
            )
        self._token_of = vocab
        self._rank = {pair: i for i, pair in enumerate(merges)}
        self.vocab_size = len(vocab)
        self.sot_id = self._id_of["<start_of_text>"]
        self.eot_id = self._id_of["<end_of_text>"]
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, word: str) -> list[str]:
        """Merge the characters of `word` (last one marked end-of-word) by merge rank."""
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pairs = {(a, b) for a, b in zip(parts, parts[1:], strict=False)}
            best = min(pairs, key=lambda p: self._rank.get(p, len(self._rank)))
            if best not in self._rank:
                break
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def _word_ids(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is None:
            chars = "".join(self._byte_char[b] for b in word.encode("utf-8"))
            ids = [self._id_of[t] for t in self._bpe(chars)]
            if len(self._cache) < 100_000:  # bounded: captions have a long tail of rare words
                self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        return [i for word in clip_pre_tokenize(clip_clean(text)) for i in self._word_ids(word)]

    def __call__(self, texts: Sequence[str], context_length: int) -> torch.Tensor:
        _check_texts(texts)
        return pack_ids([self.encode(t) for t in texts], context_length, self.sot_id, self.eot_id)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Text of `ids`; stops at the end-of-text token (what follows is padding)."""
        data = bytearray()
        for i in _as_id_list(ids):
            if i == self.eot_id:
                break
            if i == self.sot_id or not 0 <= i < self.vocab_size:
                continue
            token = self._token_of[i]
            word_end = token.endswith("</w>")
            data += bytes(self._char_byte[c] for c in token.removesuffix("</w>"))
            if word_end:
                data += b" "
        return data.decode("utf-8", errors="replace").strip()


def _read_merges(path: Path, max_merges: int) -> list[tuple[str, str]]:
    """Merge pairs of a CLIP merges file (.txt or .txt.gz): a header line, then 'a b' lines."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        lines = raw.decode("utf-8").split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise FieldError("tokenizer", f"cannot read merges file {path}: {err}") from None
    merges: list[tuple[str, str]] = []
    for number, line in enumerate(lines[1:], start=2):  # line 1 is a version header
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise FieldError("tokenizer", f"{path} line {number}: expected 'a b', got {line!r}")
        merges.append((parts[0], parts[1]))
        if len(merges) == max_merges:
            break
    return merges


# ----------------------------------------------------------------------------- factory
def get_tokenizer(name_or_path: str | Path, language_model: bool = False) -> Tokenizer:
    """`"byte"`, a `tokenizer.json` file (or a folder holding one), or a CLIP merges file
    (`.txt` / `.txt.gz`, e.g. OpenCLIP's `bpe_simple_vocab_16e6.txt.gz`).

    `language_model`: for a decoder LM's conversations (text keeps its layout; an HF
    tokenizer needs no padding / start / end tokens of its own)."""
    text = str(name_or_path)
    if text.lower() == "byte":
        return ByteTokenizer(keep_layout=language_model)
    path = Path(text)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FieldError(
            "tokenizer",
            f"{text!r} is neither 'byte' nor an existing file (a tokenizer.json or a CLIP merges "
            "file such as bpe_simple_vocab_16e6.txt.gz)",
        )
    if path.suffix == ".json":
        return HFTokenizer(path, language_model=language_model)
    if path.name.endswith((".txt", ".txt.gz")):
        return OpenClipBPE(path)
    raise FieldError(
        "tokenizer", f"{path}: unknown tokenizer file type; use .json, .txt or .txt.gz"
    )
