"""The step message: each request crosses to the workers whole once, then only what changed.

A driver schedules by hand (as in test_scheduler.py), turns every schedule into the message,
pickles it as the multiprocessing executor does, and applies it to a worker's request table.
What the worker rebuilds must be exactly what the engine's own requests say (tokens, positions,
block tables, proposals), through preemption, rolled-back proposals, n > 1 siblings, prefix
caching and aborts; and a decode step's message must not grow with the tokens generated.
"""
from __future__ import annotations

import pickle
import random

import pytest

from runtime.config import EngineConfig
from runtime.core.kv_cache_manager import KVCacheManager
from runtime.core.scheduler import Scheduler
from runtime.core.step_input import StepInputBuilder
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams
from runtime.core.messages import ScheduledRequest
from runtime.worker.request_states import RequestStates
from tests.core.test_scheduler import Driver

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
DRAFT = {"method": "draft_model", "model": "unused", "num_speculative_tokens": 3}


class MirroredDriver(Driver):
    """Every executed schedule also crosses, pickled, to one worker's request table."""

    def __init__(self, num_blocks: int, **kwargs) -> None:
        super().__init__(num_blocks, **kwargs)
        spec = self.config.speculative_config
        self.lookahead = spec is not None and spec.method == "draft_model"
        self.builder = StepInputBuilder(self.kv, self.s.max_model_len, self.lookahead)
        self.worker = RequestStates()
        self.sizes: list[int] = []  # bytes of each step's pickled message
        self.last = None  # the last message, as the worker received it

    def schedule(self):
        out = super().schedule()
        self.builder.preempted(out.preempted)
        if out.is_empty:
            return out
        payload = pickle.dumps(self.builder.build(out), protocol=pickle.HIGHEST_PROTOCOL)
        self.sizes.append(len(payload))
        self.last = pickle.loads(payload)
        views = self.worker.apply(self.last)
        assert [v.request_id for v in views] == [r.request_id for r, _ in out.scheduled]
        for view, (r, n) in zip(views, out.scheduled):
            assert view == self.expected(r, n), r
        # the worker holds exactly the running requests: the others were dropped
        assert set(self.worker.requests) == {r.request_id for r in self.s.running}
        return out

    def expected(self, r, n: int) -> ScheduledRequest:
        """The step's share of `r`, read from the engine's own request."""
        start, bs = r.num_computed_tokens, self.kv.block_size
        lookahead = min(len(r.block_ids) * bs, self.s.max_model_len) - (start + n)
        return ScheduledRequest(
            request_id=r.request_id, token_ids=r.all_token_ids[start:start + n] + r.spec_token_ids,
            start_pos=start, block_ids=r.block_ids, sample=start + n >= r.num_tokens,
            params=r.params, sample_index=r.sample_index, num_prompt_tokens=r.num_prompt_tokens,
            all_token_ids=r.all_token_ids, spec_token_ids=r.spec_token_ids,
            num_lookahead=lookahead if self.lookahead else 0)

    def update(self, out, sampled=None, drafts=None):
        finished = super().update(out, sampled, drafts)
        self.builder.finished(r.request_id for r in finished)
        return finished

    def abort(self, request_id: str) -> None:
        if self.s.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is not None:
            self.builder.finished([request_id])
        self.check()


def test_a_request_crosses_whole_once_then_only_its_changes():
    d = MirroredDriver(16, block_size=4)
    d.add("a", range(6), max_tokens=8)
    d.step({"a": [100]})
    (new,) = d.last.new_requests
    assert new.prompt_token_ids == list(range(6)) and new.output_token_ids == []
    assert new.block_ids == d.all["a"].block_ids and not d.last.cached_requests
    d.step({"a": [101]})
    assert not d.last.new_requests
    (change,) = d.last.cached_requests
    assert change.new_token_ids == [100] and change.num_computed_tokens == 6
    assert change.num_kept_blocks == 2 and change.new_block_ids == []
    assert d.last.num_scheduled_tokens == {"a": 1}
    d.step({"a": [102]})  # position 7 fills the second block
    assert d.last.cached_requests[0].new_block_ids == []
    d.step({"a": [103]})  # position 8 needs a third
    (change,) = d.last.cached_requests
    assert change.new_token_ids == [102] and change.num_kept_blocks == 2
    assert change.new_block_ids == d.all["a"].block_ids[2:] and len(change.new_block_ids) == 1


def test_rejected_proposals_cut_the_workers_block_table():
    d = MirroredDriver(16, block_size=4, speculative_config=NGRAM)
    r = d.add("a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    d.step({"a": [100]}, {"a": [101, 102, 103]})
    d.step({"a": [777]})  # every proposal rejected: the third block is freed
    assert len(r.block_ids) == 2 and len(d.worker.requests["a"].block_ids) == 3
    out = d.schedule()  # the worker's table is cut back (and the check above compares it)
    assert d.worker.requests["a"].block_ids == r.block_ids
    d.update(out)


def test_preempted_requests_are_dropped_then_sent_whole_again():
    d = MirroredDriver(4, block_size=2)
    d.add("a", [1, 2, 3], max_tokens=6)
    d.add("b", [4, 5, 6], max_tokens=6)
    resumed = []
    for _ in range(40):
        if not d.s.has_unfinished():
            break
        out, _ = d.step()
        if out.preempted:
            assert d.last.preempted_ids == [r.request_id for r in out.preempted]
        resumed += [new for new in d.last.new_requests if new.output_token_ids]
    assert not d.s.has_unfinished()
    assert resumed, "the cache was meant to be too small"
    for new in resumed:  # back with what it had generated, and no block it had before
        assert new.output_token_ids[0] == 1000 and new.num_computed_tokens == 0


def test_siblings_and_prefix_hits_arrive_with_their_computed_blocks():
    d = MirroredDriver(32, block_size=2)
    d.add("x", range(9), max_tokens=3)
    d.add("x#1", range(9), max_tokens=3, leader_id="x", sample_index=1)
    d.step()
    d.step()  # the sibling joins, on its leader's prompt blocks
    (sibling,) = d.last.new_requests
    assert sibling.request_id == "x#1" and sibling.num_computed_tokens == 8
    assert sibling.block_ids[:4] == d.all["x"].block_ids[:4] and sibling.sample_index == 1
    d.run()
    d.add("y", range(9), max_tokens=2)  # the prefix cache serves most of the prompt
    d.step()
    (new,) = d.last.new_requests
    assert new.num_computed_tokens == 8 and d.last.num_scheduled_tokens == {"y": 1}
    d.run()


@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_keep_the_worker_table_exact(seed):
    """Preemption, chunked prefill, n > 1 siblings, prefix caching, aborts and proposals
    (accepted or rolled back) at random: every step, the worker rebuilds the engine's view."""
    rng = random.Random(seed)
    spec = rng.choice([None, NGRAM, DRAFT])
    d = MirroredDriver(rng.randint(6, 12), block_size=rng.choice([1, 2, 4]),
                       max_num_batched_tokens=rng.randint(4, 16), max_num_seqs=rng.randint(1, 5),
                       scheduling_policy=rng.choice(["fcfs", "priority"]),
                       enable_prefix_caching=rng.random() < 0.8, speculative_config=spec)
    cap = d.kv.pool.num_blocks * d.kv.block_size
    t = 0.0
    for step in range(3000):
        if step < 100 and rng.random() < 0.2:
            rid, plen = f"r{step}", rng.randint(1, cap // 3)
            prompt = [rng.randint(0, 2) for _ in range(plen)]
            n = rng.choice([1, 1, 3])
            for k in range(n):
                d.add(f"{rid}#{k}" if k else rid, prompt,
                      max_tokens=rng.randint(1, cap // 2 - plen + 1),
                      priority=rng.randint(0, 3), arrival_time=t, leader_id=rid if k else None,
                      sample_index=k)
            t += 1.0
        if rng.random() < 0.02 and d.s.requests:
            d.abort(rng.choice(sorted(d.s.requests)))
        if step >= 100 and not d.s.has_unfinished():
            break
        out = d.schedule()
        sampled, drafts = {}, {}
        for r, n in out.scheduled:
            if r.num_computed_tokens + n < r.num_tokens:
                continue  # a prompt chunk short of the end samples nothing
            accepted = r.spec_token_ids[:rng.randint(0, len(r.spec_token_ids))]
            sampled[r.request_id] = accepted + [rng.randint(0, 2)]
            if spec is not None:
                drafts[r.request_id] = [rng.randint(0, 2) for _ in range(rng.randint(0, 3))]
        d.update(out, sampled, drafts)
    assert not d.s.has_unfinished()
    assert d.kv.num_free_blocks == d.kv.pool.num_blocks


def test_a_decode_step_message_does_not_grow_with_the_sequence():
    """64 requests decoding 512 tokens each: after the first step carried each request whole,
    a step's message depends on how many requests it holds, not on how long they are. (The
    scheduler is driven without the fake KV store, whose checks grow with the square of the
    sequence.)"""
    num_reqs, prompt_len, new_tokens, bs = 64, 32, 512, 16
    kv = KVCacheManager(num_reqs * (prompt_len + new_tokens) // bs, bs)
    config = EngineConfig(block_size=bs, max_num_seqs=num_reqs,
                          max_num_batched_tokens=num_reqs * prompt_len)
    s = Scheduler(config, kv, max_model_len=1024)
    builder, worker, sizes = StepInputBuilder(kv, 1024, False), RequestStates(), []
    for i in range(num_reqs):
        s.add_request(Request(f"req-{i}", [1000 + i] * prompt_len,
                              SamplingParams(max_tokens=new_tokens, ignore_eos=True), new_tokens))
    while s.has_unfinished():
        out = s.schedule()
        payload = pickle.dumps(builder.build(out), protocol=pickle.HIGHEST_PROTOCOL)
        sizes.append(len(payload))
        assert len(worker.apply(pickle.loads(payload))) == num_reqs
        # token ids of one width throughout, so that only the structure could change the size
        finished = s.update(out, {r.request_id: [1000 + r.num_tokens % 7]
                                  for r, _ in out.scheduled})
        builder.finished(r.request_id for r in finished)
    assert len(sizes) == new_tokens
    # Steps 250..265 and 490..505: each request is at the same place within its last block.
    assert sizes[250:266] == sizes[490:506]
    assert max(sizes[1:]) < sizes[0] / 5  # the first carried the prompts
