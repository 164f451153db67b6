"""`mmtrain quickstart --vlm-docs`: the drawn pages (deterministic, held-out numbers never on
a training page, inside their pages), their tokens under the run's budget (the same the loader
lays out), the tokenizer (one id per digit), the flags, and a small end-to-end run that writes
the documents block of eval.json."""

from __future__ import annotations

import json

import pytest

from mmtrain.cli import main
from mmtrain.data.stream.chat_templates import IGNORE_INDEX, encode_conversation, get_template
from mmtrain.data.stream.conversations import read_conversations
from mmtrain.data.stream.tokenizer import get_tokenizer
from mmtrain.quickstart.docs_data import (
    ALPHABET,
    EVAL_PROMPT,
    PROMPTS,
    SHAPES,
    make_pages,
    png_bytes,
    render,
    split_numbers,
    write_split,
    write_tokenizer,
)
from mmtrain.quickstart.vlm_docs import (
    VlmDocsConfig,
    docs_spec,
    page_tokens,
    run_vlm_docs,
    train_config,
)


@pytest.fixture(scope="module")
def pages():
    pool, held_out = split_numbers(0, 40)
    return make_pages(pool, "train", 64, 0), make_pages(held_out, "val", 40, 0), held_out


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, pages):
    root = tmp_path_factory.mktemp("docs")
    _, records = write_split(root / "train", pages[0][:16])
    return write_tokenizer(root / "tokenizer", records, VlmDocsConfig().vocab_size)


# ----------------------------------------------------------------------------- data
def test_pages_are_the_same_every_time_and_held_out_numbers_are_new(pages):
    train, val, held_out = pages
    pool_again, held_again = split_numbers(0, 40)
    assert held_again == held_out
    assert not set(pool_again) & set(held_out)
    assert len(pool_again) + len(held_out) == 900 + 9000  # every number of 3 and 4 digits
    again = make_pages(pool_again, "train", 64, 0)
    assert again == train
    assert [png_bytes(p) for p in again[:8]] == [png_bytes(p) for p in train[:8]]
    assert not {p.text for p in train} & {p.text for p in val}
    assert [p.text for p in val] == held_out  # each held-out number once
    assert make_pages(pool_again, "train", 8, 1) != train[:8]  # the seed matters
    assert {p.prompt for p in val} == {EVAL_PROMPT} and {p.prompt for p in train} == set(PROMPTS)


def test_pages_come_in_every_shape_and_size_and_hold_their_number(pages):
    import numpy as np

    train, val, _ = pages
    assert {p.shape for p in train} == {s.name for s in SHAPES}
    assert len({p.font_size for p in train}) >= 4
    for page in train[:16] + val[:8]:
        assert set(page.text) <= set(ALPHABET) and len(page.text) in (3, 4)
        assert "".join(page.lines) == page.text
        image = render(page)
        assert image.size == (page.width, page.height)
        ink = np.asarray(image.convert("L")) < (page.ink + page.paper) / 2
        rows, cols = np.nonzero(ink)
        assert len(rows) > 20, page.key  # the number is drawn ...
        # ... inside the page (nothing touches the edges)
        assert rows.min() > 0 and cols.min() > 0, page.key
        assert rows.max() < page.height - 1 and cols.max() < page.width - 1, page.key


def test_pages_take_their_tokens_within_the_budget(pages, tokens):
    config = VlmDocsConfig()
    spec = docs_spec(tokens, config)
    train, val, _ = pages
    counts = page_tokens(spec, config, train + val)
    assert config.image_min_tokens <= min(counts)
    assert max(counts) <= min(config.image_max_tokens, config.sample_max_tokens)
    by_shape = {p.shape: n for p, n in zip(train, counts, strict=False)}
    # the 1:1 pages are drawn at 96 x 96 (144 tokens) and the budget brings them to 48 x 48
    assert by_shape == {"1:1": 36, "3:1": 12, "2:1": 18, "1:2": 18}


def test_answers_are_one_id_per_digit_and_only_they_are_trained(tmp_path, pages, tokens):
    tokenizer = get_tokenizer(tokens.tokenizer)
    template = get_template(tokens.folder)
    page = pages[1][0]
    path, _ = write_split(tmp_path, [page])
    conv = read_conversations(path)[0]
    assert conv.turns[0].text == f"{EVAL_PROMPT}\n<image>"
    sample = encode_conversation(conv, template, tokenizer, 128, tokens.image_token_id)
    trained = [t for t, label in zip(sample.input_ids, sample.labels, strict=True)
               if label != IGNORE_INDEX]  # fmt: skip
    assert trained[-1] == tokens.eos_id
    assert tokenizer.decode(trained[:-1]).strip() == page.text
    assert len(trained) == len(page.text) + 2  # the space, each digit, [EOT]
    assert len(tokenizer.encode(EVAL_PROMPT)) <= 8  # the prompt merged into few ids (19 bytes)
    assert max(sample.input_ids) <= tokens.image_token_id < tokens.vocab_size + 1


def test_the_training_config_packs_and_budgets_the_pages(tmp_path, tokens):
    from mmtrain.config import config_from_dict
    from mmtrain.quickstart.vlm_docs import DocsPaths

    config = VlmDocsConfig(out=tmp_path)
    run = config_from_dict(train_config(config, DocsPaths(tmp_path), tokens, 100))
    assert run.data.pack and run.data.vision.image_max_tokens == config.image_max_tokens
    assert run.data.val and run.train.steps == 100


# ----------------------------------------------------------------------------- the flags
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--vlm"], "demos"),
        (["--diffusion"], "demos"),
        (["--modalities", "image,audio"], "--modalities"),
        (["--clip", "somewhere"], "--clip"),
        (["--clip-steps", "10"], "--clip-steps"),
        (["--minutes", "0"], "--minutes"),
        (["--limit", "3"], "--limit"),
    ],
)
def test_flags_are_checked_before_anything_runs(tmp_path, capsys, extra, message):
    out = tmp_path / "qs"
    assert main(["quickstart", "--vlm-docs", "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_an_out_folder_that_is_not_ours_is_refused(tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("mine")
    assert main(["quickstart", "--vlm-docs", "--out", str(afile)]) == 2
    assert "--out" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["quickstart", "--vlm-docs", "--out", str(other)]) == 2
    assert "other files" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


# ----------------------------------------------------------------------------- end to end
def test_a_small_run_writes_the_documents_block(tmp_path):
    """A reduced config (64 pages, 8 held out, 30 steps of 8): what the command writes and
    prints, and the loader's tokens per page equal to the budget's. No learning is asserted:
    30 steps read nothing, on any machine."""
    from mmtrain.commands.quickstart import vlm_docs_summary
    from mmtrain.config import config_from_dict
    from mmtrain.data.ingest.inspect import open_shards
    from mmtrain.data.stream.conversation_batches import ConversationBatcher
    from mmtrain.spec import load_spec

    config = VlmDocsConfig(out=tmp_path / "qs", steps=30, batch_size=8, train_pages=64,
                           val_pages=8, fit_budget=False, build_workers=1)  # fmt: skip
    result = run_vlm_docs(config)
    report = json.loads(result.eval_json.read_text())
    documents = report["documents"]
    for name in ("anls", "anls_shuffled_pages", "cer"):
        assert 0.0 <= documents[name] <= 1.0 or name == "cer" and documents[name] >= 0.0, name
    assert documents["n"] == 8 and report["generation"]["n_shuffled"] == 8
    assert documents["anls"] == report["generation"]["anls"]
    by_shape = documents["by_shape"]
    assert set(by_shape) == {s.name for s in SHAPES}
    assert sum(row["n"] for row in by_shape.values()) == 8
    assert all(0.0 <= row["anls"] <= 1.0 for row in by_shape.values())
    assert all(m["generated"] != m["reference"] for m in documents["misread"])
    tokens = documents["page_tokens"]
    assert 4 <= tokens["min"] <= tokens["mean"] <= tokens["max"] <= 40 and tokens["pages"] == 72
    assert report["examples"] and all(e["reference"].isdigit() for e in report["examples"])
    printed = vlm_docs_summary(result)
    assert "ANLS" in printed and "shuffled" in printed and "image_max_tokens 40" in printed
    assert (result.paths.run / "model.safetensors").is_file()
    assert (result.paths.out / "ATTRIBUTION.txt").is_file()

    # the loader lays out each held-out page at the budget's token count
    run = config_from_dict(_run_config(result))
    spec = load_spec(result.paths.spec)
    batcher = ConversationBatcher(run.data, spec)
    decoder = batcher.decoder(spec, train=False)
    sources = open_shards(str(result.paths.val_shards))[2]
    val = make_pages(split_numbers(0, 8)[1], "val", 8, 0)
    loaded = sorted((decoder(sources.read(i), None)["spans"][:, 1].tolist()[0])
                    for i in range(len(sources)))  # fmt: skip
    assert loaded == sorted(page_tokens(spec, config, val))
    # a finished run is not overwritten
    with pytest.raises(Exception, match="already holds a finished quickstart"):
        run_vlm_docs(config)


def _run_config(result) -> dict:
    import yaml

    return yaml.safe_load((result.paths.run / "config.yaml").read_text())
