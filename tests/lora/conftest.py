"""The tiny base model and its adapters, built once per session."""
from __future__ import annotations

import os

import pytest

from lora_reference import ADAPTERS, peft_greedy, save_adapter
from runtime.lora import LoRARequest
from runtime.testing.tiny_model import build_tiny_llama


@pytest.fixture(scope="session")
def lora_setup(tmp_path_factory):
    """(base folder, {name: LoRARequest}, {name or None: reference outputs per prompt})."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llama(str(root / "base"))
    requests, refs = {}, {None: peft_greedy(base, None)}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        path = save_adapter(base, os.path.join(root, name), seed=10 + i, **kwargs)
        requests[name] = LoRARequest(name, i + 1, path)
        refs[name] = peft_greedy(base, path)
    return base, requests, refs
