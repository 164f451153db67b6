"""Where a Hugging Face folder keeps its chat template, read by the data (the template a run
trains with) and by the export (the template it carries): torch-free, for both layers."""

from __future__ import annotations

from typing import Any


def stored_chat_template(config: dict[str, Any]) -> str | None:
    """The chat template a tokenizer_config.json holds: its `chat_template` string, or of a
    list of named templates the one named `default` (transformers' rule); None without one."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None
