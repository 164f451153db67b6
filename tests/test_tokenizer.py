"""Tokenizers: id layout (SOT, tokens, EOT, zeros), truncation, round trips, file loading."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from mmtrain.data.stream.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    OpenClipBPE,
    Tokenizer,
    clip_pre_tokenize,
    get_tokenizer,
    train_bpe,
)
from mmtrain.structured import FieldError

MERGES = ["t h", "th e</w>", "c a", "ca t</w>", "o f</w>", "p h", "ph o", "pho t", "phot o</w>"]


def write_merges(path, merges=MERGES, compress=False):
    text = "#version: 0.2\n" + "\n".join(merges) + "\n"
    if compress:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def check_layout(ids: torch.Tensor, sot: int, eot: int) -> None:
    """Every row: SOT first, then non-zero ids, EOT as the last non-padding id, zeros after."""
    assert ids.dtype == torch.long
    for row in ids:
        nonzero = int((row != 0).sum())
        assert row[0] == sot
        assert row[nonzero - 1] == eot
        assert (row[nonzero:] == 0).all()


# ----------------------------------------------------------------------------- byte
def test_byte_tokenizer_ids_follow_the_contract():
    tok = ByteTokenizer()
    ids = tok(["ab", "é"], context_length=6)
    assert ids.tolist() == [[256, 97, 98, 257, 0, 0], [256, 0xC3, 0xA9, 257, 0, 0]]
    assert (tok.vocab_size, tok.pad_id, tok.sot_id, tok.eot_id) == (258, 0, 256, 257)
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_normalises_text():
    tok = ByteTokenizer()
    composed = tok(["caf\u00e9"], 16)
    decomposed = tok(["cafe\u0301"], 16)
    assert torch.equal(composed, decomposed)  # NFC
    messy = tok(["  a\t\n b\x00c\x07 "], 16)
    assert torch.equal(messy, tok(["a bc"], 16))  # whitespace collapsed, NUL and controls gone
    assert tok.decode(messy[0]) == "a bc"


def test_byte_tokenizer_truncates_with_eot_last_and_round_trips():
    tok = ByteTokenizer()
    ids = tok(["x" * 100, "short"], context_length=8)
    assert ids.shape == (2, 8)
    assert ids[0].tolist() == [256] + [ord("x")] * 6 + [257]
    check_layout(ids, 256, 257)
    assert tok.decode(ids[1]) == "short"
    text = "naïve café — 東京"
    assert tok.decode(tok([text], 64)[0]) == text


def test_context_length_below_two_is_rejected():
    with pytest.raises(FieldError, match="context_length"):
        ByteTokenizer()(["a"], 1)


# ----------------------------------------------------------------------------- CLIP BPE
def test_openclip_bpe_vocab_and_known_ids(tmp_path):
    tok = OpenClipBPE(write_merges(tmp_path / "merges.txt"))
    assert tok.vocab_size == 512 + len(MERGES) + 2
    assert tok.sot_id == 512 + len(MERGES)
    assert tok.eot_id == tok.sot_id + 1
    # "!" is id 0 and "a" id 64 (printable bytes first); "a</w>" is 320, as in CLIP.
    assert tok.encode("!") == [256]  # "!</w>"
    assert tok.encode("a") == [320]
    # Merges in the file: the</w> = 512 + 1, cat</w> = 512 + 3, photo</w> = 512 + 8.
    assert tok.encode("The CAT") == [513, 515]
    assert tok.encode("photo of a cat") == [520, 516, 320, 515]
    # Unmerged word: characters, the last one marked end-of-word ("d" = 100 - 33 = 67).
    assert tok.encode("dog") == [67, ord("o") - 33, 256 + ord("g") - 33]


def test_openclip_bpe_cleans_and_splits_like_clip(tmp_path):
    tok = OpenClipBPE(write_merges(tmp_path / "merges.txt.gz", compress=True))
    assert clip_pre_tokenize("it's 42 dogs!!") == ["it", "'s", "4", "2", "dogs", "!!"]
    assert tok.encode("the &amp;  cat") == tok.encode("THE & cat")
    assert tok.decode(tok(["Photo of the  Cat!"], 16)[0]) == "photo of the cat !"
    # ftfy's character fixes, as CLIP applies them: quotes, full width, ligatures, controls.
    assert tok.encode(
        "\u201cThe\u201d \u2018cat\u2019 \uff43\uff41\uff54 \ufb01\x07"
    ) == tok.encode("\"the\" 'cat' cat fi")
    text = "naïve café 東京 2024"
    assert tok.decode(tok([text], 77)[0]) == "naïve café 東京 2 0 2 4"


def test_openclip_bpe_truncation_keeps_eot_and_pads_zero(tmp_path):
    tok = OpenClipBPE(write_merges(tmp_path / "merges.txt"))
    ids = tok(["the cat " * 20, "cat", ""], context_length=10)
    assert ids.shape == (3, 10)
    assert ids[0, -1] == tok.eot_id
    assert ids[1].tolist() == [tok.sot_id, 515, tok.eot_id] + [0] * 7
    assert ids[2].tolist()[:3] == [tok.sot_id, tok.eot_id, 0]
    check_layout(ids, tok.sot_id, tok.eot_id)


def test_openclip_bpe_max_merges_and_bad_files(tmp_path):
    path = write_merges(tmp_path / "merges.txt")
    assert OpenClipBPE(path, max_merges=3).vocab_size == 512 + 3 + 2
    bad = tmp_path / "bad.txt"
    bad.write_text("#version\nt h x\n")
    with pytest.raises(FieldError, match="line 2"):
        OpenClipBPE(bad)
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(FieldError, match="cannot read merges"):
        OpenClipBPE(broken)


# ----------------------------------------------------------------------------- HF tokenizers
CAPTIONS = [
    "a photo of a cat",
    "a photo of a dog on the grass",
    "two cats sleeping on a sofa",
    "a red car parked by the road",
    "a dog chasing a ball in the park",
] * 20


def test_train_bpe_round_trip_and_layout(tmp_path):
    path = tmp_path / "tok" / "tokenizer.json"
    tok = train_bpe(CAPTIONS, vocab_size=300, out_path=path)
    assert path.is_file() and not list(path.parent.glob("*.tmp"))
    assert (tok.pad_id, tok.sot_id, tok.eot_id) == (0, 1, 2)
    assert 259 < tok.vocab_size <= 300
    ids = tok(["a photo of a cat", "naïve café 東京 " * 10], context_length=12)
    check_layout(ids, 1, 2)
    assert ids[1, -1] == 2
    assert tok.decode(ids[0]) == "a photo of a cat"
    # Trained merges make frequent words short.
    assert len(tok.encode("a photo of a cat")) < len("a photo of a cat")
    loaded = get_tokenizer(path)
    assert isinstance(loaded, HFTokenizer)
    assert torch.equal(loaded(["a dog"], 8), tok(["a dog"], 8))


def test_train_bpe_rejects_tiny_vocab(tmp_path):
    with pytest.raises(FieldError, match="vocab_size"):
        train_bpe(CAPTIONS, vocab_size=100, out_path=tmp_path / "t.json")


def test_hf_tokenizer_requires_pad_zero_and_specials(tmp_path):
    path = tmp_path / "tokenizer.json"
    train_bpe(CAPTIONS, vocab_size=280, out_path=path)
    data = json.loads(path.read_text())

    swapped = json.loads(json.dumps(data))
    for token in swapped["added_tokens"]:
        token["content"] = {"[PAD]": "[SOT]", "[SOT]": "[PAD]"}.get(
            token["content"], token["content"]
        )
    vocab = swapped["model"]["vocab"]
    vocab["[PAD]"], vocab["[SOT]"] = vocab["[SOT]"], vocab["[PAD]"]
    (tmp_path / "swapped.json").write_text(json.dumps(swapped))
    with pytest.raises(FieldError, match="pad id 0"):
        HFTokenizer(tmp_path / "swapped.json")

    no_eot = json.loads(json.dumps(data))
    no_eot["added_tokens"] = [t for t in no_eot["added_tokens"] if t["content"] != "[EOT]"]
    no_eot["model"]["vocab"].pop("[EOT]")
    (tmp_path / "no_eot.json").write_text(json.dumps(no_eot))
    with pytest.raises(FieldError, match="end-of-text"):
        HFTokenizer(tmp_path / "no_eot.json")

    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(FieldError, match="cannot load"):
        HFTokenizer(tmp_path / "garbage.json")


# ----------------------------------------------------------------------------- factory
def test_get_tokenizer_dispatch(tmp_path):
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    assert isinstance(get_tokenizer(write_merges(tmp_path / "m.txt")), OpenClipBPE)
    train_bpe(CAPTIONS, vocab_size=280, out_path=tmp_path / "hf" / "tokenizer.json")
    assert isinstance(get_tokenizer(tmp_path / "hf"), HFTokenizer)
    with pytest.raises(FieldError, match="neither 'byte'"):
        get_tokenizer(tmp_path / "missing.json")
    other = tmp_path / "vocab.bin"
    other.write_bytes(b"x")
    with pytest.raises(FieldError, match="unknown tokenizer file type"):
        get_tokenizer(other)


def test_single_string_is_rejected():
    with pytest.raises(TypeError, match="list of texts"):
        ByteTokenizer()("a caption", 8)
