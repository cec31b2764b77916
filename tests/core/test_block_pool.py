"""BlockPool: reference counts, the LRU free list, and the prefix-cache index."""
from __future__ import annotations

import pytest

from runtime.core.block_pool import BlockPool, hash_block


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free)


def test_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_from_the_front_with_one_reference():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.usage() == 0.0
    assert pool.allocate(2) == [0, 1]
    assert [pool.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 0]
    assert free_order(pool) == [2, 3]
    assert pool.num_free_blocks == 2 and pool.usage() == 0.5
    assert pool.allocate(0) == []


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert free_order(pool) == [2]


def test_release_order_is_eviction_order():
    pool = BlockPool(6)
    a = pool.allocate(3)  # 0 1 2
    b = pool.allocate(3)  # 3 4 5
    pool.release([b[2], b[0]])
    pool.release([a[1]])
    pool.release([b[1], a[0]])
    # Freed blocks join the back in release order; allocation takes from the front.
    assert free_order(pool) == [5, 3, 1, 4, 0]
    assert pool.allocate(2) == [5, 3]
    pool.release([a[2]])
    assert free_order(pool) == [1, 4, 0, 2]
    assert pool.allocate(4) == [1, 4, 0, 2]
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0


def test_reference_counts():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.touch([b])
    pool.touch([b])
    assert pool.blocks[b].ref_count == 3
    pool.release([b])
    pool.release([b])
    assert pool.blocks[b].ref_count == 1 and b not in pool.free
    pool.release([b])
    assert pool.blocks[b].ref_count == 0 and free_order(pool) == [1, b]


def test_double_release_raises():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([b])
    with pytest.raises(RuntimeError):
        pool.release([1])  # never allocated
    assert free_order(pool) == [1, 0]


def test_hash_block_chains_on_the_prefix():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert h1 == hash_block(None, (1, 2, 3, 4))
    assert h1 != hash_block(None, [1, 2, 3, 5])
    a = hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    b = hash_block(hash_block(None, [8, 8, 8, 8]), [5, 6, 7, 8])
    assert a != b  # same tokens after a different prefix
    assert a == hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [5, 6, 7, 8]) not in (a, b)
    # Large token ids and order both matter.
    assert hash_block(None, [2**40, 1]) != hash_block(None, [1, 2**40])


def test_cache_and_lookup():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    h = hash_block(None, [1, 2])
    assert pool.lookup(h) is None
    pool.cache(b, h)
    assert pool.lookup(h) == b and pool.blocks[b].block_hash == h
    # A second block with the same contents does not take over the index entry.
    [c] = pool.allocate(1)
    pool.cache(c, h)
    assert pool.lookup(h) == b and pool.blocks[c].block_hash is None
    # A block keeps its first hash.
    pool.cache(b, hash_block(None, [3, 4]))
    assert pool.blocks[b].block_hash == h and pool.lookup(hash_block(None, [3, 4])) is None


def test_freed_cached_block_is_revived_by_touch():
    pool = BlockPool(4)
    [b] = pool.allocate(1)  # 0
    h = hash_block(None, [7])
    pool.cache(b, h)
    pool.release([b])
    assert free_order(pool) == [1, 2, 3, 0]
    assert pool.lookup(h) == b  # still cached while free
    pool.touch([pool.lookup(h)])
    assert pool.blocks[b].ref_count == 1
    assert b not in pool.free and pool.num_free_blocks == 3
    assert pool.lookup(h) == b
    assert pool.allocate(3) == [1, 2, 3]  # the revived block is not handed out


def test_freed_cached_block_is_evicted_when_handed_out():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    pool.cache(a, ha)
    pool.cache(b, hb)
    pool.release([b, a])  # b is the more evictable
    assert pool.allocate(1) == [b]
    assert pool.lookup(hb) is None and pool.blocks[b].block_hash is None
    assert pool.lookup(ha) == a  # the other one is still cached
    # The evicted block can be indexed again under another hash.
    hc = hash_block(None, [3])
    pool.cache(b, hc)
    assert pool.lookup(hc) == b


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(2, enable_caching=False)
    [b] = pool.allocate(1)
    h = hash_block(None, [1])
    pool.cache(b, h)
    assert pool.lookup(h) is None and pool.blocks[b].block_hash is None and not pool.cached


def test_reset_prefix_cache():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    pool.cache(a, ha)
    pool.cache(b, hb)
    pool.release([a])
    assert pool.reset_prefix_cache() is False  # b is still in use
    assert pool.lookup(ha) == a and pool.lookup(hb) == b
    pool.release([b])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(ha) is None and pool.lookup(hb) is None
    assert all(blk.block_hash is None for blk in pool.blocks)
    assert pool.num_free_blocks == 3
