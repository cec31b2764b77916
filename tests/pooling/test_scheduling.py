"""Pooling requests through the engine's scheduler: an encoder's run whole (alone when longer
than the token budget) and keep no KV; a decoder embedder's are chunked like prefills, hold
their blocks until the last chunk, and pool to the same vector as unchunked."""
from __future__ import annotations

import torch

from runtime import LLM
from runtime.config import EngineConfig
from runtime.core.kv_cache_manager import KVCacheManager
from runtime.core.scheduler import Scheduler
from runtime.pooling.params import PoolingParams
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams
from tests.pooling.helpers import PROMPTS, assert_close
from tests.pooling.test_encoders import qwen3_embedder


def pooling(rid: str, n: int) -> Request:
    return Request(rid, list(range(2, 2 + n)), SamplingParams(), 0,
                   pooling_params=PoolingParams(task="embed"))


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    s.update(out, {})
    return [(r.request_id, n) for r, n in out.scheduled]


def test_encoder_requests_run_whole_and_keep_no_kv():
    config = EngineConfig(max_num_batched_tokens=16, max_num_seqs=8)
    kv = KVCacheManager(1, 16, enable_caching=False)
    s = Scheduler(config, kv, 512, encoder_only=True)
    for rid, n in (("a", 6), ("b", 6), ("long", 40), ("c", 3)):
        s.add_request(pooling(rid, n))
    assert run_step(s) == [("a", 6), ("b", 6)]  # "long" waits for a step of its own
    assert run_step(s) == [("long", 40)]  # over the budget: whole, alone
    assert run_step(s) == [("c", 3)]
    assert not s.has_unfinished() and kv.num_free_blocks == 1


def test_decoder_pooling_requests_are_chunked_and_free_their_blocks():
    config = EngineConfig(max_num_batched_tokens=16, max_num_seqs=8)
    kv = KVCacheManager(32, 4, enable_caching=False)
    s = Scheduler(config, kv, 512)
    long, short = pooling("long", 40), pooling("short", 5)
    s.add_request(long)
    s.add_request(short)
    assert run_step(s) == [("long", 16)]
    assert long.status == RequestStatus.RUNNING and len(long.block_ids) == 4
    assert run_step(s) == [("long", 16)]
    assert run_step(s) == [("long", 8), ("short", 5)]
    assert long.status == short.status == RequestStatus.FINISHED_STOPPED
    assert long.block_ids == [] and kv.num_free_blocks == 32
    assert long.num_output_tokens == 0 and not s.has_unfinished()


def count_steps(llm: LLM) -> list[int]:
    """Wraps the engine core's step: each step's number of scheduled requests is recorded."""
    core, sizes = llm.pooling.core, []
    schedule = core.scheduler.schedule

    def recorded():
        out = schedule()
        if out.scheduled:
            sizes.append(len(out.scheduled))
        return out

    core.scheduler.schedule = recorded
    return sizes


def test_chunked_decoder_embedding_equals_unchunked(tiny_model_factory, tmp_path):
    folder, base = qwen3_embedder(tiny_model_factory, tmp_path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    whole = LLM(folder, dtype="float32").embed(prompts)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    steps = count_steps(llm)
    chunked = llm.embed(prompts)
    assert len(steps) >= 90 // 16, steps  # the 90-token prompt alone takes 6 steps
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = base(torch.tensor([p])).last_hidden_state[0, -1].float()
        assert_close(torch.tensor(chunked[i].outputs.embedding),
                     torch.tensor(whole[i].outputs.embedding), f"prompt {i} chunked")
        assert_close(torch.tensor(chunked[i].outputs.embedding),
                     torch.nn.functional.normalize(ref, dim=0), f"prompt {i} vs transformers")
    assert llm.pooling.core.kv.num_free_blocks == llm.pooling.core.num_blocks


def test_encoder_prompt_over_the_budget_runs_whole(tiny_model_factory):
    path = tiny_model_factory("BertModel")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = LLM(path, dtype="float32").encode(prompts, pooling_task="token_embed")
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32)
    steps = count_steps(llm)
    ours = llm.encode(prompts, pooling_task="token_embed")
    assert max(steps) > 1 and len(steps) < len(PROMPTS) + 1, steps
    for i in range(len(PROMPTS)):
        assert_close(ours[i].outputs.data, ref[i].outputs.data, f"prompt {i} hidden states")
