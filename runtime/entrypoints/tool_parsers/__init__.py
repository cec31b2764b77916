"""Tool calls in model output: one parser per model family's format (`--tool-call-parser`),
and the JSON schemas that force a call (tool_choice "required" or a named function)."""
from __future__ import annotations

from runtime.entrypoints.tool_parsers.parsers import (TOOL_PARSERS, ToolCall, ToolParser,
                                                      forced_call_schema, forced_calls)
from runtime.entrypoints.tool_parsers.tool_choice import ToolChoice, template_messages

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolChoice", "ToolParser", "forced_call_schema",
           "forced_calls", "template_messages"]
