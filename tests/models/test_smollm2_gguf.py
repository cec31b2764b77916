"""The embedded default model (SmolLM2-135M-Instruct, a real Q4_1 GGUF) against transformers,
which loads the same GGUF dequantized: same greedy tokens and logprobs."""
from __future__ import annotations

import os

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.default_model import default_model_path
from tests.parity import assert_matches_hf, hf_greedy

MAX_NEW = 16
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.", "Hi"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory="256MiB")


def test_greedy_matches_transformers_on_real_weights(llm):
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    references = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(prompts, params), references)


def test_default_model_answers_sensibly(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"
