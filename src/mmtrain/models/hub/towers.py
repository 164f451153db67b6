"""The towers of a transformers model, found from its structure rather than per family.

A hub model answers to the same `train.towers` keys as mmtrain's native VLMs:
- `text`: the language model (`get_decoder()`: embeddings, decoder layers, final norm) and the
  head (`get_output_embeddings()`);
- `vision`: every other part of the model's inner module, i.e. the visual encoder with its
  merger / projector / connector (Qwen3-VL's `visual`, InternVL's and Gemma 3's `vision_tower`
  + `multi_modal_projector`, Idefics3's `vision_model` + `connector`).

A tower's `blocks` are its transformer layers: the longest `nn.ModuleList` of one class inside
the tower, preferring classes of the model's `_no_split_modules` (what FSDP, activation
checkpointing and compile wrap one by one). Its `input_modules` run before the first block
(the token embedding; a vision encoder's patch embedding), which `freeze_blocks` freezes with
the blocks they feed.

`HubTower` is a view: the modules stay registered under their transformers names only, so the
model's state dict is the transformers model's, and a tower's parameter names are given in the
layout mmtrain's per-layer settings read (`blocks.{i}.…`, `embed.…`, `out.…`).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

INPUT_NAMES = ("embed",)  # what `train/optim.py` counts as layer 0 of a tower
EMBEDDING_TYPES = (nn.Embedding, nn.Conv2d, nn.Conv3d)
# The submodule names (first part of a block's path) whose linears a LoRA target adapts.
LORA_TARGET_WORDS = {"attn": ("attn", "attention"), "mlp": ("mlp", "feed_forward", "ffn")}


class HubTower:
    """Parts of a transformers model that train alike, with their blocks."""

    INPUT_MODULES = INPUT_NAMES

    def __init__(
        self,
        name: str,
        parts: dict[str, nn.Module],
        no_split: set[str],
        prefix: str = "",
        owner: nn.Module | None = None,
    ):
        self.name = name
        self.parts = parts  # qualified name in the model -> module
        # The model itself where the tower also holds the parameters registered on it directly
        # (Wan's output `scale_shift_table`), read at each call: FSDP replaces them.
        self.owner = owner
        self.prefix = prefix  # the model's own name in its owner's state dict ("hf.")
        self.block_path, self.blocks = _blocks(parts, no_split)
        self.embed = _input_modules(parts, self.block_path)

    def encoder(self) -> nn.Module | None:
        """The part that holds the tower's blocks (a vision tower's encoder, not its
        projector); None without blocks."""
        for path, part in self.parts.items():
            if self.block_path.startswith(path + ".") or self.block_path == path:
                return part
        return None

    def block_name(self, index: int) -> str:
        """Block `index`'s parameter-name prefix in the owner's state dict."""
        return f"{self.prefix}{self.block_path}.{index}."

    def lora_paths(self, block: nn.Module, target: str) -> list[str]:
        """The linears of `block` a LoRA target adapts, by path in the block: "attn" every
        linear of its attention, "mlp" every linear of its MLP (transformers' module names:
        `self_attn.q_proj`, `attn.qkv`, `mlp.gate_proj`, `feed_forward.w1`, ...)."""
        words = LORA_TARGET_WORDS[target]
        return [
            name
            for name, module in block.named_modules()
            if isinstance(module, nn.Linear) and any(w in name.split(".")[0] for w in words)
        ]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters by `blocks.{i}.…` (the blocks), `embed.…` (before them), `out.…` (the
        rest: final norm, head, merger), each once."""
        seen: set[int] = set()
        for i, block in enumerate(self.blocks):
            for name, param in block.named_parameters():
                seen.add(id(param))
                yield f"blocks.{i}.{name}", param
        for path, module in self.embed.named_children():
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield f"embed.{path}.{name}", param
        for path, module in self.parts.items():
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield f"out.{path}.{name}", param
        if self.owner is not None:
            for name, param in self.owner.named_parameters(recurse=False):
                yield f"out.{name}", param

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def requires_grad_(self, requires_grad: bool = True) -> HubTower:
        for param in self.parameters():
            param.requires_grad_(requires_grad)
        return self

    def modules(self) -> Iterator[nn.Module]:
        for part in self.parts.values():
            yield from part.modules()


def find_towers(model: nn.Module, prefix: str = "") -> dict[str, HubTower]:
    """{"vision": ..., "text": ...} of a transformers image-text-to-text model, {"text": ...}
    of a causal LM; `prefix`: the model's name where it is held ("hf." in a HubModel)."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    text = {names[id(decoder)]: decoder}
    if head is not None:
        text[names[id(head)]] = head
    inner = _inner(model, decoder)
    vision = {
        names[id(child)]: child
        for child in inner.children()
        if child is not decoder and any(True for _ in child.parameters())
    }
    towers = {}
    if vision and inner is not decoder:
        towers["vision"] = HubTower("vision", vision, no_split, prefix)
    towers["text"] = HubTower("text", text, no_split, prefix)
    return towers


def _inner(model: nn.Module, decoder: nn.Module) -> nn.Module:
    """The module whose children are the towers: the one holding the language model."""
    for module in model.modules():
        if any(child is decoder for child in module.children()):
            return module
    return decoder


def _blocks(parts: dict[str, nn.Module], no_split: set[str]) -> tuple[str, nn.ModuleList]:
    found: list[tuple[bool, int, str, nn.ModuleList]] = []
    for prefix, part in parts.items():
        for name, module in part.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) > 0:
                kinds = {type(m).__name__ for m in module}
                if len(kinds) == 1:
                    path = f"{prefix}.{name}" if name else prefix
                    found.append((kinds.pop() in no_split, len(module), path, module))
    if not found:
        return "", nn.ModuleList()
    _, _, path, blocks = max(found, key=lambda f: (f[0], f[1]))
    return path, blocks


def _input_modules(parts: dict[str, nn.Module], block_path: str) -> nn.ModuleDict:
    """Embeddings (token tables, patch convolutions) of the tower's block stack that run
    before the blocks, by a name without dots."""
    found = nn.ModuleDict()
    for prefix, part in parts.items():
        for name, module in part.named_modules():
            path = f"{prefix}.{name}" if name else prefix
            if isinstance(module, EMBEDDING_TYPES) and not path.startswith(block_path + "."):
                found[path.replace(".", "__")] = module
    return found
