"""Models for speculative decoding: targets, and drafts that share their vocabulary."""
from __future__ import annotations

import os

import pytest
import torch


def truncated_copy(model_dir: str, out_dir: str, num_layers: int) -> str:
    """The model with only its first `num_layers` layers: a draft that often agrees with it."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(out_dir)
    for name in os.listdir(model_dir):
        if "token" in name or name.endswith(".txt"):
            os.link(os.path.join(model_dir, name), os.path.join(out_dir, name))
    return out_dir


@pytest.fixture(scope="session")
def target(tiny_model_factory) -> str:
    return tiny_model_factory("LlamaForCausalLM")


@pytest.fixture(scope="session")
def truncated_draft(target, tmp_path_factory) -> str:
    return truncated_copy(target, str(tmp_path_factory.mktemp("truncated")), 1)


@pytest.fixture(scope="session")
def random_draft(tiny_model_factory) -> str:
    return tiny_model_factory("LlamaForCausalLM", seed=1, num_hidden_layers=1, hidden_size=32,
                              num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def bigram_model(tmp_path_factory) -> str:
    """A 512-token model whose attention output is zeroed: the next token depends on the current
    one only, so greedy decoding soon cycles and n-gram proposals are right."""
    from transformers import LlamaForCausalLM

    from runtime.testing.tiny_model import build_tiny_llama
    path = build_tiny_llama(str(tmp_path_factory.mktemp("bigram")))
    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def small_vocab_target(tmp_path_factory) -> str:
    from runtime.testing.tiny_model import build_tiny_llama
    return build_tiny_llama(str(tmp_path_factory.mktemp("small-vocab")))


@pytest.fixture(scope="session")
def small_vocab_draft(small_vocab_target, tmp_path_factory) -> str:
    return truncated_copy(small_vocab_target, str(tmp_path_factory.mktemp("small-draft")), 1)
