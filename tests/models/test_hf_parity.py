"""Each model family against transformers on the same random weights: greedy tokens and logprobs."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from tests.parity import PROMPTS, assert_matches_hf, hf_greedy

MAX_NEW = 16

CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-tied-llama3-rope": ("LlamaForCausalLM", dict(
        tie_word_embeddings=True, num_key_value_heads=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "llama-linear-rope": ("LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-yarn-rope": ("LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256})),
    "mistral-sliding-window": ("MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
}


# The default CPU backend (native decode kernel) runs every case; the portable one a few.
RUNS = [(case, None) for case in sorted(CASES)] + [
    ("llama-gqa", "torch_paged"), ("mistral-sliding-window", "torch_paged")]


@pytest.mark.parametrize("case,backend", RUNS)
def test_greedy_matches_transformers(case, backend, tiny_model_factory):
    arch, overrides = CASES[case]
    path = tiny_model_factory(arch, **overrides)
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    references = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=64,
              attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(PROMPTS, params), references)
