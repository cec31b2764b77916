"""Errors a route returns to the client, in the OpenAI or the Anthropic shape."""
from __future__ import annotations

from fastapi.responses import JSONResponse

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 405: "invalid_request_error",
                   408: "invalid_request_error", 413: "request_too_large",
                   415: "invalid_request_error", 503: "overloaded_error"}
# OpenAI answers an unknown model or route with a 404 of type invalid_request_error.
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                408: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 503: "server_overloaded"}


class APIError(Exception):
    """An error with an HTTP status, rendered as an OpenAI or Anthropic error body."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or OPENAI_TYPES.get(status, "internal_server_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, anthropic: bool = False) -> dict:
        if anthropic:
            return {"type": "error", "error": {
                "type": ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        return JSONResponse(self.body(anthropic), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def route_path(scope: dict) -> str:
    """The request's path below --root-path (ASGI servers may include the root path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def is_anthropic_path(path: str) -> bool:
    """Routes of the Anthropic Messages API answer errors in Anthropic's shape."""
    return path.startswith("/v1/messages")
