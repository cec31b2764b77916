"""Scheduler: the shared token budget, chunked prefill, admission order, preemption by
recompute, stop conditions, aborts and n > 1 siblings.

The tests drive the scheduler by hand as `EngineCore.step` does: `schedule()`, then
`update(out, sampled)` with one token for each request whose scheduled tokens reach its end. A
fake KV store stands in for the model: each step "writes" every scheduled position (the token
prefix it encodes) into its slot, and every scheduled request's context is checked against it,
so a request that reuses a block whose KV was never computed (or was overwritten) fails.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from runtime.config import EngineConfig
from runtime.core.kv_cache_manager import KVCacheManager
from runtime.core.scheduler import Scheduler, SchedulerOutput
from runtime.request import Request, RequestStatus
from runtime.sampling_params import SamplingParams


class Driver:
    def __init__(self, num_blocks: int, block_size: int = 4, max_model_len: int = 1024,
                 **config) -> None:
        self.config = EngineConfig(block_size=block_size, **config)
        self.kv = KVCacheManager(num_blocks, block_size, self.config.enable_prefix_caching)
        self.s = Scheduler(self.config, self.kv, max_model_len)
        self.script: dict[str, list[int]] = {}  # tokens a request will sample, in order
        self.kv_store: dict[tuple[int, int], tuple[int, ...]] = {}
        self.all: dict[str, Request] = {}

    def add(self, rid: str, prompt, max_tokens: int = 16, params: SamplingParams | None = None,
            **kw) -> Request:
        params = params or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        r = Request(rid, list(prompt), params, max_tokens, **kw)
        self.all[rid] = r
        self.s.add_request(r)
        self.check()
        return r

    def next_token(self, r: Request) -> int:
        script = self.script.get(r.request_id)
        return script.pop(0) if script else 1000 + r.num_output_tokens

    def schedule(self) -> SchedulerOutput:
        out = self.s.schedule()
        bs = self.kv.block_size
        ids = [r.request_id for r, _ in out.scheduled]
        assert len(ids) == len(set(ids))
        assert all(n >= 1 for _, n in out.scheduled), out.scheduled
        assert out.num_batched_tokens == sum(n for _, n in out.scheduled)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(self.s.running) <= self.config.max_num_seqs
        assert not any(r in self.s.running for r in out.preempted)
        for r, n in out.scheduled:
            assert r in self.s.running and r.status == RequestStatus.RUNNING
            seq = r.all_token_ids + r.spec_token_ids  # proposals are scheduled after the rest
            assert r.num_computed_tokens + n == len(seq) if r.spec_token_ids else \
                r.num_computed_tokens + n <= r.num_tokens
            assert len(r.block_ids) * bs >= r.num_computed_tokens + n
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
                self.kv_store[r.block_ids[pos // bs], pos % bs] = tuple(seq[:pos + 1])
        # Attention reads after every write of the step (as the paged backends do).
        for r, n in out.scheduled:
            for pos in range(r.num_computed_tokens):
                assert self.kv_store.get((r.block_ids[pos // bs], pos % bs)) == \
                    tuple(r.all_token_ids[:pos + 1]), f"{r.request_id} reads bad KV at {pos}"
        self.check()
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]] | None = None,
               drafts: dict[str, list[int]] | None = None):
        if sampled is None:
            sampled = {r.request_id: [self.next_token(r)] for r, n in out.scheduled
                       if r.num_computed_tokens + n == r.num_tokens}
        finished = self.s.update(out, sampled, drafts)
        self.check()
        return finished

    def step(self, sampled=None, drafts=None):
        out = self.schedule()
        return out, self.update(out, sampled, drafts)

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                return
            self.step()
        raise AssertionError("requests never finished")

    def check(self) -> None:
        """Every live request is in exactly one place, and block refcounts match the tables."""
        s, pool = self.s, self.kv.pool
        held = [r for rs in s.held.values() for r in rs]
        places = list(s.running) + list(s.waiting) + held
        assert sorted(r.request_id for r in places) == sorted(s.requests)
        assert s.num_waiting() == len(s.waiting) + len(held)
        refs = Counter(b for r in s.requests.values() for b in r.block_ids)
        assert [refs[b.block_id] for b in pool.blocks] == [b.ref_count for b in pool.blocks]
        assert set(pool.free) == {b.block_id for b in pool.blocks if b.ref_count == 0}
        for h, b in pool.cached.items():
            assert pool.blocks[b].block_hash == h

    def ids(self, out: SchedulerOutput) -> list[tuple[str, int]]:
        return [(r.request_id, n) for r, n in out.scheduled]


def waiting_ids(d: Driver) -> list[str]:
    return [r.request_id for r in d.s.waiting]


# --- the token budget and chunked prefill ---------------------------------------------------

def test_chunked_prefill_splits_a_long_prompt():
    d = Driver(16, max_num_batched_tokens=8)
    r = d.add("a", range(20), max_tokens=3)
    for expected in (8, 8, 4):
        out, _ = d.step()
        assert d.ids(out) == [("a", expected)]
    assert r.num_computed_tokens == 20 and r.output_token_ids == [1000]  # sampled only at the end
    out, _ = d.step()
    assert d.ids(out) == [("a", 1)]
    assert r.num_cached_tokens == 0


def test_one_partial_prefill_lets_a_long_prompt_take_the_whole_budget():
    d = Driver(64, max_num_batched_tokens=16, enable_prefix_caching=False)
    d.add("long", range(100, 160))
    d.add("short", range(200, 208))
    out, _ = d.step()
    assert d.ids(out) == [("long", 16)]  # the short one waits behind it


def test_partial_prefills_share_the_budget_between_prompts():
    d = Driver(64, max_num_batched_tokens=16, enable_prefix_caching=False,
               max_num_partial_prefills=2, max_long_partial_prefills=2,
               long_prefill_token_threshold=4)
    d.add("a", range(100, 160))
    d.add("b", range(200, 260))
    for _ in range(3):
        out, _ = d.step()
        assert d.ids(out) == [("a", 8), ("b", 8)]
    d.add("c", range(300, 306))  # a third prefill: the budget splits in two still (at most 2)
    out, _ = d.step()
    assert d.ids(out) == [("a", 8), ("b", 8)]


def test_a_long_prompt_beyond_max_long_partial_prefills_lets_shorter_ones_go_first():
    d = Driver(64, max_num_batched_tokens=16, enable_prefix_caching=False,
               max_num_partial_prefills=2, max_long_partial_prefills=1,
               long_prefill_token_threshold=10)
    d.add("long1", range(100, 140))
    d.add("long2", range(200, 240))
    d.add("short", range(300, 306))
    out, _ = d.step()
    assert d.ids(out) == [("long1", 8), ("short", 6)]  # long2 is passed over, not dropped
    assert waiting_ids(d) == ["long2"]
    d.run()
    assert all(r.is_finished for r in d.all.values())


def test_partial_prefill_options_are_checked():
    with pytest.raises(ValueError, match=r"max_long_partial_prefills \(3\) must be <= "
                                         r"max_num_partial_prefills \(2\)"):
        EngineConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        EngineConfig(max_num_partial_prefills=2, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        EngineConfig(long_prefill_token_threshold=-1)


def test_no_token_is_sampled_before_the_prompt_end():
    d = Driver(16, max_num_batched_tokens=5)
    r = d.add("a", range(12))
    for _ in range(2):
        d.step()
        assert r.num_output_tokens == 0 and r.status == RequestStatus.RUNNING
    d.step()
    assert r.num_output_tokens == 1


def test_budget_is_shared_by_decodes_and_prefill_chunks():
    d = Driver(32, max_num_batched_tokens=10)
    d.add("a", range(2))
    d.add("b", range(10, 12))
    out, _ = d.step()
    assert d.ids(out) == [("a", 2), ("b", 2)]
    d.add("c", range(100, 130))
    out, _ = d.step()
    assert d.ids(out) == [("a", 1), ("b", 1), ("c", 8)]  # decodes first, the chunk gets the rest
    assert out.num_batched_tokens == 10
    out, _ = d.step()
    assert d.ids(out) == [("a", 1), ("b", 1), ("c", 8)]
    out, _ = d.step()
    assert d.ids(out) == [("a", 1), ("b", 1), ("c", 8)]
    out, _ = d.step()
    assert d.ids(out) == [("a", 1), ("b", 1), ("c", 6)]
    assert d.all["c"].num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_larger_than_the_remaining_budget_waits():
    d = Driver(32, max_num_batched_tokens=10, enable_chunked_prefill=False)
    d.add("a", range(2), max_tokens=3)
    d.add("b", range(10, 12), max_tokens=3)
    d.step()
    d.add("c", range(100, 109))  # 9 > 10 - 2
    d.add("e", range(200, 202))  # would fit, but FCFS does not skip ahead
    out, _ = d.step()
    assert d.ids(out) == [("a", 1), ("b", 1)]
    assert waiting_ids(d) == ["c", "e"] and d.all["c"].num_computed_tokens == 0
    out, finished = d.step()  # a and b finish
    assert {r.request_id for r in finished} == {"a", "b"}
    out, _ = d.step()
    assert d.ids(out) == [("c", 9)]  # the whole prompt at once; e (2) > the 1 left
    out, _ = d.step()
    assert d.ids(out) == [("c", 1), ("e", 2)]


def test_without_chunked_prefill_a_prompt_filling_the_budget_exactly_runs():
    d = Driver(32, max_num_batched_tokens=10, enable_chunked_prefill=False)
    d.add("a", range(2))
    d.step()
    d.add("b", range(100, 109))
    out, _ = d.step()
    assert d.ids(out) == [("a", 1), ("b", 9)]


def test_max_num_seqs():
    d = Driver(32, max_num_seqs=2)
    for i in range(3):
        d.add(f"r{i}", range(i * 10, i * 10 + 3), max_tokens=2 + i)
    out, _ = d.step()
    assert d.ids(out) == [("r0", 3), ("r1", 3)] and waiting_ids(d) == ["r2"]
    out, finished = d.step()
    assert [r.request_id for r in finished] == ["r0"]
    assert d.ids(out) == [("r0", 1), ("r1", 1)]  # r2 could not join while r0 still ran
    out, _ = d.step()
    assert d.ids(out) == [("r1", 1), ("r2", 3)]


def test_running_requests_are_served_before_waiting_ones():
    d = Driver(32, max_num_batched_tokens=2)
    d.add("a", range(2))
    out, _ = d.step()
    assert d.ids(out) == [("a", 2)]
    d.add("b", range(10, 12))
    d.add("c", range(20, 22))
    out, _ = d.step()
    assert d.ids(out) == [("a", 1), ("b", 1)]
    out, _ = d.step()
    assert d.ids(out) == [("a", 1), ("b", 1)]  # the budget is spent; c keeps waiting
    assert waiting_ids(d) == ["c"]


def test_empty_schedule():
    d = Driver(4)
    out = d.schedule()
    assert out.is_empty and out.num_batched_tokens == 0 and not d.s.has_unfinished()
    assert d.s.update(out, {}) == []


# --- admission order --------------------------------------------------------------------------

def admission_order(d: Driver) -> list[str]:
    order = []
    while d.s.has_unfinished():
        out, _ = d.step()
        order += [r.request_id for r, _ in out.scheduled if r.request_id not in order]
    return order


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    d = Driver(32, max_num_seqs=1)
    for rid, prio in [("x", 5), ("y", 0), ("z", 3)]:
        d.add(rid, [1, 2, 3], max_tokens=1, priority=prio)
    assert admission_order(d) == ["x", "y", "z"]


def test_priority_admits_lower_value_first_then_earlier_arrival():
    d = Driver(32, max_num_seqs=1, scheduling_policy="priority")
    for rid, prio, t in [("a", 1, 0.0), ("b", 0, 2.0), ("c", 0, 1.0), ("d", 2, -1.0),
                         ("e", 1, 0.0)]:
        d.add(rid, [1, 2, 3], max_tokens=1, priority=prio, arrival_time=t)
    assert waiting_ids(d) == ["c", "b", "a", "e", "d"]
    assert admission_order(d) == ["c", "b", "a", "e", "d"]


# --- preemption -------------------------------------------------------------------------------

def test_fcfs_preempts_the_latest_arrival():
    d = Driver(4, enable_prefix_caching=False)
    for rid in "abc":
        d.add(rid, range(ord(rid) * 10, ord(rid) * 10 + 4), max_tokens=4)
    d.step()  # each holds one full block; one block free
    d.add("late", [1, 2, 3], max_tokens=4)
    out = d.schedule()  # a takes the free block, b needs one: the latest running arrival goes
    c = d.all["c"]
    assert out.preempted == [c] and d.ids(out) == [("a", 1), ("b", 1)]
    assert c.status == RequestStatus.PREEMPTED and c.block_ids == []
    assert c.num_computed_tokens == 0 and d.s.num_preemptions == 1
    assert waiting_ids(d) == ["c", "late"]  # back at the front, ahead of later arrivals
    assert c.num_tokens == 5  # its sampled token is kept
    d.update(out)
    # c comes back once a and b finish, and recomputes its prompt and its output together.
    seen = []
    while c.num_computed_tokens == 0:
        out, _ = d.step()
        seen += [n for r, n in out.scheduled if r is c]
    assert seen == [5] and c.num_output_tokens == 2
    d.run()
    assert c.output_token_ids == [1000, 1001, 1002, 1003]


def test_priority_preempts_the_least_important_even_if_already_scheduled():
    d = Driver(4, scheduling_policy="priority", enable_prefix_caching=False)
    low = d.add("low", range(4), max_tokens=6, priority=5, arrival_time=0.0)
    d.step()
    d.add("hi", [10, 11, 12], max_tokens=6, priority=0, arrival_time=1.0)
    d.add("mid", [20, 21, 22], max_tokens=6, priority=1, arrival_time=2.0)
    out, _ = d.step()
    assert d.ids(out) == [("low", 1), ("hi", 3), ("mid", 3)]
    assert [r.request_id for r in d.s.running] == ["low", "hi", "mid"]
    d.step()  # no new block needed
    out = d.schedule()  # low is scheduled first, then hi needs a block: low (least important) goes
    assert out.preempted == [low] and d.ids(out) == [("hi", 1), ("mid", 1)]
    assert out.num_batched_tokens == 2  # low's token was given back to the budget
    assert low.status == RequestStatus.PREEMPTED and low.block_ids == []
    assert low.num_computed_tokens == 0 and list(d.s.waiting) == [low]
    d.update(out)
    d.run()
    assert [d.all[r].num_output_tokens for r in ("low", "hi", "mid")] == [6, 6, 6]


def test_priority_victim_is_the_current_request_when_it_is_least_important():
    d = Driver(3, scheduling_policy="priority", enable_prefix_caching=False)
    d.add("a", range(4), priority=0, arrival_time=0.0)
    d.add("b", range(10, 14), priority=1, arrival_time=1.0)
    d.step()  # one block free
    out = d.schedule()  # a takes it; b needs one and is the least important itself
    assert out.preempted == [d.all["b"]] and d.ids(out) == [("a", 1)]


def test_preempted_request_resumes_past_its_cached_prefix():
    d = Driver(3)
    a = d.add("a", range(4), max_tokens=2)
    c = d.add("c", range(10, 17), max_tokens=3)  # 2 blocks, the first one full
    d.step()
    out, fin = d.step()  # a needs a block: c is preempted, a takes c's tail block
    assert out.preempted == [c] and fin == [a] and c.num_tokens == 8
    out, _ = d.step()
    assert d.ids(out) == [("c", 4)]  # its first block was still cached
    assert c.num_computed_tokens == 8 and c.output_token_ids == [1000, 1001]
    d.run()
    assert c.output_token_ids == [1000, 1001, 1002]


def test_a_later_identical_prompt_starts_past_the_cached_prefix():
    d = Driver(8)
    d.add("c", range(6), max_tokens=1)
    out, _ = d.step()
    assert d.ids(out) == [("c", 6)] and d.all["c"].num_cached_tokens == 0
    d.add("c2", range(6), max_tokens=1)
    out, _ = d.step()
    assert d.ids(out) == [("c2", 2)] and d.all["c2"].num_cached_tokens == 4


def test_no_request_is_lost_under_block_pressure():
    d = Driver(6, block_size=2, max_num_batched_tokens=7)
    for i in range(8):
        d.add(f"r{i}", [i] * (1 + i % 4), max_tokens=3 + i % 3)
    d.run()
    assert d.s.num_preemptions > 0
    for i in range(8):
        r = d.all[f"r{i}"]
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [1000 + k for k in range(3 + i % 3)]
    assert d.kv.num_free_blocks == 6 and not d.s.requests and not d.s.running


def test_preempted_request_in_the_step_that_indexed_its_block_recomputes_its_last_token():
    """Regression: a request preempted after being scheduled in the same step had indexed the
    block its newest token was to fill. On its return, that block's hash (same content as a
    block another request holds) made it count every token as cached, leaving 0 to compute."""
    d = Driver(8, block_size=2, scheduling_policy="priority", max_num_batched_tokens=64)
    d.script = {"x": [7, 8, 9, 6, 6, 6]}
    d.add("w", [5, 5, 5, 7, 8, 9, 1], max_tokens=6, priority=0, arrival_time=0.0)
    x = d.add("x", [5, 5, 5], max_tokens=6, priority=2, arrival_time=1.0)
    d.step()
    d.add("y", [3], max_tokens=6, priority=1, arrival_time=2.0)
    d.step()
    d.step()
    assert x.all_token_ids == [5, 5, 5, 7, 8, 9] and d.kv.num_free_blocks == 0
    out = d.schedule()  # x fills its third block, then y needs a block: x is preempted
    assert out.preempted == [x]
    d.update(out)
    assert x.num_tokens == 6 and len(x.block_hashes) == 2
    resumed = []
    while not resumed:
        out, _ = d.step()
        resumed = [n for r, n in out.scheduled if r is x]
    assert resumed == [2]  # w's blocks [5 5] [5 7] are reused; [8 9] is computed
    d.run()
    assert x.output_token_ids == [7, 8, 9, 6, 6, 6]


# --- update: sampled tokens and stop conditions --------------------------------------------

def test_update_appends_tokens_and_finishes_on_max_tokens():
    d = Driver(8)
    r = d.add("a", [1, 2, 3], max_tokens=3)
    free = d.kv.num_free_blocks
    _, fin = d.step({"a": [50]})
    assert r.output_token_ids == [50] and fin == []
    _, fin = d.step({"a": [51]})
    _, fin = d.step({"a": [52]})
    assert fin == [r] and r.status == RequestStatus.FINISHED_LENGTH
    assert r.status.finish_reason == "length" and r.output_token_ids == [50, 51, 52]
    assert r.block_ids == [] and d.kv.num_free_blocks == free and "a" not in d.s.requests


def test_update_finishes_on_a_stop_token():
    d = Driver(8)
    r = d.add("a", [1, 2, 3], params=SamplingParams(stop_token_ids=[9], ignore_eos=True))
    d.step({"a": [4]})
    _, fin = d.step({"a": [9]})
    assert fin == [r] and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9
    assert r.output_token_ids == [4, 9] and not d.s.has_unfinished()


def test_update_eos_min_tokens_and_ignore_eos():
    d = Driver(8)
    eos = SamplingParams().with_eos(2)
    r = d.add("eos", [1, 1], params=eos)
    m = d.add("min", [1, 1], params=SamplingParams(min_tokens=2).with_eos(2))
    i = d.add("ign", [1, 1], params=SamplingParams(ignore_eos=True).with_eos(2))
    _, fin = d.step({"eos": [2], "min": [2], "ign": [2]})
    # as vLLM: stop_reason names a stop token the request asked for, None for the EOS
    assert fin == [r] and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    _, fin = d.step({"min": [2], "ign": [2]})
    assert fin == [m] and m.output_token_ids == [2, 2]
    assert i.status == RequestStatus.RUNNING and i.output_token_ids == [2, 2]


def test_update_finishes_at_max_model_len():
    d = Driver(8, max_model_len=6)
    r = d.add("a", range(4), max_tokens=100)
    d.step()
    _, fin = d.step()
    assert fin == [r] and r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 6


def test_update_stops_at_the_first_stop_in_a_multi_token_step():
    d = Driver(8)
    r = d.add("a", [1], params=SamplingParams(stop_token_ids=[9], ignore_eos=True))
    _, fin = d.step({"a": [4, 9, 5]})
    assert fin == [r] and r.output_token_ids == [4, 9]


# --- aborts -------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_finish_request_aborts_waiting_and_running_requests(policy):
    d = Driver(8, max_num_seqs=1, scheduling_policy=policy)
    a = d.add("a", range(6))
    b = d.add("b", range(10, 16))
    c = d.add("c", range(20, 26))
    d.step()
    assert a.block_ids and list(d.s.waiting) == [b, c]
    assert d.s.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    assert b.status == RequestStatus.FINISHED_ABORTED and waiting_ids(d) == ["c"]
    assert d.s.finish_request("a", RequestStatus.FINISHED_STOPPED, "stop!") is a
    assert a.stop_reason == "stop!" and a.block_ids == [] and d.kv.num_free_blocks == 8
    assert d.s.running == [] and "a" not in d.s.requests
    d.check()
    assert d.s.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    assert d.s.finish_request("nope", RequestStatus.FINISHED_ABORTED) is None
    out, _ = d.step()
    assert d.ids(out) == [("c", 6)]
    d.s.finish_request("c", RequestStatus.FINISHED_ABORTED)
    assert not d.s.has_unfinished() and d.kv.num_free_blocks == 8


def test_abort_a_preempted_request():
    d = Driver(4, enable_prefix_caching=False)
    for rid in "abc":
        d.add(rid, range(ord(rid) * 10, ord(rid) * 10 + 4), max_tokens=4)
    d.step()
    out, _ = d.step()
    assert out.preempted == [d.all["c"]]
    d.s.finish_request("c", RequestStatus.FINISHED_ABORTED)
    d.check()
    d.run()
    assert d.kv.num_free_blocks == 4


# --- n > 1 siblings ----------------------------------------------------------------------------

def add_group(d: Driver, prompt, n: int, **kw) -> list[Request]:
    ids = ["g#0"] + [f"g#{k}" for k in range(1, n)]
    return [d.add(rid, prompt, parent_id="g", sample_index=k,
                  leader_id=ids[0] if k else None, arrival_time=0.0, **kw)
            for k, rid in enumerate(ids)]


@pytest.mark.parametrize("caching", [True, False])
def test_siblings_wait_for_the_leader_then_share_its_prompt_blocks(caching):
    d = Driver(16, max_num_batched_tokens=4, enable_prefix_caching=caching)
    leader, s1, s2 = add_group(d, range(10), 3, max_tokens=3)
    assert d.s.held == {"g#0": [s1, s2]} and d.s.num_waiting() == 3
    for expected in (4, 4):
        out, _ = d.step()
        assert d.ids(out) == [("g#0", expected)] and d.s.held["g#0"] == [s1, s2]
    out, _ = d.step()  # the leader's last prompt chunk: its siblings are released
    assert d.ids(out) == [("g#0", 2)] and "g#0" not in d.s.held
    assert waiting_ids(d) == ["g#1", "g#2"] and s1.block_ids == s2.block_ids == []
    shared = leader.block_ids[:2]  # the full blocks of the first 9 prompt tokens
    out = d.schedule()  # admission adopts them as computed
    for s in (s1, s2):
        assert s.block_ids[:2] == shared and s.num_computed_tokens == 8
    assert [d.kv.pool.blocks[b].ref_count for b in shared] == [3, 3]
    computed = Counter()
    while True:
        for r, n in out.scheduled:
            if r is not leader and r.num_output_tokens == 0:
                computed[r.request_id] += n
        d.update(out)
        if not d.s.has_unfinished():
            break
        out = d.schedule()
    assert computed == {"g#1": 2, "g#2": 2}  # only the unshared prompt tail
    assert s1.num_cached_tokens == 8 and s1.block_ids == []
    assert all(r.num_output_tokens == 3 for r in (leader, s1, s2))
    assert d.kv.num_free_blocks == 16


def test_sibling_added_after_the_leader_computed_its_prompt_is_not_held():
    d = Driver(16)
    leader = d.add("g#0", range(10), arrival_time=0.0)
    d.step()
    s = d.add("g#1", range(10), leader_id="g#0", arrival_time=0.0)
    assert not d.s.held and waiting_ids(d) == ["g#1"]
    out, _ = d.step()
    assert ("g#1", 2) in d.ids(out)  # served from the prefix cache instead
    assert s.block_ids[:2] == leader.block_ids[:2]


def test_abort_a_held_sibling_and_a_leader_with_held_siblings():
    d = Driver(16, max_num_batched_tokens=4)
    leader, s1, s2 = add_group(d, range(10), 3, max_tokens=2)
    d.step()
    assert leader.num_computed_tokens == 4
    assert d.s.finish_request("g#1", RequestStatus.FINISHED_ABORTED) is s1
    assert d.s.held == {"g#0": [s2]} and d.s.num_waiting() == 1
    d.check()
    d.s.finish_request("g#0", RequestStatus.FINISHED_ABORTED)
    # Its remaining sibling is released without sharing anything and computes the prompt.
    assert not d.s.held and waiting_ids(d) == ["g#2"] and s2.block_ids == []
    assert d.kv.num_free_blocks == 16
    d.run()
    assert s2.num_output_tokens == 2 and s2.status == RequestStatus.FINISHED_LENGTH


def test_abort_a_released_sibling():
    d = Driver(16, max_num_seqs=1)
    leader, s1 = add_group(d, range(10), 2, max_tokens=3)
    d.step()
    assert s1.status == RequestStatus.WAITING and s1.block_ids == []  # waiting holds no blocks
    d.s.finish_request("g#1", RequestStatus.FINISHED_ABORTED)
    assert [d.kv.pool.blocks[b].ref_count for b in leader.block_ids] == [1, 1, 1]
    d.run()
    assert d.kv.num_free_blocks == 16


def test_siblings_of_a_leader_that_finishes_on_its_first_token_still_run():
    d = Driver(16, enable_prefix_caching=False)
    leader, s1 = add_group(d, range(10), 2, max_tokens=1)
    _, fin = d.step()
    assert fin == [leader] and waiting_ids(d) == ["g#1"]
    d.run()
    assert s1.num_output_tokens == 1 and d.kv.num_free_blocks == 16


def test_released_siblings_do_not_block_a_more_important_request():
    """Regression: released siblings used to wait holding their leader's prompt blocks; under
    the priority policy a more important request needing those blocks stalled the queue.
    Siblings now adopt the blocks only when admitted, so waiting requests hold none."""
    d = Driver(4, scheduling_policy="priority", max_model_len=16)
    leader, s1 = add_group(d, range(9), 2, max_tokens=2, priority=1)
    d.step()
    assert s1.block_ids == [] and waiting_ids(d) == ["g#1"]
    z = d.add("z", range(100, 115), max_tokens=1, priority=0, arrival_time=1.0)  # needs 4 blocks
    out, fin = d.step()
    assert d.ids(out) == [("g#0", 1)] and fin == [leader] and waiting_ids(d) == ["z", "g#1"]
    out, fin = d.step()
    assert d.ids(out) == [("z", 15)] and s1.block_ids == [] and s1.num_computed_tokens == 0
    d.run()
    assert z.num_output_tokens == 1 and s1.num_output_tokens == 2


def test_released_siblings_do_not_block_a_preempted_request():
    """The same stall under FCFS: a preempted request returns to the front of the queue and
    needs more blocks than a waiting sibling could have left free."""
    d = Driver(5, max_model_len=20)
    p = d.add("p", range(100, 106), max_tokens=14)
    leader, s1 = add_group(d, range(9), 2, max_tokens=8)
    d.run()
    assert p.num_output_tokens == 14 and leader.num_output_tokens == s1.num_output_tokens == 8


# --- randomized: invariants hold and every request finishes -----------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_random_workloads(seed):
    rng = random.Random(seed)
    d = Driver(rng.randint(4, 10), block_size=rng.choice([1, 2, 4]),
               max_num_batched_tokens=rng.randint(4, 16), max_num_seqs=rng.randint(1, 5),
               scheduling_policy=rng.choice(["fcfs", "priority"]),
               enable_prefix_caching=rng.random() < 0.8)
    # A small vocabulary makes shared prefixes (and cache hits on generated tokens) common.
    d.next_token = lambda r: hash(tuple(r.all_token_ids)) % 3
    cap = d.kv.pool.num_blocks * d.kv.block_size
    expected, aborted, t = {}, set(), 0.0
    for step in range(5000):
        if step < 150 and rng.random() < 0.2:
            rid, plen = f"r{len(expected)}", rng.randint(1, cap // 2)
            prompt = [rng.randint(0, 2) for _ in range(plen)]
            n = rng.choice([1, 1, 1, 3])
            expected[rid] = rng.randint(1, cap - plen)
            ids = [rid] + [f"{rid}#{k}" for k in range(1, n)]
            for k, sid in enumerate(ids):
                d.add(sid, prompt, max_tokens=expected[rid], priority=rng.randint(0, 3),
                      arrival_time=t, leader_id=rid if k else None)
            t += 1.0
        if rng.random() < 0.03 and d.s.requests:
            rid = rng.choice(sorted(d.s.requests))
            aborted.add(rid)
            d.s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            d.check()
        if step >= 150 and not d.s.has_unfinished():
            break
        d.step()
    assert not d.s.has_unfinished(), d.s.requests
    for rid, r in d.all.items():
        if rid not in aborted:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.num_output_tokens == expected[rid.split("#")[0]]
    assert d.kv.num_free_blocks == d.kv.pool.num_blocks


# --- speculative decoding -------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_proposals_are_scheduled_then_the_rejected_ones_rolled_back():
    d = Driver(num_blocks=16, speculative_config=NGRAM)
    r = d.add("a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    d.step({"a": [100]}, {"a": [101, 102, 103]})
    assert r.spec_token_ids == [101, 102, 103]
    out, _ = d.step({"a": [101, 555]})  # the first proposal accepted, then the target's own
    assert d.ids(out) == [("a", 4)]  # the last token and the 3 proposals
    assert r.all_token_ids[6:] == [100, 101, 555] and r.spec_token_ids == []
    assert r.num_computed_tokens == 8  # 102 and 103 rolled back
    assert (d.s.spec_stats.num_draft_tokens, d.s.spec_stats.num_accepted_tokens) == (3, 1)
    out, _ = d.step()  # reads positions 0..7: the accepted proposal's KV is valid
    assert d.ids(out) == [("a", 1)]


def test_blocks_past_the_new_end_are_freed_to_the_front_of_the_free_list():
    d = Driver(num_blocks=16, speculative_config=NGRAM)
    r = d.add("a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    d.step({"a": [100]}, {"a": [101, 102, 103]})
    out = d.schedule()
    assert len(r.block_ids) == 3  # positions 6..9 reach a third block
    third = r.block_ids[2]
    d.update(out, {"a": [777]})  # every proposal rejected: 8 tokens, two blocks
    assert len(r.block_ids) == 2 and r.num_computed_tokens == 7
    assert next(iter(d.kv.pool.free)) == third
    assert d.kv.pool.blocks[third].block_hash is None


def test_proposals_fit_the_budget_and_the_room_left():
    d = Driver(num_blocks=16, speculative_config=NGRAM, max_num_batched_tokens=3)
    r = d.add("a", [1, 2], max_tokens=10)
    d.step({"a": [100]}, {"a": [101, 102, 103]})
    out, _ = d.step({"a": [101, 102]})  # the budget took 2 of the 3 proposals
    assert d.ids(out) == [("a", 3)]
    assert r.all_token_ids[2:] == [100, 101, 102]
    d = Driver(num_blocks=16, speculative_config=NGRAM)
    r = d.add("b", [1, 2], max_tokens=3)
    d.step({"b": [100]}, {"b": [101, 102, 103]})
    assert r.spec_token_ids == [101]  # 2 tokens left: one proposal and the target's token


def test_a_stop_among_accepted_tokens_ends_the_request_there():
    d = Driver(num_blocks=16, speculative_config=NGRAM)
    r = d.add("a", [1, 2, 3], params=SamplingParams(max_tokens=10, stop_token_ids=[7]))
    d.step({"a": [100]}, {"a": [7, 8, 9]})
    sampled = {"a": [7, 8, 9, 10]}
    _, finished = d.step(sampled)
    assert finished == [r] and r.output_token_ids == [100, 7]
    assert sampled["a"] == [7]  # what followed the stop is not reported
    assert d.kv.pool.num_free_blocks == 16


def test_a_draft_model_gets_lookahead_slots_for_its_proposals():
    spec = {"method": "draft_model", "model": "unused", "num_speculative_tokens": 3}
    d = Driver(num_blocks=16, speculative_config=spec)
    r = d.add("a", [1, 2, 3, 4], max_tokens=10)
    d.schedule()
    assert len(r.block_ids) == 2  # 4 prompt tokens + 3 lookahead slots


def test_preemption_drops_proposals():
    d = Driver(num_blocks=4, speculative_config=NGRAM)
    b = d.add("b", list(range(10, 18)), max_tokens=8)
    a = d.add("a", [1, 2, 3], max_tokens=8)
    d.step({"b": [200], "a": [100]}, {"a": [101, 102, 103]})
    out, _ = d.step()  # b's decode takes the last free block; a, last in, is preempted
    assert out.preempted == [a] and a.spec_token_ids == []
    d.run()
    assert a.is_finished and b.is_finished
