"""What a hub model computes and keeps at a planned shape, traced without its weights.

The planner (plan/, torch-free) cannot count a transformers class's FLOPs or activations from a
formula: every family lays its modules out its own way. So the model is built on the meta
device (no memory, no weights read) and one training forward runs at the planned shape, the
loss included (`HubModel.forward`, as a run computes it), under
- `torch.utils.flop_counter.FlopCounterMode`: forward FLOPs (2 x multiply-adds) per module,
  summed per tower and per block;
- `torch.autograd.graph.saved_tensors_hooks`: every tensor autograd keeps for the backward,
  deduplicated by storage, parameters left out, counted only when the graph still holds it at
  the end of the forward (as `plan --measure`, train/measure_step.py, counts a real step), and
  attributed to the innermost tower part, block or attention module running when it was saved.

Values on the host. The meta device has shapes, not values, but a VLM's forward reads some:
the image-token mask it scatters the image features into, M-RoPE's positions from the ids
(`get_rope_index`), the vision tower's per-image lengths from its grid. `_HostValues` keeps
integer and boolean tensors real, on the CPU (ids, grids, masks, positions: small), and floats
on the meta device; an op mixing the two runs on the meta device (a boolean index first turned
into the positions it selects, which the meta device can index by). Nothing large is computed.

Inputs: the row holds `shape.images` images, made by the folder's own image processor from a
blank image of the planned size where the folder has one (its pixel budget, tiling and
resizing apply), else from the config's vision settings (a Qwen-style patch grid rounded to
the merge size, or one square image at `vision_config.image_size`); their token count is the
vision tower's own output (`get_image_features`); the rest of the row is text.

The trace runs in float32 (autocast does not run on the meta device): the planner prices the
float elements at the plan's precision (plan/hub.py). Traces are cached per (config, shape,
frozen parts) as JSON under `$MMTRAIN_CACHE/traces/` (default `~/.cache/mmtrain/traces/`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from mmtrain.hub_spec import TRACE_VERSION, HubShape, HubTrace, Saved, TowerTrace
from mmtrain.models.hub.model import HubModel, build_hub_module, hub_spec_of
from mmtrain.models.hub.source import CONFIG_FILE, HubModelError, read_config
from mmtrain.models.hub.towers import HubTower, find_towers

log = logging.getLogger(__name__)

CACHE_ENV = "MMTRAIN_CACHE"
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
ATTENTION_NAMES = ("attn", "attention")  # an attention module's attribute name ends so
FACTORIES = ("arange", "zeros", "ones", "full", "empty", "scalar_tensor", "randint")
NORM_OR_TABLE = (nn.Embedding, nn.LayerNorm, nn.GroupNorm)
SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


# ----------------------------------------------------------------------------- entry point
def trace_hub(
    folder: Path,
    shape: HubShape,
    frozen: tuple[str, ...] = (),
    *,
    preset: bool = False,
    cache: bool = True,
) -> HubTrace:
    """The trace of `folder`'s model at `shape`, with `frozen` parts ("vision", or "text:4" for
    a tower's stem and first 4 blocks) frozen; from the cache when it holds it. `preset`: a
    config-only folder (plan presets), built without the processor files a run needs."""
    frozen = tuple(sorted(frozen))
    path = _cache_path(folder, shape, frozen)
    return cached_trace(path, cache, lambda: _trace(folder, shape, frozen, preset))


def cached_trace(path: Path, cache: bool, trace: Callable[[], HubTrace]) -> HubTrace:
    """The trace kept at `path` when it is readable and of this version, else `trace()`'s,
    kept there (with `cache`)."""
    if cache and path.is_file():
        try:
            cached = HubTrace.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if cached.version == TRACE_VERSION:
                return cached
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.info("trace cache %s unreadable (%s): tracing again", path, err)
    result = trace()
    if cache:
        write_atomic(path, json.dumps(result.to_dict()))
    return result


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "mmtrain"
    return base / "traces"


def _cache_path(folder: Path, shape: HubShape, frozen: tuple[str, ...]) -> Path:
    config = json.dumps(read_config(folder), sort_keys=True)
    # the image processor decides the images' tokens (its pixel budget, tiling)
    for name in PROCESSOR_FILES:
        if (folder / name).is_file():
            config += (folder / name).read_text(encoding="utf-8")
    key = f"{config}|{shape.key()}|{','.join(frozen)}|v{TRACE_VERSION}|torch {torch.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / f"{digest}.json"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- building
def meta_module(folder: Path, preset: bool = False) -> nn.Module:
    """The folder's transformers model on the meta device (float32). A preset folder holds a
    published config.json only: built without the processor files a training run needs."""
    return build_hub_module(folder, device="meta", require_processor=not preset)


# ----------------------------------------------------------------------------- host values
def _is_index_dtype(dtype: torch.dtype | None) -> bool:
    return dtype is not None and not dtype.is_floating_point and not dtype.is_complex


def _meta_of(t: Tensor) -> Tensor:
    if t.device.type == "meta":
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return out


class _HostValues(TorchDispatchMode):
    """Floats on the meta device, integers and booleans real on the CPU (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        device = kwargs.get("device")
        # Integer factories (positions, ranges) and integer copies to the meta device: real.
        if device is not None and torch.device(device).type == "meta":
            wants_int = _is_index_dtype(kwargs.get("dtype"))
            if name in FACTORIES and (wants_int or (name == "arange" and kwargs.get("dtype") is None
                                                    and _int_args(args))):  # fmt: skip
                return func(*args, **{**kwargs, "device": torch.device("cpu")})
            if name == "_to_copy" and isinstance(args[0], Tensor):
                dtype = kwargs.get("dtype") or args[0].dtype
                if args[0].device.type == "cpu" and _is_index_dtype(dtype):
                    return func(*args, **{**kwargs, "device": torch.device("cpu")})
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        if any(t.device.type == "meta" for t in tensors) and any(
            t.device.type != "meta" for t in tensors
        ):
            if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
                args = (args[0], _positions(args[1]), *args[2:])
            args, kwargs = tree_map(lambda x: _meta_of(x) if isinstance(x, Tensor) else x,
                                    (args, kwargs))  # fmt: skip
        return func(*args, **kwargs)


def _int_args(args: tuple) -> bool:
    return all(isinstance(a, int) or (isinstance(a, Tensor) and _is_index_dtype(a.dtype))
               for a in args)  # fmt: skip


def _positions(indices: list) -> list:
    """Real boolean indices as the positions they select, one index per dimension they cover
    (what the meta device can index by)."""
    out: list = []
    for index in indices:
        if isinstance(index, Tensor) and index.device.type != "meta" and index.dtype == torch.bool:
            out += list(index.nonzero(as_tuple=True))
        else:
            out.append(index)
    return out


class FlashOnMeta(TorchFunctionMode):
    """Scaled dot-product attention on the meta device through the flash kernel's op, as the
    CPU and CUDA run it (q, k, v, output and fp32 log-sum-exp kept; grouped k and v as they
    are): the meta device would otherwise take the math path, which keeps the [s, s] scores."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        # by position or by name (diffusers passes query=, key=, value=)
        extra = dict(zip(SDPA_ARGUMENTS, args, strict=False))
        extra.update({n: kwargs[n] for n in SDPA_ARGUMENTS if n in kwargs})
        q, k, v = extra["query"], extra["key"], extra["value"]
        if q.device.type == "meta":
            mask = extra.get("attn_mask")
            if mask is not None and mask.dtype == torch.bool:  # as SDPA does: an additive mask
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, extra.get("dropout_p", 0.0), extra.get("is_causal", False),
                attn_mask=mask, scale=extra.get("scale"),
            )  # fmt: skip
            return out
        return func(*args, **kwargs)


def _flash_cpu_flops(query_shape, key_shape, value_shape, *_args, **_kwargs) -> int:  # noqa: ANN001
    """The CPU flash kernel's FLOPs (torch's counter has no formula for it): q k^T and the
    weighted sum of v, 2 x multiply-adds each, over every query head and key (the causal half
    included, as spec.py counts attention)."""
    b, heads, queries, dim = query_shape
    keys, value_dim = key_shape[-2], value_shape[-1]
    return 2 * b * heads * queries * keys * (dim + value_dim)


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, knowing the CPU flash attention kernel too."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return FlopCounterMode(display=False, custom_mapping={flash: _flash_cpu_flops})


# ----------------------------------------------------------------------------- inputs
def row_inputs(folder: Path, hf: nn.Module, shape: HubShape) -> tuple[dict[str, Tensor], int]:
    """One row at `shape` as the model's forward takes it, and the image tokens it holds."""
    config = hf.config
    vision = _vision_inputs(folder, hf, shape) if shape.images else {}
    image_tokens = _image_tokens(hf, vision) if vision else 0
    ids = _row_ids(config, shape, image_tokens)
    accepts = set(inspect.signature(_inner(hf).forward).parameters)
    batch: dict[str, Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    image = _image_token_id(config)
    for name in ("mm_token_type_ids", "token_type_ids"):
        if name in accepts and image is not None:
            batch[name] = (ids == image).long()
    batch.update(vision)
    labels = ids.clone()
    if image is not None:
        labels[ids == image] = -100
    batch["labels"] = labels
    return batch, image_tokens


def _inner(hf: nn.Module) -> nn.Module:
    return getattr(hf, hf.base_model_prefix, getattr(hf, "model", hf))


def _image_token_id(config: Any) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def _row_ids(config: Any, shape: HubShape, image_tokens: int) -> Tensor:
    """Each image's placeholder run (inside the vision start/end ids where the config has
    them), then text to `shape.positions`."""
    image = _image_token_id(config)
    start, end = (
        getattr(config, n, None) for n in ("vision_start_token_id", "vision_end_token_id")
    )
    per_image = image_tokens // max(shape.images, 1)
    ids: list[int] = []
    for _ in range(shape.images):
        ids += ([start] if start is not None else []) + [image] * per_image
        ids += [end] if end is not None else []
    if len(ids) + 2 > shape.positions:
        raise HubModelError(
            "--context",
            f"{shape.positions} positions cannot hold {shape.images} image(s) of {per_image} "
            f"tokens and a target; give at least {len(ids) + 2} (or fewer or smaller images)",
        )
    text = _filler_id(config)
    ids += [text] * (shape.positions - len(ids))
    return torch.tensor([ids], dtype=torch.long)


def _filler_id(config: Any) -> int:
    """A text id no special-token field of the config names."""
    special = {int(v) for k, v in _config_items(config) if k.endswith("token_id")
               and isinstance(v, int)}  # fmt: skip
    vocab = int(config.get_text_config().vocab_size)
    return next(i for i in range(vocab - 1, -1, -1) if i not in special)


def _config_items(config: Any) -> Iterator[tuple[str, Any]]:
    yield from config.to_dict().items()
    yield from config.get_text_config().to_dict().items()


def _vision_inputs(folder: Path, hf: nn.Module, shape: HubShape) -> dict[str, Tensor]:
    processor = _image_processor(folder)
    if processor is not None:
        from PIL import Image

        image = Image.new("RGB", (shape.image_width, shape.image_height), (128, 128, 128))
        out = processor(images=[[image] * shape.images], return_tensors="pt")
        accepts = set(inspect.signature(_inner(hf).forward).parameters)
        return {k: v for k, v in out.items() if k in accepts and isinstance(v, Tensor)}
    return _config_vision_inputs(hf.config, shape)


def _image_processor(folder: Path):  # noqa: ANN202 - transformers' image processor or None
    if not any((folder / f).is_file() for f in PROCESSOR_FILES):
        return None
    import transformers

    try:
        return transformers.AutoImageProcessor.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, ImportError) as err:
        log.info("%s: no image processor (%s); images from the config's vision settings",
                 folder, err)  # fmt: skip
        return None


def _config_vision_inputs(config: Any, shape: HubShape) -> dict[str, Tensor]:
    """Images made from the config alone: a Qwen-style flattened patch grid (the size rounded
    to the patch x merge size, as the processor's resize does), or square images at the
    vision tower's `image_size`."""
    vc = config.vision_config
    channels = int(getattr(vc, "in_channels", getattr(vc, "num_channels", 3)))
    if hasattr(vc, "spatial_merge_size") and hasattr(vc, "temporal_patch_size"):
        p, merge, tp = int(vc.patch_size), int(vc.spatial_merge_size), int(vc.temporal_patch_size)
        factor = p * merge
        h = max(factor, round(shape.image_height / factor) * factor)
        w = max(factor, round(shape.image_width / factor) * factor)
        grid = [1, h // p, w // p]
        patches = shape.images * grid[1] * grid[2]
        return {
            "pixel_values": torch.empty(patches, channels * tp * p * p, device="meta"),
            "image_grid_thw": torch.tensor([grid] * shape.images, dtype=torch.long),
        }
    size = vc.image_size
    size = size if isinstance(size, int) else int(size[0])
    return {"pixel_values": torch.empty(shape.images, channels, size, size, device="meta")}


def _image_tokens(hf: nn.Module, vision: dict[str, Tensor]) -> int:
    """Language-model positions the images fill: the rows of the vision tower's output."""
    with torch.no_grad(), _HostValues():
        out = hf.get_image_features(**vision)
    features = getattr(out, "pooler_output", out)
    leaves = [t for t in tree_flatten(features)[0] if isinstance(t, Tensor)]
    return sum(t.numel() // t.shape[-1] for t in leaves)


# ----------------------------------------------------------------------------- the trace
def _trace(folder: Path, shape: HubShape, frozen: tuple[str, ...], preset: bool) -> HubTrace:
    hf = meta_module(folder, preset)
    spec = hub_spec_of(folder, str(folder), hf)
    model = HubModel(spec, hf)
    towers = model.towers
    _freeze(towers, frozen)
    batch, image_tokens = row_inputs(folder, hf, shape)
    recorder = Recorder(model, towers)
    flops = flop_counter()
    with recorder.attributing(), flops, _HostValues(), FlashOnMeta():
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            out = model(batch)
        held = recorder.held()  # while `out` (the graph) is alive
    reached = reached_parameters(out["nll_sum"])
    del out
    counts = flops_by_module(flops, model)
    traced = tuple(
        replace(
            _tower_trace(name, tower, held, counts, recorder, hf),
            unused_params=sum(
                p.numel() for p in tower.parameters() if p.requires_grad and id(p) not in reached
            ),
        )  # fmt: skip
        for name, tower in towers.items()
    )
    return HubTrace(architecture=type(hf).__name__, shape=shape, towers=traced,
                    image_tokens=image_tokens, vocab_size=spec.hub.vocab_size,
                    frozen=frozen)  # fmt: skip


def reached_parameters(loss: Tensor) -> set[int]:
    """Ids of the parameters the loss's gradient reaches (a pooling head the loss does not
    read runs in the forward but gets no gradient, hence no optimizer state)."""
    reached: set[int] = set()
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def _freeze(towers: dict[str, HubTower], frozen: tuple[str, ...]) -> None:
    for part in frozen:
        name, _, count = part.partition(":")
        if name not in towers:
            raise HubModelError("towers", f"no tower {name!r}; towers: {', '.join(towers)}")
        tower = towers[name]
        if not count:
            tower.requires_grad_(False)
            continue
        for module in [tower.embed, *list(tower.blocks)[: int(count)]]:
            for param in module.parameters():
                param.requires_grad_(False)


class Recorder:
    """Saved tensors by storage, with where they were saved: (tower, block, in attention)."""

    def __init__(self, model: nn.Module, towers: dict[str, HubTower]):
        self.params = {_key(p) for p in model.parameters()}
        self.saved: dict[int, tuple[Tensor, tuple, StorageWeakRef]] = {}
        self.where: list[tuple] = []
        self.towers = towers
        self.block_inputs: dict[str, list[Tensor]] = {n: [] for n in towers}
        self.shared: dict[str, dict[int, Tensor]] = {n: {} for n in towers}
        self.attention_inputs: dict[str, list[Tensor]] = {n: [] for n in towers}

    def pack(self, t: Tensor) -> Tensor:
        key = _key(t)
        if key not in self.params and (key not in self.saved or self.saved[key][2].expired()):
            where = self.where[-1] if self.where else ("text", None, False)
            self.saved[key] = (t, where, StorageWeakRef(t.untyped_storage()))
        return t

    def held(self) -> list[tuple[Tensor, tuple]]:
        return [(t, where) for t, where, ref in self.saved.values() if not ref.expired()]

    @contextmanager
    def attributing(self) -> Iterator[None]:
        handles = []
        for name, tower in self.towers.items():
            for part in tower.parts.values():
                handles += self._hooks(part, (name, None, False))
            for i, block in enumerate(tower.blocks):
                handles += self._hooks(block, (name, i, False), block_of=name)
                attention = _attention_module(block)
                if attention is not None:
                    handles += self._hooks(attention, (name, i, True), attention_of=name)
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hooks(self, module: nn.Module, where: tuple, block_of: str | None = None,
               attention_of: str | None = None) -> list:  # fmt: skip
        def pre(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            self.where.append(where)
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            if block_of is not None and tensors:
                self.block_inputs[block_of].append(tensors[0])
                for t in tensors[1:]:
                    self.shared[block_of].setdefault(_key(t), t)
            if attention_of is not None and tensors:
                self.attention_inputs[attention_of].append(tensors[0])

        def post(_m: nn.Module, _args: tuple, _kwargs: dict, _out: Any) -> None:
            self.where.pop()

        return [module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, with_kwargs=True)]  # fmt: skip


def _key(t: Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _attention_module(block: nn.Module) -> nn.Module | None:
    """A block's (first) attention module: `self_attn`, `attn`, or diffusers' `attn1` (a Wan
    block's self-attention, before its cross-attention `attn2`)."""
    for name, child in block.named_children():
        if name.lower().rstrip("0123456789").endswith(ATTENTION_NAMES):
            return child
    return None


def saved_of(tensors: list[Tensor]) -> Saved:
    floats = other = 0
    seen: set[int] = set()
    for t in tensors:
        key = _key(t)
        if key in seen:
            continue
        seen.add(key)
        nbytes = t.untyped_storage().nbytes()
        if t.dtype.is_floating_point:
            floats += nbytes // t.element_size()
        else:
            other += nbytes
    return Saved(floats, other)


def flops_by_module(flops: FlopCounterMode, root: nn.Module) -> dict[str, int]:
    """Forward FLOPs by the module's qualified name in `root` ("" for everything)."""
    prefix = type(root).__name__
    out = {}
    for name, by_op in flops.get_flop_counts().items():
        total = int(sum(by_op.values()))
        if name == "Global":
            out[""] = total
        elif name.startswith(prefix + "."):
            out[name[len(prefix) + 1 :]] = total
    return out


def _tower_trace(
    name: str,
    tower: HubTower,
    held: list[tuple[Tensor, tuple]],
    counts: dict[str, int],
    recorder: Recorder,
    hf: nn.Module,
) -> TowerTrace:
    blocks = len(tower.blocks)
    mine = [(t, w) for t, w in held if w[0] == name]
    block_saved = tuple(saved_of([t for t, w in mine if w[1] == i]) for i in range(blocks))
    attention = tuple(saved_of([t for t, w in mine if w[1] == i and w[2]]) for i in range(blocks))
    outside = saved_of([t for t, w in mine if w[1] is None])
    names = {id(m): n for n, m in hf.named_modules()}
    block_flops = tuple(counts.get(f"hf.{names[id(b)]}", 0) for b in tower.blocks)
    if name == "text":  # the loss's head matmuls run outside any module: the rest is text's
        other = sum(counts.get(f"hf.{p}", 0) for t in recorder.towers.values() if t is not tower
                    for p in t.parts)  # fmt: skip
        forward = counts.get("", 0) - other
    else:
        forward = sum(counts.get(f"hf.{p}", 0) for p in tower.parts)
    inputs = recorder.block_inputs[name]
    attn_inputs = recorder.attention_inputs[name]
    first = tower.blocks[0] if blocks else None
    return TowerTrace(
        name=name,
        tokens=tokens_of(inputs[0]) if inputs else 0,
        forward_flops=forward,
        block_flops=block_flops,
        block_saved=block_saved,
        attention_saved=attention,
        attention_input=attn_inputs[0].numel() if attn_inputs else 0,
        block_input=inputs[0].numel() if inputs else 0,
        shared_inputs=saved_of(list(recorder.shared[name].values())),
        outside=outside,
        params=sum(p.numel() for p in tower.parameters()),
        block_params=sum(p.numel() for p in first.parameters()) if first is not None else 0,
        stem_params=sum(p.numel() for p in tower.embed.parameters()),
        norm_params=_norm_params(tower),
        linears=_linears(first) if first is not None else (),
        **_shape_of(first, inputs),
    )


def tokens_of(hidden: Tensor) -> int:
    """Sequence length of a block's hidden-state input ([batch, seq, width] or [seq, width])."""
    return hidden.shape[-2] * (hidden.shape[0] if hidden.dim() == 3 else 1)


def _norm_params(tower: HubTower) -> int:
    """Parameters of norms and embedding tables (held in fp32 when frozen under autocast)."""
    total = 0
    for module in tower.modules():
        if isinstance(module, NORM_OR_TABLE) or "norm" in type(module).__name__.lower():
            total += sum(p.numel() for p in module.parameters(recurse=False))
    return total


def _linears(block: nn.Module) -> tuple[tuple[str, int, int], ...]:
    attention = _attention_module(block)
    inside = {id(m) for m in attention.modules()} if attention is not None else set()
    return tuple(("attn" if id(m) in inside else "mlp", m.out_features, m.in_features)
                 for m in block.modules() if isinstance(m, nn.Linear))  # fmt: skip


def _shape_of(block: nn.Module | None, inputs: list[Tensor]) -> dict[str, int]:
    """Width, heads and MLP width of a block, from its modules and config (for the planner's
    per-block communication and selective-checkpointing FLOPs)."""
    if block is None or not inputs:
        return {}
    width = int(inputs[0].shape[-1])
    attention = _attention_module(block)
    cfg = getattr(attention, "config", None)
    heads = _first_int(attention, cfg, ("num_heads", "num_attention_heads"))
    kv = _first_int(attention, cfg, ("num_key_value_heads", "num_kv_heads")) or heads
    head_dim = _first_int(attention, cfg, ("head_dim",)) or (width // heads if heads else 0)
    linears = _linears(block)
    mlp = max((max(o, i) for g, o, i in linears if g == "mlp"), default=0)
    return {"width": width, "heads": heads, "kv_heads": kv, "head_dim": head_dim,
            "mlp_hidden": mlp}  # fmt: skip


def _first_int(module: nn.Module | None, cfg: Any, names: tuple[str, ...]) -> int:
    for source in (module, cfg):
        for n in names:
            value = getattr(source, n, None)
            if isinstance(value, int) and value > 0:
                return value
    return 0


# ----------------------------------------------------------------------------- measured
def measure_hub_step(
    folder: Path, shape: HubShape, frozen: tuple[str, ...] = (), seed: int = 0
) -> dict[str, int]:
    """One real training forward and backward of `folder`'s model on the CPU in float32, at
    `shape`, with random weights and the same row as the trace: the bytes autograd keeps
    (deduplicated by storage, parameters left out, held at the end of the forward), the
    forward FLOPs torch's counter counts, and the parameters that got a gradient; what
    `plan --measure` sets beside a hub model's plan."""
    torch.manual_seed(seed)
    hf = build_hub_module(folder, device="cpu")
    spec = hub_spec_of(folder, str(folder), hf)
    model = HubModel(spec, hf)
    _freeze(model.towers, frozen)
    batch, _ = row_inputs(folder, hf, shape)
    generator = torch.Generator().manual_seed(seed)
    batch = {k: torch.randn(v.shape, generator=generator) if v.device.type == "meta" else v
             for k, v in batch.items()}  # fmt: skip
    recorder = Recorder(model, model.towers)
    flops = flop_counter()
    with flops, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        out = model(batch)
    held = recorder.held()
    saved = saved_of([t for t, _ in held])
    forward_flops = int(flops.get_total_flops())
    out["nll_sum"].backward()
    del out
    trained = [p for p in model.parameters() if p.grad is not None]
    optimizer = torch.optim.AdamW(trained, lr=0.0)
    optimizer.step()
    states = [v for state in optimizer.state.values() for v in state.values()
              if isinstance(v, Tensor) and v.dim() > 0]  # fmt: skip
    held = [*model.parameters(), *(p.grad for p in trained), *states]
    return {
        "activations_bytes": saved.bytes(4),
        "float_elements": saved.floats,
        "other_bytes": saved.other_bytes,
        "forward_flops": forward_flops,
        "model_state_bytes": saved_of(held).bytes(4),
        "trainable_params": sum(p.numel() for p in trained),
        "optimizer_state_params": sum(p.numel() for p in optimizer.state),
    }


# ----------------------------------------------------------------------------- for the planner
def resolved_folder(model: str, folder: Path, preset: bool) -> Path:
    """The local folder of `--model` (a hub name resolved through the Hugging Face cache)."""
    if preset or (folder / CONFIG_FILE).is_file():
        return folder
    from mmtrain.models.hub.source import resolve_folder

    return resolve_folder(model, key="--model")


def has_vision(folder: Path) -> bool:
    """Whether the config describes a vision tower (read from config.json, no build)."""
    return isinstance(read_config(folder, "--model").get("vision_config"), dict)


def tower_blocks(folder: Path, preset: bool) -> dict[str, int]:
    """Blocks of each tower, from a meta-device build."""
    return {name: len(t.blocks) for name, t in find_towers(meta_module(folder, preset)).items()}


def traced_for_plan(
    model: str, folder: Path, preset: bool, shape_of: Any, frozen_of: Any
) -> HubTrace:
    """The trace `mmtrain plan --model` plans from: `shape_of(towers)` and `frozen_of(blocks)`
    give the row and the frozen parts (the towers from the config, the blocks from a build
    only when the frozen parts need them)."""
    folder = resolved_folder(model, folder, preset)
    if not preset:
        from mmtrain.models.hub.source import model_class

        model_class(folder, key="--model")  # the refusals a run would give, before any trace
    towers = ("vision", "text") if has_vision(folder) else ("text",)
    shape = shape_of(towers)
    frozen = frozen_of(_LazyBlocks(folder, preset, towers))
    return trace_hub(folder, shape, frozen, preset=preset)


class _LazyBlocks(dict):
    """{tower: blocks}, built on first look (a meta build: seconds for a large model)."""

    def __init__(self, folder: Path, preset: bool, towers: tuple[str, ...]):
        super().__init__({name: 0 for name in towers})
        self._source, self._built = (folder, preset), False

    def get(self, key: str, default: Any = None) -> Any:
        if not self._built:
            self.update(tower_blocks(*self._source))
            self._built = True
        return super().get(key, default)
