"""`mmtrain quickstart --vlm-dpo`: the near misses, the flags, and a small end-to-end run (SFT
of the page reader, pairs built by `data build`, DPO of the head, the held-out figures). The
learning check itself (full defaults, minutes) is in README.md."""

from __future__ import annotations

import json
import random

from safetensors.torch import load_file

from mmtrain.cli import main
from mmtrain.quickstart.vlm_dpo import VlmDpoConfig, every_near_miss, near_miss, run_vlm_dpo

TUNED = ("towers.text.norm.weight", "towers.text.lm_head.weight")  # what the recipe trains


def test_a_near_miss_changes_one_digit_and_never_leads_with_zero():
    rng = random.Random(0)
    for number in ("1000", "4721", "905", "999"):
        for _ in range(50):
            miss = near_miss(number, rng)
            assert len(miss) == len(number) and miss[0] != "0"
            assert sum(a != b for a, b in zip(miss, number, strict=True)) == 1


def test_every_near_miss_is_each_one_digit_change_once():
    for number in ("1000", "4721", "905", "999"):
        misses = every_near_miss(number)
        assert len(misses) == len(set(misses)) == 8 + 9 * (len(number) - 1)
        assert all(m[0] != "0" and m != number for m in misses)
        assert all(sum(a != b for a, b in zip(m, number, strict=True)) == 1 for m in misses)
        rng = random.Random(1)
        assert {near_miss(number, rng) for _ in range(2000)} == set(misses)


def test_flags_of_other_demos_are_refused(tmp_path, capsys):
    assert main(["quickstart", "--vlm-dpo", "--clip", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "--clip does not go with --vlm-dpo" in capsys.readouterr().err


def test_a_small_run_tunes_the_head_and_scores_every_held_out_near_miss(tmp_path):
    config = VlmDpoConfig(out=tmp_path / "qs", sft_steps=10, steps=3, train_pages=64,
                          val_pages=6, batch_size=8, eval_batch_size=6)  # fmt: skip
    result = run_vlm_dpo(config)
    block = json.loads((result.paths.run / "eval.json").read_text())["preference"]
    pages = json.loads((tmp_path / "qs" / "sft" / "data" / "raw" / "val" / "conversations.json")
                       .read_text())  # fmt: skip
    numbers = [page["conversations"][1]["value"] for page in pages]
    pairs = json.loads((tmp_path / "qs" / "data" / "raw" / "val" / "conversations.json")
                       .read_text())  # fmt: skip
    assert sorted((p["chosen"], p["rejected"]) for p in pairs) == sorted(
        (n, m) for n in numbers for m in every_near_miss(n))
    assert block["n"] == len(pairs) and block["reward_accuracy_before"] == 0.5
    for name in ("reward_accuracy", "reward_accuracy_sharper_reference", "exact_match",
                 "exact_match_before"):  # fmt: skip
        assert 0.0 <= block[name] <= 1.0
    before = load_file(result.paths.out / "sft" / "run" / "model.safetensors")
    after = load_file(result.paths.run / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {name for name in before if not before[name].equal(after[name])}
    assert changed == set(TUNED)  # the blocks and the vision tower as stage 1 left them
