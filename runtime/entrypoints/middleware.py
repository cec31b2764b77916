"""The door every HTTP request passes: its id, the API key, and the body checks that run before
any route sees it (size, UTF-8, JSON, nesting depth, lone surrogates)."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.entrypoints.errors import APIError, bad_request, is_anthropic_path, route_path

logger = logging.getLogger(__name__)

MAX_JSON_DEPTH = 64  # arrays and objects nested deeper are refused (Python's parser recurses)
MAX_REQUEST_ID_CHARS = 128
# With an API key, every path needs it but these: /health (for probes) and the API schema,
OPEN_PATHS = ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
# and, unless --api-key-scope is "all", the utility routes.
UTILITY_PATHS = ("/tokenize", "/detokenize", "/metrics", "/version")


def needs_key(path: str, api_key_scope: str) -> bool:
    """Whether a server with an API key guards `path` (a path no route serves included)."""
    return path not in OPEN_PATHS and (api_key_scope == "all" or path not in UTILITY_PATHS)


class RequestContext:
    """ASGI middleware: gives every HTTP request an id for the logs and the X-Request-Id header
    (the client's, if printable and short, else a new one: it is a label only, never the
    engine's request id), checks the API key (`Authorization: Bearer KEY`, or Anthropic's
    `x-api-key: KEY`) on every path `needs_key` names, and checks request bodies
    (`BodyGuard`)."""

    def __init__(self, app: ASGIApp, api_key: str | None, api_key_scope: str,
                 max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.api_key = api_key
        self.api_key_scope = api_key_scope
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = _label(headers.get(b"x-request-id", b"")) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode("ascii"))]
            await send(message)

        path = route_path(scope)
        try:
            if scope["method"] != "OPTIONS" and needs_key(path, self.api_key_scope) \
                    and not self._authorized(headers):
                raise APIError(401, "invalid or missing API key", code="invalid_api_key")
            if scope["method"] in ("POST", "PUT", "PATCH"):
                guard = BodyGuard(self.max_body_bytes, self.body_timeout_s)
                receive = await guard.check(headers, receive)
        except APIError as e:
            log = logger.warning if e.status < 500 else logger.error
            log("request %s: %d on %s: %s", request_id, e.status, path, e.message)
            return await e.response(is_anthropic_path(path))(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None:
            return True
        key = self.api_key.encode()
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, key)


def _label(value: bytes) -> str:
    """A client's X-Request-Id if it is a short printable ASCII string, else ''."""
    if len(value) > MAX_REQUEST_ID_CHARS or not value.isascii():
        return ""
    text = value.decode("ascii")
    return text if text.isprintable() else ""


class BodyGuard:
    """Reads a request body (413 beyond `max_bytes`, 408 when it has not all come within
    `timeout_s`: a Content-Length larger than what is sent, or a client sending a byte now and
    then) and checks, off the event loop, that it is UTF-8 JSON nested at most MAX_JSON_DEPTH
    deep with no lone surrogate in any string (400 naming the top-level field). Returns a
    `receive` that replays the body to the route."""

    def __init__(self, max_bytes: int, timeout_s: float) -> None:
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def check(self, headers: dict[bytes, bytes], receive: Receive) -> Receive:
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            raise self._too_large()
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.timeout_s:g} s "
                           "(--body-timeout)") from None
        if body:
            _check_content_type(headers)
            await asyncio.to_thread(_check_json, body)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    async def _read(self, receive: Receive) -> bytes:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                raise APIError(400, "the client closed the request before sending its body")
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                raise self._too_large()
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes "
                        "(--max-request-body-bytes)")


def _check_content_type(headers: dict[bytes, bytes]) -> None:
    """A body is JSON: another declared type (curl -d's form type included) is a 415."""
    kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    if kind and kind != b"application/json" and not kind.endswith(b"+json"):
        raise APIError(415, "the request body must be JSON (Content-Type: application/json), "
                       f"got Content-Type: {kind[:100].decode('latin-1')}")


def _check_json(body: bytes) -> None:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e}") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    _check_value(value)


def _check_value(value: Any) -> None:
    """Depth and strings of a parsed body, without recursion."""
    stack = [(value, 1, None)]
    while stack:
        item, depth, field = stack.pop()
        if isinstance(item, str):
            if not _is_valid_utf8(item):
                raise bad_request("strings must be valid Unicode: a lone surrogate "
                                  "(\\ud800-\\udfff without its pair) was found", param=field)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                              param=field)
        if isinstance(item, dict):
            for key, sub in item.items():
                top = field if field is not None else key
                stack.append((key, depth + 1, top))
                stack.append((sub, depth + 1, top))
        else:
            stack.extend((sub, depth + 1, field) for sub in item)


def _is_valid_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
