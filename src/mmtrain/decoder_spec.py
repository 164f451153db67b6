"""The description of a decoder-only language model (Llama / Qwen2 family), as data.

`DecoderSpec` is to the LM what `TowerSpec` is to an encoder: the planner counts parameters and
FLOPs from it alone (this module imports no torch, like spec.py), `mmtrain.models.decoder` builds
the same shape as a module, and a test holds the two together (the built module's parameter
count equals `DecoderSpec.params()`).

The block is the Llama one: RMSNorm, causal self-attention with grouped-query attention and
rotary positions, RMSNorm, SwiGLU MLP; a final RMSNorm and an LM head (tied to the token
embedding or not). Qwen2 is the same block with a bias on the q/k/v projections; Qwen2-VL's LM
is Qwen2 with multimodal rotary positions (`mrope_section`: each rotary frequency reads the
time, height or width position of a token; models/mrope.py computes them).

Counting conventions are spec.py's: FLOPs are 2 x multiply-adds of matmuls and attention
(norms, softmax, rotary and bias adds left out), attention counted in full also when causal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mmtrain.structured import FieldError, check_choice, from_dict, to_dict

ROPE_TYPES = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for contexts longer than pre-training's.

    Field names are those of Hugging Face's `rope_scaling` / `rope_parameters`, so a user can
    copy them from a config.json. `linear` divides every frequency by `factor` (position
    interpolation); `llama3` (Llama 3.1) divides only the low frequencies, whose wavelength is
    longer than `original_max_position_embeddings / low_freq_factor`, keeps the high ones (shorter
    than `... / high_freq_factor`) and blends in between. The `*_freq_factor` and
    `original_max_position_embeddings` fields are llama3's only.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self, path: str) -> None:
        check_choice(f"{path}.rope_type", self.rope_type, ROPE_TYPES)
        if self.factor < 1:
            raise FieldError(f"{path}.factor", f"must be at least 1, got {self.factor}")
        if self.rope_type != "llama3":
            return
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise FieldError(
                f"{path}.high_freq_factor",
                f"needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
                f"({self.high_freq_factor})",
            )
        if self.original_max_position_embeddings <= 0:
            raise FieldError(
                f"{path}.original_max_position_embeddings",
                f"must be positive, got {self.original_max_position_embeddings}",
            )


@dataclass(frozen=True)
class DecoderSpec:
    """A Llama-style decoder LM. `kv_heads` None means `heads` (no grouping) and `head_dim` None
    means `width // heads`; both are filled in on construction, so two specs of the same model
    compare equal however they were written."""

    vocab_size: int
    width: int
    layers: int
    heads: int
    mlp_hidden: int
    kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2: bias on q, k and v (never on the output projection)
    tie_embeddings: bool = False  # the LM head reuses the token embedding matrix
    max_positions: int = 2048  # context the model was trained for (rotary has no table)
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()  # generation stops at any of them
    # M-RoPE (Qwen2-VL): how many of the head_dim / 2 rotary frequencies, lowest index first,
    # take their angle from a token's time, height and width position; None is 1-D RoPE.
    mrope_section: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Frozen: fill the defaults that depend on other fields through object.__setattr__.
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim is None and self.heads > 0:
            object.__setattr__(self, "head_dim", self.width // self.heads)
        object.__setattr__(self, "eos_ids", tuple(self.eos_ids))
        if isinstance(self.mrope_section, list):
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        self.validate()

    def validate(self, path: str = "") -> None:
        where = f"{path}." if path else ""
        for name in ("vocab_size", "width", "layers", "heads", "mlp_hidden", "kv_heads"):
            if getattr(self, name) <= 0:
                raise FieldError(where + name, f"must be positive, got {getattr(self, name)}")
        for name in ("head_dim", "max_positions", "rope_theta", "rms_eps"):
            if getattr(self, name) <= 0:
                raise FieldError(where + name, f"must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise FieldError(
                where + "kv_heads",
                f"{self.kv_heads} does not divide heads ({self.heads}): each key/value head "
                "serves a whole group of query heads",
            )
        if self.head_dim % 2:
            raise FieldError(
                where + "head_dim", f"rotary positions rotate pairs; {self.head_dim} is odd"
            )
        if self.rope_scaling is not None:
            self.rope_scaling.validate(where + "rope_scaling")
        if self.mrope_section is not None:
            self._validate_mrope_section(where + "mrope_section")
        ids = ([self.bos_id] if self.bos_id is not None else []) + list(self.eos_ids)
        for token in ids:
            if not 0 <= token < self.vocab_size:
                field = "bos_id" if token == self.bos_id else "eos_ids"
                raise FieldError(
                    where + field, f"{token} is not an id of the {self.vocab_size}-token vocabulary"
                )

    def _validate_mrope_section(self, path: str) -> None:
        section = self.mrope_section
        if (
            not isinstance(section, tuple)
            or len(section) != 3
            or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in section)
        ):
            raise FieldError(
                path, f"needs three positive integers (time, height, width), got {section!r}"
            )
        if sum(section) != self.head_dim // 2:
            raise FieldError(
                path,
                f"{list(section)} sums to {sum(section)}; it splits the head_dim / 2 = "
                f"{self.head_dim // 2} rotary frequencies",
            )

    # -- sizes
    def q_width(self) -> int:
        """Width of the concatenated query heads (differs from `width` when head_dim is set)."""
        return self.heads * self.head_dim

    def kv_width(self) -> int:
        """Width of the keys (and of the values): one head_dim per key/value head."""
        return self.kv_heads * self.head_dim

    def qkv_width(self) -> int:
        """Output rows of the fused q/k/v projection (rows ordered q, k, v)."""
        return self.q_width() + 2 * self.kv_width()

    # -- parameters
    def attention_params(self) -> int:
        bias = self.qkv_width() if self.qkv_bias else 0
        return self.width * self.qkv_width() + bias + self.q_width() * self.width

    def mlp_params(self) -> int:
        return 3 * self.width * self.mlp_hidden  # gate, up (fused as fc1) and down; no biases

    def block_params(self) -> int:
        return 2 * self.width + self.attention_params() + self.mlp_params()  # two RMSNorms

    def embedding_params(self) -> int:
        return self.vocab_size * self.width

    def head_params(self) -> int:
        """LM head: none of its own when tied to the embedding."""
        return 0 if self.tie_embeddings else self.vocab_size * self.width

    def params(self) -> int:
        return (
            self.embedding_params()
            + self.layers * self.block_params()
            + self.width  # final norm
            + self.head_params()
        )

    # -- FLOPs (2 x multiply-adds, forward, one sequence)
    def block_flops(self, tokens: int) -> int:
        per_token = self.width * self.qkv_width() + self.q_width() * self.width + self.mlp_params()
        attention = 2 * tokens * tokens * self.q_width()  # Q K^T and attention x V, every head
        return 2 * tokens * per_token + 2 * attention

    def forward_flops(self, tokens: int) -> int:
        """Forward FLOPs for one sequence of `tokens` tokens with logits at every position (the
        embedding lookup costs none; the LM head costs the same tied or not)."""
        head = 2 * tokens * self.width * self.vocab_size
        return self.layers * self.block_flops(tokens) + head

    def kv_cache_bytes_per_token(self, bytes_per_element: float) -> float:
        """KV cache: a key and a value of kv_width for every layer."""
        return 2 * self.layers * self.kv_width() * bytes_per_element

    # -- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "") -> DecoderSpec:
        return from_dict(cls, data, path)

    def replace(self, **changes: Any) -> DecoderSpec:
        return dataclasses.replace(self, **changes)
