"""Tiny, complete Hugging Face model folders for the hub-model tests (issue 42).

`make_folder(family, root)` writes `root/<family>/` as a user downloads it: config.json and
model.safetensors from `save_pretrained` of transformers' own class built from a tiny config,
generation_config.json, and the processor (tokenizer, chat template, image processor) saved by
the processor's own `save_pretrained`. Each folder builds in well under a second; a forward on
one 32-64 px image takes milliseconds.

- The tokenizer is a byte-level BPE trained with `tokenizers` on a few words, holding the
  family's special tokens as the real tokenizer names them, wrapped as transformers'
  `PreTrainedTokenizerFast`; the config's vocab size and token ids are read from it.
- The chat template takes transformers' content lists and emits the family's image markup as
  its real template does; `add_generation_prompt` opens the assistant turn.
- Weights: the class's own random init under `torch.manual_seed(seed)`, with the configs'
  `initializer_range` raised to 0.2 (transformers' 0.02 gives near-uniform logits on a
  64-wide model, so two images would give logits equal up to rounding).

torchvision. transformers 5.23 defines `VideoProcessorMixin` and the whole
`AutoVideoProcessor` module only when torchvision is installed, and a processor whose
`__init__` takes a `video_processor` (Qwen3-VL's, InternVL's) checks that argument's class
against it: without torchvision such a processor can be neither built nor loaded by
`AutoProcessor`, whatever the folder holds. Gemma 3's and Idefics3's processors have no video
processor and work as they are. So, without torchvision, `make_folder` saves Qwen3-VL and
InternVL with `images_only(cls)`: the family's own processor class with its video argument
dropped (its code, class name and saved files are otherwise the real class's), then adds the
family's video processor settings to processor_config.json under "video_processor" as the real
`save_pretrained` writes them, so where torchvision is installed `AutoProcessor` loads the full
processor. `load_processor(folder)` is `AutoProcessor.from_pretrained` where that works and
the images-only class's `from_pretrained` where it cannot.

`make_reader_folder(root, words)`: a Qwen3-VL sized to learn to read the `quickstart
--vlm-docs` pages (READER says what differs and why), for tests/test_hub_learning.py.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from pathlib import Path

import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FAMILIES = ("qwen3_vl", "internvl", "gemma3", "idefics3")
INIT_STD = 0.2  # see the module docstring: logits must depend on the image
WORDS = ["user assistant model describe the image colour red green blue",
         "a picture of a cat on a mat", "say one two three four"]  # fmt: skip
MERGES = 64  # BPE merges learnt beyond the byte alphabet and the special tokens

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPECIALS = {
    "qwen3_vl": CHATML_SPECIALS
    + ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],  # fmt: skip
    "internvl": CHATML_SPECIALS + ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"],
    "gemma3": [
        "<pad>",
        "<eos>",
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ],  # fmt: skip
    "idefics3": [
        "<|im_start|>",
        "<|im_end|>",
        "<end_of_utterance>",
        "<fake_token_around_image>",
        "<image>",
        "<global-img>",
    ]
    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
}
# bos / eos / pad, and the named tokens the processors read off the tokenizer
TOKEN_ROLES = {
    "qwen3_vl": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
    "internvl": dict(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    ),  # fmt: skip
    "gemma3": dict(
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    ),  # fmt: skip
    "idefics3": dict(
        bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|im_end|>"
    ),  # fmt: skip
}

_CONTENT = (  # a message's content: a string, or transformers' list of {"type": ...} items
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}IMAGE"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
)
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n" + _CONTENT + "<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TEMPLATES = {
    "qwen3_vl": _CHATML.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>"),
    # the processor expands each <IMG_CONTEXT> into <img><IMG_CONTEXT>*N</img>
    "internvl": _CHATML.replace("IMAGE", "<IMG_CONTEXT>\n"),
    # Gemma calls the assistant "model"; the processor expands <start_of_image>
    "gemma3": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>"
        "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        + _CONTENT.replace("IMAGE", "<start_of_image>")
        + "<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    # SmolVLM's turns: "User:<image>text<end_of_utterance>\n"
    "idefics3": (
        "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:"
        + _CONTENT.replace("IMAGE", "<image>")
        + "<end_of_utterance>\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    ),
}

# Vision towers: 8 px patches, 32 px tiles (4x4 patches, merged 2x2 into 4 image tokens).
PATCH, TILE = 8, 32
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            initializer_range=INIT_STD)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              initializer_range=INIT_STD)  # fmt: skip


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def tokenizer(family: str, words: list[str] | tuple[str, ...] = tuple(WORDS)
              ) -> transformers.PreTrainedTokenizerFast:  # fmt: skip
    """A byte-level BPE of `words` holding the family's special tokens, as transformers wraps
    it. Its merges are learnt from `words` only: a character they never hold (a digit of
    WORDS) stays one token of its own."""
    specials = SPECIALS[family]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + len(specials) + MERGES,
                                  special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    bpe.train_from_iterator(list(words), trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, chat_template=CHAT_TEMPLATES[family], **TOKEN_ROLES[family]
    )


def images_only(processor_class: type) -> type:
    """`processor_class` without its `video_processor` argument (see the module docstring)."""

    # `from_pretrained` passes the saved settings named in __init__'s code: those of
    # Qwen3VLProcessor (chat_template) and InternVLProcessor (+ image_seq_length)
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None,
                 image_seq_length=None, **kwargs):  # fmt: skip
        if image_seq_length is not None:
            kwargs["image_seq_length"] = image_seq_length
        processor_class.__init__(self, image_processor, tokenizer, None,
                                 chat_template=chat_template, **kwargs)  # fmt: skip

    # `save_pretrained` reads the parts and settings to save off __init__'s signature
    signature = inspect.signature(processor_class.__init__)
    __init__.__signature__ = signature.replace(
        parameters=[p for name, p in signature.parameters.items() if name != "video_processor"]
    )
    # the real name, so processor_config.json names the family's class
    return type(processor_class.__name__, (processor_class,), {"__init__": __init__})


def _ids(tok, *names: str) -> list[int]:
    return [tok.convert_tokens_to_ids(name) for name in names]


def _qwen3_vl(
    tok,
    *,
    patch: int = PATCH,
    positions: int = TILE // PATCH,
    image_tokens: tuple[int, int] = (4, 16),
    rope_theta: float = 1e6,
    text_width: int = TEXT["hidden_size"],
    vision_width: int = VISION["hidden_size"],
):
    """The tiny Qwen3-VL; the defaults are make_folder's. `positions`: the side of the vision
    tower's learnt position grid (interpolated to each image's); `image_tokens`: the pixel
    budget as (min, max) LM tokens of (2 x patch)^2 pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image, video, start, end = _ids(tok, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                    "<|vision_end|>")  # fmt: skip
    text = dict(TEXT, hidden_size=text_width, intermediate_size=2 * text_width,
                num_attention_heads=text_width // TEXT["head_dim"],
                num_key_value_heads=text_width // (2 * TEXT["head_dim"]), vocab_size=len(tok),
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                                 "mrope_section": [2, 3, 3], "mrope_interleaved": True})  # fmt: skip
    vision = dict(depth=2, hidden_size=vision_width, intermediate_size=2 * vision_width,
                  num_heads=vision_width // 16, patch_size=patch, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=text_width,
                  num_position_embeddings=positions**2, deepstack_visual_indexes=[0],
                  initializer_range=INIT_STD)  # fmt: skip
    config = transformers.Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    # pixel budget (default 32x32 .. 64x64: 4 .. 16 image tokens); mean/std of Qwen3-VL
    token = (2 * patch) ** 2  # pixels of one LM token: a 2 x 2 merge of patches
    pixels = dict(patch_size=patch, merge_size=2, temporal_patch_size=2,
                  size={"shortest_edge": image_tokens[0] * token,
                        "longest_edge": image_tokens[1] * token},
                  image_mean=[0.5] * 3, image_std=[0.5] * 3)  # fmt: skip
    parts = dict(image_processor=Qwen2VLImageProcessorPil(**pixels))
    return transformers.Qwen3VLForConditionalGeneration(config), transformers.Qwen3VLProcessor, \
        parts, lambda: Qwen3VLVideoProcessor(**pixels)  # fmt: skip


def _internvl(tok):
    text = dict(TEXT, model_type="qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=False)  # fmt: skip
    text.pop("head_dim")
    vision = dict(VISION, image_size=[TILE, TILE], patch_size=[PATCH, PATCH])
    tokens_per_tile = (TILE // PATCH) ** 2 // 4  # pixel shuffle by downsample_ratio 0.5
    config = transformers.InternVLConfig(
        text_config=text, vision_config=vision, image_token_id=tok.context_image_token_id,
        image_seq_length=tokens_per_tile, downsample_ratio=0.5, tie_word_embeddings=False,
    )  # fmt: skip
    # dynamic tiling as the real one does it, capped at 4 tiles (+ a thumbnail when tiled)
    images = transformers.GotOcr2ImageProcessorPil(
        size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=4
    )
    parts = dict(image_processor=images, image_seq_length=tokens_per_tile)

    def video():  # its module imports torchvision
        from transformers.models.internvl.video_processing_internvl import (
            InternVLVideoProcessor,
        )

        return InternVLVideoProcessor(size={"height": TILE, "width": TILE})

    return transformers.InternVLForConditionalGeneration(config), \
        transformers.InternVLProcessor, parts, video  # fmt: skip


def _gemma3(tok):
    boi, eoi, image = _ids(tok, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    text = dict(TEXT, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                eos_token_id=_ids(tok, "<eos>", "<end_of_turn>"), pad_token_id=tok.pad_token_id,
                query_pre_attn_scalar=TEXT["head_dim"], sliding_window=64)  # fmt: skip
    vision = dict(VISION, model_type="siglip_vision_model", image_size=TILE, patch_size=PATCH)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=boi,
        eoi_token_index=eoi, image_token_index=image, initializer_range=INIT_STD,
    )  # fmt: skip
    images = transformers.Gemma3ImageProcessorPil(
        size={"height": TILE, "width": TILE}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    parts = dict(image_processor=images, image_seq_length=4)
    return transformers.Gemma3ForConditionalGeneration(config), transformers.Gemma3Processor, \
        parts, None  # fmt: skip


def _idefics3(tok):
    text = dict(TEXT, model_type="llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    vision = dict(VISION, image_size=TILE, patch_size=PATCH)
    tokens_per_tile = (TILE // PATCH) ** 2 // 4  # pixel shuffle by scale_factor 2
    config = transformers.Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    # resized to a 64 px longest edge, split into 32 px tiles, plus the whole image as a tile
    images = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE},
        do_image_splitting=True, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    parts = dict(image_processor=images, image_seq_len=tokens_per_tile)
    return transformers.Idefics3ForConditionalGeneration(config), \
        transformers.Idefics3Processor, parts, None  # fmt: skip


BUILDERS = {"qwen3_vl": _qwen3_vl, "internvl": _internvl, "gemma3": _gemma3,
            "idefics3": _idefics3}  # fmt: skip


def make_folder(family: str, root: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32
                ) -> Path:  # fmt: skip
    """Write `root/<family>/`: the tiny model of `family` (one of FAMILIES) and its processor."""
    if family not in BUILDERS:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    tok = tokenizer(family)
    torch.manual_seed(seed)
    return _save(Path(root) / family, family, tok, BUILDERS[family](tok), dtype)


# The tiny Qwen3-VL that learns to read the `quickstart --vlm-docs` pages
# (tests/test_hub_learning.py). What differs from make_folder's, each measured on those pages
# by changing it alone (600 steps of 16 pages at lr 2e-3; the held-out answers' loss with
# shuffled pages minus with their own, nats per token, 128 pages; this: 0.46 +- 0.05):
# - patch 4: one LM token is 8 x 8 pixels, as the native demo's tower (a digit is ~7 px
#   wide); at patch 8: 0.07 +- 0.02. A pixel budget of 4 .. 40 tokens (the demo's
#   image_min/max_tokens) and a learnt position grid of 12 x 12 patches (a 48 px side);
# - a text model 96 wide and a tower 64 wide: at make_folder's 64 / 32, 0.09 +- 0.02;
# - the decoder's rotary base 3, the native demo's (quickstart/vlm_docs.docs_spec says why):
#   at 1e6, 0.38 +- 0.04;
# - a BPE of the demo's prompts (no digit in them: each digit of an answer is one token).
# INIT_STD stays: at transformers' 0.02 (norms not redrawn) the model learnt to ignore the
# page, 0.000 +- 0.000.
READER = dict(patch=4, positions=12, image_tokens=(4, 40), rope_theta=3.0, text_width=96,
              vision_width=64)  # fmt: skip


def make_reader_folder(root: Path, words: list[str] | tuple[str, ...], *, seed: int = 0
                       ) -> Path:  # fmt: skip
    """Write `root/qwen3_vl_reader/`: the Qwen3-VL of READER with a BPE of `words`."""
    tok = tokenizer("qwen3_vl", words)
    torch.manual_seed(seed)
    built = _qwen3_vl(tok, **READER)
    return _save(Path(root) / "qwen3_vl_reader", "qwen3_vl", tok, built, torch.float32)


def _save(folder: Path, family: str, tok, built: tuple, dtype: torch.dtype) -> Path:
    """`folder` as a user downloads it: the built model (random init, constant parameters
    redrawn) and its processor."""
    model, processor_class, parts, video = built
    _redraw_constant_parameters(model)
    generation = model.generation_config
    generation.bos_token_id, generation.pad_token_id = tok.bos_token_id, tok.pad_token_id
    generation.eos_token_id = model.config.get_text_config().eos_token_id
    model.to(dtype).save_pretrained(folder)
    template = CHAT_TEMPLATES[family]
    if video is None or has_torchvision():
        extra = {} if video is None else {"video_processor": video()}
        processor_class(tokenizer=tok, chat_template=template, **parts, **extra
                        ).save_pretrained(folder)  # fmt: skip
        return folder
    images_only(processor_class)(tokenizer=tok, chat_template=template, **parts
                                 ).save_pretrained(folder)  # fmt: skip
    try:
        _add_video_processor(folder, video())
    except ImportError:  # InternVL's video processor module imports torchvision
        logging.getLogger(__name__).info("%s: no video processor settings without torchvision",
                                         family)  # fmt: skip
    return folder


@torch.no_grad()
def _redraw_constant_parameters(model: torch.nn.Module) -> None:
    """Draw each parameter the class initialises to one value (norm weights, biases, Gemma 3's
    image projection: zeros) around that value, so every weight matters to the outputs."""
    for parameter in model.parameters():
        first = parameter.flatten()[0]
        if parameter.is_floating_point() and bool((parameter == first).all()):
            parameter.normal_(float(first), INIT_STD)


def _add_video_processor(folder: Path, video) -> None:
    """Record `video`'s settings in processor_config.json where `save_pretrained` puts them."""
    path = folder / "processor_config.json"
    config = json.loads(path.read_text())
    config["video_processor"] = {k: v for k, v in video.to_dict().items()
                                 if k not in ("_processor_class", "processor_class")}  # fmt: skip
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_processor(folder: Path) -> transformers.ProcessorMixin:
    """The folder's processor as `AutoProcessor` loads it; images only without torchvision."""
    config = json.loads((Path(folder) / "processor_config.json").read_text())
    processor_class = getattr(transformers, config["processor_class"])
    takes_video = "video_processor" in inspect.signature(processor_class.__init__).parameters
    if not takes_video or has_torchvision():
        return transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
    return images_only(processor_class).from_pretrained(folder, local_files_only=True)


def conversation(family: str, text: str = "describe the image", answer: str = "a red cat"
                 ) -> list[dict]:  # fmt: skip
    """One user turn (an image, then text) and the assistant's answer, as transformers takes it."""
    if family not in BUILDERS:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def image(seed: int, size: tuple[int, int] = (64, 32)) -> Image.Image:
    """A random RGB image of `size` (width, height) drawn from `seed`; 64x32 is two tiles
    for InternVL and Idefics3 (plus their thumbnail / global tile), 8 tokens for Qwen3-VL."""
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed),
                           dtype=torch.uint8)  # fmt: skip
    return Image.fromarray(pixels.numpy())


def processed(folder: Path, images: list, conversations: list[list[dict]]
              ) -> transformers.BatchFeature:  # fmt: skip
    """The folder's processor applied as a transformers user does: template, then processor."""
    processor = load_processor(folder)
    texts = [processor.apply_chat_template(c, tokenize=False) for c in conversations]
    return processor(text=texts, images=images, padding=True, return_tensors="pt")


def hub_cache(folder: Path, repo_id: str, cache_dir: Path, revision: str = "main") -> Path:
    """Lay `folder` out as huggingface_hub's cache holds a download of `repo_id` at `revision`.

    `cache_dir/models--org--name/`: `blobs/<id>` holds each file once (id: the sha256 of an LFS
    file, here the safetensors, else its git blob sha1, as the Hub's etags are),
    `snapshots/<commit>/<path>` links to its blob by a relative symlink, and `refs/<revision>`
    holds the commit (a sha1 of the file list, so equal folders give equal commits). No
    `trees/` listing is written: huggingface_hub treats a missing one as "cannot tell" and
    returns the snapshot. Returns the snapshot folder.
    """
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())
    blobs = {name: _blob_id(Path(folder) / name) for name in files}
    commit = hashlib.sha1("".join(f"{n}\0{b}\n" for n, b in blobs.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, blob_id in blobs.items():
        blob = repo / "blobs" / blob_id
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes((Path(folder) / name).read_bytes())
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)  # no newline: huggingface_hub reads it as is
    return snapshot


def _blob_id(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".safetensors":  # stored with git LFS on the Hub: sha256
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
