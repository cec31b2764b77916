"""`--generation-config`: the sampling defaults a request gets for the fields it leaves out.

As in vLLM: "auto" reads the model's generation_config.json, "vllm" uses SamplingParams' own
defaults, any other value is a folder holding a generation_config.json. Only the sampling fields
below are taken; `max_new_tokens` becomes `max_tokens`.
"""
from __future__ import annotations

import json
import os
from typing import Any

from runtime.model_loader.source import ModelSource

# generation_config.json key -> SamplingParams field
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "max_new_tokens": "max_tokens"}


def generation_defaults(setting: str, source: ModelSource) -> dict[str, Any]:
    """SamplingParams fields from the generation config `setting` names (empty for "vllm")."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if source.format == "gguf":
            return _embedded_defaults(source.path)
        folder = source.path
    else:
        folder = setting
        if not os.path.isfile(os.path.join(folder, "generation_config.json")):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                             f"generation_config.json; {setting!r} has none")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {field: data[key] for key, field in SAMPLING_FIELDS.items()
            if data.get(key) is not None}


def _embedded_defaults(gguf_path: str) -> dict[str, Any]:
    """A GGUF file carries no generation config; the embedded default model brings its own."""
    from runtime.default_model import DEFAULT_GENERATION_CONFIG, default_model_path
    try:
        is_default = os.path.samefile(gguf_path, default_model_path())
    except FileNotFoundError:
        is_default = False
    return dict(DEFAULT_GENERATION_CONFIG) if is_default else {}
