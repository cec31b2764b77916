"""Tool calls in model output: one parser per model family's format (`--tool-call-parser`),
readers that find the calls while the output streams, and the JSON schemas that force a call
(tool_choice "required" or a named function)."""
from __future__ import annotations

from runtime.entrypoints.tool_parsers.calls import ToolCall
from runtime.entrypoints.tool_parsers.parsers import TOOL_PARSERS, ToolParser
from runtime.entrypoints.tool_parsers.streaming import CallReader, Delta
from runtime.entrypoints.tool_parsers.tool_choice import (ToolChoice, forced_call_schema,
                                                          template_messages)

__all__ = ["TOOL_PARSERS", "CallReader", "Delta", "ToolCall", "ToolChoice", "ToolParser",
           "forced_call_schema", "template_messages"]
