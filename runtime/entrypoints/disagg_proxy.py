"""The disaggregated-prefill proxy (`runtime disagg-proxy`), as vLLM's example proxies: each
OpenAI completion or chat request goes first to a prefill instance (kv_role kv_producer) with
`kv_transfer_params: {"do_remote_decode": true}` and `max_tokens: 1`, not streamed; the
`kv_transfer_params` of its response then go with the client's own request to a decode instance
(kv_consumer), which loads the prompt's KV instead of computing it, and whose response
(streamed or not) is the client's. Instances of each kind are taken in turn (round robin).
"""
from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

ROUTES = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("authorization", "x-request-id")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill instance is asked: the prompt, one token, once, not streamed."""
    body = {k: v for k, v in body.items() if k not in ("stream_options", "best_of")}
    body.update(kv_transfer_params={"do_remote_decode": True}, max_tokens=1, stream=False, n=1)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": param, "code": None}}, status_code=status)


def build_app(prefill: list[str], decode: list[str]) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one --prefill and one --decode instance")
    prefills = itertools.cycle(u.rstrip("/") for u in prefill)
    decodes = itertools.cycle(u.rstrip("/") for u in decode)
    client = httpx.AsyncClient(timeout=None)
    app = FastAPI(title="runtime disagg-proxy")

    async def forward(raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            return _error(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is the proxy's to set", "kv_transfer_params")
        headers = {k: v for k, v in raw.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            first = await client.post(next(prefills) + raw.url.path,
                                      json=prefill_request(body), headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"the prefill instance did not answer: {e}")
        if first.status_code != 200:  # the client's request is wrong, or the instance is
            return Response(first.content, first.status_code,
                            media_type=first.headers.get("content-type"))
        params = first.json().get("kv_transfer_params")
        if params is not None:  # without them the decode instance computes the prompt
            body = dict(body, kv_transfer_params=params)
        request = client.build_request("POST", next(decodes) + raw.url.path, json=body,
                                       headers=headers)
        try:
            reply = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            return _error(502, f"the decode instance did not answer: {e}")
        return StreamingResponse(reply.aiter_raw(), reply.status_code,
                                 media_type=reply.headers.get("content-type"),
                                 background=BackgroundTask(reply.aclose))

    for route in ROUTES:
        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        headers = {k: v for k, v in raw.headers.items() if k.lower() in FORWARDED_HEADERS}
        reply = await client.get(next(decodes) + "/v1/models", headers=headers)
        return Response(reply.content, reply.status_code,
                        media_type=reply.headers.get("content-type"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    app.router.add_event_handler("shutdown", client.aclose)
    return app
