"""Scheduling choices must not change what is generated: the same greedy tokens with and without
chunked prefill, with and without prefix caching, with concurrent partial prefills, under
preemption, and under both policies."""
from __future__ import annotations

import pytest
import torch
import transformers

from runtime import LLM, SamplingParams
from tests.parity import PROMPTS, hf_greedy

MAX_NEW = 24
# Prompts that share long prefixes, so prefix caching has something to find.
SHARED = list(range(2000, 2040))
PREFIX_PROMPTS = PROMPTS + [SHARED + [5, 6, 7], SHARED + [8], SHARED[:33] + [9, 9]]

# K and V x 2 layers x 16 tokens x 2 KV heads x head size 32 x 4 bytes (float32)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 32 * 4
VARIANTS = {
    "default": dict(),
    "chunked-prefill-7": dict(max_num_batched_tokens=7),
    "no-chunked-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=128),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "block-size-4": dict(block_size=4),
    "priority": dict(scheduling_policy="priority"),
    # two prompts share each step's 32 tokens; long ones (over 20 left) one at a time
    "partial-prefills": dict(max_num_batched_tokens=32, max_num_partial_prefills=2,
                             max_long_partial_prefills=1, long_prefill_token_threshold=20),
    # 10 blocks of 16 tokens: the batch cannot fit, so requests are preempted and recomputed.
    "preemption": dict(kv_cache_memory=10 * BLOCK_BYTES, max_model_len=150),
    "preemption-priority": dict(kv_cache_memory=10 * BLOCK_BYTES, max_model_len=150,
                                scheduling_policy="priority"),
}


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    path = tiny_model_factory("LlamaForCausalLM", num_attention_heads=2, num_key_value_heads=2)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p, MAX_NEW)[0] for p in PREFIX_PROMPTS]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_same_tokens_under_every_schedule(variant, reference):
    path, expected = reference
    kwargs = {"kv_cache_memory": "16MiB", **VARIANTS[variant]}
    llm = LLM(path, dtype="float32", **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    priority = list(range(len(PREFIX_PROMPTS), 0, -1)) if "priority" in variant else None
    outputs = llm.generate(PREFIX_PROMPTS, params, priority=priority)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    scheduler = llm.engine.core.scheduler
    if variant.startswith("preemption"):
        assert scheduler.num_preemptions > 0, "the cache was meant to be too small"
    if variant == "default":
        assert llm.engine.core.kv.num_cache_hits > 0, "shared prefixes were meant to hit"
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.num_blocks, "blocks leaked"
    # the engine forgot what the workers held of every request (finished or preempted)
    assert not llm.engine.core.step_inputs.num_sent_tokens


def test_without_chunked_prefill_a_sequence_must_fit_one_step(reference):
    """A prompt over the step budget could never be scheduled: the model's length is lowered to
    the budget (so such a prompt is refused up front), and a length the user set is refused."""
    path, _ = reference
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", enable_chunked_prefill=False,
              max_num_batched_tokens=64)
    assert llm.engine.core.model_config.max_model_len == 64
    with pytest.raises(ValueError, match="64"):
        llm.generate([{"prompt_token_ids": list(range(100, 180))}],
                     SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="raise --max-num-batched-tokens or lower "
                                         "--max-model-len"):
        LLM(path, dtype="float32", kv_cache_memory="16MiB", enable_chunked_prefill=False,
            max_num_batched_tokens=64, max_model_len=128)
