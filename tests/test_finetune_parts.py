"""Fine-tuning the way users do it: partial freezing (`freeze_blocks`, LiT-style
`unlocked_blocks`), layer-wise learning-rate decay, and LoRA (adapters, merging, their file,
exact resume), plus the planner's agreement with what the module trains."""

from __future__ import annotations

import copy
import json

import pytest
import safetensors.torch
import torch
import yaml

import mmtrain
from micro import make_shards, micro_run, micro_spec
from mmtrain.checkpoint import load_checkpoint
from mmtrain.cli import main
from mmtrain.config import LoraConfig, TowerTrainConfig, TrainConfig
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train.loop import train
from mmtrain.train.lora import (
    LORA_FILE,
    LoraLinear,
    apply_lora,
    is_adapter,
    load_lora,
    lora_scales,
    lora_state_dict,
    merge_lora,
    merge_lora_state,
    save_lora,
)
from mmtrain.train.optim import (
    freeze_parameters,
    make_optimizer,
    param_groups,
    resolve_optimizer_defaults,
)

SPEC3 = micro_spec(layers=3)  # three blocks per tower: room for "first N" and "last N"


def model3(seed: int = 0, dtype: torch.dtype | None = None):
    return mmtrain.create_model(ModelSpec.from_dict(SPEC3), seed=seed, dtype=dtype)


def batch(n: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    text = torch.zeros(n, 16, dtype=torch.long)
    text[:, 0] = 256
    text[:, 1:6] = torch.randint(1, 256, (n, 5), generator=g)
    text[:, 6] = 257
    return {"image": torch.randn(n, 3, 16, 16, generator=g, dtype=dtype), "text": text}


def tuning(**towers) -> TrainConfig:
    config = TrainConfig(
        steps=1, batch_size=1, lr=1e-3, towers={k: TowerTrainConfig(**v) for k, v in towers.items()}
    )
    resolve_optimizer_defaults(config, ModelSpec.from_dict(SPEC3))  # as the trainer does
    return config


def trainable(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"), 32)


def run_config(folder, shards: str, towers: dict, **train):
    return micro_run(folder, shards, spec=SPEC3, train={"towers": towers, **train})


# ----------------------------------------------------------------------------- partial freezing
def test_unlocked_blocks_train_the_last_blocks_and_the_output_layers_only():
    model = model3()
    freeze_parameters(model, tuning(image={"unlocked_blocks": 1}))
    image = {n for n in trainable(model) if n.startswith("towers.image.")}
    # The last block (norms included), the final norm and the projection: nothing else.
    assert image == {
        n
        for n, _ in model.named_parameters()
        if n.startswith(("towers.image.blocks.2.", "towers.image.norm_final.", "towers.image.proj"))
    }
    assert all(n in trainable(model) for n, _ in model.named_parameters() if ".text." in n)

    zero = model3()
    freeze_parameters(zero, tuning(image={"unlocked_blocks": 0}))
    assert {n for n in trainable(zero) if n.startswith("towers.image.")} == {
        "towers.image.norm_final.weight",
        "towers.image.norm_final.bias",
        "towers.image.proj.weight",
    }


def test_freeze_blocks_freeze_the_stem_and_the_first_blocks_with_their_norms():
    model = model3()
    frozen = freeze_parameters(model, tuning(text={"freeze_blocks": 2}))
    frozen_names = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen_names == {
        n
        for n, _ in model.named_parameters()
        if n.startswith(("towers.text.stem.", "towers.text.blocks.0.", "towers.text.blocks.1."))
    }
    assert "towers.text.blocks.1.norm2.weight" in frozen_names
    assert frozen == sum(p.numel() for n, p in model.named_parameters() if n in frozen_names)
    # No optimizer state for them: the groups hold exactly the trainable parameters.
    grouped = {
        id(p) for g in param_groups(model, tuning(text={"freeze_blocks": 2})) for p in g["params"]
    }
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}


@pytest.mark.parametrize(
    ("towers", "field", "match"),
    [
        ({"image": {"unlocked_blocks": 4}}, "train.towers.image.unlocked_blocks", "more than the tower's 3"),
        ({"text": {"freeze_blocks": 5}}, "train.towers.text.freeze_blocks", "more than the tower's 3"),
    ],
)  # fmt: skip
def test_more_blocks_than_the_tower_has_is_refused_naming_the_field(towers, field, match):
    with pytest.raises(FieldError, match=match) as err:
        freeze_parameters(model3(), tuning(**towers))
    assert err.value.path == field


@pytest.mark.parametrize(
    ("tower", "field"),
    [
        ({"freeze_blocks": 1, "unlocked_blocks": 1}, "train.towers.image.unlocked_blocks"),
        ({"freeze": True, "freeze_blocks": 1}, "train.towers.image.freeze_blocks"),
        ({"unlocked_blocks": 1, "lora": {"rank": 2}}, "train.towers.image.lora"),
        ({"unlocked_blocks": -1}, "train.towers.image.unlocked_blocks"),
        ({"lr_layer_decay": 1.5}, "train.towers.image.lr_layer_decay"),
        ({"lr_layer_decay": 0.0}, "train.towers.image.lr_layer_decay"),
        ({"lora": {"rank": 0}}, "train.towers.image.lora.rank"),
        ({"lora": {"dropout": 1.0}}, "train.towers.image.lora.dropout"),
        ({"lora": {"targets": ["attn", "qkv"]}}, "train.towers.image.lora.targets[1]"),
        ({"lora": {"targets": []}}, "train.towers.image.lora.targets"),
    ],
)
def test_contradictory_or_out_of_range_settings_name_the_field(tmp_path, tower, field):
    with pytest.raises(FieldError) as err:
        run_config(tmp_path, "shards", {"image": tower})
    assert err.value.path == field


def test_lora_takes_ema_and_qlora_refuses_it(tmp_path):
    """A LoRA run averages its adapters (train/ema.py; test_hub_wan.py trains one); QLoRA
    with an average is refused, naming the field."""
    run_config(tmp_path, "shards", {"text": {"lora": {}}}, ema=0.99)
    with pytest.raises(FieldError) as err:
        run_config(tmp_path, "shards", {"text": {"lora": {"quantize_base": "nf4"}}}, ema=0.99)
    assert err.value.path == "train.ema" and "quantize_base" in str(err.value)


@pytest.mark.slow
def test_frozen_parameters_get_no_state_and_stay_bitwise_unchanged(tmp_path, shards):
    towers = {"image": {"unlocked_blocks": 1}, "text": {"freeze_blocks": 2}}
    train(run_config(tmp_path, shards, towers))
    start = model3(seed=1).state_dict()  # micro_run's seed
    final = mmtrain.load_model(tmp_path / "run").state_dict()
    reference = model3()
    freeze_parameters(reference, tuning(**towers))
    frozen = {n for n, p in reference.named_parameters() if not p.requires_grad}
    assert frozen and trainable(reference)
    for name in frozen:
        assert torch.equal(final[name], start[name]), name
    for name in trainable(reference):
        assert not torch.equal(final[name], start[name]), name  # they did train
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000004").state
    moments = state["optimizer"]["state"]
    counts = sorted(m["exp_avg"].numel() for m in moments.values())
    assert counts == sorted(p.numel() for p in reference.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- layer decay
def test_layer_decay_follows_beit_timm_depth_scaling():
    # BEiT/timm: with L blocks, layer 0 = stem, layer i+1 = block i, L+1 = final norm and
    # projection; layer l gets lr x decay^(L + 1 - l).
    model = model3()
    config = tuning(image={"lr": 1e-2, "lr_layer_decay": 0.5})
    config.lr = 1e-3
    groups = {g["name"]: g for g in param_groups(model, config)}
    expected = {
        "image/stem": 1e-2 * 0.5**4,
        "image/block0": 1e-2 * 0.5**3,
        "image/block1": 1e-2 * 0.5**2,
        "image/block2": 1e-2 * 0.5,
        "image/out": 1e-2,
    }
    for prefix, lr in expected.items():
        assert groups[f"{prefix}/decay"]["lr"] == pytest.approx(lr, rel=1e-12)
        assert groups[f"{prefix}/no_decay"]["lr"] == pytest.approx(lr, rel=1e-12)
    assert groups["image/block2/no_decay"]["weight_decay"] == 0.0
    assert {g["lr"] for n, g in groups.items() if n.startswith("text/")} == {1e-3}
    assert {g["lr"] for n, g in groups.items() if n.startswith("head/")} == {1e-3}
    # Every parameter once, in the group of its layer.
    names = {id(p): n for n, p in model.named_parameters()}
    for group_name, group in groups.items():
        for p in group["params"]:
            if group_name.startswith("image/block1/"):
                assert names[id(p)].startswith("towers.image.blocks.1."), names[id(p)]
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))


def test_layer_decay_groups_hold_only_what_trains():
    model = model3()
    config = tuning(image={"unlocked_blocks": 1, "lr_layer_decay": 0.8})
    freeze_parameters(model, config)
    names = {g["name"].rsplit("/", 1)[0] for g in param_groups(model, config)}
    assert {n for n in names if n.startswith("image/")} == {"image/block2", "image/out"}


# ----------------------------------------------------------------------------- LoRA: module
def test_lora_wraps_the_default_targets_keeps_names_and_freezes_the_tower():
    model = model3()
    names_before = set(model.state_dict())
    added = apply_lora(model, {"image": LoraConfig(rank=4)})
    after = set(model.state_dict())
    assert names_before <= after  # the base weights keep their names: checkpoints load
    adapters = after - names_before
    assert all(is_adapter(n) for n in adapters)
    layers = {n.rsplit(".", 1)[0] for n in adapters}
    assert layers == {
        f"towers.image.blocks.{i}.{path}"
        for i in range(3)
        for path in ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")
    }
    assert added == sum(model.state_dict()[n].numel() for n in adapters)
    image = {n for n in trainable(model) if n.startswith("towers.image.")}
    assert image == {n for n in adapters}  # only the adapters of the tower train
    assert any(n.startswith("towers.text.") for n in trainable(model))  # the other tower does
    qkv = model.towers["image"].blocks[0].attn.qkv
    assert isinstance(qkv, LoraLinear) and qkv.lora_a.shape == (4, 32)
    assert qkv.lora_b.shape == (96, 4) and not qkv.lora_b.any()
    bound = 1 / 32**0.5  # kaiming-uniform(a=sqrt(5)) on fan-in 32
    assert 0 < qkv.lora_a.abs().max() <= bound

    only_mlp = model3()
    apply_lora(only_mlp, {"text": LoraConfig(rank=2, targets=["mlp"])})
    assert {n.split(".")[-3] for n in lora_state_dict(only_mlp)} == {"mlp"}


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_lora_at_step_zero_is_the_base_model_exactly(dropout):
    base, adapted = model3(), model3()
    apply_lora(adapted, {"image": LoraConfig(rank=4, dropout=dropout), "text": LoraConfig()})
    inputs = batch()
    torch.manual_seed(0)
    expected = base(inputs)
    got = adapted(inputs)  # training mode: dropout active on the (zero) adapter path
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_lora_adapter_init_is_a_function_of_the_seed():
    one, two, other = model3(), model3(), model3()
    apply_lora(one, {"image": LoraConfig()}, seed=5)
    apply_lora(two, {"image": LoraConfig()}, seed=5)
    apply_lora(other, {"image": LoraConfig()}, seed=6)
    a, b, c = lora_state_dict(one), lora_state_dict(two), lora_state_dict(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["towers.image.blocks.0.attn.qkv.lora_a"], c["towers.image.blocks.0.attn.qkv.lora_a"]
    )


def test_gradients_reach_only_the_adapters_of_a_lora_tower():
    model = model3()
    apply_lora(model, {"image": LoraConfig(rank=4), "text": LoraConfig(rank=4)})
    _randomise_b(model)  # with B = 0 the gradient of A is exactly zero
    out = model(batch())
    (out["image"] * out["text"]).sum().backward()
    for name, p in model.named_parameters():
        if is_adapter(name):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        elif name.startswith("towers."):
            assert p.grad is None, name
    optimizer = make_optimizer(model, tuning(), torch.device("cpu"))
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if is_adapter(n) or "." not in n}


def _randomise_b(model, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


def test_merged_model_computes_what_the_adapted_one_does_in_float64():
    model = model3(dtype=torch.float64)
    apply_lora(model, {"image": LoraConfig(rank=4, alpha=8), "text": LoraConfig(rank=2)})
    _randomise_b(model)
    model.eval()
    inputs = batch(dtype=torch.float64)
    expected = model(inputs)
    scales = lora_scales(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merge_lora(copy.deepcopy(model))
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(model3().state_dict())  # the plain model's names
    # Exactly W + scale B A (summed in float64), and the state-dict route agrees bit for bit.
    for prefix, scale in scales.items():
        weight = (
            state[f"{prefix}.weight"]
            + scale * state[f"{prefix}.lora_b"] @ state[f"{prefix}.lora_a"]
        )
        assert torch.equal(merged.get_parameter(f"{prefix}.weight"), weight), prefix
    plain = merge_lora_state(state, scales)
    for name, value in merged.state_dict().items():
        assert torch.equal(plain[name], value), name
    # W x + s B (A x) and (W + s B A) x differ by float64 rounding only: ~1e-16 relative per
    # operation, a few hundred operations deep, on O(1) values; 1e-10 holds on any CPU.
    got = merged(inputs)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10)


def test_save_lora_round_trips_adapters_and_settings(tmp_path):
    model = model3()
    apply_lora(model, {"image": LoraConfig(rank=4, alpha=2.0, dropout=0.1, targets=["attn"])})
    _randomise_b(model)
    path = save_lora(model, tmp_path / "adapters.safetensors")
    tensors, configs = load_lora(path)
    expected = lora_state_dict(model)
    assert set(tensors) == set(expected)
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert configs == {"image": LoraConfig(rank=4, alpha=2.0, dropout=0.1, targets=["attn"])}
    assert not any(not is_adapter(k) for k in safetensors.torch.load_file(path))


# ----------------------------------------------------------------------------- LoRA: training
LORA_TOWERS = {
    "image": {"lora": {"rank": 4, "alpha": 8, "dropout": 0.1}},
    "text": {"lora": {"rank": 2, "targets": ["attn"]}},
}


@pytest.mark.slow
def test_lora_run_resumes_bitwise_and_saves_merged_weights_and_adapters(tmp_path, shards):
    whole = run_config(tmp_path / "whole", shards, LORA_TOWERS)
    losses = [row["loss"] for row in train(whole).history]
    assert len(losses) == 4

    # Killed after step 3 (checkpoint at step 2), then the same command again.
    cut = run_config(tmp_path / "cut", shards, LORA_TOWERS)
    halted = [row["loss"] for row in train(cut, halt_after_step=3).history]
    resumed = train(cut)
    assert resumed.resumed_from == 2
    assert halted + [row["loss"] for row in resumed.history][1:] == losses

    for name in ("model.safetensors", LORA_FILE):
        a = safetensors.torch.load_file(tmp_path / "whole" / "run" / name)
        b = safetensors.torch.load_file(tmp_path / "cut" / "run" / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name

    # The checkpoint holds base + adapters; model.safetensors is their merge, a plain model;
    # lora.safetensors the adapters alone, with their settings.
    run = tmp_path / "whole" / "run"
    saved = load_checkpoint(run / "checkpoints" / "step_00000004").model
    adapted = model3()
    apply_lora(adapted, {k: LoraConfig(**v["lora"]) for k, v in LORA_TOWERS.items()})
    assert set(saved) == set(adapted.state_dict())
    final = mmtrain.load_model(run)
    assert not any(isinstance(m, LoraLinear) for m in final.modules())
    expected = merge_lora_state(saved, lora_scales(adapted))
    for name, value in final.state_dict().items():
        assert torch.equal(value, expected[name]), name
    start = model3(seed=1).state_dict()
    for name, value in final.state_dict().items():
        # Only adapted weights and what lies outside the towers (the temperature) move.
        adapted_weight = name.removesuffix(".weight") in lora_scales(adapted)
        assert (not torch.equal(value, start[name])) == (adapted_weight or "." not in name), name
    tensors, configs = load_lora(run / LORA_FILE)
    assert set(tensors) == {k for k in saved if is_adapter(k)}
    assert all(torch.equal(tensors[k], saved[k]) for k in tensors)
    assert configs["image"] == LoraConfig(rank=4, alpha=8.0, dropout=0.1)
    assert configs["text"] == LoraConfig(rank=2, alpha=2.0, targets=["attn"])  # alpha resolved
    assert (
        yaml.safe_load((run / "config.yaml").read_text())["train"]["towers"]["image"]["lora"][
            "rank"
        ]
        == 4
    )


# ----------------------------------------------------------------------------- planner
GATED = {
    "name": "gated",
    "embed_dim": 16,
    "pairs": [["image", "text"]],
    "towers": {
        "image": {"modality": "image", "stem": {"image_size": 16, "patch_size": 8},
                  "width": 32, "layers": 2, "heads": 2, "activation": "swiglu", "norm": "rmsnorm"},
        "text": {"modality": "text", "stem": {"vocab_size": 258, "context_length": 8},
                 "width": 32, "layers": 1, "heads": 2},
    },
}  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "tiny-clip", "--lora", "image"],
        ["--model", "tiny-clip", "--lora", "image", "--lora", "text", "--lora-rank", "4"],
        ["--model", "tiny-clip", "--lora", "text", "--lora-rank", "8", "--lora-targets", "mlp"],
        ["--model", "tiny-clip", "--freeze", "text", "--lora", "image", "--lora-targets", "attn"],
        ["--model", "tiny-fusion", "--lora", "image", "--lora-rank", "2"],
        ["--model", "tiny-fusion", "--freeze", "text"],
        ["--model", "GATED", "--lora", "image", "--lora-rank", "3"],
        ["--model", "tiny-clip", "--lora", "image", "--lora", "text", "--ac", "full"],
        ["--model", "tiny-clip", "--freeze-blocks", "image=1"],
        ["--model", "tiny-clip", "--unlocked-blocks", "text=0", "--lora", "image"],
        ["--model", "tiny-fusion", "--unlocked-blocks", "image=1", "--freeze-blocks", "text=1"],
    ],
)
def test_planner_counts_what_the_lora_or_frozen_module_trains(capsys, tmp_path, argv):
    spec_file = tmp_path / "gated.yaml"
    spec_file.write_text(yaml.safe_dump(GATED))
    argv = [str(spec_file) if a == "GATED" else a for a in argv]
    assert main(["plan", *argv, "--micro-batch", "2", "--measure", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    measured = result["measured"]
    planned = result["model"]["trainable_params"]
    assert measured["predicted_trainable_params"] == planned
    assert measured["trainable_params"] == planned  # parameters that got a gradient
    assert measured["optimizer_state_params"] == planned  # parameters holding AdamW state
    assert abs(measured["model_state_error"]) < 1e-3  # weights, grads, AdamW: exact counts
    assert abs(measured["activations_error"]) < 0.10


def test_planner_lora_count_equals_the_adapters_train_lora_adds():
    from mmtrain.plan.model import from_spec

    spec = ModelSpec.from_dict(GATED)
    for targets in (("attn",), ("mlp",), ("attn", "mlp")):
        plan = from_spec(spec).with_modes({"image": "lora"}, 5, targets)
        model = mmtrain.create_model(spec)
        added = apply_lora(model, {"image": LoraConfig(rank=5, targets=list(targets))})
        assert plan.stack("image").lora_params() == added, targets


@pytest.mark.parametrize(
    ("flag", "match"),
    [
        (["--freeze-blocks", "image"], "TOWER=N"),
        (["--unlocked-blocks", "image=9"], "has 5 blocks"),
        (["--freeze-blocks", "image=9"], "towers.image.frozen_blocks"),
    ],
)
def test_planner_partial_freezing_flags_are_checked(capsys, flag, match):
    assert main(["plan", "--model", "tiny-clip", *flag]) == 2
    assert match in capsys.readouterr().err


def test_lora_on_a_tower_the_model_lacks_is_refused_naming_it():
    model = model3()
    with pytest.raises(FieldError, match="did you mean 'image'") as err:
        apply_lora(model, {"imag": LoraConfig()})
    assert err.value.path == "train.towers.imag.lora"
    assert not lora_state_dict(model)  # nothing was wrapped
