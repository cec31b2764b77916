"""The scheduler's view of the encoder cache: which items' embeddings the workers hold, counted
in embedding tokens, shared between requests with the same item (by content hash).

An entry is referenced by the requests that still need it (their placeholders are not all
computed); unreferenced entries stay, least recently used first out, until the space is
needed. The workers keep the tensors, encode the items a step needs that they lack, and drop
an entry when the step's message says so (`take_evicted`).
"""
from __future__ import annotations

from collections import OrderedDict

from runtime.request import Request


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.sizes: dict[str, int] = {}  # identifier -> embedding tokens held
        self.users: dict[str, set[str]] = {}  # identifier -> request ids that still need it
        self.unused: OrderedDict[str, None] = OrderedDict()  # unreferenced, oldest first
        self.num_used_tokens = 0
        self._evicted: list[str] = []
        self.num_queries = 0  # items needed by a request for the first time
        self.num_hits = 0  # of those, already cached (no encoder run)

    def in_use(self, request: Request, index: int) -> bool:
        """Whether `request` already holds item `index` (an earlier chunk needed it)."""
        return request.request_id in self.users.get(request.mm_features[index].identifier, ())

    def hit(self, request: Request, index: int) -> bool:
        """Whether item `index`, which `request` needs now for the first time, is cached; if
        so, the request now uses it (counted as a hit)."""
        identifier = request.mm_features[index].identifier
        if identifier not in self.sizes:
            return False
        self.num_queries += 1
        self.num_hits += 1
        self._use(identifier, request.request_id)
        return True

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether `num_tokens` fit, once unreferenced entries are evicted as needed."""
        free = self.capacity - self.num_used_tokens
        return num_tokens <= free + sum(self.sizes[i] for i in self.unused)

    def allocate(self, request: Request, index: int) -> None:
        """Reserve room for item `index`, whose encoder output the workers compute this step."""
        feature = request.mm_features[index]
        self.num_queries += 1
        while self.capacity - self.num_used_tokens < feature.length:
            oldest, _ = self.unused.popitem(last=False)
            self.num_used_tokens -= self.sizes.pop(oldest)
            self.users.pop(oldest, None)
            self._evicted.append(oldest)
        self.sizes[feature.identifier] = feature.length
        self.num_used_tokens += feature.length
        self._use(feature.identifier, request.request_id)

    def _use(self, identifier: str, request_id: str) -> None:
        self.users.setdefault(identifier, set()).add(request_id)
        self.unused.pop(identifier, None)

    def release(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """The request no longer needs the items whose placeholders end within its first
        `num_computed_tokens` (None: any of them, it finished or was preempted)."""
        for feature in request.mm_features:
            if num_computed_tokens is not None and feature.end > num_computed_tokens:
                continue
            users = self.users.get(feature.identifier)
            if users is None or request.request_id not in users:
                continue
            users.discard(request.request_id)
            if not users:
                self.unused[feature.identifier] = None

    def take_evicted(self) -> list[str]:
        """The entries evicted since the last call: the workers drop them."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0
