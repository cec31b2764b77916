"""Sampling: turn logits into tokens, batched over the requests of a step."""
from runtime.sampling.batch import SamplingBatch
from runtime.sampling.sampler import Sampler, SamplerOutput, gather_logprobs

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "gather_logprobs"]
