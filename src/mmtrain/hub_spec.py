"""What the spec of a hub model records: a transformers model trained as it is (models/hub/).

A hub model is transformers' own module class, built from the config.json of a user's folder
(or a name in the Hugging Face cache). Its spec is not a description mmtrain builds from (the
folder is); it records where the model comes from and what the meta-device build counted, so
the run folder, checkpoints, the resume check and the planner all say what was trained.
Torch-free, like spec.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mmtrain.structured import FieldError

HUB_TOWERS = ("vision", "text")  # the towers a hub model has (`train.towers` keys), in order


@dataclass(frozen=True)
class HubSpec:
    """A transformers model by its source and class, with its counts per tower."""

    source: str  # the folder (absolute) or the hub name `org/name` the run started from
    architecture: str  # the transformers class (config.json's `architectures[0]`)
    model_type: str
    # Parameters of each tower, exact, from the meta-device build: "vision" (the visual
    # encoder with its merger / projector) and "text" (the language model with its head).
    tower_params: dict[str, int] = field(default_factory=dict)
    text_width: int = 0  # the language model's hidden size
    text_layers: int = 0
    vocab_size: int = 0
    tied_embeddings: bool = False  # the head shares the token embedding's weight

    def validate(self, path: str = "hub") -> None:
        if not self.source:
            raise FieldError(f"{path}.source", "a hub model needs the folder or name it comes from")
        unknown = sorted(set(self.tower_params) - set(HUB_TOWERS))
        if unknown:
            raise FieldError(
                f"{path}.tower_params.{unknown[0]}",
                f"a hub model's towers are {', '.join(HUB_TOWERS)}",
            )
        if "text" not in self.tower_params:
            raise FieldError(f"{path}.tower_params", "a hub model has a language model (text)")

    def towers(self) -> list[str]:
        return [name for name in HUB_TOWERS if name in self.tower_params]

    def params(self) -> int:
        return sum(self.tower_params.values())


# ----------------------------------------------------------------------------- traces
# What models/hub/trace.py counts of a hub model at one planned shape, for the planner (which
# imports no torch). Saved bytes are of a float32 trace: `floats` elements of floating dtypes
# (4 bytes each in the trace; the planner counts them at the plan's precision) and
# `other_bytes` of integer and boolean tensors (ids, indices, masks), deduplicated by storage.
TRACE_VERSION = 1  # bump when what a trace counts changes: cached traces are then redone


@dataclass(frozen=True)
class HubShape:
    """One planned row of a hub model: `positions` language-model positions (image tokens
    spliced in), `images` images of `image_height` x `image_width` pixels (before the
    processor's resizing)."""

    positions: int
    images: int = 0
    image_height: int = 0
    image_width: int = 0

    def key(self) -> str:
        return f"s{self.positions}-i{self.images}-{self.image_height}x{self.image_width}"


@dataclass(frozen=True)
class Saved:
    """Bytes autograd keeps, split as the planner prices them."""

    floats: int = 0  # elements of floating dtypes
    other_bytes: int = 0  # integer and boolean tensors, as held

    def bytes(self, float_bytes: float) -> float:
        return self.floats * float_bytes + self.other_bytes

    def __add__(self, other: Saved) -> Saved:
        return Saved(self.floats + other.floats, self.other_bytes + other.other_bytes)


@dataclass(frozen=True)
class TowerTrace:
    """One tower of a traced hub model, per row of the traced shape.

    Blocks are the tower's `blocks` (models/hub/towers.py); `block_saved[i]` is what block i
    keeps without checkpointing, `attention_saved[i]` the part of it kept inside its attention
    module (what selective checkpointing recomputes), `attention_input` the elements of one
    attention module's input (kept instead), `block_input` those of one block's hidden-state
    input (what full checkpointing keeps per block), `shared_inputs` what the blocks' other
    inputs hold once for all (rotary tables, masks). `outside` is what the tower keeps outside
    its blocks (embeddings, patch projection, merger, final norm, the loss's inputs)."""

    name: str
    tokens: int  # the blocks' sequence length per row (patches of all images; positions)
    forward_flops: int  # per row, torch's FLOP counter (2 x multiply-adds)
    block_flops: tuple[int, ...] = ()
    block_saved: tuple[Saved, ...] = ()
    attention_saved: tuple[Saved, ...] = ()
    attention_input: int = 0
    block_input: int = 0
    shared_inputs: Saved = Saved()
    outside: Saved = Saved()
    # Parameters from the same meta build: one block's (exact, the first block's), the
    # modules before the first block (token table, patch projection), and the (out, in) of
    # one block's linears by group ("attn" in the attention module, "mlp" the rest), what
    # LoRA adapts (train/lora.py's target groups).
    params: int = 0  # the tower's, exact
    unused_params: int = 0  # of them, those the forward never reads (no gradient, no state)
    block_params: int = 0
    stem_params: int = 0
    norm_params: int = 0  # of the tower's parameters, those of norms and embedding tables
    linears: tuple[tuple[str, int, int], ...] = ()
    width: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    mlp_hidden: int = 0

    @property
    def blocks(self) -> int:
        return len(self.block_saved)


@dataclass(frozen=True)
class HubTrace:
    """A hub model traced at `shape` (models/hub/trace.py), with the parts frozen in the trace
    (`frozen`: tower names, and `tower:N` for a tower's first N blocks and its stem)."""

    architecture: str
    shape: HubShape
    towers: tuple[TowerTrace, ...]
    image_tokens: int = 0  # language-model positions the row's images fill
    vocab_size: int = 0
    frozen: tuple[str, ...] = ()
    dtype: str = "float32"
    version: int = TRACE_VERSION

    def tower(self, name: str) -> TowerTrace:
        for t in self.towers:
            if t.name == name:
                return t
        raise KeyError(name)

    def forward_flops(self) -> int:
        return sum(t.forward_flops for t in self.towers)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HubTrace:
        def saved(x: dict) -> Saved:
            return Saved(int(x["floats"]), int(x["other_bytes"]))

        towers = []
        for t in d["towers"]:
            t = dict(t)
            for k in ("block_saved", "attention_saved"):
                t[k] = tuple(saved(x) for x in t[k])
            for k in ("shared_inputs", "outside"):
                t[k] = saved(t[k])
            t["block_flops"] = tuple(t["block_flops"])
            t["linears"] = tuple(tuple(x) for x in t["linears"])
            towers.append(TowerTrace(**t))
        return cls(
            architecture=d["architecture"],
            shape=HubShape(**d["shape"]),
            towers=tuple(towers),
            image_tokens=int(d["image_tokens"]),
            vocab_size=int(d["vocab_size"]),
            frozen=tuple(d["frozen"]),
            dtype=d["dtype"],
            version=int(d["version"]),
        )
