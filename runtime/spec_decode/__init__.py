"""Speculative decoding: proposers (n-gram, draft model), the rejection sampler, and its stats."""
from runtime.config.speculative import SpeculativeConfig
from runtime.spec_decode.stats import SpecDecodeStats

__all__ = ["SpecDecodeStats", "SpeculativeConfig"]
