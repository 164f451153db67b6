"""MultimodalModel: the towers of a `ModelSpec`, the contrastive temperature, an optional fusion
head; plus `create_model`, `save_model` and `load_model`.

A model folder (run folder or converted checkpoint) holds exactly two files: `model.safetensors`
(the state dict) and `spec.yaml` (the `ModelSpec`). Both are written atomically.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from mmtrain.atomic import atomic_write_bytes, atomic_write_text
from mmtrain.models.heads import FusionHead
from mmtrain.models.towers import Tower
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError

WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "spec.yaml"

_NORMS = (nn.LayerNorm, nn.RMSNorm)


class ModelFileError(FieldError):
    """A model file exists but cannot be used (corrupt, or keys/shapes that do not fit the spec)."""

    def __init__(self, file: str | Path, message: str):
        super().__init__(str(file), message)


class MultimodalModel(nn.Module):
    """Towers by name (the batch keys), `logit_scale` / `logit_bias` for the contrastive loss,
    and an optional `fusion` head over the towers' token sequences."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.towers = nn.ModuleDict(
            {name: Tower(tower, spec.embed_dim) for name, tower in spec.towers.items()}
        )
        if spec.pairs:
            self.logit_scale = nn.Parameter(torch.tensor(float(spec.logit_scale_init)))
        if spec.logit_bias_init is not None:
            self.logit_bias = nn.Parameter(torch.tensor(float(spec.logit_bias_init)))
        self.fused = spec.fused_towers()
        self.fusion = None
        if spec.fusion is not None:
            widths = {name: spec.towers[name].width for name in self.fused}
            self.fusion = FusionHead(spec.fusion, widths)

    def _present(self, batch: Mapping[str, torch.Tensor]) -> list[str]:
        names = [name for name in self.towers if name in batch]
        if not names:
            raise KeyError(
                f"the batch has none of this model's towers ({', '.join(self.towers)}); "
                f"batch keys: {', '.join(map(str, batch)) or 'none'}"
            )
        return names

    def encode(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """L2-normalised embeddings [B, embed_dim] for every tower whose name is a batch key
        (other keys, such as labels, are ignored)."""
        return {
            name: F.normalize(self.towers[name](batch[name]), dim=-1)
            for name in self._present(batch)
        }

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`encode(batch)`, plus "fusion" -> [B, num_outputs] when the model has a fusion head and
        every fused tower is in the batch (each tower runs once for both)."""
        out: dict[str, torch.Tensor] = {}
        memory: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name in self._present(batch):
            tower, x = self.towers[name], batch[name]
            tokens = tower.forward_tokens(x)
            out[name] = F.normalize(tower.pool_and_project(tokens, x), dim=-1)
            if name in self.fused:
                memory[name] = (tokens, tower.token_mask(x))
        if self.fusion is not None and all(name in memory for name in self.fused):
            out["fusion"] = self.fusion(memory)
        return out

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Random init: linear, conv, embedding weights and learned tokens ~ N(0, 0.02), position
        embeddings ~ N(0, 0.01), biases 0, norms 1/0, `logit_scale`/`logit_bias` from the spec.

        Values are drawn on the CPU from `generator` in parameter order and copied, so the same
        generator state gives the same weights on any device.
        """
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, _NORMS):
                    param.fill_(1.0 if name == "weight" else 0.0)
                elif module is self:
                    init = (
                        self.spec.logit_scale_init
                        if name == "logit_scale"
                        else self.spec.logit_bias_init
                    )
                    param.fill_(float(init))
                elif name == "bias":
                    nn.init.zeros_(param)
                else:
                    std = 0.01 if name.startswith("pos_") else 0.02
                    _normal_(param, std, generator)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute derived (non-persistent) buffers such as the audio stem's mel filterbank."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()


def _normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill `param` with N(0, std) drawn on the CPU in float32 (in place when it lives there)."""
    if param.device.type == "cpu" and param.dtype == torch.float32:
        param.normal_(0.0, std, generator=generator)
    else:
        param.copy_(torch.empty(param.shape).normal_(0.0, std, generator=generator))


def create_model(
    name_or_spec: str | Path | ModelSpec,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> MultimodalModel:
    """A randomly initialised model from a preset name, a spec file or a `ModelSpec`.

    `device="meta"` builds without memory or init (instant, for counting and planning). The
    initialisation is a pure function of `seed`, whatever the device.
    """
    spec = load_spec(name_or_spec)
    device = torch.device(device) if device is not None else torch.device("cpu")
    # Build on the meta device (no memory, no default init), then allocate once and init once.
    with torch.device("meta"):
        model = MultimodalModel(spec)
    if device.type != "meta":
        model = model.to_empty(device=device)
        model.init_weights(torch.Generator().manual_seed(seed))
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def _unwrap(model: nn.Module) -> MultimodalModel:
    """The MultimodalModel inside torch.compile / DDP wrappers."""
    while not isinstance(model, MultimodalModel):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None:
            raise TypeError(f"expected a MultimodalModel, got {type(model).__name__}")
        model = inner
    return model


def save_model(model: nn.Module, directory: str | Path) -> Path:
    """Write `directory/model.safetensors` and `directory/spec.yaml` (each atomically).

    Returns the folder. Tensors are saved as they are (dtype kept), moved to the CPU.
    """
    model = _unwrap(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    weights = safetensors.torch.save(state, metadata={"format": "pt"})
    atomic_write_bytes(directory / WEIGHTS_FILE, weights)
    atomic_write_text(directory / SPEC_FILE, yaml.safe_dump(model.spec.to_dict(), sort_keys=False))
    return directory


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor], source: str | Path
) -> None:
    """Raise ModelFileError listing missing, unexpected and mis-shaped keys of `state`."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    mis_shaped = sorted(
        f"{k} {list(state[k].shape)} (model: {list(expected[k])})"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if mis_shaped:
        problems.append(f"mis-shaped keys: {_listing(mis_shaped)}")
    if problems:
        raise ModelFileError(
            source,
            "weights do not fit the spec; "
            + "; ".join(problems)
            + ". Was it saved from a different model?",
        )


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> MultimodalModel:
    """Load a model folder (run folder or converted checkpoint: model.safetensors + spec.yaml),
    or the path of its model.safetensors. Raises FileNotFoundError naming a missing file and
    ModelFileError for a corrupt file or weights that do not fit the spec."""
    path = Path(path)
    folder = path.parent if path.is_file() and path.suffix == ".safetensors" else path
    weights_path = path if folder is not path else folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    for needed in (folder / SPEC_FILE, weights_path):
        if not needed.is_file():
            raise FileNotFoundError(
                f"{needed} is missing: a model folder holds {WEIGHTS_FILE} and {SPEC_FILE} "
                "(written by mmtrain.save_model, a training run or `mmtrain convert`)"
            )
    spec = ModelSpec.load(folder / SPEC_FILE)
    try:
        state = safetensors.torch.load_file(weights_path, device="cpu")
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise ModelFileError(
            weights_path,
            f"is not a readable safetensors file ({err}); it may be truncated or corrupt",
        ) from None
    with torch.device("meta"):
        model = MultimodalModel(spec)
    check_state_dict(model, state, weights_path)
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_buffers()
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model
