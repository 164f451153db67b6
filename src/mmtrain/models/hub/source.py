"""Where a hub model comes from: a user's folder or a name in the Hugging Face cache, and the
transformers class that builds it.

`resolve_folder("org/name")` finds the snapshot through huggingface_hub, as transformers would
(downloading it when online; `HF_HUB_OFFLINE=1` reads the cache only), and the errors name the
cache folder looked in. `model_class(folder)` is the transformers class the folder's config
builds: an image-text-to-text model (a VLM) or a causal LM, refused with the reason and what to
do where mmtrain cannot train it yet (a class transformers does not build from a config, a
mixture-of-experts model, a VLM folder without its processor files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmtrain.model_sources import HF_CONFIG_FILE as CONFIG_FILE
from mmtrain.model_sources import HubModelError, read_json_object, resolve_folder

__all__ = ["CONFIG_FILE", "HubModelError", "model_class", "read_config", "resolve_folder"]

# Files of a VLM folder's processor: its image processor's settings, or the processor's own.
PROCESSOR_CONFIGS = ("preprocessor_config.json", "processor_config.json")
TOKENIZER_CONFIGS = ("tokenizer.json", "tokenizer_config.json")
# Config fields that make a model a mixture of experts (transformers' names across families).
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def read_config(folder: Path, key: str = "init") -> dict[str, Any]:
    return read_json_object(folder / CONFIG_FILE, key)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's section of a VLM config (the config itself for a causal LM)."""
    for name in ("text_config", "llm_config", "language_config"):
        if isinstance(config.get(name), dict):
            return config[name]
    return config


def model_class(folder: Path, key: str = "init", *, require_processor: bool = True) -> type:
    """The transformers class that builds `folder`'s model from its config: the class an
    image-text-to-text or a causal-LM auto class maps the config to. Refuses what mmtrain
    cannot train yet, with the reason and what to do; a VLM folder without its processor
    files too, unless `require_processor` is False (a config-only preset the planner reads)."""
    import transformers
    from transformers.models.auto import modeling_auto

    config = read_config(folder, key)
    _refuse_experts(config, folder, key)
    try:
        hf_config = transformers.AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, OSError) as err:
        raise HubModelError(
            key,
            f"{folder / CONFIG_FILE}: transformers {transformers.__version__} cannot read it "
            f"({err}); a newer transformers may know model_type {config.get('model_type')!r}",
        ) from None
    for mapping, auto in (
        (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "image-text-to-text"),
        (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal LM"),
    ):
        name = mapping.get(hf_config.model_type)
        if name is not None:
            cls = getattr(transformers, name, None)
            if cls is not None:
                if auto == "image-text-to-text" and require_processor:
                    _require_processor(folder, key)
                return cls
    raise HubModelError(
        key,
        f"{folder / CONFIG_FILE}: model_type {hf_config.model_type!r} "
        f"({', '.join(config.get('architectures') or ['no architectures'])}) is neither an "
        "image-text-to-text model nor a causal LM that transformers builds from a config; "
        "mmtrain trains those (and its native CLIP / SigLIP, LLaVA, Qwen2-VL families)",
    )


def _refuse_experts(config: dict[str, Any], folder: Path, key: str) -> None:
    section = text_config(config)
    experts = next((section[f] for f in EXPERT_FIELDS if section.get(f)), None)
    if experts:
        raise HubModelError(
            key,
            f"{folder / CONFIG_FILE}: a mixture-of-experts model ({experts} experts): not yet "
            "(mmtrain has no expert parallelism, and FSDP alone would gather every expert in "
            "every layer); train a dense model of the family",
        )


def _require_processor(folder: Path, key: str) -> None:
    missing = []
    if not any((folder / f).is_file() for f in PROCESSOR_CONFIGS):
        missing.append(" or ".join(PROCESSOR_CONFIGS))
    if not any((folder / f).is_file() for f in TOKENIZER_CONFIGS):
        missing.append(" or ".join(TOKENIZER_CONFIGS))
    if missing:
        raise HubModelError(
            key,
            f"{folder} has no {' and no '.join(missing)}: a vision-language model's inputs are "
            "made by its own processor; copy the processor files of the model's release into "
            "the folder (processor.save_pretrained(folder))",
        )
