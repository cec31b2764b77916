"""The request fields that constrain the output, as one `StructuredOutputsParams`: OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` names. Reading them is
cheap and done as the body is read; the grammar backend's check runs later, in the server's
`GrammarChecker` (worker processes), through `check_constraint`."""
from __future__ import annotations

from typing import Any

from runtime.entrypoints.errors import bad_request
from runtime.structured_output import StructuredOutputsParams
from runtime.structured_output.checker import GrammarChecker

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None; a 400 naming the field when it is malformed
    or when two fields ask for one (the request must say which it means)."""
    asked: dict[str, StructuredOutputsParams] = {}
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        asked["response_format"] = _from_response_format(response_format)
    if body.structured_outputs is not None:
        asked["structured_outputs"] = checked("structured_outputs", body.structured_outputs)
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            asked[name] = checked(name, {kind: value})
    if len(asked) > 1:
        raise bad_request(f"{' and '.join(asked)} each constrain the output: give only one",
                          param=list(asked)[1])
    return next(iter(asked.values()), None)


def constraint_field(body: Any) -> str:
    """The request field that gave the body's constraint (for errors about it)."""
    if body.response_format is not None and body.response_format.type != "text":
        return "response_format"
    return "structured_outputs" if body.structured_outputs is not None else \
        next((name for name in GUIDED if getattr(body, name) is not None), "structured_outputs")


def _from_response_format(response_format: Any) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return checked("response_format", {"json_object": True})
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          param="response_format")
    return checked("response_format", {"json": spec.json_schema})


def checked(param: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    """The constraint `fields` describe; a 400 naming `param` when it is malformed."""
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param}: {e}", param=param) from None


async def check_constraint(checker: GrammarChecker, params: StructuredOutputsParams,
                           param: str) -> None:
    """The grammar backend's check of a request's constraint, off the event loop; a 400
    naming `param` when the backend cannot take it or checking it passes a server limit."""
    try:
        await checker.check(params)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param) from None
