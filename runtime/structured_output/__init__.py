"""Structured outputs: the output constrained to a JSON schema, a regex, a choice or a grammar
(xgrammar). `params` is imported by `SamplingParams`; `grammar` loads xgrammar. The engine
core's side (waiting for grammars, matchers, the step's bitmask) is
`runtime.core.structured_output`."""
from runtime.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
