"""Counters of speculative decoding, kept by the scheduler as it verifies proposals."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # request-steps that verified at least one proposed token
    num_draft_tokens: int = 0  # proposed tokens verified by the target model
    num_accepted_tokens: int = 0  # of those, the ones accepted

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted share of the proposed tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step emits per request on average: accepted ones plus the one the
        target samples itself (1.0 = no gain)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
