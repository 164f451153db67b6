"""Language-model evaluation: answer scores, perplexity, the image-shuffle check, and the
`mmtrain eval` / `mmtrain generate` / `mmtrain report` paths for a vision-language model.

The model is a real tiny VLM (ViT tower, MLP projector, Llama-style decoder) trained here in a
few dozen steps to name the colour of a solid image; the data are real tar shards of
conversations with real PNG members, the tokenizer a real byte-level BPE with chat tokens.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from tokenizers import Tokenizer as RawTokenizer

import mmtrain
from dist_helpers import run_distributed
from mmtrain.cli import main
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.chat_templates import IGNORE_INDEX, encode_conversation, get_template
from mmtrain.data.stream.conversations import Conversation, Turn
from mmtrain.data.stream.tokenizer import HFTokenizer, train_bpe
from mmtrain.data.stream.transforms import ImageTransform
from mmtrain.eval.answers import (
    anls,
    character_edits,
    choice_accuracy,
    exact_match,
    normalize_answer,
    relaxed_accuracy,
    token_f1,
)
from mmtrain.eval.generation import VLMEvaluator, derangement, perplexity, target_nll
from mmtrain.report import build_report
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

COLOURS = {
    "red": (220, 20, 20),
    "green": (20, 200, 40),
    "blue": (30, 40, 230),
    "yellow": (240, 230, 20),
}
QUESTION = "What colour is this?"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<image>"]
IMAGE_SIZE = 16


# ----------------------------------------------------------------------------- answer scores
@pytest.mark.parametrize(
    "prediction, reference, f1, em",
    [
        ("a grey cat", "the cat is grey", 0.8, 0.0),  # P 2/2, R 2/3
        ("The Cat!", "cat", 1.0, 1.0),  # case, article, punctuation
        ("cat cat", "cat", 2 / 3, 0.0),  # tokens are a multiset: P 1/2, R 1
        ("Don't stop", "dont  stop", 1.0, 1.0),  # punctuation deleted as SQuAD does
        ("\u201cYes\u201d\u2014", "yes", 1.0, 1.0),  # Unicode quotes and dash
        ("dog", "cat", 0.0, 0.0),
        ("", "", 1.0, 1.0),
        ("", "cat", 0.0, 0.0),
        ("the", "a", 1.0, 1.0),  # nothing left of either after articles go
    ],
)
def test_token_f1_and_exact_match_on_known_strings(prediction, reference, f1, em):
    assert token_f1(prediction, reference) == pytest.approx(f1, rel=1e-12)
    assert token_f1(reference, prediction) == pytest.approx(f1, rel=1e-12)  # symmetric
    assert exact_match(prediction, reference) == em


# Hand-computed: "hello wrld" is 1 edit from "hello world" (11 characters): 1 - 1/11.
@pytest.mark.parametrize(
    "prediction, references, score",
    [
        ("hello wrld", "hello world", 1 - 1 / 11),
        ("  Total:   42 ", ["TOTAL: 42", "forty-two"], 1.0),  # case and spaces; best reference
        ("abcd", "abxy", 0.0),  # 2 edits of 4: at the 0.5 threshold, no credit
        ("abcde", "abxye", 0.6),  # 2 of 5
        ("", "", 1.0),
        ("x", "", 0.0),
    ],
)
def test_anls_is_docvqas_thresholded_similarity(prediction, references, score):
    assert anls(prediction, references) == pytest.approx(score, rel=1e-12)


@pytest.mark.parametrize(
    "prediction, reference, right",
    [
        ("10.4", "10", 1.0),  # 4 % off
        ("10.6", "10", 0.0),  # 6 % off
        ("47%", "45%", 1.0),  # 4.4 % off, the % sign ignored
        ("0.0", "0", 1.0),
        ("0.01", "0", 0.0),  # a zero reference needs zero
        ("1,200", "1200", 1.0),
        (" Yes", "yes", 1.0),  # not numbers: exact, lower-cased
        ("Yes.", "yes", 0.0),
    ],
)
def test_relaxed_accuracy_is_chartqas(prediction, reference, right):
    assert relaxed_accuracy(prediction, reference) == right


def test_character_edits_and_choices():
    assert character_edits("kitten", "sitting") == (3, 7)  # k->s, e->i, +g
    assert character_edits(" page one ", "page one") == (0, 8)
    assert choice_accuracy("The best answer is B.", "B") == 1.0
    assert choice_accuracy("(C) a red car", "B") == 0.0
    assert choice_accuracy("answer: D", "(D)") == 1.0
    assert choice_accuracy("B", "a red car") is None  # not a multiple-choice reference
    assert choice_accuracy("I cannot tell", "A") == 0.0


def test_normalize_answer():
    assert normalize_answer("  An Apple, the  Pear and A plum. ") == "apple pear and plum"


def test_derangement_moves_every_item_within_its_group():
    groups = [1, 1, 2, 1, 2, 2, 3, 1, None]
    partners = derangement(groups, seed=7)
    assert partners == derangement(groups, seed=7)  # a pure function of its inputs
    for i, p in enumerate(partners):
        if groups.count(groups[i]) == 1:
            assert p is None  # alone in its group: nothing to swap with
        else:
            assert p != i and groups[p] == groups[i]
    moved = [p for p in partners if p is not None]
    assert len(moved) == len(set(moved))  # a permutation: every image used once
    seeds = {tuple(derangement(list(range(1)) * 9, seed=s)) for s in range(6)}
    assert len(seeds) > 1  # the seed matters


def test_target_nll_and_perplexity_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([[IGNORE_INDEX, 3, IGNORE_INDEX, 1], [IGNORE_INDEX] * 3 + [4]])
    # logits at t score labels[t + 1]
    picks = [(0, 0, 3), (0, 2, 1), (1, 2, 4)]
    want = -sum(float(torch.log_softmax(logits[r, t], -1)[y]) for r, t, y in picks)
    total, count = target_nll(logits, labels)
    assert count == 3
    assert total == pytest.approx(want, rel=1e-12)
    assert perplexity(total, count) == pytest.approx(math.exp(want / 3), rel=1e-12)
    assert math.isnan(perplexity(0.0, 0))


# ----------------------------------------------------------------------------- fixtures
def _png(rgb: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rgb).save(out, "PNG")
    return out.getvalue()


def _record(key: str, answer: str, images: int = 1) -> dict:
    tags = "<image>\n" * images
    return {
        "id": key,
        "messages": [
            {"role": "user", "content": tags + QUESTION},
            {"role": "assistant", "content": answer},
        ],
        "images": [f"{i}.png" for i in range(images)],
    }


def write_conversations(folder: Path, items: list[tuple[str, str]], extra=()) -> Path:
    """Shards with one conversation per (key, colour), its image as member `key.0.png`."""
    with ShardWriter(folder, max_samples=3) as writer:
        for key, colour in items:
            writer.write(
                {
                    "__key__": key,
                    "json": json.dumps(_record(key, colour)),
                    "0.png": _png(COLOURS[colour]),
                }
            )
        for sample in extra:
            writer.write(sample)
    return folder


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    corpus = [f"{QUESTION} {' '.join(COLOURS)} You are a helpful assistant. system user"] * 20
    train_bpe(corpus, vocab_size=320, out_path=path)
    raw = RawTokenizer.from_file(str(path))
    raw.add_special_tokens(CHAT_TOKENS)
    raw.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path) -> HFTokenizer:
    return HFTokenizer(tokenizer_path)


@pytest.fixture(scope="module")
def spec(tokenizer) -> ModelSpec:
    return ModelSpec.from_dict(
        {
            "name": "tiny-vlm",
            "embed_dim": 32,
            "objective": "next_token",
            "towers": {
                "image": {
                    "modality": "image",
                    "stem": {"image_size": IMAGE_SIZE, "patch_size": 8},
                    "width": 32,
                    "layers": 2,
                    "heads": 2,
                    "output_proj": False,
                }
            },
            "decoder": {
                "vocab_size": tokenizer.vocab_size,
                "width": 32,
                "layers": 2,
                "heads": 2,
                "mlp_hidden": 64,
                "eos_ids": [tokenizer.encode("<|im_end|>")[0]],
            },
            "projector": {
                "image_token_id": tokenizer.encode("<image>")[0],
                "kind": "mlp",
                "feature_layer": -1,
            },
        }
    )


@pytest.fixture(scope="module")
def val_dir(tmp_path_factory) -> Path:
    items = [(f"c{i}", colour) for i, colour in enumerate(COLOURS)]
    return write_conversations(tmp_path_factory.mktemp("val"), items)


@contextlib.contextmanager
def one_thread():
    # Tiny matmuls on a shared 2-core machine: threads only contend (seconds -> minutes).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _training_batch(spec, tokenizer) -> dict[str, torch.Tensor]:
    template = get_template("chatml")
    image_id = spec.projector.image_token_id
    rows = [
        encode_conversation(
            Conversation(c, [Turn("user", "<image>\n" + QUESTION), Turn("assistant", c)], ["0"]),
            template,
            tokenizer,
            256,
            image_id,
            image_length=spec.image_tokens(),
        )
        for c in COLOURS
    ]
    width = max(len(r.input_ids) for r in rows)
    text = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX)
    for i, r in enumerate(rows):
        text[i, : len(r.input_ids)] = torch.tensor(r.input_ids)
        labels[i, : len(r.labels)] = torch.tensor(r.labels)
    transform = ImageTransform(IMAGE_SIZE, train=False)
    images = torch.stack([transform.decode(_png(rgb)) for rgb in COLOURS.values()])
    return {"text": text, "image": images, "labels": labels}


@pytest.fixture(scope="module")
def trained(spec, tokenizer):
    """The tiny VLM after 60 AdamW steps on the four colour questions (about 2 s)."""
    model = mmtrain.create_model(spec, seed=0)
    batch = _training_batch(spec, tokenizer)
    labels = batch.pop("labels")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    with one_thread():
        for _ in range(60):
            logits = model(batch)["logits"]
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, trained, tokenizer_path, val_dir) -> Path:
    """A run folder as `mmtrain train` leaves it: final weights, spec and config.yaml."""
    folder = tmp_path_factory.mktemp("run")
    mmtrain.save_model(trained, folder)
    config = {
        "data": {
            "train": [{"path": str(val_dir)}],
            "val": [{"path": str(val_dir)}],
            "tokenizer": str(tokenizer_path),
            "chat_template": "chatml",
        }
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


# ----------------------------------------------------------------------------- the evaluator
def test_trained_model_answers_better_with_its_own_images(spec, trained, tokenizer, val_dir):
    evaluator = VLMEvaluator(
        spec, val_dir, batch_size=3, tokenizer=tokenizer, chat_template="chatml", max_new_tokens=4
    )
    with one_thread():
        report = evaluator.report(trained)
    evaluator.close()
    generation = report["generation"]
    assert generation["n"] == generation["n_shuffled"] == 4
    # Four different colours: with another sample's image, a model that reads the image names
    # that image's colour, which is the wrong answer for the question's sample.
    assert generation["token_f1"] >= 0.75
    assert generation["token_f1_shuffled_images"] <= 0.25
    assert generation["token_f1"] > generation["token_f1_shuffled_images"]
    assert report["perplexity"] < 2.0  # it learned the answers
    # the document scores of the same answers: a model that names the colours reads them too
    assert generation["anls"] >= 0.75 and generation["relaxed_accuracy"] >= 0.75
    assert 0 <= generation["cer"] <= 0.25 and generation["n_choice"] == 0  # no option letters
    by_key = {e["key"]: e for e in report["examples"]}
    assert sorted(by_key) == ["c0", "c1", "c2", "c3"]
    for example in by_key.values():
        assert example["prompt"].endswith("<|im_start|>assistant\n")
        assert example["question"] == "<image>\n" + QUESTION
        if example["exact_match"]:
            assert example["generated"] == example["reference"]
    assert report["skipped_samples"] == report["corrupt_samples"] == 0


def test_perplexity_is_exp_of_the_mean_nll_computed_by_hand(spec, trained, tokenizer, tmp_path):
    """float64 model, batches of 2 with padding, one refused sample: the report's perplexity
    equals exp(mean NLL) over each conversation scored alone."""
    model = copy.deepcopy(trained).to(torch.float64)
    items = [("b0", "green"), ("a1", "red"), ("c2", "blue")]
    broken = {
        "__key__": "z9",
        "json": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    }
    data = write_conversations(tmp_path / "val", items, extra=[broken])
    evaluator = VLMEvaluator(
        spec, data, batch_size=2, tokenizer=tokenizer, chat_template="chatml", max_new_tokens=2
    )
    with one_thread():
        report = evaluator.report(model)
    evaluator.close()
    assert report["n_samples"] == 3 and report["skipped_samples"] == 1

    transform = ImageTransform(IMAGE_SIZE, train=False)
    total, tokens = 0.0, 0
    for key, colour in items:
        conv = Conversation(
            key, [Turn("user", "<image>\n" + QUESTION), Turn("assistant", colour)], ["0"]
        )
        encoded = encode_conversation(
            conv, get_template("chatml"), tokenizer, 10_000, spec.projector.image_token_id,
            image_length=spec.image_tokens(),
        )  # fmt: skip
        batch = {
            "text": torch.tensor([encoded.input_ids]),
            "image": transform.decode(_png(COLOURS[colour]))[None].double(),
        }
        with torch.no_grad():
            log_probs = torch.log_softmax(model(batch)["logits"][0].double(), dim=-1)
        for t in range(len(encoded.labels) - 1):
            target = encoded.labels[t + 1]
            if target != IGNORE_INDEX:
                total -= float(log_probs[t, target])
                tokens += 1
    assert report["target_tokens"] == tokens
    assert report["perplexity"] == pytest.approx(math.exp(total / tokens), rel=1e-9)


def test_evaluator_refuses_bad_settings(spec, tokenizer, val_dir):
    clip = mmtrain.create_model("tiny-clip").spec
    with pytest.raises(FieldError, match="no decoder"):
        VLMEvaluator(clip, val_dir, batch_size=2)
    # The byte tokenizer splits <|im_start|> into bytes: every sample would be mistrained.
    with pytest.raises(FieldError, match="chat_template"):
        VLMEvaluator(spec, val_dir, batch_size=2, tokenizer="byte", chat_template="chatml")
    with pytest.raises(FieldError, match="data"):
        VLMEvaluator(spec, val_dir / "nothing", batch_size=2, tokenizer=tokenizer)


def _rank_report(rank: int, world_size: int, model_dir: str, tokenizer: str, data: str) -> dict:
    model = mmtrain.load_model(model_dir, dtype=torch.float64)
    spec = model.spec
    if world_size > 1:  # as the training loop hands it over: wrapped in DDP
        model = torch.nn.parallel.DistributedDataParallel(model)
    evaluator = VLMEvaluator(
        spec,
        data,
        batch_size=2,
        tokenizer=tokenizer,
        chat_template="chatml",
        max_new_tokens=3,
    )
    report = evaluator.report(model)
    evaluator.close()
    return report


@pytest.mark.slow
def test_two_ranks_report_what_one_process_reports(run_dir, tokenizer_path, tmp_path):
    """5 conversations on 2 gloo ranks with a DDP-wrapped model (3 + 2 samples, so one rank
    runs a padded forward to stay in step): sums all-reduced, answers gathered in key order;
    float64, so the numbers agree to rounding."""
    colours = list(COLOURS)
    data = write_conversations(tmp_path / "val", [(f"k{i}", colours[i % 4]) for i in range(5)])
    args = (str(run_dir), str(tokenizer_path), str(data))
    single = _rank_report(0, 1, *args)
    reports = run_distributed(_rank_report, world_size=2, args=args)
    assert reports[0] == reports[1]
    for name in ("perplexity", "nll_per_token"):
        assert reports[0][name] == pytest.approx(single[name], rel=1e-9)
    assert reports[0]["target_tokens"] == single["target_tokens"]
    assert reports[0]["generation"] == single["generation"]
    assert reports[0]["examples"] == single["examples"]


# ----------------------------------------------------------------------------- command line
def test_generate_command_answers_from_the_image(run_dir, tmp_path, capsys):
    image = tmp_path / "blue.png"
    image.write_bytes(_png(COLOURS["blue"]))
    with one_thread():
        code = main(["generate", str(run_dir), "--image", str(image), "--prompt", QUESTION])
    out = capsys.readouterr().out.strip()
    assert code == 0
    assert out == "blue"  # decoded by the run's tokenizer, stopped at <|im_end|>
    with one_thread():  # the same with the tag written out, and with sampling at a seed
        assert (
            main(
                [
                    "generate",
                    str(run_dir),
                    "--image",
                    str(image),
                    "--prompt",
                    "<image>\n" + QUESTION,
                ]
            )
            == 0
        )
        assert capsys.readouterr().out.strip() == "blue"
        sampled = ["--temperature", "1.0", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "6"]
        main(["generate", str(run_dir), "--image", str(image), "--prompt", QUESTION, *sampled])
        first = capsys.readouterr().out
        main(["generate", str(run_dir), "--image", str(image), "--prompt", QUESTION, *sampled])
        assert capsys.readouterr().out == first  # seeded: reproducible


def test_generate_command_refuses_bad_input(run_dir, tmp_path, capsys):
    image = tmp_path / "red.png"
    image.write_bytes(_png(COLOURS["red"]))
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    clip_dir = mmtrain.save_model(mmtrain.create_model("tiny-clip"), tmp_path / "clip")
    cases = [
        (["--image", str(tmp_path / "missing.jpg"), "--prompt", "x"], "no such file"),
        (["--image", str(image), "--prompt", "<image> and <image>?"], "2 <image> tag"),
        (["--image", str(not_image), "--prompt", "x"], "cannot be read as an image"),
        (["--image", str(image), "--prompt", "x", "--top-p", "0"], "--top-p"),
    ]
    for args, words in cases:
        assert main(["generate", str(run_dir), *args]) == 2
        assert words in capsys.readouterr().err
    assert main(["generate", str(clip_dir), "--image", str(image), "--prompt", "x"]) == 2
    assert "not a language model" in capsys.readouterr().err


@pytest.fixture(scope="module")
def built_val(tmp_path_factory) -> Path:
    """Validation shards as users make them: `mmtrain data build` on a LLaVA json."""
    folder = tmp_path_factory.mktemp("llava")
    records = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        (folder / f"{name}.png").write_bytes(_png(rgb))
        turns = [
            {"from": "human", "value": "<image>\n" + QUESTION},
            {"from": "gpt", "value": name},
        ]
        records.append({"id": f"q{i}", "image": f"{name}.png", "conversations": turns})
    (folder / "chat.json").write_text(json.dumps(records))
    assert main(["data", "build", str(folder / "chat.json"), "--out", str(folder / "shards")]) == 0
    return folder / "shards"


def test_eval_command_writes_generation_block_and_report_shows_gallery(run_dir, built_val, capsys):
    with one_thread():
        code = main(["eval", str(run_dir), "--data", str(built_val), "--batch-size", "3"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "perplexity" in printed and "token F1" in printed
    report = json.loads((run_dir / "eval.json").read_text())
    generation = report["generation"]
    assert set(generation) >= {"token_f1", "token_f1_shuffled_images", "exact_match", "n"}
    assert generation["n"] == 4
    assert generation["token_f1"] > generation["token_f1_shuffled_images"]
    assert report["model_name"] == "tiny-vlm" and report["examples"]
    # examples name the source record too (the build keys samples by position)
    assert {e["id"] for e in report["examples"]} <= {f"q{i}" for i in range(4)}
    assert np.isfinite(report["perplexity"])
    # CLIP-only options are refused for a language model.
    assert main(["eval", str(run_dir), "--data", str(built_val), "--probe"]) == 2
    assert "not for a language model" in capsys.readouterr().err

    html = build_report(run_dir)
    gallery = [p for p in html.plots if p.name == "gallery_generation"]
    assert len(gallery) == 1 and gallery[0].png is not None, gallery
    assert (run_dir / "report_gallery_generation.png").is_file()
    assert 'id="gallery_generation"' in html.html.read_text()


def test_text_only_language_model_has_no_shuffled_score(spec, tokenizer, tmp_path):
    """An LM without an image tower on text-only conversations: perplexity and answers, and
    no image-shuffle score (null in eval.json, left out of the flat metrics)."""
    lm_spec = ModelSpec.from_dict({**spec.to_dict(), "towers": {}, "projector": None})
    with ShardWriter(tmp_path / "val") as writer:
        for key, colour in [("t0", "red"), ("t1", "blue")]:
            record = {**_record(key, colour, images=0), "images": []}
            writer.write({"__key__": key, "json": json.dumps(record)})
    evaluator = VLMEvaluator(
        lm_spec, tmp_path / "val", batch_size=2, tokenizer=tokenizer, max_new_tokens=3
    )
    with one_thread():
        flat = evaluator(mmtrain.create_model(lm_spec, seed=1))
        report = evaluator.report(mmtrain.create_model(lm_spec, seed=1))
    evaluator.close()
    assert report["generation"]["n"] == 2 and report["generation"]["n_shuffled"] == 0
    assert report["generation"]["token_f1_shuffled_images"] is None
    assert "generation/token_f1_shuffled_images" not in flat
    assert flat["perplexity"] == report["perplexity"] > 1.0
