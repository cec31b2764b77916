"""The pool of KV-cache blocks: reference counts, an LRU free list, and the prefix-cache index."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...],
               extra_keys: bytes = b"") -> bytes:
    """The chained hash of a full block: it names the block's tokens and every token before them,
    and `extra_keys` (the content hashes of the images whose placeholders the block holds)."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None


class BlockPool:
    """Owns every block. A block is free when its reference count is 0.

    Free blocks wait in LRU order; a free block may still hold a cached prefix (its hash stays in
    the index) until it is handed out again, so a later request can revive it for free.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # called with (block id, hash) for each cached block handed out again (a KV connector
        # saves its contents before this step's forward writes over them)
        self.on_evict: Callable[[int, bytes], None] | None = None
        # called with each hash that leaves the index (a hybrid's checkpoints go with it)
        self.on_uncache: Callable[[bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the least recently used end, evicting their cached hashes."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free)} free")
        ids = [self.free.popitem(last=False)[0] for _ in range(n)]
        if self.on_evict is not None:
            for block_id in ids:
                block = self.blocks[block_id]
                if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
                    self.on_evict(block_id, block.block_hash)
        self.uncache(ids)
        for block_id in ids:
            self.blocks[block_id].ref_count = 1
        return ids

    def uncache(self, block_ids: list[int]) -> None:
        """Drop these blocks' hashes from the prefix-cache index."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                if self.on_uncache is not None:
                    self.on_uncache(block.block_hash)
            block.block_hash = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on each block (reviving free cached blocks)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    def release(self, block_ids: list[int], evict_first: bool = False) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free list in this order,
        so pass the most evictable first. `evict_first` puts them at the front of the free list
        instead (blocks that hold nothing worth keeping)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if evict_first:
                    self.free.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Record that `block_id` holds the full block named by `block_hash`."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """Every block holding a cached prefix block, as (block id, hash): the free ones in LRU
        order, then those in use."""
        order = [*self.free, *(b.block_id for b in self.blocks if b.ref_count > 0)]
        return [(i, self.blocks[i].block_hash) for i in order
                if self.blocks[i].block_hash is not None
                and self.cached.get(self.blocks[i].block_hash) == i]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self.free) != self.num_blocks:
            return False
        if self.on_uncache is not None:
            for block_hash in self.cached:
                self.on_uncache(block_hash)
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
