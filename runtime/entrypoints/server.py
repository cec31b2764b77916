"""The FastAPI app: the engine's lifetime, the API key, error bodies, and the routes that do not
generate (/health, /metrics, /tokenize, /detokenize)."""
from __future__ import annotations

import hmac
import logging
import signal
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.engine.async_llm import AsyncLLM, EngineDeadError
from runtime.entrypoints import anthropic_api, openai_api
from runtime.entrypoints.chat import render_chat, text_of
from runtime.entrypoints.errors import APIError, bad_request, is_anthropic_path
from runtime.entrypoints.protocol import DetokenizeRequest, TokenizeRequest
from runtime.entrypoints.serving import ServerState, check_model, state_of
from runtime.metrics import Metrics

logger = logging.getLogger(__name__)
router = APIRouter()


class RequestContext:
    """ASGI middleware: gives every HTTP request an id (the client's X-Request-Id, else a new
    one; echoed in the response and used in logs), and checks the API key on /v1 routes
    (`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        if scope["path"].startswith("/v1") and not self._authorized(headers):
            logger.warning("request %s: 401 on %s", request_id, scope["path"])
            error = APIError(401, "invalid or missing API key", type="authentication_error",
                             code="invalid_api_key")
            return await error.response(is_anthropic_path(scope["path"]))(
                scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None:
            return True
        key = self.api_key.encode()
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, key)


def create_app(engine: AsyncLLM, metrics: Metrics, model_names: list[str],
               chat_template: str | None = None, api_key: str | None = None) -> FastAPI:
    """The server's app; starting it (its lifespan) starts the engine, stopping it stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        logger.info("serving %s (max_model_len %d) with %d KV blocks", model_names[0],
                    engine.max_model_len, engine.num_blocks)
        yield
        await engine.shutdown()

    app = FastAPI(title="runtime", lifespan=lifespan)
    app.state.server = ServerState(engine, metrics, model_names, chat_template, api_key)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(router)
    app.add_middleware(RequestContext, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        log = logger.error if e.status >= 500 else logger.warning
        log("request %s: %d on %s: %s", request.state.request_id, e.status, request.url.path,
            e.message)
        return e.response(is_anthropic_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                             for err in e.errors())
        param = next((str(err["loc"][-1]) for err in e.errors() if err.get("loc")), None)
        return await api_error(request, bad_request(f"invalid request: {problems}", param))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return await api_error(request, APIError(500, str(e), type="internal_server_error"))

    return app


@router.get("/health")
async def health(raw: Request) -> Response:
    engine = state_of(raw).engine
    if engine.is_healthy:
        return Response(status_code=200)
    return JSONResponse({"error": engine.dead_reason or "the engine is not running"},
                        status_code=503)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(state_of(raw).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> dict:
    state = state_of(raw)
    check_model(state, body.model)
    tokenizer = state.engine.tokenizer
    if body.messages is not None:
        messages = [{"role": m.role, "content": text_of(m.content)} for m in body.messages]
        tokens = render_chat(tokenizer, messages, state.chat_template,
                             body.add_generation_prompt)
    elif body.prompt is not None:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise bad_request("give a prompt or messages", param="prompt")
    return {"tokens": tokens, "count": len(tokens),
            "max_model_len": state.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> dict:
    state = state_of(raw)
    check_model(state, body.model)
    vocab = state.engine.hf_config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": state.engine.tokenizer.decode(body.tokens)}


def run_server(app: FastAPI, host: str, port: int, shutdown_timeout: float) -> bool:
    """Serve until SIGINT or SIGTERM; then stop taking connections, give in-flight requests up
    to `shutdown_timeout` seconds, abort the rest and stop the engine. Returns False if the
    server never started (the engine failed to load, or the port was taken)."""
    level = logging.getLogger("runtime").getEffectiveLevel()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=level,
                                           lifespan="on", access_log=level <= logging.INFO,
                                           timeout_graceful_shutdown=shutdown_timeout))
    # uvicorn re-raises the signal that stopped it once it has shut down; the shutdown was
    # graceful, so the process then exits normally instead of dying of the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return server.started
