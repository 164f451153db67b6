"""Multimodal rotary positions (models/mrope.py) and the M-RoPE decoder (decoder_spec's
`mrope_section`, models/decoder.py) against transformers' Qwen2-VL / Qwen2.5-VL.

- positions: `rope_index` / `rope_index_batch` equal transformers' `get_rope_index` (tiny
  models built from configs, no download) for text, images, videos and padding; packed rows
  restart per document; placeholders that disagree with the grids are refused.
- logits: a decoder with `mrope_section`, given those positions, computes the logits of
  transformers' `Qwen2VLForConditionalGeneration` (text-only inputs: no vision forward, the
  placeholder ids are embedded as tokens) with the weights renamed, in float64.
- generation: greedy decoding with the KV cache continues the positions as transformers'
  `generate` does after an image.

Tolerances: float64 to FP64_ATOL = 1e-10 as in tests/test_decoder.py (its docstring derives
it; the rotary tables are float32 in both implementations, RMSNorm is made to normalise in
float64 by the same patch). Positions and tokens are integers: compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLModel,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLModel,
)
from transformers.models.qwen2_vl import modeling_qwen2_vl

from mmtrain.decoder_spec import DecoderSpec
from mmtrain.models.decoder import Decoder, document_positions, next_positions
from mmtrain.models.formats.hf_llama import hf_to_mmtrain
from mmtrain.models.mrope import rope_index, rope_index_batch
from mmtrain.structured import FieldError
from test_decoder import randomize, rms_norm_in_input_precision

FP64_ATOL = 1e-10

VOCAB, IMAGE, VIDEO, PAD = 96, 90, 91, 0
MERGE, TOKENS_PER_SECOND = 2, 2
# head_dim 12: six rotary frequencies split 1 / 2 / 3 between time, height and width (uneven,
# so a swapped axis shows)
SECTION = (1, 2, 3)
TEXT_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=list(SECTION)),
)
POSITIONS = dict(image_token_id=IMAGE, video_token_id=VIDEO, merge_size=MERGE)
# transformers' get_rope_index (since 5.3) for the text after a clip; the default is Qwen's rule
AS_TRANSFORMERS = dict(POSITIONS, text_after="transformers")


def qwen2_vl_config() -> Qwen2VLConfig:
    vision = dict(depth=1, embed_dim=16, hidden_size=48, num_heads=2, spatial_merge_size=MERGE)
    return Qwen2VLConfig(
        text_config=TEXT_CONFIG,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        attn_implementation="sdpa",
    )


def qwen2_5_vl_config(tokens_per_second: int = TOKENS_PER_SECOND) -> Qwen2_5_VLConfig:
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        out_hidden_size=48,
        num_heads=2,
        spatial_merge_size=MERGE,
        tokens_per_second=tokens_per_second,
        fullatt_block_indexes=[0],
    )
    return Qwen2_5_VLConfig(
        text_config=TEXT_CONFIG, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO
    )


# ----------------------------------------------------------------------------- rows
def build_row(parts: list) -> tuple[list[int], list[int], list[tuple], list[tuple]]:
    """ids, transformers' mm_token_type_ids, image grids and video grids of a row written as
    parts: an int n is n text tokens, ("image" | "video", (t, h, w)) one expanded visual."""
    ids, types, images, videos = [], [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += [3 + (len(ids) + i) % 80 for i in range(part)]
            types += [0] * part
            continue
        kind, grid = part
        count = grid[0] * grid[1] * grid[2] // MERGE**2
        ids += [IMAGE if kind == "image" else VIDEO] * count
        types += [1 if kind == "image" else 2] * count
        (images if kind == "image" else videos).append(grid)
    return ids, types, images, videos


def build_batch(rows: list[list], left_padded: bool = True) -> dict:
    """A padded batch of `build_row` rows: ids, types, bool attention mask, grids in order."""
    built = [build_row(parts) for parts in rows]
    length = max(len(ids) for ids, *_ in built)
    batch = dict(ids=[], types=[], mask=[], images=[], videos=[])
    for ids, types, images, videos in built:
        pad = length - len(ids)
        before, after = (pad, 0) if left_padded else (0, pad)
        batch["ids"].append([PAD] * before + ids + [PAD] * after)
        batch["types"].append([0] * before + types + [0] * after)
        batch["mask"].append([False] * before + [True] * len(ids) + [False] * after)
        batch["images"] += images
        batch["videos"] += videos
    for key in ("ids", "types", "mask"):
        batch[key] = torch.tensor(batch[key])
    return batch


def their_positions(model, batch: dict, seconds: list[float] | None = None):
    extra = {} if seconds is None else {"second_per_grid_ts": torch.tensor(seconds)}
    return model.get_rope_index(
        batch["ids"],
        batch["types"],
        image_grid_thw=torch.tensor(batch["images"]) if batch["images"] else None,
        video_grid_thw=torch.tensor(batch["videos"]) if batch["videos"] else None,
        attention_mask=batch["mask"].long(),
        **extra,
    )


# ----------------------------------------------------------------------------- positions
ROWS = {
    "text-only": [[9]],
    "one-image-1x4": [[3, ("image", (1, 2, 8)), 4]],
    "image-first-and-last": [[("image", (1, 4, 2)), 3, ("image", (1, 2, 2))]],
    "two-images": [[2, ("image", (1, 4, 4)), 3, ("image", (1, 2, 6)), 2]],
    "image-and-video": [[2, ("image", (1, 2, 4)), 2, ("video", (2, 4, 6)), 3]],
    # six time steps over a 1 x 2 merged grid: the text after it follows the grid's rows and
    # columns, not its time (transformers 5.23's rule)
    "long-video": [[2, ("video", (6, 2, 4)), 3, ("image", (1, 2, 2)), 1]],
    # rows of different lengths: padding in front or behind, and a text-only row among them
    "padded-batch": [
        [2, ("image", (1, 2, 8)), 3],
        [7],
        [1, ("image", (1, 4, 4)), 1, ("video", (2, 2, 4)), 5],
    ],
}


@pytest.mark.parametrize("left_padded", [True, False], ids=["left-pad", "right-pad"])
@pytest.mark.parametrize("case", list(ROWS))
def test_qwen2_vl_positions_equal_transformers(case, left_padded):
    batch = build_batch(ROWS[case], left_padded)
    expected, expected_deltas = their_positions(Qwen2VLModel(qwen2_vl_config()), batch)
    got, deltas = rope_index_batch(
        batch["ids"], batch["images"], batch["videos"], attention_mask=batch["mask"],
        **AS_TRANSFORMERS,
    )  # fmt: skip
    assert torch.equal(got, expected)
    assert torch.equal(deltas, expected_deltas[:, 0])
    if len(ROWS[case]) == 1 and left_padded:  # one row, no padding: the one-row function
        alone = rope_index(batch["ids"][0], batch["images"], batch["videos"], **AS_TRANSFORMERS)
        assert torch.equal(alone, got[:, 0])


def test_qwen2_5_vl_video_time_is_scaled_by_seconds():
    # 0.7 s per temporal step at 2 tokens per second: time steps 0, 1.4, 2.8 truncate to
    # 0, 1, 2; the second video uses 0.25 s: 0, 0.5 -> 0, 0. Images are never scaled.
    rows = [
        [2, ("video", (3, 4, 8)), 2, ("image", (1, 2, 4)), 1],
        [1, ("video", (2, 4, 4)), 3],
    ]
    batch, seconds = build_batch(rows), [0.7, 0.25]
    expected, expected_deltas = their_positions(
        Qwen2_5_VLModel(qwen2_5_vl_config()), batch, seconds
    )
    got, deltas = rope_index_batch(
        batch["ids"],
        batch["images"],
        batch["videos"],
        attention_mask=batch["mask"],
        seconds_per_grid=seconds,
        tokens_per_second=TOKENS_PER_SECOND,
        **AS_TRANSFORMERS,
    )
    assert torch.equal(got, expected) and torch.equal(deltas, expected_deltas[:, 0])
    assert sorted(set(got[0, 0, 2:26].tolist())) == [2, 3, 4]  # time = 2 + (0, 1, 2)


TEMPORAL_PATCH = 2  # frames per temporal grid step, Qwen2.5-VL's processor default


def processor_seconds(fps: float, clips: int) -> list[float]:
    """Each clip's seconds per temporal grid step as transformers' Qwen2.5-VL processor makes
    `second_per_grid_ts`: temporal_patch_size / fps (a float32 tensor once batched)."""
    return [TEMPORAL_PATCH / fps] * clips


# Clips of 2, 4 and 6 frames (temporal grids 1, 2, 3), at frame rates that make a grid step
# 2 s, 1 s and 2/3 s, at 2 tokens a second (Qwen2.5-VL-7B's) and 25 (transformers' example):
# time positions that stay below, equal and pass the clips' rows and columns.
@pytest.mark.parametrize("fps", [1.0, 2.0, 3.0])
@pytest.mark.parametrize("tokens_per_second", [2, 25])
@pytest.mark.parametrize("frames", [2, 4, 6])
def test_text_after_a_clip_is_positioned_as_transformers(frames, tokens_per_second, fps):
    t = frames // TEMPORAL_PATCH
    rows = [
        [2, ("image", (1, 4, 6)), 2, ("video", (t, 2, 4)), 3, ("image", (1, 2, 2)), 2],
        [1, ("video", (t, 4, 4)), 4, ("video", (t, 6, 2)), 2],
    ]
    batch, seconds = build_batch(rows), processor_seconds(fps, 3)
    model = Qwen2_5_VLModel(qwen2_5_vl_config(tokens_per_second))
    expected, expected_deltas = their_positions(model, batch, seconds)
    got, deltas = rope_index_batch(
        batch["ids"],
        batch["images"],
        batch["videos"],
        attention_mask=batch["mask"],
        seconds_per_grid=seconds,
        tokens_per_second=tokens_per_second,
        **AS_TRANSFORMERS,
    )
    assert torch.equal(got, expected)
    # a generator's next token: one past the row's largest position, as transformers' deltas
    assert torch.equal(deltas, expected_deltas[:, 0])
    alone = rope_index(
        batch["ids"][0][batch["mask"][0]],
        batch["images"],
        batch["videos"][:1],
        seconds_per_grid=seconds[:1],
        tokens_per_second=tokens_per_second,
        **AS_TRANSFORMERS,
    )
    assert torch.equal(alone, got[:, 0, batch["mask"][0]])


def test_the_qwen_rule_continues_past_a_clips_last_time_step():
    """The default rule, the checkpoints' (Qwen's reference, vLLM): a clip whose time reaches
    further than its rows and columns (8 steps of one second at 2 tokens a second: time 0 ...
    14 over a 2 x 2 merged grid) has the text after it continue one past its largest position,
    3 + 14 + 1 = 18, where transformers' own next-token delta also goes; every position up to
    the clip's end equals transformers' get_rope_index, which puts the text after it at 3 + 2."""
    ids, types, _, videos = build_row([3, ("video", (8, 4, 4)), 4])
    batch = dict(ids=torch.tensor([ids]), types=torch.tensor([types]), images=[], videos=videos)
    batch["mask"] = torch.ones_like(batch["ids"], dtype=torch.bool)
    theirs, their_deltas = their_positions(Qwen2_5_VLModel(qwen2_5_vl_config()), batch, [1.0])
    got = rope_index(
        batch["ids"][0], [], videos, seconds_per_grid=[1.0], tokens_per_second=2, **POSITIONS
    )
    video_end = 3 + 8 * 4
    assert torch.equal(got[:, :video_end], theirs[:, 0, :video_end])
    assert int(got[:, :video_end].max()) == 3 + 14
    assert torch.equal(got[:, video_end:], torch.arange(18, 22).expand(3, 4))
    assert len(ids) + int(their_deltas) == 18  # transformers' own "next text position"
    assert torch.equal(theirs[:, 0, video_end:], torch.arange(5, 9).expand(3, 4))
    as_transformers = rope_index(batch["ids"][0], [], videos, seconds_per_grid=[1.0],
                                 tokens_per_second=2, **AS_TRANSFORMERS)  # fmt: skip
    assert torch.equal(as_transformers, theirs[:, 0])


def test_packed_rows_restart_positions_at_every_document():
    documents = [[2, ("image", (1, 2, 4)), 3], [4], [1, ("image", (1, 4, 2)), 2]]
    built = [build_row(parts) for parts in documents]
    ids = torch.tensor([sum((row[0] for row in built), [])] * 2)
    images = [grid for row in built for grid in row[2]] * 2
    document_ids = torch.tensor([sum(([d] * len(row[0]) for d, row in enumerate(built)), [])] * 2)
    got, _ = rope_index_batch(ids, images, [], document_ids=document_ids, **POSITIONS)
    alone = [rope_index(torch.tensor(row[0]), row[2], [], **POSITIONS) for row in built]
    assert torch.equal(got[:, 0], torch.cat(alone, dim=1))
    assert torch.equal(got[:, 1], got[:, 0])
    # without images, a packed row's positions are the decoder's document positions
    text = torch.full((1, 12), 5)
    doc_ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    got, _ = rope_index_batch(text, [], [], document_ids=doc_ids, **POSITIONS)
    assert torch.equal(got, document_positions(doc_ids).expand(3, 1, 12))


def test_placeholders_that_disagree_with_the_grids_are_refused():
    ids = torch.tensor(build_row([2, ("image", (1, 4, 4)), 2])[0])
    with pytest.raises(ValueError, match=r"grid \(1, 4, 8\), 8 tokens .* but 4 placeholder"):
        rope_index(ids, [(1, 4, 8)], [], **POSITIONS)
    with pytest.raises(ValueError, match="no grid left"):
        rope_index(ids, [], [], **POSITIONS)
    with pytest.raises(ValueError, match="1 of the 2 image grids have no placeholder"):
        rope_index(ids, [(1, 4, 4), (1, 2, 2)], [], **POSITIONS)
    with pytest.raises(ValueError, match="multiples of merge_size 2"):
        rope_index(ids, [(1, 4, 3)], [], **POSITIONS)
    with pytest.raises(ValueError, match="seconds_per_grid .* tokens_per_second"):
        rope_index(ids, [(1, 4, 4)], [], seconds_per_grid=[], **POSITIONS)


# ----------------------------------------------------------------------------- the decoder
def qwen2_vl_lm(seed: int = 0) -> Qwen2VLForConditionalGeneration:
    model = Qwen2VLForConditionalGeneration(qwen2_vl_config())
    randomize(model, seed)
    return model.eval()


def our_lm(hf: Qwen2VLForConditionalGeneration) -> Decoder:
    """The LM of `hf` as our decoder: its weights renamed as a Qwen2 checkpoint's."""
    spec = DecoderSpec(
        vocab_size=VOCAB,
        width=48,
        layers=2,
        heads=4,
        kv_heads=2,
        mlp_hidden=40,
        rope_theta=1e6,
        rms_eps=1e-5,
        qkv_bias=True,
        mrope_section=SECTION,
    )
    prefix = "model.language_model."
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in hf.state_dict().items()
        if not k.startswith("model.visual.")
    }
    model = Decoder(spec)
    model.load_state_dict(hf_to_mmtrain(state, spec), strict=True)
    return model.to(next(hf.parameters()).dtype).eval()


@pytest.fixture
def float64_qwen2_vl(monkeypatch):
    monkeypatch.setattr(modeling_qwen2_vl.Qwen2VLRMSNorm, "forward", rms_norm_in_input_precision)
    hf = qwen2_vl_lm().double()
    return hf, our_lm(hf)


@torch.no_grad()
def test_decoder_logits_equal_transformers_qwen2_vl(float64_qwen2_vl):
    hf, ours = float64_qwen2_vl
    batch = build_batch(ROWS["padded-batch"])
    positions, _ = rope_index_batch(
        batch["ids"], batch["images"], batch["videos"], attention_mask=batch["mask"], **POSITIONS
    )
    expected = hf(
        input_ids=batch["ids"], attention_mask=batch["mask"].long(), position_ids=positions
    ).logits
    got = ours(batch["ids"], position_ids=positions, attention_mask=batch["mask"])
    real = batch["mask"]  # padding queries attend nothing: their outputs are not compared
    diff = (got[real] - expected[real]).abs().max().item()
    assert diff < FP64_ATOL, diff
    # the comparison sees the positions: text positions would move the logits far more
    text = (batch["mask"].long().cumsum(1) - 1).clamp(min=0)
    moved = ours(batch["ids"], position_ids=text, attention_mask=batch["mask"])
    assert (moved[real] - expected[real]).abs().max() > 1e-3


@torch.no_grad()
def test_text_rows_with_equal_axes_are_1d_rope_exactly():
    torch.manual_seed(0)
    ours = our_lm(qwen2_vl_lm(seed=3))
    plain = Decoder(ours.spec.replace(mrope_section=None)).eval()
    plain.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 80, (2, 10))
    positions = torch.arange(4, 14).expand(2, 10)
    one_d = plain(ids, position_ids=positions)
    assert torch.equal(ours(ids, position_ids=positions.expand(3, 2, 10)), one_d)
    assert torch.equal(ours(ids, position_ids=positions), one_d)


@torch.no_grad()
def test_greedy_generation_after_an_image_continues_as_transformers(float64_qwen2_vl):
    hf, ours = float64_qwen2_vl
    # prompts end in text (as a chat template's assistant turn does); the second row is
    # left-padded and holds a video, so the rows continue from different positions
    batch = build_batch(
        [[2, ("image", (1, 2, 8)), 4], [1, ("image", (1, 4, 4)), 1, ("video", (2, 2, 4)), 2]]
    )
    steps = 3
    theirs = hf.generate(
        input_ids=batch["ids"],
        attention_mask=batch["mask"].long(),
        mm_token_type_ids=batch["types"],
        image_grid_thw=torch.tensor(batch["images"]),
        video_grid_thw=torch.tensor(batch["videos"]),
        max_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
    )
    positions, deltas = rope_index_batch(
        batch["ids"], batch["images"], batch["videos"], attention_mask=batch["mask"], **POSITIONS
    )
    tokens = ours.generate(
        batch["ids"], steps, attention_mask=batch["mask"], position_ids=positions, eos_ids=()
    )
    assert torch.equal(tokens, theirs.sequences)
    # each step's logits, recomputed in one forward at the continued positions: the real
    # tokens so far + delta on every axis (the new tokens are text)
    prompt = batch["ids"].shape[1]
    real = batch["mask"].sum(1, keepdim=True)
    assert torch.equal(next_positions(positions), real + deltas[:, None])  # what generate uses
    continued = (real + deltas[:, None] + torch.arange(steps - 1)).expand(3, -1, -1)
    full = ours(
        tokens[:, :-1],
        position_ids=torch.cat([positions, continued], dim=2),
        attention_mask=torch.nn.functional.pad(batch["mask"], (0, steps - 1), value=True),
    )
    # generate hands its logits out in float32: ours rounded to float32 equal them up to the
    # one float32 ulp (2**-23 relative) a float64 difference below FP64_ATOL can flip
    expected = torch.stack(theirs.logits, dim=1)
    assert expected.dtype == torch.float32
    got = full[:, prompt - 1 :].float()
    torch.testing.assert_close(got, expected, rtol=2**-23, atol=FP64_ATOL)


# ----------------------------------------------------------------------------- errors
def test_spec_names_a_bad_mrope_section_and_round_trips_a_good_one():
    base = dict(vocab_size=VOCAB, width=48, layers=1, heads=4, mlp_hidden=40)
    for bad in ([2, 2], [2, 2, 3], [0, 3, 3], [2, 2.5, 1.5]):
        with pytest.raises(FieldError) as err:
            DecoderSpec.from_dict({**base, "mrope_section": bad}, "decoder")
        assert err.value.path.startswith("decoder.mrope_section"), err.value.path
    with pytest.raises(FieldError, match=r"mrope_section: \[2, 2, 3\] sums to 7.* 6 rotary"):
        DecoderSpec(**base, mrope_section=(2, 2, 3))
    spec = DecoderSpec.from_dict({**base, "mrope_section": [1, 2, 3]}, "decoder")
    assert spec.mrope_section == (1, 2, 3)
    assert DecoderSpec.from_dict(spec.to_dict()) == spec
    plain = spec.replace(mrope_section=None)
    assert spec.params() == plain.params() and spec.forward_flops(7) == plain.forward_flops(7)


@torch.no_grad()
def test_position_shapes_the_decoder_cannot_rotate_by_are_refused():
    base = dict(vocab_size=VOCAB, width=48, layers=1, heads=4, mlp_hidden=40)
    mrope = Decoder(DecoderSpec(**base, mrope_section=SECTION)).eval()
    plain = Decoder(DecoderSpec(**base)).eval()
    ids = torch.randint(3, 80, (2, 5))
    with pytest.raises(ValueError, match=r"\[3, B, T\].*mrope_section is unset"):
        plain(ids, position_ids=torch.zeros(3, 2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be \[3, B, T\] = \[3, 2, 5\], got \(4, 2, 5\)"):
        mrope(ids, position_ids=torch.zeros(4, 2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[T\], \[B, T\] or \[3, B, T\].*got \(2, 6\)"):
        mrope(ids, position_ids=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="got \\(1, 3, 2, 5\\)"):
        mrope(ids, position_ids=torch.zeros(1, 3, 2, 5, dtype=torch.long))
