"""Multi-LoRA against transformers + PEFT: adapters and the base model mixed in one batch."""
from __future__ import annotations

import pytest

from runtime.sampling_params import SamplingParams
from runtime.llm import LLM
from lora_reference import MAX_TOKENS, PROMPTS
from parity import assert_matches_hf

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


def run_mixed(llm: LLM, requests: dict, refs: dict) -> None:
    """Every prompt under the base model and under each adapter, all in one generate call."""
    names = [None, *requests]
    prompts = [{"prompt_token_ids": p} for _ in names for p in PROMPTS]
    loras = [requests.get(n) for n in names for _ in PROMPTS]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for k, name in enumerate(names):
        assert_matches_hf(outputs[k * len(PROMPTS):(k + 1) * len(PROMPTS)], refs[name])


def test_adapters_change_the_output(lora_setup):
    _, _, refs = lora_setup
    for name in ("qv", "all", "mlp"):
        assert [t for t, _ in refs[name]] != [t for t, _ in refs[None]], name


@pytest.fixture(scope="module")
def llm(lora_setup):
    base, _, _ = lora_setup
    return LLM(base, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=3,
               max_lora_rank=16)


def test_mixed_batch_matches_peft(llm, lora_setup):
    _, requests, refs = lora_setup
    run_mixed(llm, requests, refs)


def test_more_adapters_than_slots(lora_setup):
    """One slot and two host copies for three adapters: each step's adapters are swapped in
    (least recently used out) and the tokens stay PEFT's."""
    base, requests, refs = lora_setup
    llm = LLM(base, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=1,
              max_cpu_loras=2, max_lora_rank=16)
    run_mixed(llm, requests, refs)
    manager = llm.engine.core.executor.worker.lora
    assert len(manager.slots) == 1 and len(manager.cpu) == 2


def test_prefix_cache_not_shared_across_adapters(llm, lora_setup):
    _, requests, _ = lora_setup
    prompt = {"prompt_token_ids": list(range(200, 260))}
    params = SamplingParams(temperature=0, max_tokens=1)

    def cached(lora) -> int:
        return llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(requests["qv"]) == 0
    assert cached(requests["mlp"]) == 0  # same tokens, another adapter: nothing shared
    assert cached(None) == 0
    assert cached(requests["qv"]) > 0 and cached(requests["mlp"]) > 0 and cached(None) > 0


def test_tensor_parallel_matches_peft(lora_setup):
    """tp=2: A and B cut like their base layers (B's rows for q/k/v and gate/up, A's columns for
    o and down, whose shrink is all-reduced)."""
    base, requests, refs = lora_setup
    llm = LLM(base, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=3,
              max_lora_rank=16, tensor_parallel_size=2, num_threads=1)
    run_mixed(llm, requests, refs)


def test_pipeline_parallel_matches_peft(lora_setup):
    """pp=2: each stage holds (and reads from the adapter files) its own layers' A and B."""
    base, requests, refs = lora_setup
    llm = LLM(base, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=3,
              max_lora_rank=16, pipeline_parallel_size=2, num_threads=1)
    run_mixed(llm, requests, refs)
