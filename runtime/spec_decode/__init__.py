"""Speculative decoding: proposers (n-gram, draft model) and the rejection sampler; the
scheduler keeps its counters (`runtime.core.spec_stats`)."""
from runtime.config.speculative import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
