"""KVCacheManager: block tables, prefix caching by chained hashes, sharing and freeing."""
from __future__ import annotations

import pytest

from runtime.core.block_pool import hash_block
from runtime.core.kv_cache_manager import KVCacheManager
from runtime.request import Request
from runtime.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens, max_tokens: int = 8) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_tokens)


def compute(kv: KVCacheManager, r: Request, n: int | None = None, cached=None) -> None:
    """Schedule and 'compute' `n` tokens (default: all the rest) as one step would."""
    cached = cached or []
    n = r.num_tokens - r.num_computed_tokens - len(cached) * kv.block_size if n is None else n
    assert kv.allocate_slots(r, n, cached)
    r.num_computed_tokens += n


def refcounts(kv: KVCacheManager, ids) -> list[int]:
    return [kv.pool.blocks[b].ref_count for b in ids]


@pytest.mark.parametrize("num_tokens, blocks", [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_slots_block_counts_at_boundaries(num_tokens, blocks):
    kv = KVCacheManager(10, BS)
    r = req("a", range(100, 100 + num_tokens))
    assert kv.allocate_slots(r, num_tokens)
    assert len(r.block_ids) == blocks and len(set(r.block_ids)) == blocks
    assert kv.num_free_blocks == 10 - blocks


def test_allocate_slots_grows_one_block_per_boundary_crossed():
    kv = KVCacheManager(10, BS)
    r = req("a", range(3))
    compute(kv, r, 3)
    assert len(r.block_ids) == 1
    for token, expected in [(50, 1), (51, 2), (52, 2), (53, 2), (54, 2), (55, 3)]:
        r.append_token(token)  # 4, 5, ... tokens; the newest is computed next
        compute(kv, r, 1)
        assert len(r.block_ids) == expected, r.num_tokens
    # Already-held slots need no new block.
    assert kv.allocate_slots(r, 0) and len(r.block_ids) == 3


def test_chunked_allocation_matches_one_shot():
    kv = KVCacheManager(10, BS)
    r = req("a", range(11))
    compute(kv, r, 3)
    assert len(r.block_ids) == 1
    compute(kv, r, 2)
    assert len(r.block_ids) == 2
    compute(kv, r, 6)
    assert len(r.block_ids) == 3 and kv.num_free_blocks == 7


def test_allocate_slots_fails_without_changes_when_pool_too_small():
    kv = KVCacheManager(3, BS)
    a = req("a", range(8))
    compute(kv, a)  # 2 blocks
    b = req("b", range(50, 59))  # needs 3
    assert not kv.allocate_slots(b, 9)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and kv.num_free_blocks == 1
    # A growing request that needs one block more than is free fails too.
    a.append_token(7)
    assert not kv.allocate_slots(a, 6)  # 8 + 6 = 14 tokens -> 4 blocks
    assert len(a.block_ids) == 2 and kv.num_free_blocks == 1
    assert kv.allocate_slots(a, 1)
    assert len(a.block_ids) == 3 and kv.num_free_blocks == 0


def test_revived_cached_blocks_count_against_the_free_pool():
    kv = KVCacheManager(3, BS)
    a = req("a", range(9))
    compute(kv, a)  # 3 blocks, first 2 indexed
    ids = list(a.block_ids)
    kv.free(a)
    assert kv.num_free_blocks == 3
    b = req("b", list(range(8)) + [70, 71, 72, 73, 74])  # 13 tokens: 4 blocks
    cached = kv.find_cached_blocks(b)
    assert cached == ids[:2]
    # 2 revived + 2 new > 3 free: refuse, and do not adopt the cached blocks.
    assert not kv.allocate_slots(b, 5, cached)
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert kv.num_free_blocks == 3 and refcounts(kv, cached) == [0, 0]
    # 2 revived + 1 new fit.
    assert kv.allocate_slots(b, 4, cached)
    assert b.block_ids[:2] == cached and b.num_computed_tokens == 8 and kv.num_free_blocks == 0


def test_prefix_hit_shares_full_blocks():
    kv = KVCacheManager(10, BS)
    a = req("a", range(10))  # blocks [0..3] [4..7] [8, 9]
    compute(kv, a)
    b = req("b", list(range(8)) + [42, 43, 44])
    cached = kv.find_cached_blocks(b)
    assert cached == a.block_ids[:2]
    compute(kv, b, cached=cached)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert b.num_computed_tokens == 11
    assert refcounts(kv, a.block_ids) == [2, 2, 1]
    # A different first block means nothing downstream matches either (chained hashes).
    c = req("c", [99] + list(range(1, 8)) + [1])
    assert kv.find_cached_blocks(c) == []


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(10, BS)
    a = req("a", range(8))
    compute(kv, a)
    assert len(kv.pool.cached) == 2  # both blocks are full and indexed
    b = req("b", range(8))
    cached = kv.find_cached_blocks(b)
    assert cached == a.block_ids[:1]  # not the block holding the last token
    assert kv.allocate_slots(b, 4, cached)
    assert b.num_computed_tokens == 4 and b.num_tokens - b.num_computed_tokens == 4
    # One token past a full cached prefix: every full block hits, one token left to compute.
    c = req("c", range(9))
    cached = kv.find_cached_blocks(c)
    assert cached == a.block_ids[:2]
    assert kv.allocate_slots(c, 1, cached) and c.num_computed_tokens == 8
    # A single-token prompt can never hit.
    assert kv.find_cached_blocks(req("d", [0])) == []


def test_hit_counters():
    kv = KVCacheManager(10, BS)
    assert kv.hit_rate() == 0.0
    a = req("a", range(10))
    assert kv.find_cached_blocks(a) == []
    compute(kv, a)
    assert (kv.num_cache_queries, kv.num_cache_hits) == (10, 0)
    b = req("b", list(range(8)) + [42, 43])
    kv.find_cached_blocks(b)
    assert (kv.num_cache_queries, kv.num_cache_hits) == (20, 8)
    assert kv.hit_rate() == pytest.approx(8 / 20)


def test_caching_disabled_gives_no_hits():
    kv = KVCacheManager(10, BS, enable_caching=False)
    a = req("a", range(10))
    compute(kv, a)
    assert not kv.pool.cached and a.block_hashes == []
    b = req("b", range(10))
    assert kv.find_cached_blocks(b) == []
    assert kv.num_cache_queries == 0 and kv.hit_rate() == 0.0
    kv.free(a)
    assert kv.find_cached_blocks(req("c", range(10))) == []


def test_prompt_logprob_requests_get_no_hits():
    kv = KVCacheManager(10, BS)
    compute(kv, req("a", range(10)))
    b = Request("b", list(range(10)), SamplingParams(prompt_logprobs=1), 4)
    assert kv.find_cached_blocks(b) == []


def test_hashes_follow_the_chain_and_index_only_full_computed_blocks():
    kv = KVCacheManager(10, BS)
    a = req("a", range(10))
    compute(kv, a, 5)  # one full block after this step
    h0 = hash_block(None, [0, 1, 2, 3])
    assert a.block_hashes == [h0] and a.num_indexed_blocks == 1
    assert kv.pool.lookup(h0) == a.block_ids[0]
    compute(kv, a)  # 10 tokens: two full blocks
    h1 = hash_block(h0, [4, 5, 6, 7])
    assert a.block_hashes == [h0, h1] and a.num_indexed_blocks == 2
    assert kv.pool.lookup(h1) == a.block_ids[1]
    assert len(kv.pool.cached) == 2  # the partial third block is not indexed
    # Generated tokens extend the chain once their block is full.
    for t in (20, 21):
        a.append_token(t)
        compute(kv, a, 1)
    assert len(a.block_hashes) == 3
    assert kv.pool.lookup(hash_block(h1, [8, 9, 20, 21])) == a.block_ids[2]


def test_free_releases_tail_first_and_keeps_the_prefix_cached():
    kv = KVCacheManager(4, BS)
    a = req("a", range(12))
    compute(kv, a)
    ids = list(a.block_ids)
    kv.free(a)
    assert a.block_ids == [] and a.num_computed_tokens == 0 and a.num_indexed_blocks == 0
    assert list(kv.pool.free) == [3] + ids[::-1]  # the never-used block, then tail first
    # New allocations evict the tail of the old request first; its prefix still hits.
    other = req("x", range(100, 108))
    compute(kv, other)
    assert other.block_ids == [3, ids[2]]
    b = req("b", list(range(8)) + [55])
    assert kv.find_cached_blocks(b) == ids[:2]


def test_freed_request_revives_its_own_blocks():
    kv = KVCacheManager(4, BS)
    a = req("a", range(10))
    compute(kv, a)
    ids = list(a.block_ids)
    a.append_token(77)
    kv.free(a)  # as a preemption does
    cached = kv.find_cached_blocks(a)
    assert cached == ids[:2]
    assert kv.allocate_slots(a, 3, cached)
    assert a.block_ids[:2] == ids[:2] and a.num_computed_tokens == 8
    assert refcounts(kv, ids[:2]) == [1, 1]


def test_adopting_a_running_requests_prompt_blocks_refcounts():
    """How n > 1 siblings share their leader's prompt: its full blocks are adopted as computed."""
    kv = KVCacheManager(10, BS, enable_caching=False)
    parent = req("p", range(10))
    compute(kv, parent)
    parent.append_token(50)
    child = req("c", range(10))
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(child, 2, parent.block_ids[:2])  # 2 full blocks + the 2-token tail
    assert child.block_ids[:2] == parent.block_ids[:2]
    assert child.num_computed_tokens == 8
    assert refcounts(kv, parent.block_ids) == [2, 2, 1]
    assert len(child.block_ids) == 3 and child.block_ids[2] != parent.block_ids[2]
    assert kv.num_free_blocks == free_before - 1
    kv.free(parent)
    assert refcounts(kv, child.block_ids) == [1, 1, 1]
    kv.free(child)
    assert kv.num_free_blocks == 10


def test_free_unindexes_blocks_scheduled_but_never_computed():
    """A request preempted in the step that scheduled it: blocks it indexed for that step hold
    no KV, so nobody may hit them, and its own hash chain stops at what was computed."""
    kv = KVCacheManager(10, BS)
    a = req("a", range(12))
    compute(kv, a, 4)
    assert kv.allocate_slots(a, 8)  # indexes blocks 1 and 2, then is never computed
    assert len(kv.pool.cached) == 3
    kv.free(a)
    assert len(kv.pool.cached) == 1 and a.block_hashes == [hash_block(None, [0, 1, 2, 3])]
    b = req("b", range(12))
    assert len(kv.find_cached_blocks(b)) == 1
    # a itself recomputes everything past its first block.
    cached = kv.find_cached_blocks(a)
    assert len(cached) == 1 and kv.allocate_slots(a, 8, cached)
    assert a.num_computed_tokens == 4


def test_block_changes_say_what_was_kept_and_what_is_new():
    kv = KVCacheManager(10, BS)
    r = req("a", range(6))
    compute(kv, r)
    assert kv.take_block_changes(r) == (0, r.block_ids) and len(r.block_ids) == 2
    assert kv.take_block_changes(r) == (2, [])  # nothing changed since
    r.all_token_ids += [7, 8, 9]
    assert kv.allocate_slots(r, 3, num_lookahead_tokens=4)  # positions 6..8, then 4 slots
    del r.all_token_ids[7:]  # proposals rejected: 7 tokens fit in two blocks
    kv.trim(r)
    assert kv.take_block_changes(r) == (2, []) and len(r.block_ids) == 2
    assert kv.allocate_slots(r, 5)
    kept, new = kv.take_block_changes(r)
    assert kept == 2 and new == r.block_ids[2:] and len(new) == 1
    assert kv.allocate_slots(r, 1, num_lookahead_tokens=8)
    del r.all_token_ids[4:]
    kv.trim(r)  # grown, then cut below the length last taken: the cut shows
    assert kv.take_block_changes(r) == (1, []) and len(r.block_ids) == 1


def test_state_slots_are_held_while_running_and_returned_on_free():
    """A hybrid model's requests each take a recurrent state slot with their first blocks; a
    request finding none free is refused, changing nothing; free (finish, abort, preemption)
    returns the slot."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False, num_state_slots=2)
    a, b, c = req("a", range(5)), req("b", range(3)), req("c", range(2))
    compute(kv, a, 2)
    compute(kv, a, 3)  # a later chunk keeps its slot
    compute(kv, b)
    assert {a.state_slot, b.state_slot} == {0, 1}
    free_blocks = kv.num_free_blocks
    assert not kv.allocate_slots(c, 2)
    assert c.state_slot is None and c.block_ids == [] and kv.num_free_blocks == free_blocks
    slot = a.state_slot
    kv.free(a)
    assert a.state_slot is None
    compute(kv, c)
    assert c.state_slot == slot


def test_dense_models_take_no_state_slot():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    r = req("a", range(3))
    compute(kv, r)
    assert r.state_slot is None


# -- a hybrid model's state checkpoints --------------------------------------------------------

def checkpointed(kv: KVCacheManager, r: Request, n: int) -> list[tuple[int, int]]:
    """Schedule `n` tokens as one step would, with the checkpoints it orders."""
    assert kv.allocate_slots(r, n)
    orders = kv.take_checkpoint_orders(r)
    kv.checkpoints.end_step()
    r.num_computed_tokens += n
    return orders


def test_checkpoints_at_interval_and_last_resumable_block_and_hits_end_there():
    kv = KVCacheManager(20, BS, num_state_slots=2, num_checkpoints=8, checkpoint_interval=2)
    a = req("a", range(100, 115))  # 15 tokens: blocks 1-3 full, resumable up to block 3
    # chunks of 6 and 9: block ends 4 (odd: skipped), 8 and 12 (the prompt's last resumable)
    assert [p for p, _ in checkpointed(kv, a, 6)] == []
    assert [p for p, _ in checkpointed(kv, a, 9)] == [7, 11]
    b = req("b", list(range(100, 114)) + [7])  # shares 14 tokens: 3 full cached blocks
    hits = kv.find_cached_blocks(b)
    assert hits == a.block_ids[:3]  # block 3 has a checkpoint
    assert kv.allocate_slots(b, b.num_tokens - 12, hits)
    assert kv.take_restore(b) == kv.checkpoints.lookup(a.block_hashes[2])
    c = req("c", list(range(100, 110)) + [7])  # shares 10 tokens: resumes after block 2
    assert kv.find_cached_blocks(c) == a.block_ids[:2]
    d = req("d", list(range(100, 106)) + [7])  # shares 6: block 1 has no checkpoint
    assert kv.find_cached_blocks(d) == []


def test_a_block_leaving_the_cache_takes_its_checkpoint():
    kv = KVCacheManager(4, BS, num_state_slots=1, num_checkpoints=8)
    a = req("a", range(100, 109))  # 9 tokens: checkpoints after blocks 1 and 2
    assert len(checkpointed(kv, a, 9)) == 2
    kv.free(a)
    b = req("b", range(200, 216))  # takes every block: a's are evicted
    checkpointed(kv, b, 16)
    assert not {kv.checkpoints.lookup(h) for h in a.block_hashes} - {None}
    assert len(kv.checkpoints) == 4  # each of b's blocks


def test_a_prefix_checkpointed_by_this_step_is_resumed_from_the_next():
    kv = KVCacheManager(10, BS, num_state_slots=2, num_checkpoints=8)
    a = req("a", range(100, 109))
    assert kv.allocate_slots(a, 9)  # this step computes a's blocks 1 and 2
    b = req("b", list(range(100, 108)) + [5, 6])
    assert kv.find_cached_blocks(b) == [] and kv.resumes_deeper_next_step(b)
    assert len(kv.take_checkpoint_orders(a)) == 2
    kv.checkpoints.end_step()
    a.num_computed_tokens = 9
    assert not kv.resumes_deeper_next_step(b)
    assert kv.find_cached_blocks(b) == a.block_ids[:2]


def test_a_full_store_gives_up_its_least_recently_used_checkpoint():
    kv = KVCacheManager(10, BS, num_state_slots=2, num_checkpoints=2)
    a = req("a", range(100, 113))
    assert len(checkpointed(kv, a, 6)) == 1
    assert len(checkpointed(kv, a, 7)) == 2  # blocks 2 and 3: the second takes block 1's entry
    assert kv.checkpoints.lookup(a.block_hashes[0]) is None and kv.checkpoints.num_evicted == 1
    assert kv.find_cached_blocks(req("b", list(range(100, 113)) + [1])) == a.block_ids[:3]
