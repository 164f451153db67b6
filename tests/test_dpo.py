"""Preference tuning (`train.objective: dpo`): preference records in the formats people have
(TRL's standard and conversational forms, LLaVA turns with `chosen` / `rejected`) build into
pair shards with the reasons for what is refused; each pair is two rows scored on their final
answers; the loss and its gradients equal TRL's DPOTrainer's on the same rows and LoRA weights
(sigmoid and IPO); a run logs TRL's metrics and learns the pairs; what this version does not
do is refused by name. The model is a tiny Qwen2 built by transformers (test_export_hf_folder.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mmtrain.cli import main
from mmtrain.config import DataConfig, DpoConfig
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.chat_templates import IGNORE_INDEX
from mmtrain.data.stream.conversation_batches import ConversationBatcher
from mmtrain.data.stream.conversations import ConversationError, parse_conversation
from mmtrain.data.stream.preference_batches import PairDecoder, collate_pairs, final_answer_labels
from mmtrain.models.build import create_model
from mmtrain.models.formats.hf import read_hf_model
from mmtrain.models.formats.peft_adapter import adapted_linears, peft_tensors
from mmtrain.train.dpo import DpoObjective
from mmtrain.train.init_start import load_init
from mmtrain.train.lora import apply_lora, lora_state_dict

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from test_export_hf_folder import save_lm  # noqa: E402

PAIRS = [{"prompt": f"Say {i}.", "chosen": f"colour {i}", "rejected": f"colour {i + 1}"}
         for i in range(8)]  # fmt: skip


# ----------------------------------------------------------------------------- records
@pytest.mark.parametrize(
    "record",
    [
        {"prompt": "Say 1.", "chosen": "one", "rejected": "two"},  # TRL standard
        {"prompt": [{"role": "user", "content": "Say 1."}],  # TRL conversational
         "chosen": [{"role": "assistant", "content": "one"}],
         "rejected": [{"role": "assistant", "content": "two"}]},
        {"conversations": [{"from": "human", "value": "Say 1."}],  # LLaVA turns
         "chosen": "one", "rejected": "two"},
    ],
)  # fmt: skip
def test_each_format_gives_the_prompt_and_both_answers(record):
    conv = parse_conversation(record)
    assert [(t.role, t.text) for t in conv.turns] == [("user", "Say 1.")]
    assert (conv.chosen, conv.rejected) == ("one", "two")
    assert conv.answered("one").turns[-1].text == "one"


@pytest.mark.parametrize(
    ("record", "kind", "words"),
    [
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, "equal_answers", "same answer"),
        ({"prompt": "q", "chosen": "", "rejected": "b"}, "empty_turn", "chosen"),
        ({"prompt": "q", "chosen": "a"}, "format", "'chosen' without 'rejected'"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}],
          "rejected": "b"}, "format", "implicit-prompt"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
          "chosen": "c", "rejected": "d"}, "roles", "ends with the user's turn"),
    ],
)  # fmt: skip
def test_a_pair_that_teaches_nothing_is_refused_with_its_reason(record, kind, words):
    with pytest.raises(ConversationError) as err:
        parse_conversation(record)
    assert err.value.kind == kind and words in err.value.reason


# ----------------------------------------------------------------------------- shards
@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny Qwen2 folder, its spec, and shards `data build` made of PAIRS (plus a pair of
    equal answers, refused) in TRL's standard form."""
    root = tmp_path_factory.mktemp("dpo")
    save_lm(root / "hf")
    records = [*PAIRS, {"prompt": "Say x.", "chosen": "same", "rejected": "same"}]
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["data", "build", str(root / "prefs.jsonl"), "--out", str(root / "shards"),
            "--workers", "1", "--max-reject-rate", "0.2"]  # fmt: skip
    assert main(argv) == 0
    spec, _ = read_hf_model(root / "hf")
    spec.save(root / "spec.json")
    return root, spec


def test_the_build_refuses_equal_answers_and_stores_both_sides(made):
    root, _ = made
    rejects = [json.loads(line) for line in (root / "shards" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["path"]) for r in rejects] == [("equal_answers", "prefs.jsonl:9")]
    shards = ShardSet.open(root / "shards")
    meta = json.loads(shards.read(0)["json"])
    assert meta["messages"] == [{"role": "user", "content": "Say 0."}]
    assert (meta["chosen"], meta["rejected"]) == ("colour 0", "colour 1")


def pair_batch(root: Path, spec, n: int) -> dict:
    data = DataConfig(train=str(root / "shards"), tokenizer=str(root / "hf"),
                      chat_template=str(root / "hf"), sequence_length=64)  # fmt: skip
    batcher = ConversationBatcher(data, spec)
    decode = PairDecoder(batcher.decoder(spec))
    shards = ShardSet.open(root / "shards")
    outs = [decode(shards.read(i), np.random.default_rng(0)) for i in range(n)]
    return collate_pairs(spec, batcher)(outs)


def test_a_pairs_cost_for_data_balance_is_its_two_rows(made):
    """data.balance deals a step's pairs by their forward FLOPs: both rows at their lengths."""
    from mmtrain.train.sample_costs import sample_costs

    root, spec = made
    data = DataConfig(train=str(root / "shards"), tokenizer=str(root / "hf"),
                      chat_template=str(root / "hf"), sequence_length=64)  # fmt: skip
    costs = sample_costs([ShardSet.open(root / "shards")], spec, ConversationBatcher(data, spec),
                         str(root / "hf"))  # fmt: skip
    batch = pair_batch(root, spec, 1)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    assert costs[0] == sum(spec.sequence_flops_by_part(lengths, 0).values()) > 0


def test_a_pair_is_two_rows_scored_on_their_answers_chosen_first(made):
    root, spec = made
    batch = pair_batch(root, spec, 3)
    tok = transformers.AutoTokenizer.from_pretrained(root / "hf")
    rows = batch["text"].shape[0]
    assert rows == 6
    for row, answer in enumerate(["colour 0", "colour 1", "colour 2", "colour 1", "colour 2",
                                  "colour 3"]):  # fmt: skip
        ids, labels = batch["text"][row], batch["labels"][row]
        scored = ids[labels != IGNORE_INDEX].tolist()
        assert tok.decode(scored).startswith(answer)  # the answer (and the turn's end) alone
        prompt = tok.decode(ids[: int((labels != IGNORE_INDEX).nonzero()[0])].tolist())
        assert f"Say {row % 3}." in prompt
    assert final_answer_labels([-100, 5, 6, -100, -100, 7, 8, -100]) == [-100] * 5 + [7, 8, -100]


def test_log_probs_by_token_equal_those_of_the_whole_logits(made):
    """mmtrain's own model scores each target's NLL, its head a chunk of positions at a time
    (no whole logits); the per-side sums and their gradients equal those read from the whole
    logits (float64: equal up to rounding), with chunks smaller than a row."""
    from mmtrain.train.dpo import batch_logps, model_inputs

    root, spec = made
    batch = pair_batch(root, spec, 3)
    model = create_model(spec, dtype=torch.float64)
    load_init(model, str(root / "hf"))
    model.loss_chunk_rows = 7
    sums, grads = [], []
    for by_token in (True, False):
        model.zero_grad()
        logps = batch_logps(model(model_inputs(batch, by_token)), batch)
        (logps * torch.arange(1.0, 7.0, dtype=logps.dtype)).sum().backward()
        sums.append(logps.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-12, atol=0)
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-9, atol=1e-12, msg=name)


# ----------------------------------------------------------------------------- parity
def _trl_trainer(root: Path, linears, adapters, loss: str, beta: float, sft_weight: float):
    """TRL's DPOTrainer over the tiny Qwen2 in float64 with a new LoRA adapter (so its
    reference is the base model, as mmtrain's) holding mmtrain's adapter weights."""
    datasets = pytest.importorskip("datasets")
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float64)
    modules = [module for linear in linears for module, _ in linear.modules]
    rank = adapters[f"{linears[0].ours}.lora_a"].shape[0]
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules)
    terms = {"loss_type": [loss], "loss_weights": [1.0]}
    if sft_weight:  # RPO: TRL's "sft" term beside the pairs' loss
        terms = {"loss_type": [loss, "sft"], "loss_weights": [1.0, sft_weight]}
    args = trl.DPOConfig(output_dir=str(root / "trl"), beta=beta, report_to=[], use_cpu=True,
                         **terms)  # fmt: skip
    data = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    tok = transformers.AutoTokenizer.from_pretrained(root / "hf")
    trainer = trl.DPOTrainer(model=base, args=args, train_dataset=data, processing_class=tok,
                             peft_config=config)  # fmt: skip
    state = {k: v.double() for k, v in peft_tensors(linears, adapters).items()}
    peft.set_peft_model_state_dict(trainer.model, state)
    return trainer


@pytest.mark.parametrize(("loss", "sft_weight"), [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.7)])
def test_the_loss_and_gradients_equal_trls_dpo_trainer(made, loss, sft_weight):
    """On the same rows and LoRA weights (B random, so the policy differs from the base
    reference), mmtrain's loss and its adapters' gradients equal DPOTrainer's. TRL computes
    the log-probs in float32 (its fused head) while mmtrain's run in float64 here: the bound
    is float32's rounding of per-token log-probs (2^-24 relative, summed over the answer's
    tokens), far under the 1e-6 used."""
    root, spec = made
    batch = pair_batch(root, spec, 3)
    model = create_model(spec, dtype=torch.float64)
    load_init(model, str(root / "hf"))
    apply_lora(model, {"text": _lora()}, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(0.05 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    config = DpoConfig(beta=0.5, loss=loss, sft_weight=sft_weight)
    objective = DpoObjective(model, config)
    objective.prepare(model, [batch], None)
    ours = objective.loss(model(objective.inputs(batch, 0)), batch, 0)
    ours.backward()
    adapters = lora_state_dict(model)
    linears = adapted_linears(spec, adapters)
    trainer = _trl_trainer(root, linears, adapters, loss, config.beta, sft_weight)
    inputs = {"input_ids": batch["text"], "attention_mask": batch["attention_mask"].long(),
              "completion_mask": (batch["labels"] != IGNORE_INDEX).long()}  # fmt: skip
    trainer.model.train()
    theirs = trainer.compute_loss(trainer.model, inputs)
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(ours.item()))
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    params = dict(model.named_parameters())
    largest = max(p.grad.abs().max().item() for n, p in params.items() if p.grad is not None)
    for linear in linears:
        names = [f"base_model.model.{module}.lora_{{}}.default.weight" for module, _ in linear.modules]
        their_a = sum(grads[n.format("A")] for n in names)  # A is shared by the split modules
        their_b = torch.cat([grads[n.format("B")] for n in names])
        torch.testing.assert_close(params[f"{linear.ours}.lora_a"].grad, their_a.double(),
                                   rtol=1e-6, atol=1e-6 * largest)  # fmt: skip
        torch.testing.assert_close(params[f"{linear.ours}.lora_b"].grad, their_b.double(),
                                   rtol=1e-6, atol=1e-6 * largest)  # fmt: skip


def _lora():
    from mmtrain.config import LoraConfig

    return LoraConfig(rank=4, alpha=4)


# ----------------------------------------------------------------------------- runs
def run_config(root: Path, name: str, data: dict | None = None, **train) -> Path:
    config = {"model": str(root / "spec.json"), "init": str(root / "hf"),
              "data": {"train": str(root / "shards"), "tokenizer": str(root / "hf"),
                       "chat_template": str(root / "hf"), "sequence_length": 64, **(data or {})},
              "train": {"steps": 12, "batch_size": 8, "lr": 2e-2, "warmup_steps": 0,
                        "objective": "dpo", "dpo": {"beta": 0.5},
                        "towers": {"text": {"lora": {"rank": 4}}}, **train},
              "metrics": {"tensorboard": False}, "out": str(root / name)}  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_run_logs_trls_metrics_and_learns_the_pairs(made):
    root, _ = made
    assert main(["train", str(run_config(root, "run"))]) == 0
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
             "logps/chosen", "logps/rejected")  # fmt: skip
    assert all(name in steps[0] for name in names)
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # B = 0: policy = reference
    assert steps[0]["rewards/margins"] == 0.0
    assert steps[-1]["rewards/margins"] > 0.5 and steps[-1]["rewards/accuracies"] == 1.0
    assert steps[-1]["loss"] < 0.5 * np.log(2)
    assert (root / "run" / "adapter" / "adapter_config.json").is_file()
    from mmtrain.report.doctor import diagnose
    from mmtrain.report.rundata import load_run

    assert not [f for f in diagnose(load_run(root / "run")) if f.kind == "preference"]
    from mmtrain.report.plots import make_plots

    plots = {plot.name: plot for plot in make_plots(load_run(root / "run"))}
    assert plots["preference"].png is not None  # the report's margins chart
    # What the run wrote opens in transformers and PEFT: its adapter over the base folder
    # gives the logits of the run converted to a transformers folder (both stored in
    # float32, so equal to its rounding of the weights, ~1e-7 relative: 1e-5 of the logits'
    # scale), and the adapter's effect is far larger than that.
    peft = pytest.importorskip("peft")
    assert main(["convert", "--to", "hf", str(root / "run"), "--out", str(root / "run-hf")]) == 0
    ids = pair_batch(root, made[1], 2)["text"]

    def logits(model):
        with torch.no_grad():
            return model.double().eval()(input_ids=ids).logits

    load = transformers.AutoModelForCausalLM.from_pretrained
    merged, base = logits(load(root / "run-hf")), logits(load(root / "hf"))
    adapted = logits(peft.PeftModel.from_pretrained(load(root / "hf"), root / "run" / "adapter"))
    scale = merged.abs().max().item()
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-5 * scale)
    assert (adapted - base).abs().max().item() > 1e-3 * scale


def _rows(margins, chosen, rejected, logps):
    return [{"step": i + 1, "step_s": 1.0, "rewards/margins": m, "rewards/chosen": c,
             "rewards/rejected": r, "logps/chosen": lp}
            for i, (m, c, r, lp) in enumerate(zip(margins, chosen, rejected, logps, strict=True))]  # fmt: skip


def test_doctor_names_a_collapsing_margin_and_rewards_that_both_fall(tmp_path):
    """The rules on rows a run could log (the run above logs neither: no finding there)."""
    from mmtrain.report.preference_check import preference_rewards
    from mmtrain.report.rundata import RunData

    config = {"train": {"lr": 1e-3, "dpo": {"beta": 0.1}}}
    rise_fall = [0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 1.0, 0.3, 0.2, 0.1, 0.1, 0.1]
    collapsed = RunData(tmp_path, config, _rows(rise_fall, [0.1] * 12, [0.0] * 12, [-20.0] * 12))
    finding = preference_rewards(collapsed)
    assert finding is not None and "fell from 2" in finding.why
    assert "train.lr=0.000333" in finding.advice and finding.steps == [10, 11, 12]
    down = [-0.1 * i for i in range(12)]
    both = RunData(tmp_path, config, _rows([0.1 * i for i in range(12)], down,
                                           [2 * d for d in down], [-20 + d for d in down]))  # fmt: skip
    finding = preference_rewards(both)
    assert finding is not None and "pushing every answer down" in finding.why
    assert "train.dpo.beta to 0.2" in finding.advice


def test_a_full_fine_tune_takes_a_frozen_copy_as_its_reference(made):
    root, _ = made
    config = run_config(root, "full", towers={}, steps=3, lr=1e-3, dpo={"reference": "copy"})
    assert main(["train", str(config)]) == 0
    rows = [json.loads(line) for line in (root / "full" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the copy is the start
    assert steps[-1]["rewards/margins"] > 0  # and the policy moves away from it


def _losses(result) -> list[float]:
    return [row["loss"] for row in result.history]


def test_a_full_fine_tunes_reference_is_scored_once_and_trains_as_the_copy_does(made):
    """auto: the 8 pairs scored once before the first step and stored beside the run; 3
    epochs of them train what the frozen copy's forward at every step trains (float64: the
    stored values differ from the copy's by the rounding of other paddings, losses to
    1e-9); a resume reads them back without scoring again."""
    from mmtrain.config import load_config
    from mmtrain.train.loop import train
    from mmtrain.train.reference_cache import COMPLETE_FILE, FOLDER

    root, _ = made
    settings = dict(towers={}, steps=4, lr=1e-3, precision="fp64", batch_size=6)
    runs = {}
    for reference in ("copy", "auto"):
        path = run_config(root, f"ref-{reference}", dpo={"reference": reference}, **settings)
        runs[reference] = _losses(train(load_config(path)))
    torch.testing.assert_close(torch.tensor(runs["auto"]), torch.tensor(runs["copy"]),
                               rtol=1e-9, atol=0)  # fmt: skip
    folder = root / "ref-auto" / FOLDER
    assert json.loads((folder / COMPLETE_FILE).read_text())["pairs"] == len(PAIRS)
    assert not (root / "ref-copy" / FOLDER).exists()

    stopped = load_config(run_config(root, "ref-stopped", dpo={"reference": "cache"},
                                     **settings), ["checkpoint.every_steps=2"])  # fmt: skip
    train(stopped, halt_after_step=3)
    parts = {p.name: p.stat().st_mtime_ns for p in (root / "ref-stopped" / FOLDER).iterdir()}
    resumed = train(stopped)
    assert resumed.resumed_from == 2 and _losses(resumed) == runs["auto"][2:]
    assert {p.name: p.stat().st_mtime_ns for p in (root / "ref-stopped" / FOLDER).iterdir()} == parts
    (root / "ref-stopped" / FOLDER / COMPLETE_FILE).unlink()  # lost: it cannot be scored again
    code = main(["train", str(root / "ref-stopped.yaml"), "train.steps=5"])
    assert code == 2


def test_auto_picks_the_reference_the_run_can_trust(made):
    """One stored score cannot follow a pair whose crop changes at each read (a LLaVA-style
    model's train transform): auto takes a frozen copy there, and cache asked is refused.
    The model without its adapters is the reference only where nothing else trains."""
    from mmtrain.structured import FieldError
    from mmtrain.train.dpo import reference_mode

    _, spec = made
    model = create_model(spec)
    assert reference_mode(model, DpoConfig(), inputs_vary=False) == "cache"
    assert reference_mode(model, DpoConfig(), inputs_vary=True) == "copy"
    with pytest.raises(FieldError, match="cropped and flipped at random"):
        reference_mode(model, DpoConfig(reference="cache"), inputs_vary=True)
    apply_lora(model, {"text": _lora()}, seed=1)
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(("lora_a", "lora_b")))
    assert reference_mode(model, DpoConfig(), inputs_vary=True) == "adapters"
    # Trained beside the adapters, a norm would stay trained in "the model without them".
    next(p for n, p in model.named_parameters() if "norm" in n).requires_grad_(True)
    assert reference_mode(model, DpoConfig(), inputs_vary=False) == "cache"
    with pytest.raises(FieldError, match="besides the LoRA adapters"):
        reference_mode(model, DpoConfig(reference="adapters"))


def _pair_batches(count: int, per_batch: int = 2, fail_at: int | None = None):
    for b in range(count):
        if b == fail_at:
            raise RuntimeError("the node went away")
        index = list(range(b * per_batch, (b + 1) * per_batch))
        yield {"__index__": index, "__key__": [str(i) for i in index]}


def test_a_stopped_pass_goes_on_from_its_parts_and_another_runs_pass_starts_anew(tmp_path):
    """A pass over 10 micro-batches of 2 pairs, a part every 2 micro-batches, stops while
    reading the 8th: parts hold the first 6, so the next pass scores the 7th (scored, but its
    part never written) to the 10th; a pass of another identity deletes those parts and
    scores all 10."""
    from mmtrain.train.reference_cache import ReferencePass

    scored = []

    def score(batch):  # chosen -i, rejected -i - 0.5 for pair sample i
        scored.append(batch["__test__"])
        chosen = -torch.tensor(batch["__test__"], dtype=torch.float64)
        return torch.cat([chosen, chosen - 0.5])

    def batches(fail_at=None):
        for batch in _pair_batches(10, fail_at=fail_at):
            batch["__test__"] = list(batch["__index__"])
            yield batch

    identity = {"model": "m.json", "sources": ["abc"]}
    store = ReferencePass(tmp_path, identity, samples=20, rank=0, barrier=lambda: None,
                          part_batches=2)  # fmt: skip
    with pytest.raises(RuntimeError, match="went away"):
        store.run(batches(fail_at=7), score)
    assert len(scored) == 7 and not store.complete()
    scored.clear()
    values = store.run(batches(), score).values
    assert [b[0] // 2 for b in scored] == [6, 7, 8, 9]
    assert store.complete() and np.array_equal(values[:, 0], -np.arange(20.0))
    assert np.array_equal(values[:, 1], -np.arange(20.0) - 0.5)
    scored.clear()
    other = ReferencePass(tmp_path, {**identity, "sources": ["changed"]}, samples=20, rank=0,
                          barrier=lambda: None, part_batches=2)  # fmt: skip
    assert not other.complete()
    other.run(batches(), score)
    assert len(scored) == 10


@pytest.mark.parametrize(
    ("train", "field", "words"),
    [({"towers": {}, "dpo": {"reference": "adapters"}}, "train.dpo.reference", "no LoRA"),
     ({"objective": None}, None, "preference_pair")],
)  # fmt: skip
def test_what_this_version_lacks_exits_2_by_name(made, capsys, train, field, words):
    root, _ = made
    code = main(["train", str(run_config(root, f"refused-{field}", steps=1, **train))])
    err = capsys.readouterr().err
    assert code == 2 and words in err and (field is None or field in err)


def test_a_resumed_run_ends_bitwise_where_the_whole_run_ends(made):
    from safetensors.torch import load_file

    from mmtrain.config import load_config
    from mmtrain.train.loop import train

    root, _ = made
    overrides = ["train.steps=4", "checkpoint.every_steps=2"]
    whole = train(load_config(run_config(root, "whole"), overrides))
    stopped = load_config(run_config(root, "stopped"), overrides)
    train(stopped, halt_after_step=3)  # dies after step 3; the step-2 checkpoint resumes
    resumed = train(stopped)
    assert resumed.resumed_from == 2
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history][2:]
    a, b = (load_file(root / name / "lora.safetensors") for name in ("whole", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _dpo_on_ranks(rank: int, world: int, path: str) -> list[float]:
    from mmtrain.config import load_config
    from mmtrain.train.loop import train

    return [row["loss"] for row in train(load_config(path)).history]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("towers", "reference", "balance"),
    [(None, "auto", False), ({}, "copy", False), ({}, "cache", False), (None, "auto", True)],
    ids=["lora", "full-with-a-frozen-copy", "full-with-cached-log-probs", "lora-balanced"],
)  # fmt: skip
def test_fsdp_on_two_ranks_trains_what_one_process_trains(made, towers, reference, balance):
    """A pair's loss is normalised by the step's pairs on all ranks, and the reference is each
    rank's own (adapters disabled under FSDP2, a sharded copy, or the pairs each rank scored
    before the first step, read by both); with data.balance the step's pairs are dealt to
    the ranks by their cost (both sides' rows, the inputs once): 2 gloo ranks train what one
    process trains on the same global batch (float64, AdamW's eps 1 so an update is Lipschitz
    in its gradient: test_hub_train_parallel.py; losses to 1e-9, weights to float64 rounding
    of their updates)."""
    from safetensors.torch import load_file

    from dist_helpers import run_distributed
    from mmtrain.config import load_config
    from mmtrain.train.loop import train

    root, _ = made
    settings = dict(steps=3, batch_size=8, micro_batch=2, precision="fp64", eps=1.0, lr=1e-2,
                    dpo={"beta": 0.5, "reference": reference})  # fmt: skip
    if towers is not None:
        settings["towers"] = towers
    name = ("lora" if towers is None else f"full-{reference}") + ("-balanced" * balance)
    data = {"balance": balance}
    one = train(load_config(run_config(root, f"one-{name}", data, **settings)))
    path = str(run_config(root, f"fsdp-{name}", data, parallel="fsdp", **settings))
    first, second = run_distributed(_dpo_on_ranks, world_size=2, args=(path,), timeout_s=300)
    assert first == second
    want = [row["loss"] for row in one.history]
    torch.testing.assert_close(torch.tensor(first), torch.tensor(want), rtol=1e-9, atol=0)
    weights = "lora.safetensors" if towers is None else "model.safetensors"
    a, b = (load_file(root / f"{run}-{name}" / weights) for run in ("one", "fsdp"))
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-9, atol=1e-12, msg=key)


def test_packed_pairs_train_what_padded_pairs_train(made):
    """Each side a document of packed rows (data.pack): its log-prob summed by document; the
    run equals the padded one (float64: losses to 1e-9)."""
    from mmtrain.config import load_config
    from mmtrain.train.loop import train

    root, _ = made
    runs = {}
    for pack in (False, True):
        config = load_config(run_config(root, f"pack-{pack}", steps=3, precision="fp64"),
                             [f"data.pack={str(pack).lower()}"])  # fmt: skip
        runs[pack] = [row["loss"] for row in train(config).history]
    torch.testing.assert_close(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-9,
                               atol=0)  # fmt: skip


def test_activation_checkpointing_trains_the_same_adapters(made):
    """The reference's forward runs without gradients through the checkpointed blocks too."""
    from safetensors.torch import load_file

    root, _ = made
    towers = {"text": {"lora": {"rank": 4}, "activation_checkpointing": True}}
    assert main(["train", str(run_config(root, "plain", steps=3))]) == 0
    assert main(["train", str(run_config(root, "ac", steps=3, towers=towers))]) == 0
    a, b = (load_file(root / name / "lora.safetensors") for name in ("plain", "ac"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_runs_planned_memory_is_a_dpo_plan(made):
    """The plan record a run writes (what `mmtrain doctor` compares the measured peak with)
    plans two rows a pair, and a full fine-tune's frozen copy (fp32
    here: 4 bytes a parameter) where it takes one, none where its log-probs are cached."""
    import dataclasses

    from mmtrain.config import load_config
    from mmtrain.train.metrics import planned_memory

    root, spec = made
    dpo = load_config(run_config(root, "planned", towers={}, precision="fp32",
                                 dpo={"reference": "copy"}))  # fmt: skip
    sft = dataclasses.replace(dpo, train=dataclasses.replace(dpo.train, objective=None))
    cached = dataclasses.replace(dpo, train=dataclasses.replace(
        dpo.train, dpo=dataclasses.replace(dpo.train.dpo, reference="cache")))  # fmt: skip
    plans = [planned_memory(spec, c, world_size=1, recompute=[], device=torch.device("cpu"))
             for c in (dpo, sft, cached)]  # fmt: skip
    params = spec.params()
    states = [p["predicted_model_state_bytes"] for p in plans]
    assert states[0] - states[1] == pytest.approx(4 * params, abs=1)
    assert states[2] == states[1]
    acts = [p["predicted_activations_bytes"] for p in plans]
    assert acts[0] > 2 * acts[1]  # twice the rows, plus each target's NLL
