"""Validation, `mmtrain eval` and `mmtrain generate` of hub models (issue 42).

A hub run (a transformers class trained as it is, tests/hub_folders.py's tiny Qwen3-VL) is
validated with the metric names a native VLM run reports: the answers' perplexity on held-out
conversations made into batches exactly as training makes them, and greedy answers from the
class's own `generate` on the processor's prompt, scored with eval/answers.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image

from mmtrain.cli import main

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from hub_folders import image, load_processor, make_folder  # noqa: E402
from test_hub_train import conversation_shards, run_config  # noqa: E402

# What a native VLM's validation reports (eval/generation.py), under val/ and in eval.json.
NATIVE_NAMES = ("perplexity", "nll_per_token", "target_tokens", "n_samples")
NATIVE_GENERATION = ("token_f1", "exact_match", "anls", "relaxed_accuracy", "cer",
                     "token_f1_shuffled_images", "exact_match_shuffled_images",
                     "anls_shuffled_images", "n", "n_shuffled", "max_new_tokens")  # fmt: skip
VAL_SAMPLES = 5  # odd: a batch of 2 leaves one short (its padding must not count)


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory) -> dict[str, Path]:
    """A 2-step Qwen3-VL hub run validated at every step on held-out conversations."""
    root = tmp_path_factory.mktemp("hub_eval")
    folder = make_folder("qwen3_vl", root)
    config = run_config(root, str(folder))
    val = conversation_shards(root / "val", n=VAL_SAMPLES)
    data = yaml.safe_load(config.read_text())
    data["data"]["val"] = [str(val)]
    data["eval"] = {"every_steps": 1, "batch_size": 2}
    config.write_text(yaml.safe_dump(data))
    assert main(["train", str(config)]) == 0
    return {"folder": folder, "run": root / "run", "val": val}


def test_validation_of_a_hub_run_reports_the_native_metrics(hub_run):
    run = hub_run["run"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    validated = [r for r in rows if "val/perplexity" in r]
    assert [r["step"] for r in validated] == [1, 2]
    for row in validated:
        assert row["val/perplexity"] > 1 and row["val/target_tokens"] > 0
        for name in NATIVE_GENERATION:
            assert f"val/generation/{name}" in row, name
        assert row["val/generation/n"] == VAL_SAMPLES  # every sample answered once
    report = json.loads((run / "eval.json").read_text())
    assert report["step"] == 2 and report["n_samples"] == VAL_SAMPLES
    for name in NATIVE_NAMES:
        assert name in report, name
    assert set(NATIVE_GENERATION) <= set(report["generation"])
    assert report["examples"] and all("generated" in e for e in report["examples"])
    assert report["perplexity"] == pytest.approx(validated[-1]["val/perplexity"], rel=1e-12)


def test_validation_loss_is_the_class_own_loss_on_the_same_conversations(hub_run, tmp_path):
    """The evaluator's NLL (batched and padded as training does) equals the class's own float64
    logits scored against the answers, each conversation alone; any batch size."""
    from mmtrain.eval.hub import HubEvaluator, hub_batcher, load_hub_model

    folder, val = hub_run["folder"], hub_run["val"]
    model = load_hub_model(folder, torch.device("cpu"), dtype=torch.float64)
    reports = []
    for batch_size in (2, 3):
        evaluator = HubEvaluator(model.spec, val, batcher=hub_batcher(model.spec, folder, 128),
                                 batch_size=batch_size, max_new_tokens=4)  # fmt: skip
        reports.append(evaluator.report(model))
        evaluator.close()

    processor = load_processor(folder)
    total, tokens = 0.0, 0
    for i in range(VAL_SAMPLES):  # the conversations of conversation_shards, one at a time
        answer = ["a red cat", "a picture of a mat on a cat"][i % 2]
        messages = [
            {"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "describe the image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]  # fmt: skip
        prompt = processor.apply_chat_template(
            messages[:1], add_generation_prompt=True, tokenize=False
        )
        text = processor.apply_chat_template(messages, tokenize=False)
        inputs = processor(text=[text], images=[[image(i)]], return_tensors="pt")
        start = len(processor(text=[prompt], images=[[image(i)]])["input_ids"][0])
        with torch.no_grad():
            logits = model.hf(**inputs, use_cache=False).logits[0]
        assert logits.dtype == torch.float64
        ids = inputs["input_ids"][0]
        # The answer's tokens (and its end-of-turn marker), each scored by the position before.
        total += float(F.cross_entropy(logits[start - 1 : -2], ids[start:-1], reduction="sum"))
        tokens += len(ids) - 1 - start
    for report in reports:
        assert report["target_tokens"] == tokens
        # float64 sums of a few dozen terms of size ~ln(vocab): equal to ~1e-15 relative
        assert report["nll_per_token"] == pytest.approx(total / tokens, rel=1e-12, abs=0)
    assert reports[0]["generation"] == reports[1]["generation"]


def _rank_report(rank: int, world_size: int, folder: Path, val: Path) -> dict:
    from mmtrain.eval.hub import HubEvaluator, hub_batcher, load_hub_model

    model = load_hub_model(folder, torch.device("cpu"), dtype=torch.float64)
    evaluator = HubEvaluator(model.spec, val, batcher=hub_batcher(model.spec, folder, 128),
                             batch_size=2, max_new_tokens=4)  # fmt: skip
    try:
        return evaluator.report(model)
    finally:
        evaluator.close()


def test_two_ranks_report_what_one_process_reports(hub_run):
    """Each rank evaluates its share (5 samples: 3 and 2, the short rank runs a weightless
    batch to stay in step); the sums are all-reduced, the answers gathered by key."""
    from dist_helpers import run_distributed

    folder, val = hub_run["folder"], hub_run["val"]
    single = _rank_report(0, 1, folder, val)
    first, second = run_distributed(_rank_report, world_size=2, args=(folder, val))
    assert first == second
    assert first["target_tokens"] == single["target_tokens"]
    # float64 sums in another order (two partial sums, then all-reduced): ~1e-15 relative
    assert first["nll_per_token"] == pytest.approx(single["nll_per_token"], rel=1e-12, abs=0)
    assert first["generation"] == single["generation"]
    assert first["examples"] == single["examples"]


def test_eval_command_on_a_hub_run_prints_its_metrics(hub_run, capsys):
    run, val = hub_run["run"], hub_run["val"]
    out = run.parent / "eval-cli.json"
    args = ["eval", str(run), "--data", str(val), "--json", "--batch-size", "2", "--out", str(out)]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    for name in NATIVE_NAMES:
        assert name in printed, name
    assert set(NATIVE_GENERATION) <= set(printed["generation"])
    # The run's final weights, the same batches: validation at the last step, again.
    trained = json.loads((run / "eval.json").read_text())
    assert printed["target_tokens"] == trained["target_tokens"]
    # float32 on both sides, the same operations: equal up to float32 rounding of the sum
    assert printed["nll_per_token"] == pytest.approx(trained["nll_per_token"], rel=1e-5)
    assert [e["generated"] for e in printed["examples"]] == [
        e["generated"] for e in trained["examples"]
    ]
    # A transformers folder of a hub class, as downloaded (no spec.yaml): evaluated the same way.
    source = run.parent / "eval-source.json"
    args = ["eval", str(hub_run["folder"]), "--data", str(val), "--out", str(source),
            "--max-new-tokens", "1", "--examples", "0"]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    assert json.loads(source.read_text())["target_tokens"] == trained["target_tokens"]


def test_generate_on_a_hub_run_prints_the_class_own_greedy_answer(hub_run, tmp_path, capsys):
    """`mmtrain generate` answers as transformers' own `generate` through the processor does:
    the same new token ids, printed up to the end of the turn."""
    from mmtrain.eval.hub import hub_answer_ids, load_hub_model

    run = hub_run["run"]
    picture = tmp_path / "page.png"
    image(3).save(picture)
    args = ["generate", str(run), "--image", str(picture), "--prompt", "describe the image",
            "--max-new-tokens", "6"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out.strip()

    model = transformers.AutoModelForImageTextToText.from_pretrained(run)
    processor = load_processor(run)
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "describe the image"}]}]  # fmt: skip
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with Image.open(picture) as opened:
        pixels = opened.convert("RGB")
    inputs = processor(text=[prompt], images=[[pixels]], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1] :].tolist()
    ours = load_hub_model(run, torch.device("cpu"))
    assert hub_answer_ids(ours, processor, messages, [pixels], max_new_tokens=6) == want
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    end = next((i for i, t in enumerate(want) if t in eos), len(want))
    assert end > 0 and printed == processor.tokenizer.decode(want[:end]).strip()


def test_generate_and_eval_refuse_what_a_hub_model_does_not_take(hub_run, tmp_path, capsys):
    run, val = hub_run["run"], hub_run["val"]
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"not read")
    assert main(["generate", str(run), "--video", str(clip), "--prompt", "what moves"]) == 2
    assert "--video" in capsys.readouterr().err
    assert main(["generate", str(run), "--tokenizer", "byte", "--prompt", "hi"]) == 2
    assert "processor" in capsys.readouterr().err
    assert main(["eval", str(run), "--data", str(val), "--chat-template", "chatml"]) == 2
    assert "--chat-template" in capsys.readouterr().err
