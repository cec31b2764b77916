"""Structured outputs: the output constrained to a JSON schema, a regex, a choice or a grammar
(xgrammar). `params` is imported by `SamplingParams`; `grammar` and `manager` load xgrammar."""
from runtime.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
