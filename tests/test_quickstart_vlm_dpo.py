"""`mmtrain quickstart --vlm-dpo`: the near misses, the flags, and a small end-to-end run (SFT
of the page reader, pairs built by `data build`, DPO, the held-out figures). The learning
check itself (full defaults, minutes) is in README.md."""

from __future__ import annotations

import json
import random

from mmtrain.cli import main
from mmtrain.quickstart.vlm_dpo import VlmDpoConfig, near_miss, run_vlm_dpo


def test_a_near_miss_changes_one_digit_and_never_leads_with_zero():
    rng = random.Random(0)
    for number in ("1000", "4721", "905", "999"):
        for _ in range(50):
            miss = near_miss(number, rng)
            assert len(miss) == len(number) and miss[0] != "0"
            assert sum(a != b for a, b in zip(miss, number, strict=True)) == 1


def test_flags_of_other_demos_are_refused(tmp_path, capsys):
    assert main(["quickstart", "--vlm-dpo", "--clip", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "--clip does not go with --vlm-dpo" in capsys.readouterr().err


def test_a_small_run_writes_the_preference_block(tmp_path):
    config = VlmDpoConfig(out=tmp_path / "qs", sft_steps=10, steps=3, train_pages=64,
                          val_pages=6, batch_size=8, eval_batch_size=6)  # fmt: skip
    result = run_vlm_dpo(config)
    block = json.loads((result.paths.run / "eval.json").read_text())["preference"]
    assert block["n"] == 6 and block["reward_accuracy_before"] == 0.5
    assert 0.0 <= block["reward_accuracy"] <= 1.0
    assert 0.0 <= block["exact_match"] <= 1.0 and 0.0 <= block["exact_match_before"] <= 1.0
    pairs = json.loads((tmp_path / "qs" / "data" / "raw" / "val" / "conversations.json").read_text())
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    assert (result.paths.run / "adapter" / "adapter_config.json").is_file()
