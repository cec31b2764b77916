"""Per-request block tables on top of the block pool, with prefix caching by chained hashes.

The manager is the only writer of `Request.block_ids`, and it records where each table changed,
so the engine can send the workers only the new part (`take_block_changes`).

A hybrid model's recurrent layers keep a fixed-size state per request instead of KV: the
manager also owns `num_state_slots` state slots, one held by each running request
(`Request.state_slot`) from its first scheduled step until it is preempted or retired. With
prefix caching, the state at the end of full blocks is checkpointed into `num_checkpoints`
host entries (`runtime.core.state_checkpoints`), ordered with the slots of the step that
completes them (`take_checkpoint_orders`): a prefix hit resumes from the deepest cached block
that has one, its slot filled from it (`take_restore`).
"""
from __future__ import annotations

from runtime.core.block_pool import BlockPool, hash_block
from runtime.core.state_checkpoints import CheckpointIndex
from runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_state_slots: int = 0, num_checkpoints: int = 0,
                 checkpoint_interval: int = 1) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # pop() takes slot 0
        self.checkpoints = CheckpointIndex(num_checkpoints)
        self.checkpoint_interval = checkpoint_interval
        self.pool.on_uncache = self.checkpoints.drop
        self._restores: dict[str, int] = {}  # request id -> the entry its slot starts from
        # request id -> (position, entry, block hash) of the checkpoints its step makes
        self._orders: dict[str, list[tuple[int, int, bytes]]] = {}
        self.num_cache_queries = 0  # prompt tokens looked up, for the hit rate
        self.num_cache_hits = 0
        # request id -> the first index of its block table changed since `take_block_changes`
        self._changed_from: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _changed(self, request: Request, index: int) -> None:
        rid = request.request_id
        self._changed_from[rid] = min(self._changed_from.get(rid, index), index)

    def take_block_changes(self, request: Request) -> tuple[int, list[int]]:
        """How the request's block table changed since the last call: the number of leading
        blocks that stayed, and the ids after them. Tables only grow at the end (new slots)
        and shrink at the end (`trim`), so these two describe any change."""
        start = self._changed_from.pop(request.request_id, len(request.block_ids))
        return start, request.block_ids[start:]

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's hash chain over its full blocks within the first `num_tokens`."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else request.cache_seed()
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs],
                                     request.mm_keys(i * bs, (i + 1) * bs)))

    def find_cached_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that prefixes this request's tokens.

        The last token is never served from the cache: it must be computed to produce logits.
        A request asking for prompt logprobs gets no hits: each prompt position must be computed.
        A hybrid model's run ends at the deepest block with a state checkpoint.
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return []
        self._update_hashes(request, request.num_tokens - 1)
        hits = []
        for block_hash in request.block_hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.num_state_slots:
            while hits and self.checkpoints.ready(request.block_hashes[len(hits) - 1]) is None:
                hits.pop()
        self.num_cache_queries += request.num_tokens
        self.num_cache_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens of `request` past its computed ones.

        `cached_blocks` (from `find_cached_blocks`, for a request not yet holding blocks) are
        adopted first and count as computed. `num_lookahead_tokens` more slots are reserved
        past those (a draft model writes the KV of its proposals there). New tokens past the
        request's known ones (speculative proposals) get slots but no prefix-cache entry.
        A request of a hybrid model takes a state slot with its first slots.
        Returns False, changing nothing, when the pool (or the state slots) is too small.
        """
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = cdiv(total + num_lookahead_tokens, self.block_size) - \
            len(request.block_ids) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return False
        if self.num_state_slots and request.state_slot is None:
            if not self.free_state_slots:
                return False
            request.state_slot = self.free_state_slots.pop()
        if cached_blocks or num_needed > 0:
            self._changed(request, len(request.block_ids))
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.block_ids.extend(cached_blocks)
            request.num_computed_tokens = num_computed
            if self.num_state_slots:
                entry = self.checkpoints.lookup(request.block_hashes[len(cached_blocks) - 1])
                self.checkpoints.use(entry)
                self._restores[request.request_id] = entry
        if num_needed > 0:
            request.block_ids.extend(self.pool.allocate(num_needed))
        if self.enable_caching:
            # Blocks that will be full after this step hold known tokens: index them now.
            num_full = min(total, request.num_tokens) // self.block_size
            self._update_hashes(request, num_full * self.block_size)
            for i in range(request.num_indexed_blocks, num_full):
                self.pool.cache(request.block_ids[i], request.block_hashes[i])
            request.num_indexed_blocks = max(request.num_indexed_blocks, num_full)
            if self.num_state_slots:
                self._order_checkpoints(request, num_computed, num_full * self.block_size)
        return True

    def take_restore(self, request: Request) -> int | None:
        """The checkpoint entry the request's state slot is filled from before this step (it
        was admitted on a cached prefix), once."""
        return self._restores.pop(request.request_id, None)

    def take_checkpoint_orders(self, request: Request) -> list[tuple[int, int]]:
        """The checkpoints the request's step makes, as (position of the token after which the
        state is kept, store entry), once."""
        return [(pos, entry) for pos, entry, _ in self._orders.pop(request.request_id, [])]

    def _order_checkpoints(self, request: Request, start: int, end: int) -> None:
        """Order a checkpoint at the end of each block the step completes (of its known tokens
        [start, end)) that has none yet: every `checkpoint_interval` blocks, and at the
        request's deepest resumable block (the one before its prompt's last token, from which
        its n > 1 siblings and a repeat of the prompt resume)."""
        bs, every = self.block_size, self.checkpoint_interval
        last = (request.num_prompt_tokens - 1) // bs
        for block in range(start // bs + 1, end // bs + 1):
            block_hash = request.block_hashes[block - 1]
            if (block % every and block != last) or self.checkpoints.lookup(block_hash) is not None:
                continue
            entry = self.checkpoints.add(block_hash)
            if entry is None:
                break
            self._orders.setdefault(request.request_id, []).append(
                (block * bs - 1, entry, block_hash))

    def resumes_deeper_next_step(self, request: Request) -> bool:
        """Whether a checkpoint this step makes lies on the request's cached prefix deeper than
        any it could resume from now: it had better wait a step than compute that part too."""
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return False
        self._update_hashes(request, request.num_tokens - 1)
        pending = False
        for block_hash in request.block_hashes:
            if self.pool.lookup(block_hash) is None:
                break
            entry = self.checkpoints.lookup(block_hash)
            if entry is not None:
                pending = entry in self.checkpoints.pending
        return pending

    def defer_indexing(self, request: Request, first_block: int) -> None:
        """Take the request's blocks from `first_block` on out of the prefix-cache index until
        they hold their KV (a KV connector loads them this step; `index_loaded` puts back those
        that arrived)."""
        self.pool.uncache(request.block_ids[first_block:request.num_indexed_blocks])
        request.num_indexed_blocks = min(request.num_indexed_blocks, first_block)

    def index_loaded(self, request: Request, first_block: int, num_blocks: int) -> None:
        """`num_blocks` blocks from `first_block` were loaded: they count as computed and
        join the prefix-cache index."""
        request.num_computed_tokens = (first_block + num_blocks) * self.block_size
        for i in range(first_block, first_block + num_blocks):
            self.pool.cache(request.block_ids[i], request.block_hashes[i])
        request.num_indexed_blocks = first_block + num_blocks

    def trim(self, request: Request) -> None:
        """Free the blocks past the request's tokens, after a speculative step rolled back its
        rejected proposals. They hold no accepted token, so nothing is lost: they go to the
        front of the free list."""
        keep = cdiv(request.num_tokens, self.block_size)
        if len(request.block_ids) > keep:
            self._changed(request, keep)
            self.pool.release(request.block_ids[keep:], evict_first=True)
            del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its shared prefix stays cached longest.

        A request preempted in the step that scheduled it has indexed blocks whose KV was never
        computed: they leave the index, and its hash chain is cut back to its computed blocks.
        """
        num_valid = request.num_computed_tokens // self.block_size
        self.pool.uncache(request.block_ids[num_valid:request.num_indexed_blocks])
        del request.block_hashes[num_valid:]
        self.pool.release(list(reversed(request.block_ids)))
        if request.state_slot is not None:
            self.free_state_slots.append(request.state_slot)
            request.state_slot = None
        self._restores.pop(request.request_id, None)
        for _, _, block_hash in self._orders.pop(request.request_id, []):
            self.checkpoints.drop(block_hash)  # preempted in the step that ordered them
        self._changed_from.pop(request.request_id, None)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_indexed_blocks = 0

    def hit_rate(self) -> float:
        return self.num_cache_hits / self.num_cache_queries if self.num_cache_queries else 0.0
