"""`plan --data` on a native-resolution VLM (presets/tiny-qwen2-vl.yaml): every sample keeps its
pages' sizes under the run's pixel budget, so the planned positions are those the loader's
decoder lays out, the layouts' tower FLOPs are the sum of `forward_flops` over the laid-out
samples' own inputs (exact integers), and memory is planned for the heaviest row's inputs.

Real parts: PNG pages of several sizes in tar shards of conversations, a byte-level BPE with the
"plain" template, the loader's own decoder (ConversationDecoder) as the reference.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from mmtrain.cli import main
from mmtrain.commands._data_args import visual_budget
from mmtrain.config import config_from_dict
from mmtrain.data.ingest.inspect import conversation_counts, open_shards
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.tokenizer import train_bpe
from mmtrain.hardware import default_catalog
from mmtrain.lengths import Lengths
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.data_plan import plan_from_data
from mmtrain.plan.lengths import packed_layout, padded_layout
from mmtrain.spec import VISION_TOWER, ModelSpec, load_spec
from mmtrain.visual_budget import ImageSize

# Pages within 8..24 tokens each, 64 a sample: three large pages shrink together to fit, the
# nine-page sample cannot fit at 8 tokens a page and is refused (visual_budget).
VISION = {"image_min_tokens": 8, "image_max_tokens": 24, "sample_max_tokens": 64}
BUDGET_ITEMS = [f"{k}={v}" for k, v in VISION.items()]
BUDGET = [f"--budget={item}" for item in BUDGET_ITEMS]
SIZES = [(40, 40), (96, 24), (24, 72), (56, 32), (16, 16), (16, 48), (120, 160)]  # (h, w)
BIG = [(64, 96), (96, 64), (120, 160)]
COLOURS = [(220, 30, 30), (30, 200, 60), (30, 60, 220)]
WORDS = ["red", "green", "blue"]
SAMPLES = 16
SEQUENCE = 256  # longer than any sample: nothing is truncated, by the loader or the planner


def _png(size: tuple[int, int], seed: int) -> bytes:
    height, width = size
    image = Image.new("RGB", (width, height), COLOURS[seed % 3])
    image.putpixel((seed % width, (7 * seed) % height), (255, 255, 255))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _pages(i: int) -> int:
    """Pages of sample i: two text-only samples, one over the sample budget, one to three."""
    if i in (3, 10):
        return 0
    if i == 7:
        return 9
    return 1 + i % 3


def _sizes(i: int) -> list[ImageSize]:
    if i in (2, 8):  # 24 + 24 + 20 tokens at the per-page budget: shrunk to fit 64 together
        return [ImageSize(*size) for size in BIG]
    return [ImageSize(*SIZES[(i + 2 * k) % len(SIZES)]) for k in range(_pages(i))]


def _sample(i: int) -> dict:
    members = {f"{k}.png": _png((s.height, s.width), i + k) for k, s in enumerate(_sizes(i))}
    pages = len(members)
    word = WORDS[i % 3]
    record = {
        "id": str(i),
        "images": list(members),
        "messages": [
            {"role": "user", "content": "<image>" * pages + f"Say {word}."},
            {"role": "assistant", "content": f"a {word} page " * (1 + i % 4)},
        ],
    }
    return {"__key__": f"{i:09d}", "json": json.dumps(record), **members}


def _spec_file(folder: Path, vocab: int, wrap: bool) -> Path:
    spec = load_spec("tiny-qwen2-vl").to_dict()
    extra = 4 if wrap else 2
    spec["decoder"].update(vocab_size=vocab + extra, bos_id=None, eos_ids=[])
    spec["vision_tokens"].update(image_token_id=vocab, video_token_id=vocab + 1)
    if wrap:  # <|vision_start|> / <|vision_end|> around every input
        spec["vision_tokens"].update(start_id=vocab + 2, end_id=vocab + 3)
    path = folder / ("spec-wrap.json" if wrap else "spec.json")
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("native-pages")
    words = [f"Say {w}. a {w} page {w}" for w in WORDS] * 4
    vocab = train_bpe(words, vocab_size=280, out_path=folder / "tokenizer.json").vocab_size
    for wrap in (False, True):
        _spec_file(folder, vocab, wrap)
    with ShardWriter(folder, max_samples=6) as writer:
        for i in range(SAMPLES):
            writer.write(_sample(i))
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return folder


def _spec(shards: Path, wrap: bool) -> tuple[Path, ModelSpec]:
    path = shards / ("spec-wrap.json" if wrap else "spec.json")
    return path, ModelSpec.from_dict(json.loads(path.read_text()))


def _loaded(shards: Path, spec_path: Path, spec: ModelSpec):
    """Per sample the loader's decoder keeps: LM positions and its inputs' (frames, height,
    width) as decoded; and the samples it skips, by reason."""
    from mmtrain.data.stream.conversation_batches import ConversationBatcher, SkippedSample

    config = config_from_dict(
        {
            "model": str(spec_path),
            "data": {
                "train": str(shards),
                "tokenizer": str(shards / "tokenizer.json"),
                "chat_template": "plain",
                "sequence_length": SEQUENCE,
                "vision": VISION,
            },
            "train": {"steps": 1, "batch_size": 2},
            "out": str(shards / "unused"),
        }
    )
    batcher = ConversationBatcher(config.data, spec)
    decoder = batcher.decoder(spec)
    sources = open_shards(str(shards))[2]
    positions, shapes, skipped = [], [], {}
    for index in range(len(sources)):
        try:
            out = decoder.encode(sources.read(index), None)
        except SkippedSample as err:
            skipped[err.reason] = skipped.get(err.reason, 0) + 1
            continue
        spans = [n for _, n in out.spans]
        positions.append(len(out.input_ids) - len(spans) + sum(spans))
        shapes.append(
            tuple((1, *image.shape[1:]) for image in out.visual.images)
            + tuple((clip.shape[0], *clip.shape[2:]) for clip in out.visual.videos)
        )
    return batcher, positions, shapes, skipped


def _counts(shards: Path, spec: ModelSpec, batcher):
    choice = visual_budget(spec, BUDGET_ITEMS)
    counts = conversation_counts(
        open_shards(str(shards))[2], batcher.tokenizer, batcher.template,
        budget=choice.budget, wrap=choice.wrap,
    )  # fmt: skip
    return choice, counts


def _tower_flops(spec: ModelSpec, shapes) -> int:
    return sum(spec.vision.forward_flops(h, w, f) for sample in shapes for f, h, w in sample)


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "start-end-ids"])
def test_planned_positions_and_shapes_are_the_loaders(shards, wrap):
    spec_path, spec = _spec(shards, wrap)
    batcher, positions, shapes, skipped = _loaded(shards, spec_path, spec)
    choice, counts = _counts(shards, spec, batcher)
    assert choice.wrap is wrap and choice.settings.sample_max_tokens == 64
    assert skipped == {"visual_budget": 1} and counts.refused == {"visual_budget": 1}
    assert counts.positions == positions and len(positions) == SAMPLES - 1
    assert [tuple(map(tuple, s)) for s in counts.visual_shapes] == shapes
    v = spec.vision
    tokens = [sum(v.tokens(h, w, f) for f, h, w in s) for s in shapes]
    assert counts.visual_tokens == tokens and max(tokens) <= 64
    assert max(counts.page_tokens) <= 24 and min(counts.page_tokens) >= 8
    assert sum(1 for s in shapes if not s) == 2  # the text-only samples
    # three-page samples over 64 tokens at the per-page budget are shrunk together and kept
    alone = replace(choice.budget, sample_max_tokens=None)
    over = [i for i in range(SAMPLES) if _pages(i) == 3 and sum(alone.tokens(_sizes(i))) > 64]
    assert over and all(counts.visual_tokens[i - (i > 7)] <= 64 for i in over)


def test_layouts_count_each_samples_own_tower_flops(shards):
    spec_path, spec = _spec(shards, False)
    batcher, positions, shapes, _ = _loaded(shards, spec_path, spec)
    _, counts = _counts(shards, spec, batcher)
    lengths = Lengths(tuple(counts.positions), tuple(counts.images),
                      visual_shapes=tuple(counts.visual_shapes))  # fmt: skip
    expected = _tower_flops(spec, shapes)
    v = spec.vision
    patches = [sum(v.patches(h, w, f) for f, h, w in s) for s in shapes]
    padded = padded_layout(spec, lengths, SEQUENCE, micro_batch=2)
    packed = packed_layout(spec, lengths, SEQUENCE, micro_batch=2)
    lm = spec.decoder
    for lay in (padded, packed):
        assert isinstance(lay.vision_flops, int) and lay.vision_flops == expected
        assert lay.real_positions == sum(positions) and lay.truncated == 0
        assert lay.useful_flops - expected == sum(lm.forward_flops(p) for p in positions)
    assert packed.computed_flops - expected == packed.rows * lm.forward_flops(SEQUENCE)
    # memory: the padded layout's heaviest row is the sample with the most patches
    assert padded.max_visual_patches == max(patches)
    assert sum(v.patches(h, w, f) for f, h, w in padded.max_visual_inputs) == max(patches)
    assert packed.rows < padded.rows and packed.max_visual_patches >= max(patches)
    # a short row truncates text, never a page: the tower's FLOPs stay the data's
    short = padded_layout(spec, lengths, 48, micro_batch=1)
    assert short.truncated > 0 and short.vision_flops == expected

    cfg = PlanConfig(gpu="h100", micro_batch=2, global_batch=8)
    plans = plan_from_data(spec, lengths, cfg, default_catalog(), sequence_length=SEQUENCE)
    for p in plans:
        lay, model = p.layout, p.plan.model
        tower = model.stack(VISION_TOWER)
        assert tower.forward_flops == round(lay.vision_flops / lay.rows)
        assert tower.tokens == lay.max_visual_patches  # the heaviest row's patches
        # each stack's FLOPs are whole numbers: the mean row's, rounded once per stack
        assert abs(model.forward_flops() - lay.computed_flops / lay.rows) <= 1
        assert p.to_dict()["vision_flops"] == expected


def test_plan_data_json_through_the_cli(shards, capsys):
    spec_path, spec = _spec(shards, True)
    _, positions, shapes, _ = _loaded(shards, spec_path, spec)
    argv = ["plan", "--model", str(spec_path), "--data", str(shards), "--tokenizer",
            str(shards / "tokenizer.json"), "--chat-template", "plain", "--gpu", "h100",
            "--micro-batch", "2", "--global-batch", "8", "--sequence-length", str(SEQUENCE),
            *BUDGET]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    data = out["data"]
    assert data["samples"] == len(positions) and data["refused"] == {"visual_budget": 1}
    assert data["positions"]["max"] == max(positions)
    assert data["positions"]["mean"] == round(sum(positions) / len(positions), 2)
    v = spec.vision
    tokens = [sum(v.tokens(h, w, f) for f, h, w in s) for s in shapes]
    assert data["visual_tokens"]["max"] == max(tokens) and data["visual_tokens"]["count"] == 15
    pages = [v.tokens(h, w) for s in shapes for _, h, w in s]
    assert data["page_tokens"]["count"] == len(pages) and data["page_tokens"]["max"] == max(pages)
    budget = data["budget"]
    assert budget["settings"]["image_max_tokens"] == 24 and budget["wrap"] is True
    assert budget["image_max_pixels"] == 24 * 8 * 8 and budget["sample_max_tokens"] == 64
    assert out["model"]["image_tokens"] == "per page (budget)"
    expected = _tower_flops(spec, shapes)
    assert [lay["layout"] for lay in out["layouts"]] == ["padded", "packed"]
    for lay in out["layouts"]:
        assert lay["vision_flops"] == expected and lay["heaviest_row_patches"] > 0
    assert main(argv) == 0  # the table
    text = capsys.readouterr().out
    assert "visual_tokens" in text and "heaviest row" in text and "image_max_tokens=24" in text


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        (["image_max_tokens"], "expected KEY=VALUE"),
        (["pixels=12"], "--budget.pixels: unknown key"),
        (["image_max_tokens=many"], "--budget.image_max_tokens"),
        (["image_min_tokens=30", "image_max_tokens=24"], "--budget.image_min_tokens"),
        (["sample_max_tokens=0"], "--budget.sample_max_tokens"),
        (["video_fps=["], "is not a value"),
    ],
)
def test_bad_budget_names_the_flag(shards, capsys, budget, says):
    argv = ["plan", "--model", str(shards / "spec.json"), "--data", str(shards), "--tokenizer",
            str(shards / "tokenizer.json"), "--chat-template", "plain",
            *(f"--budget={item}" for item in budget)]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "--budget" in err


def test_rows_too_short_for_a_samples_pages_name_the_flag(shards, capsys):
    argv = ["plan", "--model", str(shards / "spec.json"), "--data", str(shards), "--tokenizer",
            str(shards / "tokenizer.json"), "--chat-template", "plain", "--sequence-length", "40",
            *BUDGET]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    assert "--sequence-length" in capsys.readouterr().err


def test_budget_needs_a_native_vlm_and_data(shards, capsys):
    capsys.readouterr()
    argv = ["plan", "--model", "tiny-vlm", "--data", str(shards), "--tokenizer",
            str(shards / "tokenizer.json"), "--chat-template", "plain",
            "--budget", "image_max_tokens=24"]  # fmt: skip
    assert main(argv) == 2
    assert "--budget" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny-qwen2-vl", "--budget", "image_max_tokens=24"]) == 2
    assert "--data" in capsys.readouterr().err
