"""The planner on language models (decoder LM and LLaVA-style VLM): the same spec as the
built module (exact parameters; activations as autograd keeps them within 10%), the workload
rows from specs, and planning from the data's own token lengths (`plan --data`)."""

import io
import json
import random
from pathlib import Path

import pytest
from PIL import Image
from tokenizers import Tokenizer as RawTokenizer

from mmtrain.cli import build_parser, main
from mmtrain.config import load_config
from mmtrain.data.ingest.inspect import conversation_counts, inspect_shards, open_shards
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.chat_templates import encode_conversation, get_template
from mmtrain.data.stream.conversations import parse_conversation
from mmtrain.data.stream.packing import pack_rows
from mmtrain.data.stream.tokenizer import HFTokenizer, train_bpe
from mmtrain.decoder_spec import DecoderSpec
from mmtrain.hardware import default_catalog
from mmtrain.lengths import Lengths, summarize
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.data_plan import plan_from_data
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.lengths import first_fit_rows, packed_layout, padded_layout
from mmtrain.plan.memory import training_memory
from mmtrain.plan.workloads import load_model
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError

LM = ModelSpec(
    name="tiny-lm",
    embed_dim=64,
    towers={},
    objective="next_token",
    decoder=DecoderSpec(
        vocab_size=300, width=64, layers=2, heads=4, kv_heads=4, mlp_hidden=160, max_positions=48
    ),
)


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "tiny-lm.yaml"
    LM.save(path)
    return path


@pytest.mark.parametrize("name", ["tiny-vlm", "llava-1.5-7b"])
def test_parameter_counts_equal_the_built_module(name, lm_path):
    from mmtrain.models.build import create_model

    for spec in (load_spec(name), load_spec(lm_path)):
        module = create_model(spec, device="meta")
        planned = load_model(str(lm_path) if spec.name == "tiny-lm" else name)
        assert sum(p.numel() for p in module.parameters()) == planned.params() == spec.params()
        trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
        assert trained == planned.trainable_params()  # blocks after the feature layer: frozen


def test_planned_flops_are_the_specs():
    spec = load_spec("tiny-vlm")
    model = load_model("tiny-vlm", context=256, images=2)
    assert model.forward_flops() == spec.sequence_flops(256, 2)
    assert model.stack("text").tokens == 256 and model.stack("image").per_sample == 2


# fp32 CPU step of the real module against the plan: GQA (tiny-vlm) and MHA (tiny-lm), padded
# and packed rows, each checkpointing mode, a frozen tower, LoRA, frozen front blocks of the
# decoder behind a trained projector (they keep what the image tokens' gradient needs).
@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "tiny-vlm", "--micro-batch", "2", "--context", "192"],
        ["--model", "tiny-vlm", "--micro-batch", "2", "--context", "192", "--packed", "--images", "2"],
        ["--model", "tiny-vlm", "--micro-batch", "2", "--context", "160", "--ac", "full", "--freeze", "image"],
        ["--model", "tiny-vlm", "--micro-batch", "3", "--context", "160", "--ac", "selective", "--packed"],
        ["--model", "tiny-vlm", "--micro-batch", "2", "--context", "160", "--lora", "text", "--freeze", "image"],
        ["--model", "tiny-vlm", "--micro-batch", "2", "--context", "160", "--freeze-blocks", "text=1"],
        ["--model", "LM", "--micro-batch", "3"],
        ["--model", "LM", "--micro-batch", "2", "--packed", "--ac", "full"],
    ],
)  # fmt: skip
def test_measure_agrees_with_prediction(capsys, argv, lm_path):
    argv = [str(lm_path) if a == "LM" else a for a in argv]
    assert main(["plan", *argv, "--measure", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert abs(measured["activations_error"]) < 0.10
    assert abs(measured["model_state_error"]) < 0.01
    assert measured["trainable_params"] == measured["predicted_trainable_params"]


def test_kv_cache_and_bad_rows():
    from mmtrain.plan.inference import kv_cache_bytes

    spec = load_spec("llava-1.5-7b")
    model = load_model("llava-1.5-7b")
    assert kv_cache_bytes(model, 1, 1) == spec.decoder.kv_cache_bytes_per_token(2)
    with pytest.raises(FieldError, match="cannot hold 2 image") as err:
        load_model("tiny-vlm", context=100, images=2)
    assert err.value.path == "--context"


def test_workload_rows_come_from_specs():
    llava = load_model("llava-1.5-7b", context=2048)
    assert llava.params() == load_spec("llava-1.5-7b").params()
    assert llava.forward_flops() == load_spec("llava-1.5-7b").sequence_flops(2048, 1)
    vlm = load_model("vlm-70b")
    assert vlm.stack("text").params / 1e9 == pytest.approx(70.55, abs=0.01)  # Llama-3-70B
    assert vlm.stack("image").mode == "frozen"
    assert load_model("llava-34b").stack("image").per_sample == 5  # anyres: 5 x 576 tokens
    qwen = load_model("mllm-30b").stack("text")
    assert qwen.params == 32_763_876_352  # Qwen2.5-32B, q/k/v biases included


def test_language_model_families(lm_path):
    from mmtrain.plan.compute import workload_family

    assert workload_family(load_model(str(lm_path))) == "llm"
    assert workload_family(load_model(str(lm_path), packed=True)) == "llm"
    assert workload_family(load_model("tiny-vlm")) == "vlm-padded"
    assert workload_family(load_model("tiny-vlm", packed=True)) == "vlm-packed"
    assert workload_family(load_model("doc-ocr-2b")) == "vlm-padded"  # built from its shape


def test_vlm_packed_recipe_on_an_a100_gives_back_the_published_mfu():
    """Every part trained with full recompute (lmms-engine's reading): MFU = the midpoint."""
    model = load_model("tiny-vlm", packed=True)
    plan = make_plan(model, PlanConfig(gpu="a100", ac="full"), default_catalog())
    assert plan.time.efficiency_family == "vlm-packed"
    assert plan.time.mfu == pytest.approx((0.30 + 0.40) / 2)


def _stage2(ac: str, precision: str, gpu: str | None = None):
    """LLaVA-1.5-7B stage 2 per GPU (scripts/v1_5/finetune.sh): 8 GPUs, ZeRO-3, 16 per device,
    rows of 2,048, the tower frozen."""
    model = load_model("llava-1.5-7b", context=2048).with_modes({"image": "frozen"})
    cfg = PlanConfig(gpu=gpu or "a100-40g", gpus=8, zero=3, ac=ac, micro_batch=16,
                     global_batch=128, precision=precision)  # fmt: skip
    if gpu is None:  # the formula's terms alone: no CUDA context, no fragmentation
        return model, training_memory(model, cfg, None, usable_bytes=40 * 2**30)
    return model, make_plan(model, cfg, default_catalog()).memory


@pytest.mark.parametrize("ac", ["none", "full"])
def test_bf16_weights_differs_from_autocast_by_the_residual_stream(ac):
    """The same model states but the frozen tower's tables and norms (fp32 under autocast,
    bf16 in a bf16 model; ZeRO-3 over 8 GPUs); activations 4 - 2 bytes less per residual
    element: per decoder layer and position the norm inputs (2h) and the RMSNorm's normalised
    copies (2h), or with full checkpointing the kept block input (h), and the recomputed
    block's 4h."""
    model, autocast = _stage2(ac, "bf16")
    _, weights = _stage2(ac, "bf16-weights")
    text = model.stack("text")
    rows = 16 * text.tokens  # positions of one micro-batch
    fp32 = model.stack("image").fp32_params
    assert fp32 == model.frozen_fp32_params() > 0
    assert autocast.model_state_bytes - weights.model_state_bytes == fp32 * (4 - 2) / 8
    kept = text.width if ac == "full" else 4 * text.width
    saved = text.layers * rows * kept * (4 - 2)
    assert autocast.saved_activations_bytes - weights.saved_activations_bytes == saved
    if ac == "full":  # one block live again while it is recomputed
        assert autocast.recompute_bytes - weights.recompute_bytes == rows * 4 * text.width * 2


def test_llava_stage2_fits_a100_40g_with_deepspeed_bf16_only():
    assert _stage2("full", "bf16-weights", "a100-40g")[1].fits
    assert not _stage2("full", "bf16", "a100-40g")[1].fits  # autocast's fp32 residual stream
    assert _stage2("full", "bf16", "a100")[1].fits


STAGE_1 = Path(__file__).resolve().parents[1] / "configs" / "vlm-stage1.yaml"


def _header_plan(path: Path) -> list[str]:
    """The `mmtrain plan` command of a recipe's header comment that needs no data (no
    `--data`), as the argv after `mmtrain`."""
    from test_configs import commented_commands

    found = [
        argv[1:]
        for argv in commented_commands(path)
        if argv[:2] == ["mmtrain", "plan"] and "--data" not in argv
    ]
    assert len(found) == 1, f"{path.name}: one `mmtrain plan` without --data in the header"
    return found[0]


def test_llava_stage_1_recipe_fits_an_h100_with_its_frozen_lm_recomputed(capsys):
    """configs/vlm-stage1.yaml trains the projector through the frozen LM: the LM's
    activations count (the plan said 29.5 GiB a GPU with them left out), its blocks recompute,
    and the header's plan of the recipe's own settings fits an H100."""
    argv = _header_plan(STAGE_1)
    args = build_parser(argv).parse_args(argv)
    t, data = load_config(STAGE_1).train, load_config(STAGE_1).data
    assert args.model == load_config(STAGE_1).model
    assert sorted(args.freeze) == sorted(n for n, tower in t.towers.items() if tower.freeze)
    assert t.towers["text"].activation_checkpointing and args.ac == "full"
    assert (args.micro_batch, args.global_batch, args.context, args.gpus) == (
        t.micro_batch, t.batch_size, data.sequence_length, t.batch_size // t.micro_batch,
    )  # fmt: skip
    assert args.gpu == "h100" and t.precision == args.precision == "bf16"
    assert main(argv + ["--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["fits"]
    d = load_spec(args.model).decoder  # each recomputed block keeps its fp32 input
    kept_inputs = args.micro_batch * args.context * d.layers * d.width * 4
    assert memory["activations_by_tower"]["text"] >= kept_inputs
    recomputed_not = [a if a != "full" else "none" for a in argv]
    assert main(recomputed_not + ["--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["memory"]["fits"]


def test_a_frozen_lm_on_the_gradients_path_is_recomputed_under_checkpointing():
    """Stage 1's frozen LM passes the gradient (2x forward) and, checkpointed, runs its
    forward again in backward (hardware FLOPs); the frozen image tower does neither."""
    from mmtrain.plan.compute import flops_per_sample

    plan = load_model("tiny-vlm", context=160).with_modes({"image": "frozen", "text": "frozen"})
    image, projector, text = (plan.stack(n).forward_flops for n in ("image", "projector", "text"))
    assert plan.input_grads() == (False, False, True)
    model, hardware = flops_per_sample(plan, "full")
    assert model == image + 3 * projector + 2 * text
    assert hardware == model + projector + text
    d = load_spec("tiny-vlm").decoder  # selective: the attention sub-blocks of the LM alone
    attention = d.layers * (2 * 160 * (2 * d.width**2 + 2 * d.width * d.kv_heads * d.head_dim)
                            + 4 * 160**2 * d.heads * d.head_dim)  # fmt: skip
    assert flops_per_sample(plan, "selective")[1] == model + attention


# ----------------------------------------------------------------------------- lengths
def test_summary_uses_nearest_rank_percentiles():
    s = summarize(list(range(1, 101)))
    assert (s["count"], s["mean"], s["p50"], s["p90"], s["p99"], s["max"]) == (
        100, 50.5, 50, 90, 99, 100,
    )  # fmt: skip


def test_first_fit_rows_are_the_packers():
    rng = random.Random(3)
    sizes = [rng.randint(1, 40) for _ in range(300)]
    from mmtrain.data.stream.chat_templates import EncodedSample

    samples = [EncodedSample([5] * n, [5] * n) for n in sizes]
    rows = [r.samples for r in pack_rows(samples, 64, image_token_id=9)]
    assert first_fit_rows(sizes, 64) == rows


def test_layouts_count_padding_and_packing():
    spec = load_spec("tiny-vlm")  # 64 image tokens
    lengths = Lengths((100, 20, 30, 80, 70, 10), (1, 0, 0, 1, 1, 0))
    padded = padded_layout(spec, lengths, 128, micro_batch=2)
    assert padded.rows == 6 and padded.real_positions == 310
    assert padded.computed_positions >= padded.real_positions and padded.max_positions == 100
    full = padded_layout(spec, lengths, 128, micro_batch=2, pad_to="max")
    assert full.computed_positions == 6 * 128 and full.fill == pytest.approx(310 / 768)
    packed = packed_layout(spec, lengths, 128, micro_batch=2)
    assert packed.rows == 3 and packed.computed_positions == 3 * 128  # 310 positions in 3 rows
    assert packed.images == padded.images == 3
    lm = spec.decoder
    assert packed.useful_flops == padded.useful_flops  # the same samples, each alone
    assert packed.computed_flops == 3 * lm.forward_flops(128) + packed.vision_flops
    short = padded_layout(spec, lengths, 64, micro_batch=1)
    assert short.truncated == 3 and short.max_positions <= 65  # an image is never cut


# ----------------------------------------------------------------------------- --data
SPECIALS = ["<s>", "</s>", "<image>"]
WORDS = "a cat dog on the sofa what is in picture colour grey red blue it sits".split()


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    corpus = [" ".join(random.Random(i).choices(WORDS, k=12)) for i in range(50)]
    train_bpe(corpus + ["USER: ASSISTANT:"] * 5, vocab_size=300, out_path=path)
    raw = RawTokenizer.from_file(str(path))
    raw.add_special_tokens(SPECIALS)
    raw.save(str(path))
    return path


def _jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, format="JPEG")
    return out.getvalue()


def _conversation(i: int) -> tuple[dict, int]:
    rng = random.Random(i)
    images = int(i % 3 != 0)
    question = " ".join(rng.choices(WORDS, k=rng.randint(2, 30)))
    answer = " ".join(rng.choices(WORDS, k=rng.randint(1, 60)))
    messages = [
        {"role": "user", "content": ("<image>\n" if images else "") + question},
        {"role": "assistant", "content": answer},
    ]
    return {
        "id": str(i),
        "messages": messages,
        "images": [f"{k}.jpg" for k in range(images)],
    }, images


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """Conversation shards as the contract writes them, plus one bad record."""
    folder = tmp_path_factory.mktemp("convs")
    records = []
    with ShardWriter(folder, max_samples=25) as writer:
        for i in range(60):
            record, images = _conversation(i)
            sample = {"__key__": f"c{i:03d}", "json": json.dumps(record)}
            sample.update({f"{k}.jpg": _jpeg() for k in range(images)})
            writer.write(sample)
            records.append(record)
        bad = {"id": "bad", "messages": [{"role": "user", "content": "no answer"}], "images": []}
        writer.write({"__key__": "bad", "json": json.dumps(bad)})
    write_manifest(folder, writer.shards)
    return folder, records


def test_token_counts_are_the_encoders(conversations, tokenizer_path):
    folder, records = conversations
    tok, template = HFTokenizer(tokenizer_path), get_template("vicuna-v1")
    counts = conversation_counts(open_shards(str(folder))[2], tok, template, image_tokens=64)
    assert len(counts.positions) == 60 and counts.refused == {"roles": 1}
    for record, positions, ids in zip(records, counts.positions, counts.text_ids, strict=True):
        conv = parse_conversation(record)
        encoded = encode_conversation(conv, template, tok, 10**9, 7)
        assert ids == len(encoded.input_ids)
        assert positions == ids + 63 * len(record["images"])
    text_only = conversation_counts(open_shards(str(folder))[2], tok, template, image_tokens=0)
    assert text_only.refused == {"roles": 1, "images_without_tower": 40}  # an LM has no tower
    text_ids = [n for n, r in zip(counts.text_ids, records, strict=True) if not r["images"]]
    assert text_only.positions == text_ids


def test_inspect_reports_the_token_distribution(conversations, tokenizer_path):
    folder, _ = conversations
    report = inspect_shards(str(folder))
    conv = report["conversations"]
    assert conv["samples"] == 60 and conv["images"]["max"] == 1 and "note" in conv
    tok, template = HFTokenizer(tokenizer_path), get_template("vicuna-v1")
    conv = inspect_shards(str(folder), tokenizer=tok, template=template, image_tokens=64)[
        "conversations"
    ]
    assert set(conv["positions"]) == {"count", "mean", "p50", "p90", "p99", "max"}
    assert conv["positions"]["p50"] <= conv["positions"]["p90"] <= conv["positions"]["max"]


def test_plan_from_data_padded_and_packed(conversations, tokenizer_path):
    folder, _ = conversations
    spec = load_spec("tiny-vlm")
    counts = conversation_counts(
        open_shards(str(folder))[2], HFTokenizer(tokenizer_path), get_template("vicuna-v1"), 64
    )
    lengths = Lengths(tuple(counts.positions), tuple(counts.images))
    cfg = PlanConfig(gpu="a100", gpus=2, micro_batch=4, global_batch=16, precision="bf16")
    padded, packed = plan_from_data(
        spec, lengths, cfg, default_catalog(), sequence_length=512, samples=6000
    )
    to_max = plan_from_data(
        spec, lengths, cfg, default_catalog(), sequence_length=512, samples=6000, pad_to="max"
    )[0]
    assert padded.plan.config.samples == to_max.plan.config.samples == 6000  # a row per sample
    assert packed.plan.config.samples == round(6000 / packed.layout.samples_per_row)
    assert packed.layout.samples_per_row > 1 and packed.layout.fill > to_max.layout.fill
    assert packed.hours < to_max.hours  # rows of the same length, fewer of them
    assert padded.hours < to_max.hours  # a micro-batch's longest is shorter than the maximum
    assert packed.plan.memory.saved_activations_bytes > padded.plan.memory.saved_activations_bytes
    # One VLM figure on computed positions: the padded layout pays its padding through its
    # FLOPs (fill), not through a lower fraction as well.
    assert padded.plan.time.efficiency_family == "vlm-padded"
    assert packed.plan.time.efficiency_family == "vlm-packed"
    assert padded.plan.time.achievable_fraction == packed.plan.time.achievable_fraction
    assert padded.to_dict()["efficiency_family"] == "vlm-padded"
    for p in (padded, packed):  # time follows the FLOPs of the rows actually computed
        assert p.plan.model.forward_flops() == pytest.approx(
            p.layout.computed_flops / p.layout.rows, rel=1e-6
        )


def test_plan_data_cli(capsys, conversations, tokenizer_path):
    folder, _ = conversations
    argv = ["plan", "--model", "tiny-vlm", "--data", str(folder), "--tokenizer",
            str(tokenizer_path), "--chat-template", "vicuna-v1", "--gpu", "a100", "--gpus", "2",
            "--micro-batch", "2", "--global-batch", "8", "--sequence-length", "256"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"]["samples"] == 60 and out["data"]["refused"] == {"roles": 1}
    assert [lay["layout"] for lay in out["layouts"]] == ["padded", "packed"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "p99" in text and "packed" in text and "time h" in text
    assert main(["plan", "--model", "tiny-clip", "--data", str(folder)]) == 2
    assert "has no decoder" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny-vlm", "--data", str(folder)]) == 2
    assert "--tokenizer" in capsys.readouterr().err
