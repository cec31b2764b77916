"""runtime: a hardware-pluggable LLM inference engine."""
from runtime.beam_search import BeamSearchParams
from runtime.llm import LLM
from runtime.outputs import CompletionOutput, RequestOutput
from runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
