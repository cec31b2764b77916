"""What a chat template does with tools: does it show them to the model, and which tool-call
parser reads the calls it teaches the model to write."""
from __future__ import annotations

import logging

import jinja2
import jinja2.meta

logger = logging.getLogger(__name__)

# Text a template puts in the prompt to show the model how to call, and the parser that reads
# calls written that way.
_CALL_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                 ("<|python_tag|>", "llama3_json"))


def tool_template(template: str | dict | None) -> str | None:
    """The template that renders requests with tools: the template itself, or of a tokenizer's
    named templates the `tool_use` one, else the `default` one."""
    if isinstance(template, dict):
        return template.get("tool_use") or template.get("default")
    return template


def renders_tools(template: str) -> bool:
    """Whether the template reads the `tools` variable at all (a template that never reads it
    drops the tools, and the model cannot call what it never saw)."""
    parsed = jinja2.Environment().parse(template)
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def tool_call_parser_for(template: str) -> str | None:
    """The parser for the call format the template teaches, if it teaches one we read."""
    for marker, parser in _CALL_MARKERS:
        if marker in template:
            return parser
    return None


def tool_call_parser_of(template: str | dict | None, model_name: str, parser: str | None,
                        auto_tool_choice: bool) -> str | None:
    """`--tool-call-parser`, or under `--enable-auto-tool-choice` without one the parser of the
    call format the chat template teaches (ValueError when it teaches none we read). Warns
    when the template drops `tools`."""
    template = tool_template(template)
    if template is not None and not renders_tools(template):
        logger.warning(
            "the chat template of %s does not render `tools`: requests with tools reach the "
            "model without them, so it cannot choose to call one (tool_choice 'required' or a "
            "named function still force calls); for ChatML models such as SmolLM2 start with "
            "--chat-template examples/chat_templates/chatml_tools.jinja", model_name)
    if not auto_tool_choice or parser is not None:
        return parser
    parser = tool_call_parser_for(template) if template is not None else None
    if parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: the chat template "
                         "teaches no call format that a parser here reads")
    logger.info("tool calls are read with the %s parser (the chat template's call format)",
                parser)
    return parser
