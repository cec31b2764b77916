"""Maps a Hugging Face architecture name to our implementation, plugins' additions included."""
from __future__ import annotations

import importlib
from typing import Any

from runtime.plugins.manager import get_plugin_manager

_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": "runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "runtime.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "runtime.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "runtime.models.qwen:Qwen3ForCausalLM",
}


def supported_architectures() -> dict[str, Any]:
    """Built-in architectures, then every plugin's `runtime_register_models` answer on top."""
    table: dict[str, Any] = dict(_BUILTIN)
    for answer in get_plugin_manager().hook.runtime_register_models():
        table.update(answer or {})
    return table


def resolve_model_class(architectures: list[str] | None) -> type:
    """The class for the first supported name in config.json's `architectures`."""
    table = supported_architectures()
    for name in architectures or []:
        if name in table:
            entry = table[name]
            if isinstance(entry, str):
                module, _, attr = entry.partition(":")
                entry = getattr(importlib.import_module(module), attr)
            return entry
    raise ValueError(f"model architecture {architectures} is not supported; "
                     f"supported: {', '.join(sorted(table))}")
