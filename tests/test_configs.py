"""Every recipe in configs/ loads, validates and names a model that builds its spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmtrain.config import load_config
from mmtrain.spec import load_spec

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
EXPECTED = {
    "tiny-clip",
    "clip-vit-b-16",
    "siglip-vit-b-16",
    "audio-text",
    "video-text",
    "finetune-clip",
    "vlm-stage1",
    "vlm-stage2",
    "llava-1.5-7b",
    "qwen2.5-vl-7b-docs",
    "qwen2.5-vl-7b-docs-lora",
}
# their comments launch 8 ranks
MULTI_GPU = {
    "siglip-vit-b-16": 8,
    "video-text": 8,
    "vlm-stage1": 8,
    "vlm-stage2": 8,
    "llava-1.5-7b": 8,
    "qwen2.5-vl-7b-docs": 8,
    "qwen2.5-vl-7b-docs-lora": 2,
}


def test_the_recipes_of_the_issue_are_there():
    assert EXPECTED | {"fusion-4modal"} <= {path.stem for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_recipe_loads_and_validates(path):
    config = load_config(path)
    spec = load_spec(config.model)  # a preset or configs/specs/*.yaml, resolved next to the file
    assert set(config.train.towers) <= set(spec.tower_names()), "train.towers names unknown towers"
    config.validate(world_size=MULTI_GPU.get(path.stem, 1))  # the batch splits evenly
    assert path.read_text().startswith("#"), "a recipe opens with what it is for and its data"


def test_fusion_recipe_fuses_four_modalities_into_a_classifier():
    spec = load_spec(load_config(CONFIGS[0].parent / "fusion-4modal.yaml").model)
    assert {t.modality for t in spec.towers.values()} == {"image", "audio", "timeseries", "text"}
    assert spec.fusion is not None and spec.fusion.task == "classify"


ROOT = CONFIGS[0].parent.parent
# Where a recipe's files live, beside configs/ (its paths are relative to the file: `../data/`).
BESIDE_CONFIGS = ("data", "runs", "baselines", "configs/specs")


def _recipe_paths(config) -> list[str]:
    """The file paths of a loaded recipe (absolute after loading): its spec file, `init`, data
    sources, tokenizer and `out`; names (presets, "byte", template names) left out."""
    paths = [config.out]
    if Path(config.model).is_absolute():
        paths.append(config.model)
    init = config.init if isinstance(config.init, dict) else {"": config.init}
    paths += [p for p in init.values() if p]
    for source in [*config.data.train, *(config.data.val or [])]:
        paths += [source.path] if isinstance(source.path, str) else source.path
    if Path(config.data.tokenizer).is_absolute():
        paths.append(config.data.tokenizer)
    return paths


def commented_commands(path: Path) -> list[list[str]]:
    """The `mmtrain ...` commands a recipe's opening comment shows (continuations joined)."""
    import shlex

    lines, pending = [], ""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        pending += line.lstrip("#").strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.startswith(("mmtrain ", "torchrun ")):
            lines.append(shlex.split(pending, comments=True))
        pending = ""
    return lines


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_recipe_paths_are_relative_to_the_file_and_match_its_commands(path):
    """A recipe's paths land beside configs/ (data/, runs/, baselines/), from any directory,
    where the commands of its comment, run from the repository root, write and read them:
    `data build --out DIR` builds its data.train, `eval` / `generate RUN` read its `out`."""
    config = load_config(path)
    for found in _recipe_paths(config):
        where = Path(found).relative_to(ROOT).as_posix()
        assert where.startswith(BESIDE_CONFIGS), f"{path.name}: {found} is not beside configs/"
    sources = {s.path for s in config.data.train if isinstance(s.path, str)}
    written = {config.out}  # the run's folder, and what an earlier command writes (--out)
    for argv in commented_commands(path):
        if argv[1] in ("eval", "generate") and argv[2].startswith("runs/"):
            assert str(ROOT / argv[2]) in written, f"{path.name}: {argv[2]} is not its out"
        if "--out" in argv:
            written.add(str(ROOT / argv[argv.index("--out") + 1]))
        if argv[1:3] == ["data", "build"]:
            built = str(ROOT / argv[argv.index("--out") + 1])
            assert built in sources, f"{path.name}: `{' '.join(argv)}` builds no data.train"
