"""The request fields that constrain the output, as one `StructuredOutputsParams`: OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` names."""
from __future__ import annotations

from typing import Any

from runtime.entrypoints.errors import bad_request
from runtime.structured_output import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def structured_outputs_of(body: Any, backend: str) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None; a 400 naming the field when it is malformed,
    when the grammar `backend` cannot take it, or when two fields ask for one (the request must
    say which it means)."""
    asked: dict[str, StructuredOutputsParams] = {}
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        asked["response_format"] = _from_response_format(response_format, backend)
    if body.structured_outputs is not None:
        asked["structured_outputs"] = checked("structured_outputs", body.structured_outputs,
                                              backend)
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            asked[name] = checked(name, {kind: value}, backend)
    if len(asked) > 1:
        raise bad_request(f"{' and '.join(asked)} each constrain the output: give only one",
                          param=list(asked)[1])
    return next(iter(asked.values()), None)


def _from_response_format(response_format: Any, backend: str) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return checked("response_format", {"json_object": True}, backend)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          param="response_format")
    return checked("response_format", {"json": spec.json_schema}, backend)


def checked(param: str, fields: dict[str, Any], backend: str) -> StructuredOutputsParams:
    """The constraint `fields` describe, checked by the configured grammar `backend`; a 400
    naming `param` when it is malformed or the backend cannot take it."""
    try:
        params = StructuredOutputsParams(**fields)
        from runtime.structured_output.backends import check
        check(params, backend)
        return params
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param}: {e}", param=param) from None
