"""DPO for a hub model (a transformers folder trained as its own class, models/hub/): pairs
made by the folder's own processor, a LoRA run that learns its pairs, and a full fine-tune
whose loss and gradients (every parameter) equal TRL's DPOTrainer's on the same rows. The model
is a tiny Qwen3-VL built by transformers (tests/hub_folders.py)."""

from __future__ import annotations

import copy
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mmtrain.cli import main
from mmtrain.config import DataConfig, DpoConfig
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.chat_templates import IGNORE_INDEX
from mmtrain.data.stream.preference_batches import ProcessorPairDecoder, collate_pairs
from mmtrain.data.stream.processor_batches import ProcessorBatcher
from mmtrain.train.dpo import DpoObjective

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from hub_folders import FAMILIES, image, load_processor, make_folder  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tiny Qwen3-VL folder and 8 one-image pairs (a colour named right or wrong)."""
    root = tmp_path_factory.mktemp("dpo-hub")
    folder = make_folder("qwen3_vl", root)
    (root / "shards").mkdir()
    with ShardWriter(root / "shards", max_samples=4) as writer:
        for i in range(8):
            record = {"id": str(i), "images": ["0.png"],
                      "messages": [{"role": "user", "content": "<image>describe the image"}],
                      "chosen": "a red cat" if i % 2 else "a green dog",
                      "rejected": "a blue cat"}  # fmt: skip
            buffer = io.BytesIO()
            image(i).save(buffer, format="PNG")
            writer.write({"__key__": f"{i:09d}", "json": json.dumps(record),
                          "0.png": buffer.getvalue()})  # fmt: skip
    write_manifest(root / "shards", writer.shards, modalities=["image", "text"])
    return root, folder


def test_a_lora_run_learns_its_pairs_and_writes_its_adapter(made):
    root, folder = made
    config = {"init": str(folder), "data": {"train": str(root / "shards"), "sequence_length": 128},
              "train": {"steps": 4, "batch_size": 4, "lr": 2e-2, "warmup_steps": 0,
                        "precision": "fp32", "objective": "dpo", "dpo": {"beta": 0.5},
                        "towers": {"text": {"lora": {"rank": 4}}}},
              "metrics": {"tensorboard": False}, "out": str(root / "run")}  # fmt: skip
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(root / "run.yaml")]) == 0
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert steps[-1]["rewards/accuracies"] == 1.0 and steps[-1]["rewards/margins"] > 1.0
    assert (root / "run" / "adapter" / "adapter_config.json").is_file()


def _pairs_in_float64(root: Path, folder: Path, pairs: int = 2):
    """The hub spec and a micro-batch of the first `pairs` pairs, made by the folder's own
    processor, its pixels in float64."""
    from mmtrain.models.hub.model import hub_spec_of

    spec = hub_spec_of(folder, str(folder))
    batcher = ProcessorBatcher(DataConfig(train=str(root / "shards"), sequence_length=128), spec)
    decode = ProcessorPairDecoder(batcher.decoder(spec))
    shards = ShardSet.open(root / "shards")
    batch = collate_pairs(spec, batcher)([decode(shards.read(i), np.random.default_rng(0))
                                          for i in range(pairs)])  # fmt: skip
    return spec, {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                  for k, v in batch.items()}  # fmt: skip


def test_a_hub_models_log_probs_by_token_equal_its_logits(made):
    """A hub model's DPO log-probs come from its inner model's hidden state through the head a
    chunk of positions at a time (no whole logits): equal, with their gradients, to those of
    the class's own logits (float64: equal up to rounding)."""
    from mmtrain.models.hub.model import HubModel
    from mmtrain.models.hub.source import model_class
    from mmtrain.train.dpo import batch_logps, model_inputs, scores_by_token

    root, folder = made
    spec, batch = _pairs_in_float64(root, folder)
    model = HubModel(spec, model_class(folder).from_pretrained(folder, dtype=torch.float64),
                     loss_chunk_rows=5)  # fmt: skip
    assert scores_by_token(model)
    sums, grads = [], []
    for by_token in (True, False):
        model.zero_grad()
        logps = batch_logps(model(model_inputs(batch, by_token)), batch)
        (logps * torch.arange(1.0, 5.0, dtype=logps.dtype)).sum().backward()
        sums.append(logps.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-12, atol=0)
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pairs_images_go_through_the_vision_encoder_once(made, tmp_path, family):
    """A padded pair batch's rejected pixels repeat its chosen ones, and it says so: the class's
    vision encoder takes half its inputs, and the pair's log-probs and every gradient equal
    those of the sides encoded apart (float64; the gradients to float32's rounding, below)."""
    from mmtrain.models.hub.model import HubModel
    from mmtrain.models.hub.shared_pixels import PAIRED_PIXELS
    from mmtrain.models.hub.source import model_class
    from mmtrain.train.dpo import batch_logps, model_inputs

    root, _ = made
    folder = make_folder(family, tmp_path)
    spec, batch = _pairs_in_float64(root, folder)
    assert batch[PAIRED_PIXELS] is True
    model = HubModel(spec, model_class(folder).from_pretrained(folder, dtype=torch.float64))
    seen = []  # the rows (patches or images) the encoder's first block gets
    model.towers["vision"].blocks[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(next(x.shape[0] for x in (*args, *kwargs.values())
                                                 if torch.is_tensor(x))), with_kwargs=True)  # fmt: skip
    sums, grads = [], []
    for paired in (True, False):
        model.zero_grad()
        logps = batch_logps(model(model_inputs({**batch, PAIRED_PIXELS: paired}, True)), batch)
        (logps * torch.arange(1.0, 5.0, dtype=logps.dtype)).sum().backward()
        sums.append(logps.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert seen[0] * 2 == seen[1]  # half the images' rows, then all of them
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-12, atol=0)
    assert grads[0].keys() == grads[1].keys()
    assert any(n.startswith(("hf.model.visual", "hf.model.vision")) for n in grads[0])
    # transformers' eager attention takes its softmax in float32, in a float64 model too: the
    # repeated features' gradient is summed before that cast, the sides' apart after it, so the
    # encoder's gradients agree to float32's rounding (2^-24 a step), the rest to float64's.
    largest = max(g.abs().max().item() for g in grads[1].values())
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-6, atol=1e-6 * largest, msg=name)


def test_a_full_fine_tune_equals_trls_dpo_trainer(made):
    """The policy (the folder's weights moved at random) against a frozen copy of the folder:
    mmtrain's loss and every parameter's gradient equal DPOTrainer's on the same rows, the
    reference's log-probs given to TRL from its own (fused-head) forward of the copy. TRL's
    log-probs are float32, mmtrain's float64 here: equal to 1e-6. (TRL 1.16 scores a separate
    `ref_model` through another path, whose log-probs of this model differ from its own
    logits' by up to 0.1%: hence the reference given as precomputed log-probs.)"""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from mmtrain.models.hub.model import HubModel
    from mmtrain.models.hub.source import model_class

    root, folder = made
    spec, batch = _pairs_in_float64(root, folder)

    def load():
        return model_class(folder).from_pretrained(folder, dtype=torch.float64).eval()

    reference, policy = load(), load()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    their_policy, their_reference = copy.deepcopy(policy), copy.deepcopy(reference)

    ours = HubModel(spec, policy)
    config = DpoConfig(beta=0.5, reference="copy")
    objective = DpoObjective(ours, config, reference=HubModel(spec, reference))
    objective.prepare(ours, [batch], None)
    loss = objective.loss(ours(objective.inputs(batch, 0)), batch, 0)
    loss.backward()

    args = trl.DPOConfig(output_dir=str(root / "trl"), beta=config.beta, loss_type=["sigmoid"],
                         report_to=[], use_cpu=True)  # fmt: skip
    data = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])

    def trainer(model):
        return trl.DPOTrainer(model=model, args=args, train_dataset=data,
                              processing_class=load_processor(folder))  # fmt: skip

    inputs = {k: v for k, v in batch.items() if k not in ("labels", "pairs")}
    completion = (batch["labels"] != IGNORE_INDEX).long()
    labels = inputs["input_ids"].masked_fill(completion == 0, IGNORE_INDEX)
    with torch.no_grad():  # TRL's own log-probs of the reference
        scored = trainer(their_reference).model(**inputs, labels=labels, fused_lm_head=True,
                                                use_cache=False)  # fmt: skip
    ref_logps = scored.log_probs[:, -(labels.shape[1] - 1) :].sum(dim=1)
    theirs_trainer = trainer(their_policy)
    theirs_trainer.precompute_ref_logps = True
    n = ref_logps.shape[0] // 2
    theirs = theirs_trainer.compute_loss(theirs_trainer.model, {
        **inputs, "completion_mask": completion, "ref_chosen_logps": ref_logps[:n],
        "ref_rejected_logps": ref_logps[n:]})  # fmt: skip
    theirs.backward()
    assert abs(loss.item() - theirs.item()) <= 1e-6 * max(1.0, abs(loss.item()))
    mine = {name[len("hf.") :]: p.grad for name, p in ours.named_parameters()}
    their = dict(theirs_trainer.model.named_parameters())
    largest = max(g.abs().max().item() for g in mine.values() if g is not None)
    assert mine.keys() == their.keys()
    for name, grad in mine.items():
        torch.testing.assert_close(grad, their[name].grad.double(), rtol=1e-6,
                                   atol=1e-6 * largest, msg=name)  # fmt: skip


def test_packed_pairs_train_what_padded_pairs_train(made):
    """A hub model's packed rows (`data.pack`): each side's log-prob summed by its sample
    (`sample_ids`); the run equals the padded one (float64: losses to 1e-9)."""
    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    root, folder = made
    losses = {}
    for pack in (False, True):
        config = {"init": str(folder),
                  "data": {"train": str(root / "shards"), "sequence_length": 128, "pack": pack},
                  "train": {"steps": 2, "batch_size": 4, "lr": 1e-2, "warmup_steps": 0,
                            "precision": "fp64", "objective": "dpo",
                            # (the vision tower frozen: a trained one's gradients agree to
                            # float32's rounding, test_a_pairs_images_go_through_...)
                            "towers": {"vision": {"freeze": True}, "text": {"lora": {"rank": 4}}}},
                  "metrics": {"tensorboard": False}, "out": str(root / f"pack-{pack}")}  # fmt: skip
        losses[pack] = [row["loss"] for row in train(config_from_dict(config)).history]
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]),
                               rtol=1e-9, atol=0)  # fmt: skip


def _losses_on_ranks(rank: int, world: int, path: str) -> list[float]:
    from mmtrain.config import load_config
    from mmtrain.train.loop import train

    return [row["loss"] for row in train(load_config(path)).history]


@pytest.mark.slow
def test_fsdp_on_two_ranks_trains_what_one_process_trains(made):
    """A hub model's full fine-tune under FSDP2, its vision tower trained, the reference
    cached before the first step and each pair's images through the sharded encoder once: 2
    gloo ranks train what one process trains on the same global batch (float64, AdamW's eps
    1 so an update is Lipschitz in its gradient: test_hub_train_parallel.py; losses to
    1e-9)."""
    from dist_helpers import run_distributed
    from mmtrain.config import load_config
    from mmtrain.train.loop import train

    root, folder = made
    paths = {}
    for parallel in ("ddp", "fsdp"):
        config = {"init": str(folder), "data": {"train": str(root / "shards"), "sequence_length": 128},
                  "train": {"steps": 2, "batch_size": 4, "micro_batch": 1, "lr": 1e-3, "eps": 1.0,
                            "warmup_steps": 0, "precision": "fp64", "objective": "dpo",
                            "parallel": parallel},
                  "metrics": {"tensorboard": False}, "out": str(root / f"hub-{parallel}")}  # fmt: skip
        paths[parallel] = root / f"hub-{parallel}.yaml"
        paths[parallel].write_text(yaml.safe_dump(config))
    one = [row["loss"] for row in train(load_config(paths["ddp"])).history]
    first, second = run_distributed(_losses_on_ranks, world_size=2, args=(str(paths["fsdp"]),),
                                    timeout_s=300)  # fmt: skip
    assert first == second
    assert (root / "hub-fsdp" / "reference_logps" / "complete.json").is_file()
    torch.testing.assert_close(torch.tensor(first), torch.tensor(one), rtol=1e-9, atol=0)
