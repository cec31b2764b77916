"""n > 1 and best_of: samples share the prompt's KV blocks; best_of returns the best n."""
from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams

PROMPT = list(range(500, 540))  # 40 tokens: two full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("LlamaForCausalLM"), dtype="float32", kv_cache_memory="16MiB")


def test_n8_holds_the_prompt_blocks_once(llm):
    engine, pool = llm.engine, llm.engine.core.kv.pool
    params = SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=0, ignore_eos=True)
    request_id = engine.add_request(PROMPT, params)
    engine.step()  # sample 0 computes the prompt (3 blocks)
    engine.step()  # the 7 others adopt its 2 full blocks, each computing its own third one
    samples = [engine.core.scheduler.requests[f"{request_id}#{k}"] for k in range(8)]
    held = {b for s in samples for b in s.block_ids}
    assert all(len(s.block_ids) == 3 for s in samples)
    assert len(held) == 2 + 8  # not 8 x 3: the prompt's full blocks are held once
    assert pool.num_blocks - pool.num_free_blocks == len(held)
    assert [pool.blocks[b].ref_count for b in samples[0].block_ids[:2]] == [8, 8]
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.num_free_blocks == pool.num_blocks


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(llm):
    common = dict(temperature=1.0, max_tokens=5, seed=11, ignore_eos=True)
    everyone = llm.generate([PROMPT], SamplingParams(n=6, logprobs=0, **common))[0].outputs
    ranked = sorted(everyone, key=lambda o: o.cumulative_logprob, reverse=True)
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=6, **common))[0].outputs
    assert [o.index for o in best] == [0, 1]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.cumulative_logprob for o in best] == \
        pytest.approx([o.cumulative_logprob for o in ranked[:2]])
    assert all(o.logprobs is None for o in best)  # not asked for


def test_best_of_cannot_stream(llm):
    from runtime.engine.output_processor import OutputKind
    with pytest.raises(ValueError, match="cannot be streamed"):
        llm.engine.processor.add_request(PROMPT, SamplingParams(n=1, best_of=2),
                                         output_kind=OutputKind.DELTA)
