"""The n-gram (prompt-lookup) proposer: continue the sequence as it went on after an earlier
occurrence of its own suffix."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from runtime.config.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from runtime.core.messages import ScheduledRequest, StepOutput


class NgramProposer:
    """Proposals are one-hot: verification accepts d with the target's probability p(d). A
    step hook of the model runner (`runtime.worker.step_hooks`) that keeps nothing per request."""

    kv_bytes_per_block = 0  # no cache of its own

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def draft_probs(self, request_id: str, num_tokens: int) -> None:
        return None

    def before_forward(self, reqs: list[ScheduledRequest], batch: object) -> None:
        pass

    def after_sampling(self, reqs: list[ScheduledRequest], out: StepOutput) -> None:
        out.draft_token_ids = self.propose(reqs, out.sampled)

    def finish(self, request_ids: list[str]) -> None:
        pass

    def propose(self, reqs: list[ScheduledRequest],
                emitted: dict[str, list[int]]) -> dict[str, list[int]]:
        """Proposals for each request that emitted tokens this step, from its whole sequence."""
        drafts = {}
        for r in reqs:
            new = emitted.get(r.request_id)
            if new:
                tokens = self.lookup(r.all_token_ids + new)
                if tokens:
                    drafts[r.request_id] = tokens
        return drafts

    def lookup(self, token_ids: list[int]) -> list[int]:
        """Up to k tokens that followed the first earlier occurrence of the longest suffix of
        `token_ids` (min_n..max_n tokens long); [] when no such suffix occurred before.

        The first occurrence, not the latest: in a sequence that repeats itself, it has the
        longest known continuation.
        """
        length = len(token_ids)
        if length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length-n-1: each has at least one token after it
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return token_ids[start:start + self.k]
        return []
