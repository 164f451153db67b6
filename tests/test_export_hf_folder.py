"""`mmtrain convert --to hf RUN`: a run folder exports as a folder other tools open.

A tiny LLaVA, Qwen2-VL and Qwen2 LM are built with transformers from configs and saved with a
real processor beside them: a byte-level BPE made with `tokenizers` holding the family's special
tokens, the family's image processor, a ChatML-style chat template (strings with `<image>` tags
for mmtrain, content lists for transformers), the generation config `save_pretrained` writes.
A real `mmtrain train` of two steps starts from each (`init:` the folder, its tokenizer and
template as `data.tokenizer` / `data.chat_template`), then `convert --to hf RUN` exports it, and
transformers opens the export: `AutoProcessor` (or the tokenizer and image processor) applies
the chat template to a conversation with an image and processes the image exactly as the
original folder's processor does, the model class loads with no missing or unexpected key, its
logits on the processor's ids are the run's own (mmtrain's model read from the run folder, at
each of mmtrain's ids: one placeholder per image) to the fp32 interop tolerance of
test_hf_llava.py (the run's two steps move them far past it: an export of other weights
fails), and `generate` answers.

transformers' Qwen2-VL video processor imports torchvision, which the test environment lacks:
there the Qwen2-VL folder holds the tokenizer and image processor, and `AutoProcessor` is
checked where torchvision is installed.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mmtrain.cli import main
from mmtrain.config import load_config
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.models import load_model
from mmtrain.models.formats.hf import read_hf_model
from mmtrain.models.formats.hf_processor_files import PROCESSOR_FILES
from mmtrain.train.export import copy_processor_files

transformers = pytest.importorskip("transformers")
from test_hf_llava import FP32_ATOL, hf_lm, llava  # noqa: E402

# Qwen's ChatML and vision tokens, and LLaVA's image placeholder.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>", "<image>"]  # fmt: skip
IMAGE_MARKUP = {"llava": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "lm": ""}  # fmt: skip
WORDS = [f"Say {i}. colour {i} user assistant" for i in range(8)]
CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Say 3."}]}
]
QWEN_VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
QWEN_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6,
                 rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # fmt: skip
PIXELS = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=4096)


def chat_template(family: str) -> str:
    """ChatML; a content list's image items become the family's markup (transformers), a
    string content is kept with its `<image>` tags (mmtrain puts the placeholder there)."""
    image = IMAGE_MARKUP[family]
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}" + image + "{% else %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def tokenizer(family: str) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of WORDS with SPECIALS as special tokens, as transformers wraps it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=alphabet, show_progress=False)  # fmt: skip
    tok.train_from_iterator(WORDS, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=chat_template(family),
    )  # fmt: skip


def token_ids(tok) -> dict[str, int]:
    return {name: tok.convert_tokens_to_ids(name) for name in SPECIALS}


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def save_llava(folder: Path) -> None:
    tok = tokenizer("llava")
    ids = token_ids(tok)
    model = llava("clip-llama-default", seed=3, image_id=ids["<image>"], vocab_size=len(tok),
                  bos_token_id=None, eos_token_id=ids["<|im_end|>"])  # fmt: skip
    model.save_pretrained(folder)
    images = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    transformers.LlavaProcessor(
        image_processor=images, tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
        vision_feature_select_strategy="default", chat_template=chat_template("llava"),
    ).save_pretrained(folder)  # fmt: skip


def save_qwen2_vl(folder: Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = tokenizer("qwen2_vl")
    ids = token_ids(tok)
    text = dict(QWEN_TEXT, vocab_size=len(tok), bos_token_id=None, eos_token_id=ids["<|im_end|>"])
    config = transformers.Qwen2VLConfig(
        text_config=text, vision_config=QWEN_VISION, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(4)
    transformers.Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    images = Qwen2VLImageProcessorPil(**PIXELS)
    if has_torchvision():
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        transformers.Qwen2VLProcessor(
            image_processor=images, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(**PIXELS),
            chat_template=chat_template("qwen2_vl"),
        ).save_pretrained(folder)  # fmt: skip
    else:  # transformers' video processor (and so its Qwen2VLProcessor) needs torchvision
        tok.save_pretrained(folder)
    # transformers 5 nests it in processor_config.json; mmtrain reads the pixel budget here
    images.save_pretrained(folder)


def save_lm(folder: Path) -> None:
    tok = tokenizer("lm")
    ids = token_ids(tok)
    hf_lm("qwen2-tied", seed=2, vocab_size=len(tok), bos_token_id=None,
          eos_token_id=ids["<|im_end|>"]).save_pretrained(folder)  # fmt: skip
    tok.save_pretrained(folder)


def png(i: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (30 * i, 200 - 20 * i, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def conversation_shards(folder: Path, images: bool) -> Path:
    """Eight one-turn conversations, each about a 16 px image when `images`."""
    folder.mkdir(parents=True)
    with ShardWriter(folder, max_samples=4) as writer:
        for i in range(8):
            prompt = "<image>" if images else f"Say {i}."
            record = {"id": str(i), "images": ["0.png"] if images else [],
                      "messages": [{"role": "user", "content": prompt},
                                   {"role": "assistant", "content": f"colour {i}"}]}  # fmt: skip
            sample = {"__key__": f"{i:09d}", "json": json.dumps(record)}
            if images:
                sample["0.png"] = png(i)
            writer.write(sample)
    write_manifest(folder, writer.shards, modalities=["image", "text"] if images else ["text"])
    return folder


def train_from(root: Path, hf: Path, images: bool) -> Path:
    """Two steps of `mmtrain train` started from the HF folder `hf`; the run folder."""
    spec, _ = read_hf_model(hf)
    spec.save(root / "spec.json")
    config = {
        "model": str(root / "spec.json"),
        "init": str(hf),
        "data": {
            "train": str(conversation_shards(root / "shards", images)),
            "tokenizer": str(hf),
            "chat_template": str(hf),
            "sequence_length": 64,
        },
        "train": {"steps": 2, "batch_size": 2, "lr": 1e-3, "warmup_steps": 0},
        "metrics": {"tensorboard": False},
        "out": str(root / "run"),
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(root / "run.yaml")]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(HF folder, run folder) of each family."""
    out = {}
    for family, save, images in (("llava", save_llava, True), ("qwen2_vl", save_qwen2_vl, True),
                                 ("lm", save_lm, False)):  # fmt: skip
        root = tmp_path_factory.mktemp(family)
        save(root / "hf")
        out[family] = (root / "hf", train_from(root, root / "hf", images))
    return out


def export(run: Path, out: Path) -> Path:
    assert main(["convert", "--to", "hf", str(run), "--out", str(out)]) == 0
    return out


def loads_strictly(cls, folder: Path):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def answer(model, inputs: dict, new_tokens: int = 3) -> torch.Tensor:
    """`new_tokens` greedy tokens after the prompt."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)  # fmt: skip
    prompt = inputs["input_ids"].shape[1]
    assert out.shape == (1, prompt + new_tokens)
    return out[0, prompt:]


def collapsed(ids: torch.Tensor, token: int) -> tuple[torch.Tensor, list[int]]:
    """mmtrain's ids [1, T'] of transformers' one row `ids` [1, T] (each run of `token`, an
    image's tokens, becomes one placeholder) and the transformers row of each (a run's last)."""
    ours, rows = [], []
    for i, t in enumerate(ids[0].tolist()):
        if t == token and ours and ours[-1] == token:
            rows[-1] = i
        else:
            ours.append(t)
            rows.append(i)
    return torch.tensor([ours]), rows


def assert_the_runs_logits(run: Path, model, hf_inputs: dict, token: int, images: dict) -> None:
    """transformers' `model` (the export) on `hf_inputs` computes what mmtrain's model of the
    run folder computes on the same ids with one placeholder (`token`) per image (`images`:
    mmtrain's image entries)."""
    ids, rows = collapsed(hf_inputs["input_ids"], token)
    with torch.no_grad():
        want = load_model(run).eval().logits({"text": ids, **images})
        got = model(**hf_inputs).logits[:, rows]
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def assert_same_inputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


# ----------------------------------------------------------------------------- the families
def test_a_llava_run_exports_a_folder_that_auto_processor_and_the_model_open(runs, tmp_path):
    hf, run = runs["llava"]
    folder = export(run, tmp_path / "export")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "processor_config.json", "generation_config.json"):  # fmt: skip
        assert (folder / name).read_bytes() == (hf / name).read_bytes(), name
    processor = transformers.AutoProcessor.from_pretrained(folder)
    original = transformers.AutoProcessor.from_pretrained(hf)
    prompt = processor.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert prompt == original.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>user\n<image>Say 3.")
    image = Image.open(io.BytesIO(png(3)))
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    assert_same_inputs(inputs, original(text=[prompt], images=[image], return_tensors="pt"))
    model = loads_strictly(transformers.AutoModelForImageTextToText, folder)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert_the_runs_logits(run, model, dict(inputs), image_id, {"image": inputs["pixel_values"]})
    assert isinstance(processor.decode(answer(model, dict(inputs))), str)


def test_a_qwen2_vl_run_exports_its_tokenizer_template_and_image_processor(runs, tmp_path):
    hf, run = runs["qwen2_vl"]
    folder = export(run, tmp_path / "export")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    original = transformers.AutoTokenizer.from_pretrained(hf)
    assert prompt == original.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                                  tokenize=False)  # fmt: skip
    assert "<|vision_start|><|image_pad|><|vision_end|>Say 3." in prompt
    image = Image.open(io.BytesIO(png(3)))
    pixels = transformers.AutoImageProcessor.from_pretrained(folder)(image, return_tensors="pt")
    original_pixels = transformers.AutoImageProcessor.from_pretrained(hf)(
        image, return_tensors="pt"
    )
    assert_same_inputs(pixels, original_pixels)
    # what Qwen2VLProcessor does with the two: one pad token per merged 2 x 2 patches
    tokens = int(pixels["image_grid_thw"].prod()) // PIXELS["merge_size"] ** 2
    text = tok(prompt.replace("<|image_pad|>", "<|image_pad|>" * tokens), return_tensors="pt")
    model = loads_strictly(transformers.AutoModelForImageTextToText, folder)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    # one page both ways: mmtrain's tower patchifies it as the image processor lays patches out
    page = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(0))
    patches, grid = load_model(run).towers["vision"].patchify([page])
    assert torch.equal(grid, pixels["image_grid_thw"])
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    types = (text["input_ids"] == pad).long()  # 1: an image's token (the processor's output)
    hf_inputs = {
        **text,
        "pixel_values": patches,
        "image_grid_thw": grid,
        "mm_token_type_ids": types,
    }
    assert_the_runs_logits(run, model, hf_inputs, pad, {"image": [page]})
    assert isinstance(tok.decode(answer(model, {**text, **pixels})), str)


@pytest.mark.skipif(
    not has_torchvision(), reason="transformers' Qwen2-VL video processor needs torchvision"
)
def test_a_qwen2_vl_export_opens_with_auto_processor(runs, tmp_path):
    hf, run = runs["qwen2_vl"]
    folder = export(run, tmp_path / "export")
    processor = transformers.AutoProcessor.from_pretrained(folder)
    original = transformers.AutoProcessor.from_pretrained(hf)
    prompt = processor.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    image = Image.open(io.BytesIO(png(3)))
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    assert_same_inputs(inputs, original(text=[prompt], images=[image], return_tensors="pt"))
    model = loads_strictly(transformers.AutoModelForImageTextToText, folder)
    assert isinstance(processor.decode(answer(model, dict(inputs))), str)


def test_a_language_model_run_exports_a_folder_auto_tokenizer_and_the_model_open(runs, tmp_path):
    hf, run = runs["lm"]
    folder = export(run, tmp_path / "export")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    conversation = [{"role": "user", "content": "Say 3."}]
    ids = tok.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")  # fmt: skip
    original = transformers.AutoTokenizer.from_pretrained(hf)
    assert torch.equal(ids["input_ids"], original.apply_chat_template(
        conversation, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"])  # fmt: skip
    model = loads_strictly(transformers.AutoModelForCausalLM, folder)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert_the_runs_logits(run, model, dict(ids), -1, {})
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(tok.decode(answer(model, dict(ids))), str)


# ----------------------------------------------------------------------------- where files come from
def copy_run(run: Path, to: Path, **changes) -> Path:
    """A copy of the run folder whose config.yaml has `changes` (dotted keys), without its
    checkpoints and without processor files of its own (whether the trainer copied them there
    or not): the export finds them where config.yaml says."""
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("checkpoints", *PROCESSOR_FILES))
    config = yaml.safe_load((to / "config.yaml").read_text())
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[last] = value
    (to / "config.yaml").write_text(yaml.safe_dump(config))
    return to


def test_relative_paths_of_the_run_config_resolve_against_the_run_folders_parent(
    runs, tmp_path, monkeypatch
):
    hf, run = runs["lm"]
    where = tmp_path / "runs"
    relative = os.path.relpath(hf, where)
    copy = copy_run(run, where / "lm", init=relative, **{"data.tokenizer": relative,
                                                         "data.chat_template": relative})  # fmt: skip
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    folder = export(copy, tmp_path / "export")
    assert (folder / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert (folder / "generation_config.json").is_file()


def test_a_starting_folder_moved_away_is_named(runs, tmp_path, capsys):
    _, run = runs["lm"]
    gone = str(tmp_path / "gone")
    copy = copy_run(run, tmp_path / "run", init=gone, **{"data.tokenizer": gone,
                                                         "data.chat_template": gone})  # fmt: skip
    out = tmp_path / "export"
    assert main(["convert", "--to", "hf", str(copy), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{copy / 'config.yaml'}: init: '{gone}' is not found" in err
    assert not (out / "config.json").exists()


def test_a_tokenizer_with_more_tokens_than_the_model_is_refused(runs, tmp_path, capsys):
    hf, run = runs["lm"]
    copy = copy_run(run, tmp_path / "run")
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    vocab = len(tok)
    tok.add_tokens(["<extra_0>", "<extra_1>"])
    tok.save_pretrained(copy)  # the run folder's own files come first
    out = tmp_path / "export"
    assert main(["convert", "--to", "hf", str(copy), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{vocab + 2} tokens" in err and f"vocab_size {vocab}" in err
    assert not (out / "config.json").exists()


def test_a_run_folder_holding_its_files_exports_without_its_starting_folder(runs, tmp_path):
    """train/export.py's copy_processor_files puts the starting folder's files in the run
    folder (the trainer calls it at start): the export needs nothing else, and they win over
    what config.yaml names."""
    hf, run = runs["lm"]
    config = load_config(run / "config.yaml")  # the run's resolved config
    gone = str(tmp_path / "gone")
    copy = copy_run(run, tmp_path / "run", init=gone, **{"data.tokenizer": gone,
                                                         "data.chat_template": gone})  # fmt: skip
    names = copy_processor_files(config, copy)
    assert names == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "generation_config.json"]  # fmt: skip
    assert copy_processor_files(config, copy) == []  # a resumed run keeps what it started with
    folder = export(copy, tmp_path / "export")
    for name in names:
        assert (folder / name).read_bytes() == (hf / name).read_bytes(), name
    assert transformers.AutoTokenizer.from_pretrained(folder).chat_template is not None


def test_the_chat_template_the_run_trained_with_is_the_exports(runs, tmp_path):
    hf, run = runs["lm"]
    template = chat_template("lm").replace("<|im_start|>", "<|im_start|> ")
    (tmp_path / "mine.jinja").write_text(template)
    copy = copy_run(run, tmp_path / "run", **{"data.chat_template": str(tmp_path / "mine.jinja")})
    folder = export(copy, tmp_path / "export")
    assert (folder / "chat_template.jinja").read_text() == template
    assert (folder / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt == "<|im_start|> user\nhi<|im_end|>\n"


def test_a_tokenizer_other_than_the_one_the_run_trained_with_is_refused(runs, tmp_path, capsys):
    _, run = runs["lm"]
    other = tokenizer("lm")
    other.add_tokens(["colour"])  # a token the starting folder's tokenizer lacks
    other.backend_tokenizer.save(str(tmp_path / "other.json"))
    copy = copy_run(run, tmp_path / "run", **{"data.tokenizer": str(tmp_path / "other.json")})
    out = tmp_path / "export"
    assert main(["convert", "--to", "hf", str(copy), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        f"is not the tokenizer the run trained with (data.tokenizer {tmp_path / 'other.json'})"
        in err
    )
    assert not (out / "config.json").exists()
