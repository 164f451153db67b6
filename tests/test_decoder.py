"""The decoder LM (models/decoder.py) and its Hugging Face Llama / Qwen2 interop
(models/formats/hf_llama.py): converted weights give transformers' own logits and greedy
generations, the export loads back into transformers, the KV cache and packing change nothing,
and the spec counts what is built.

Tiny transformers models are built from configs (no download), every parameter randomised
(transformers initialises norms to 1, which would hide a swapped norm), saved with
`save_pretrained` and read by our code.

Tolerances. In float64 both implementations compute the same sums in different orders: each
rounding is ~1e-16 relative and no sum here has more than a few hundred terms of O(1) values,
so logits agree to ~1e-13; FP64_ATOL = 1e-10 leaves three orders of magnitude on any CPU. Two
reference details would hide that agreement behind float32 rounding, so:
- rotary angle tables: both compute them in float32 whatever the model's dtype (pre-trained
  weights expect those rounded tables; models/decoder.py does it on purpose);
- RMSNorm: transformers casts a float64 input *down* to float32 to normalise it. For the
  float64 comparisons only, `float64_reference` makes it normalise in the input's precision
  (its formula unchanged); the float32 comparison runs transformers as shipped.
FP32_ATOL = 1e-4 is the interop contract of DESIGN.md section 5.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from mmtrain.decoder_spec import DecoderSpec, RopeScaling
from mmtrain.models.decoder import Decoder, KVCache, document_positions
from mmtrain.models.formats.hf_common import HFFolderError
from mmtrain.models.formats.hf_llama import (
    hf_config,
    load_hf_decoder,
    read_hf_decoder,
    write_hf_decoder,
)

FP64_ATOL = 1e-10
FP32_ATOL = 1e-4

VOCAB, BOS, EOS = 96, 1, 2
# hidden 48 over 4 heads: head_dim 12, six rotary frequencies with wavelengths 6.3 ... 13536,
# so llama3 scaling with a 32-token original context keeps one, blends one, stretches four.
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
CASES = {
    "llama-gqa-untied": ("llama", dict(num_key_value_heads=2)),
    # one kv head for all 4 query heads, and heads wider than hidden / heads (q is 64 wide)
    "llama3rope-mqa-tied": (
        "llama",
        dict(
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters=LLAMA3_ROPE,
        ),
    ),
    "linearrope-mha": (
        "llama",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=500000.0, factor=2.0)),
    ),
    "qwen2-bias-gqa-tied": (
        "qwen2",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
}
HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


# ----------------------------------------------------------------------------- helpers
@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=g)
        if param.dim() >= 2:
            param.copy_(noise / math.sqrt(param.shape[-1]))  # fan-in scaled, as trained weights
        elif "norm" in name:
            param.copy_(1 + 0.1 * noise)
        else:
            param.copy_(0.1 * noise)


def hf_model(case: str, seed: int = 0) -> transformers.PreTrainedModel:
    family, changes = CASES[case]
    config_cls, model_cls = HF_CLASSES[family]
    config = config_cls(**BASE, **changes, attn_implementation="sdpa")
    model = model_cls(config)
    randomize(model, seed)
    return model.eval()


def token_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)  # no bos / eos among them


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


def our_model(spec: DecoderSpec, state: dict, dtype: torch.dtype) -> Decoder:
    model = Decoder(spec).to(dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


def rms_norm_in_input_precision(self, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm formula, normalising in at least float32 instead of always in
    float32 (which rounds a float64 input to float32)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


@pytest.fixture
def float64_reference(monkeypatch):
    def enable():
        for cls in (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm):
            monkeypatch.setattr(cls, "forward", rms_norm_in_input_precision)

    return enable


def tiny_spec(**changes) -> DecoderSpec:
    fields = dict(
        vocab_size=VOCAB,
        width=48,
        layers=2,
        heads=4,
        kv_heads=2,
        mlp_hidden=40,
        rope_scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=32),
        rms_eps=1e-5,
        bos_id=BOS,
        eos_ids=(EOS,),
    )
    return DecoderSpec(**{**fields, **changes})


def random_decoder(spec: DecoderSpec, seed: int = 0) -> Decoder:
    model = Decoder(spec)
    randomize(model, seed)
    return model.double().eval()


# ----------------------------------------------------------------------------- transformers parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_and_export_loads_back(tmp_path, case, float64_reference):
    hf = hf_model(case)
    sharded = case == "llama-gqa-untied"
    hf.save_pretrained(tmp_path / "hf", **({"max_shard_size": "20KB"} if sharded else {}))
    if sharded:
        assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
        assert not (tmp_path / "hf" / "model.safetensors").exists()
    spec, state = read_hf_decoder(tmp_path / "hf")
    family, changes = CASES[case]
    assert spec.qkv_bias == (family == "qwen2")
    assert spec.tie_embeddings == changes.get("tie_word_embeddings", False)
    assert spec.kv_heads == changes.get("num_key_value_heads", 4)
    assert spec.params() == sum(p.numel() for p in hf.parameters())
    ids = token_ids(2, 40)  # positions past the llama3 case's 32-token original context

    # float32, transformers as shipped
    expected = hf_logits(hf, ids)
    got = our_model(spec, state, torch.float32)(ids)
    torch.testing.assert_close(got, expected, atol=FP32_ATOL, rtol=0)

    # export: transformers loads it with no missing or unexpected key and computes the same
    write_hf_decoder(spec, state, tmp_path / "back")
    reloaded, info = type(hf).from_pretrained(tmp_path / "back", output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[kind], (kind, info[kind])
    original = hf.state_dict()
    assert reloaded.state_dict().keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    assert torch.equal(hf_logits(reloaded.eval(), ids), expected)  # a config difference shows
    spec_again, state_again = read_hf_decoder(tmp_path / "back")
    assert spec_again == spec and state_again.keys() == state.keys()
    assert all(torch.equal(state_again[k], v) for k, v in state.items())

    # float64: equal up to rounding
    float64_reference()
    expected = hf_logits(hf.double(), ids)
    got = our_model(spec, state, torch.float64)(ids)
    diff = (got - expected).abs().max().item()
    assert diff < FP64_ATOL, diff


def test_reference_comparison_is_sensitive_to_the_weights(tmp_path, float64_reference):
    # Guards the parity test against a comparison that cannot fail: a swapped k/v split or a
    # mis-stacked gate/up would move the logits by far more than the tolerance.
    hf = hf_model("qwen2-bias-gqa-tied")
    hf.save_pretrained(tmp_path / "hf")
    spec, state = read_hf_decoder(tmp_path / "hf")
    float64_reference()
    expected = hf_logits(hf.double(), token_ids(1, 12))
    for key, rows in (("blocks.1.attn.qkv.bias", -1), ("blocks.0.mlp.fc1.weight", 0)):
        changed = {k: v.clone() for k, v in state.items()}
        changed[key][rows] += 0.5
        got = our_model(spec, changed, torch.float64)(token_ids(1, 12))
        assert (got - expected).abs().max() > 1e-3, key


def test_greedy_generate_equals_transformers(tmp_path, float64_reference):
    float64_reference()
    # seed 5: random weights whose greedy continuations vary (many seeds repeat one token)
    hf = hf_model("llama3rope-mqa-tied", seed=5).double()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_decoder(tmp_path / "hf", dtype=torch.float64).eval()
    prompt, steps, pad = token_ids(2, 6, seed=4), 12, VOCAB - 1

    def theirs(eos: list[int]) -> torch.Tensor:
        return hf.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )

    # every step of both rows, with an eos neither row produces
    free = ours.generate(prompt, steps, eos_ids=())
    unused = next(i for i in range(VOCAB) if i not in free)
    assert torch.equal(free, theirs([unused]))
    assert all(len(set(row)) >= 5 for row in free[:, 6:].tolist())
    # stopping: row 1 ends early at a token row 0 never produces (and is padded after it),
    # row 0 at its last new token, so the batch ends before max_new_tokens
    first, second = free[0, 6:].tolist(), free[1, 6:].tolist()
    i1 = next(i for i in range(2, steps) if second[i] not in first + second[:i])
    i0 = max(i for i, token in enumerate(first) if token not in first[:i] + second[: i1 + 1])
    assert i1 < i0 < steps - 1
    eos = [second[i1], first[i0]]
    got = ours.generate(prompt, steps, eos_ids=tuple(eos), pad_id=pad)
    assert torch.equal(got, theirs(eos)), (got, theirs(eos))
    assert got.shape == (2, 6 + i0 + 1) and got[0, -1] == first[i0]
    assert got[1, 6 + i1] == second[i1] and (got[1, 7 + i1 :] == pad).all()


# ----------------------------------------------------------------------------- our own invariants
def test_kv_cache_decoding_equals_full_recompute():
    model = random_decoder(tiny_spec())
    ids = token_ids(2, 14, seed=5)
    full = model(ids)
    cache = KVCache(model.spec, 2, 14, dtype=torch.float64)
    parts = [model(ids[:, :6], cache=cache), model(ids[:, 6:9], cache=cache)]  # prefill, chunk
    parts += [model(ids[:, i : i + 1], cache=cache) for i in range(9, 14)]  # one at a time
    diff = (torch.cat(parts, dim=1) - full).abs().max().item()
    assert diff < FP64_ATOL, diff
    with pytest.raises(ValueError, match="KV cache"):
        model(ids[:, :1], cache=cache)


def test_left_padded_batch_generates_as_each_prompt_alone():
    model = random_decoder(tiny_spec(tie_embeddings=True), seed=6)
    short, long = token_ids(1, 4, seed=7), token_ids(1, 7, seed=8)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch, dtype=torch.bool)
    mask[0, :3] = False
    together = model.generate(batch, 8, attention_mask=mask, eos_ids=())
    assert torch.equal(together[0, 3:], model.generate(short, 8, eos_ids=())[0])
    assert torch.equal(together[1], model.generate(long, 8, eos_ids=())[0])


def test_sampling_is_reproducible_and_top_p_narrows_to_greedy():
    model = random_decoder(tiny_spec(), seed=9)
    prompt = token_ids(2, 5, seed=10)

    def sampled(seed: int, **kwargs) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 10, temperature=1.0, generator=g, eos_ids=(), **kwargs)

    assert torch.equal(sampled(0), sampled(0))
    assert not torch.equal(sampled(0), sampled(1))  # 20 draws from ~96 tokens
    greedy = model.generate(prompt, 10, eos_ids=())
    assert torch.equal(sampled(2, top_p=1e-6), greedy)  # only the most probable token is left


def test_packed_documents_give_each_documents_logits():
    model = random_decoder(tiny_spec(qkv_bias=True), seed=11)
    a, b = token_ids(1, 5, seed=12), token_ids(1, 7, seed=13)
    docs = torch.tensor([[0] * 5 + [1] * 7])
    assert document_positions(docs).tolist() == [list(range(5)) + list(range(7))]
    packed = model(torch.cat([a, b], 1), document_ids=docs)  # positions restart by default
    explicit = model(torch.cat([a, b], 1), document_ids=docs, position_ids=document_positions(docs))
    assert torch.equal(packed, explicit)
    diff = max(
        (packed[:, :5] - model(a)).abs().max().item(), (packed[:, 5:] - model(b)).abs().max().item()
    )
    assert diff < FP64_ATOL, diff


def test_inputs_embeds_equal_input_ids():
    model = random_decoder(tiny_spec(), seed=14)
    ids = token_ids(2, 6, seed=15)
    assert torch.equal(model(inputs_embeds=model.embed(ids)), model(ids))


# ----------------------------------------------------------------------------- the spec
SPECS = {
    "untied-gqa": tiny_spec(),
    "tied-mha": tiny_spec(kv_heads=None, tie_embeddings=True, rope_scaling=None),
    "bias-mqa-headdim": tiny_spec(kv_heads=1, head_dim=16, qkv_bias=True),
    "tied-bias-gqa": tiny_spec(tie_embeddings=True, qkv_bias=True, layers=3),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_spec_counts_what_the_module_holds_and_computes(name):
    spec = SPECS[name]
    model = Decoder(spec)
    model.init_weights(torch.Generator().manual_seed(0))
    assert spec.params() == sum(p.numel() for p in model.parameters())
    ids = token_ids(1, 9)
    # the math kernel runs attention as matmuls the counter sees (it has no formula for the
    # fused CPU kernel)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter, torch.no_grad():
        model(ids)
    assert spec.forward_flops(9) == counter.get_total_flops()
    assert DecoderSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_spec_is_torch_free_and_names_bad_fields():
    code = "import sys, mmtrain.decoder_spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    with pytest.raises(ValueError, match="kv_heads: 3 does not divide heads"):
        tiny_spec(kv_heads=3)
    with pytest.raises(ValueError, match="eos_ids: 200 is not an id"):
        tiny_spec(eos_ids=(200,))
    with pytest.raises(ValueError, match="rope_scaling.rope_type"):
        tiny_spec(rope_scaling=RopeScaling("yarn", 4.0))


# ----------------------------------------------------------------------------- bad folders
def write_config(folder, config: dict) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, field",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "rope_scaling": None},
            "rope_parameters.rope_type",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "qwen2"}, "model_type"),
        ({"eos_token_id": 500}, "eos_token_id"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_llama_configs_name_file_and_field(tmp_path, change, field):
    config = {**hf_config(tiny_spec(), torch.float32), **change}
    write_config(tmp_path / "hf", config)
    with pytest.raises(HFFolderError, match=f"config.json: {field}"):
        read_hf_decoder(tmp_path / "hf")


def test_qwen2_sliding_window_is_refused(tmp_path):
    config = {**hf_config(tiny_spec(qkv_bias=True), torch.float32), "use_sliding_window": True}
    write_config(tmp_path / "hf", config)
    with pytest.raises(HFFolderError, match="config.json: use_sliding_window"):
        read_hf_decoder(tmp_path / "hf")
