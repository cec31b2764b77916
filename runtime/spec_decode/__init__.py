"""Speculative decoding: proposers (n-gram, draft model) and the rejection sampler; the
scheduler keeps its counters (`runtime.core.spec_stats`)."""
from runtime.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
