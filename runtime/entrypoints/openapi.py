"""/openapi.json as the server answers: the error statuses each route can send, with the error
bodies' schemas (OpenAI's, or Anthropic's on /v1/messages), event streams beside JSON, and the
API key where it is required. FastAPI's own 422 is gone: a bad body is a 400 here."""
from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from runtime.sampling_params import INT64_MAX, INT64_MIN

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}}

WHY = {400: "invalid request (the message names the field and what is allowed)",
       401: "invalid or missing API key", 404: "no such model or adapter",
       408: "the request body did not all arrive within --body-timeout",
       413: "request body above --max-request-body-bytes",
       415: "the request body is not JSON (Content-Type other than application/json)",
       500: "the engine failed on this request, or is dead",
       503: "overloaded (the waiting queue is full) or the engine is restarting: retry after "
            "Retry-After seconds"}
GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
# One Server-Sent Event (before OpenAPI 3.2, an event stream's schema describes each event):
# `data` is a JSON chunk, an error body, or [DONE]; Anthropic's and the Responses API's events
# are named.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "data": {"type": "string"}}}


def _error(status: int, path: str) -> dict:
    schema = ANTHROPIC_ERROR if path.startswith("/v1/messages") else OPENAI_ERROR
    response: dict[str, Any] = {"description": WHY[status],
                                "content": {"application/json": {"schema": schema}}}
    if status == 503:
        response["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
    return response


def build_openapi(app: FastAPI, guarded: Callable[[str], bool] | None) -> dict:
    """The schema; `guarded` says which paths the API key guards (None: no key)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            responses = op["responses"]
            responses.pop("422", None)
            statuses = set()
            if "requestBody" in op:
                statuses |= {400, 408, 413, 415}
                if not path.endswith("_lora_adapter"):  # the others name a model: 404 if unknown
                    statuses.add(404)
            if path in GENERATING:
                statuses |= {500, 503}
                responses["200"]["content"]["text/event-stream"] = {"schema": SSE_EVENT}
            if path in ("/v1/models/{model}", "/v1/unload_lora_adapter"):
                statuses.add(404)
            if guarded is not None and guarded(path):
                statuses.add(401)
                op["security"] = [{"bearer": []}, {"x-api-key": []}]
            for status in sorted(statuses):
                responses[str(status)] = _error(status, path)
    health = schema["paths"]["/health"]["get"]["responses"]
    health["200"] = {"description": "the engine is running (empty body)"}
    health["503"] = {**_error(503, "/health"), "description": "the engine core is down "
                     "(restarting, or dead for good)"}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
        "text/plain": {"schema": {"type": "string"}}}
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if guarded is not None:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    _exact_int64_bounds(schema)
    return schema


def _exact_int64_bounds(schema: Any) -> None:
    """FastAPI's OpenAPI model stores bounds as floats: int64's, rounded to +-2**63, are put
    back to the exact integers (2**63 itself would be a value the server refuses)."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key in ("maximum", "minimum"):
                if item.get(key) == float(INT64_MAX):
                    item[key] = INT64_MAX
                elif item.get(key) == float(INT64_MIN):
                    item[key] = INT64_MIN
            stack.extend(item.values())
