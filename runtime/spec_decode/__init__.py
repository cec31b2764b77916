"""Speculative decoding: proposers (n-gram, draft model), the rejection sampler, and its stats."""
from runtime.spec_decode.config import SpeculativeConfig
from runtime.core.spec_stats import SpecDecodeStats

__all__ = ["SpecDecodeStats", "SpeculativeConfig"]
