"""PEFT adapters of LoRA runs (models/formats/peft_adapter.py, train/export.py): OUT/adapter/
loads in `peft.PeftModel.from_pretrained` over the transformers model of the unmerged weights
and gives the merged export's outputs, for every native family with a transformers class:
Llama and Qwen2 LMs, LLaVA (CLIP and SigLIP towers), Qwen2-VL and Qwen2.5-VL, CLIP, SigLIP and
a bare CLIP vision model. Fused projections of ours (q|k|v, gate|up) are written as the
separate modules' adapters; a real `mmtrain train` of a LoRA run writes the folder.

Each family: a tiny transformers model (random, saved in float64) is read by mmtrain, LoRA is
applied to its towers (attn + mlp; two towers with different ranks and alphas where the model
has two) with random, non-zero B, and the base (adapters left out), the merged model (through
the existing HF writer) and the adapter are written. Both sides then run in transformers, in
float64 (its float32 RMSNorms and vision rotary made to compute in the input's precision): W x +
s B (A x) and (W + s B A) x differ by float64 rounding only, ~1e-16 relative per operation over
a few hundred operations per output, so 1e-12 of the outputs' scale holds on any CPU, while a
wrong row, scale or module shows at the size of the adapters' effect (checked to be >= 1e-3).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mmtrain.cli import main
from mmtrain.config import LoraConfig, config_from_dict
from mmtrain.models.build import model_with_weights
from mmtrain.models.formats.hf import read_hf_model, write_hf_state
from mmtrain.models.formats.hf_common import NoHFCounterpart
from mmtrain.models.formats.peft_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    peft_base_name,
    write_peft_adapter,
)
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.train.export import export_model
from mmtrain.train.loop import train
from mmtrain.train.lora import (
    apply_lora,
    is_adapter,
    lora_configs,
    lora_modules,
    lora_scales,
    lora_state_dict,
    merge_lora_state,
)
from test_decoder import randomize, rms_norm_in_input_precision
from test_hf_llava import IDS, hf_inputs, hf_lm, image_tokens, images, llava
from test_hf_qwen2_vl import peer, rotary_in_input_precision
from test_init_lm import conversation_shards

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402

ROUNDING = 1e-12  # float64, relative to the outputs' scale (module docstring)
EFFECT = 1e-3  # the adapters must move the outputs by at least this much of their scale
BOTH = ["attn", "mlp"]


@pytest.fixture(autouse=True)
def float64_transformers(monkeypatch):
    """transformers' RMSNorms and vision rotary compute in float32 whatever the input; in the
    input's precision here, so both sides are float64 throughout."""
    for module in (modeling_llama, modeling_qwen2, modeling_qwen2_vl, modeling_qwen2_5_vl):
        for name in dir(module):
            if name.endswith("RMSNorm"):
                monkeypatch.setattr(getattr(module, name), "forward", rms_norm_in_input_precision)
    for module in (modeling_qwen2_vl, modeling_qwen2_5_vl):
        monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", rotary_in_input_precision)


# ----------------------------------------------------------------------------- the families
CLIP_TEXT = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                 num_attention_heads=2, max_position_embeddings=8, eos_token_id=63)  # fmt: skip
CLIP_VISION = dict(hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                   num_attention_heads=2, image_size=16, patch_size=8)  # fmt: skip
IMAGE, VIDEO, START, END = 150, 151, 152, 153  # test_hf_qwen2_vl's ids


def clip(kind: str):
    if kind == "clip":
        config = transformers.CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION,
                                         projection_dim=8)  # fmt: skip
        model = transformers.CLIPModel(config)
    elif kind == "siglip":
        config = transformers.SiglipConfig(
            text_config={**CLIP_TEXT, "eos_token_id": 1}, vision_config=CLIP_VISION
        )
        model = transformers.SiglipModel(config)
    else:
        model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**CLIP_VISION))
    randomize(model, 3)
    return model


def _pixels(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(5)).double()


def _ids(rows: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab - 1, (rows, length), generator=torch.Generator().manual_seed(6))


def lm_outputs(model) -> list[torch.Tensor]:
    return [model(input_ids=_ids(2, 9, 64)).logits]


def llava_outputs(case: str) -> Callable:
    def run(model) -> list[torch.Tensor]:
        ids, _ = hf_inputs(IDS, image_tokens(case))
        return [model(input_ids=ids, pixel_values=images(4, torch.float64)).logits]

    return run


def qwen2_vl_outputs(model) -> list[torch.Tensor]:
    """One 16 x 16 image (a 4 x 4 grid of 4 px patches, merged 2 x 2 into 4 tokens), then text."""
    patch = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch
    pixels = torch.randn(16, patch, generator=torch.Generator().manual_seed(7)).double()
    ids = torch.tensor([[1, START, *[IMAGE] * 4, END, 7, 8, 9]])
    grid, kinds = torch.tensor([[1, 4, 4]]), (ids == IMAGE).long()  # 1: an image's token
    out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=kinds)
    return [out.logits]


def encoder_outputs(model) -> list[torch.Tensor]:
    out = model(input_ids=_ids(2, 8, 64), pixel_values=_pixels())
    return [out.image_embeds, out.text_embeds]


def vision_outputs(model) -> list[torch.Tensor]:
    out = model(pixel_values=_pixels())
    return [out.last_hidden_state, out.pooler_output]


# name: (the transformers model, LoRA per tower, its outputs)
CASES = {
    "llama": (lambda: hf_lm("llama-sharded"), {"text": LoraConfig(4, 8.0, targets=BOTH)},
              lm_outputs),
    "qwen2-tied": (lambda: hf_lm("qwen2-tied"), {"text": LoraConfig(2, targets=["mlp"])},
                   lm_outputs),
    "llava-clip-two-ranks": (
        lambda: llava("clip-llama-default"),
        {"image": LoraConfig(2, 3.0, targets=BOTH), "text": LoraConfig(4, 16.0, targets=BOTH)},
        llava_outputs("clip-llama-default"),
    ),
    "llava-siglip-text-only": (
        lambda: llava("siglip-headless-qwen2"),
        {"text": LoraConfig(3, 6.0, targets=BOTH)},
        llava_outputs("siglip-headless-qwen2"),
    ),
    "qwen2-vl": (lambda: peer("qwen2_vl"),
                 {"vision": LoraConfig(2, 4.0, targets=BOTH), "text": LoraConfig(4, targets=BOTH)},
                 qwen2_vl_outputs),
    "qwen2.5-vl": (lambda: peer("qwen2_5_vl"),
                   {"vision": LoraConfig(4, 2.0, targets=BOTH),
                    "text": LoraConfig(4, 2.0, targets=BOTH)},
                   qwen2_vl_outputs),
    "clip-two-ranks": (lambda: clip("clip"),
                       {"image": LoraConfig(2, targets=BOTH), "text": LoraConfig(4, targets=BOTH)},
                       encoder_outputs),
    "siglip-image-only": (lambda: clip("siglip"), {"image": LoraConfig(3, 5.0, targets=BOTH)},
                          encoder_outputs),
    "clip-vision": (lambda: clip("vision"), {"image": LoraConfig(2, 4.0, targets=["attn"])},
                    vision_outputs),
}  # fmt: skip


# ----------------------------------------------------------------------------- helpers
def lora_model(folder: Path, loras: dict[str, LoraConfig]):
    """mmtrain's model of a HF folder (float64) with LoRA on `loras`' towers, every B random."""
    spec, state = read_hf_model(folder)
    model = model_with_weights(spec, state)
    apply_lora(model, loras, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_b.copy_(torch.randn(module.lora_b.shape, generator=g) * 0.3)
    return spec, model


def write_three(tmp_path: Path, spec: ModelSpec, model) -> tuple[Path, Path, Path, list[str]]:
    """The base and merged HF folders (the existing writer) and the PEFT adapter."""
    state = model.state_dict()
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    write_hf_state(spec, base, tmp_path / "base")
    write_hf_state(spec, merge_lora_state(state, lora_scales(model)), tmp_path / "merged")
    modules = write_peft_adapter(spec, lora_state_dict(model), lora_configs(model),
                                 tmp_path / "adapter", str(tmp_path / "base"))  # fmt: skip
    return tmp_path / "base", tmp_path / "merged", tmp_path / "adapter", modules


def load(cls, folder: Path):
    return cls.from_pretrained(folder, dtype=torch.float64).eval()


def assert_same_outputs(got: list[torch.Tensor], want: list[torch.Tensor], base: list) -> None:
    """`got` equals `want` up to float64 rounding, and the adapters matter: `base` differs in
    at least one output (a tower without adapters keeps its own)."""
    moved = []
    for g, w, b in zip(got, want, base, strict=True):
        scale = w.abs().max().item()
        assert (g - w).abs().max().item() <= ROUNDING * scale
        moved.append((b - w).abs().max().item() >= EFFECT * scale)
    assert any(moved)


def adapted_modules(peft_model) -> set[str]:
    """The transformers modules PEFT put LoRA on (names relative to the transformers model)."""
    base = peft_model.get_base_model()
    return {name for name, m in base.named_modules() if hasattr(m, "lora_A") and m.lora_A}


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("case", list(CASES))
def test_peft_loads_the_adapter_with_the_merged_exports_outputs(tmp_path, case):
    make, loras, outputs = CASES[case]
    hf = make()
    cls = type(hf)
    hf.double().save_pretrained(tmp_path / "source")
    spec, model = lora_model(tmp_path / "source", loras)
    base_dir, merged_dir, adapter_dir, modules = write_three(tmp_path, spec, model)

    with torch.no_grad():
        merged = outputs(load(cls, merged_dir))
        plain = outputs(load(cls, base_dir))
        adapted = peft.PeftModel.from_pretrained(load(cls, base_dir), adapter_dir).eval()
        got = outputs(adapted)
    assert_same_outputs(got, merged, plain)
    assert adapted_modules(adapted) == set(modules)  # each module named is one PEFT adapts


def test_fused_projections_become_the_separate_modules_with_a_shared_a(tmp_path):
    """A Llama block's qkv adapter is q_proj's, k_proj's and v_proj's (A shared, B's rows
    q | k | v); fc1's is gate_proj's and up_proj's; the config is what PEFT reads."""
    hf = hf_lm("llama-sharded")
    hf.double().save_pretrained(tmp_path / "source")
    spec, model = lora_model(tmp_path / "source", {"text": LoraConfig(4, 8.0, targets=BOTH)})
    _, _, adapter_dir, _ = write_three(tmp_path, spec, model)
    tensors = safetensors.torch.load_file(str(adapter_dir / WEIGHTS_FILE))
    ours = lora_state_dict(model)
    a, b = (
        ours["towers.text.blocks.1.attn.qkv.lora_a"],
        ours["towers.text.blocks.1.attn.qkv.lora_b"],
    )
    rows = {"q": 32, "k": 16, "v": 16}  # hidden 32, 2 of 4 heads for k and v
    for x, part in zip(rows, b.split(list(rows.values())), strict=True):
        key = f"base_model.model.model.layers.1.self_attn.{x}_proj.lora_"
        assert torch.equal(tensors[key + "A.weight"], a)
        assert torch.equal(tensors[key + "B.weight"], part)
    gate, up = ours["towers.text.blocks.0.mlp.fc1.lora_b"].chunk(2)
    assert torch.equal(tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"], gate)
    assert torch.equal(tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"], up)
    assert len(tensors) == 2 * 2 * 7  # 2 layers x 7 modules x (A, B)

    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["bias"]) == (4, 8, "none")
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    assert config["rank_pattern"] == {} and config["alpha_pattern"] == {}
    loaded = peft.LoraConfig.from_pretrained(adapter_dir)
    assert loaded.target_modules == set(config["target_modules"])


def test_only_the_adapted_towers_modules_are_targeted(tmp_path):
    """LoRA on a LLaVA's LM only: the vision tower's q_proj / fc1 stay plain in PEFT."""
    hf = llava("clip-llama-default")
    hf.double().save_pretrained(tmp_path / "source")
    spec, model = lora_model(tmp_path / "source", {"text": LoraConfig(2, targets=BOTH)})
    base_dir, _, adapter_dir, modules = write_three(tmp_path, spec, model)
    adapted = peft.PeftModel.from_pretrained(load(type(hf), base_dir), adapter_dir)
    assert adapted_modules(adapted) == set(modules)
    assert all(name.startswith("model.language_model.layers.") for name in modules)


def test_a_spec_without_a_transformers_class_is_refused(tmp_path):
    spec = load_spec("tiny-multimodal")  # image, audio and text towers: no HF class
    with pytest.raises(NoHFCounterpart):
        write_peft_adapter(spec, {}, {}, tmp_path / "adapter", None)
    assert not (tmp_path / "adapter").exists()


def test_base_name_is_an_hf_init_folder_only(tmp_path):
    hf_lm("llama-sharded").save_pretrained(tmp_path / "hf")
    assert peft_base_name(str(tmp_path / "hf")) == str((tmp_path / "hf").resolve())
    assert peft_base_name(str(tmp_path)) is None  # no config.json
    assert peft_base_name({"text": str(tmp_path / "hf")}) is None  # a model of several sources
    assert peft_base_name(None) is None


def test_the_export_records_the_init_as_base_only_when_nothing_else_trained(tmp_path):
    """export_model (the run's end) writes OUT/adapter/ beside lora.safetensors; a LLaVA whose
    projector also trained has no base folder to name (its init is not the adapters' base)."""
    hf = llava("clip-llama-default")
    hf.double().save_pretrained(tmp_path / "source")
    loras = {"text": LoraConfig(2, targets=BOTH)}
    _, model = lora_model(tmp_path / "source", loras)
    init = str(tmp_path / "source")
    (tmp_path / "run").mkdir()  # the run's folder, which exists from its start
    export_model(model, tmp_path / "run", 0, lora_scales(model), loras, base_name=init)
    config = json.loads((tmp_path / "run" / "adapter" / CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] is None  # the projector and image tower trained
    assert (tmp_path / "run" / "lora.safetensors").is_file()

    model.requires_grad_(False)
    for module in lora_modules(model).values():
        module.lora_a.requires_grad_(True)
        module.lora_b.requires_grad_(True)
    export_model(model, tmp_path / "run", 0, lora_scales(model), loras, base_name=init)
    config = json.loads((tmp_path / "run" / "adapter" / CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == init
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "adapter" in p.name) == [
        "adapter"
    ]  # the folder was replaced whole, nothing left beside it


# ----------------------------------------------------------------------------- a real run
def test_a_lora_run_writes_an_adapter_peft_loads_over_its_init(tmp_path):
    """`mmtrain train` (2 steps, LoRA on a Llama started from its HF folder) writes OUT/adapter/;
    PEFT over the init folder gives the logits of `mmtrain convert --to hf OUT`."""
    image_id = conversation_shards(tmp_path / "shards")
    text = dict(vocab_size=image_id + 1, bos_token_id=None, eos_token_id=None)
    hf_lm("llama-sharded", seed=8, **text).save_pretrained(tmp_path / "hf")
    spec, _ = read_hf_model(tmp_path / "hf")
    spec.save(tmp_path / "spec.json")
    config = config_from_dict({
        "model": str(tmp_path / "spec.json"),
        "init": str(tmp_path / "hf"),
        "data": {"train": str(tmp_path / "shards"), "chat_template": "plain",
                 "tokenizer": str(tmp_path / "shards" / "tokenizer.json"), "sequence_length": 48},
        "train": {"steps": 2, "batch_size": 2, "lr": 1e-2, "warmup_steps": 0, "precision": "fp64",
                  "towers": {"text": {"lora": {"rank": 4, "alpha": 8}}}},
        "metrics": {"tensorboard": False},
        "out": str(tmp_path / "run"),
    })  # fmt: skip
    run = train(config).out
    assert main(["convert", "--to", "hf", str(run), "--out", str(tmp_path / "merged")]) == 0

    cls, ids = transformers.LlamaForCausalLM, _ids(2, 9, image_id)
    with torch.no_grad():
        want = load(cls, tmp_path / "merged")(input_ids=ids).logits
        plain = load(cls, tmp_path / "hf")(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(load(cls, tmp_path / "hf"), run / "adapter")
        got = adapted.eval()(input_ids=ids).logits
    assert_same_outputs([got], [want], [plain])
    # the run trained the adapters alone: its init folder is exactly their base
    adapter = json.loads((run / "adapter" / CONFIG_FILE).read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "hf").resolve())
