"""The FastAPI app: the engine's lifetime, error bodies, CORS, and the routes that do not
generate (/health, /metrics, /tokenize, /detokenize); and running it under uvicorn."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

import runtime
from runtime.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from runtime.entrypoints import (anthropic_api, dev_api, lora_api, openai_api, pooling_api,
                                 responses_api, tokens_api)
from runtime.entrypoints.chat import render_chat, text_of
from runtime.entrypoints.connection import HEADER_TIMEOUT_S, GuardedH11Protocol
from runtime.entrypoints.grpc.server import GrpcServer
from runtime.entrypoints.errors import (APIError, bad_request, is_anthropic_path,
                                        route_path)
from runtime.entrypoints.middleware import RequestContext, needs_key
from runtime.entrypoints.openapi import build_openapi
from runtime.entrypoints.protocol import DetokenizeRequest, TokenizeRequest
from runtime.entrypoints.reasoning import reasoning_parser_of
from runtime.entrypoints.serving import (ClientDisconnected, ServerState, check_model,
                                         grammar_backend, state_of)
from runtime.entrypoints.template_tools import tool_call_parser_of
from runtime.lora.request import LoRARequest
from runtime.metrics import Metrics
from runtime.structured_output.checker import GrammarChecker

logger = logging.getLogger(__name__)
router = APIRouter()

SHUTDOWN_GRACE_S = 2.0  # after --shutdown-timeout: time for the streams' error events to go out


@dataclass
class Limits:
    """What one request may cost the API process: its grammar's check (worker processes, each
    check at most `grammar_check_timeout` seconds and `max_grammar_bytes` of text; the results
    cached up to `grammar_cache_bytes`), and how long reading its headers or body may take."""

    grammar_check_workers: int = 2
    grammar_check_timeout: float = 10.0
    max_grammar_bytes: int = 2**20
    grammar_cache_bytes: int = 64 * 2**20
    header_timeout: float = HEADER_TIMEOUT_S
    body_timeout: float = 60.0


@dataclass
class CORS:
    """Starlette's CORSMiddleware settings (vLLM's --allowed-origins and friends)."""

    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool = False


def create_app(engine: AsyncLLM, metrics: Metrics, model_names: list[str],
               chat_template: str | None, api_key: str | None, api_key_scope: str,
               max_body_bytes: int, cors: CORS, log_requests: bool,
               tool_call_parser: str | None = None,
               enable_auto_tool_choice: bool = False,
               lora_modules: dict[str, LoRARequest] | None = None,
               enable_runtime_lora_updating: bool = False,
               limits: Limits | None = None, url: str = "",
               grpc_server: GrpcServer | None = None, dev_mode: bool = False,
               reasoning_parser: str | None = None) -> FastAPI:
    """The server's app; starting it (its lifespan) starts the engine, stopping it stops it,
    and once it is up logs that `model_names[0]` is served at `url`.
    If the engine dies for good, the app asks the server to stop (`app.state.stop_server`) and
    sets `app.state.exit_code` to 1. A `grpc_server` serves the same engine while the app runs.
    `dev_mode` (RUNTIME_SERVER_DEV_MODE=1) mounts the development routes (runtime.entrypoints.
    dev_api: sleep mode, weight reload)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            app.state.server.reasoning_parser = reasoning_parser_of(reasoning_parser,
                                                                    engine.tokenizer)
        except ValueError as e:  # the tokenizer lacks the markers: stop, the core included
            logger.error("error: --reasoning-parser %s: %s", reasoning_parser, e)
            await engine.shutdown()
            raise SystemExit(2) from None
        metrics.engine_started(engine.config, engine.max_model_len, engine.num_blocks)
        if grpc_server is not None:
            await grpc_server.start(app.state.server)
        state = app.state.server
        state.tool_call_parser = tool_call_parser_of(
            state.chat_template or engine.tokenizer.chat_template, model_names[0],
            tool_call_parser, enable_auto_tool_choice)
        logger.info("Serving %s on %s (OpenAI, Anthropic, Responses; docs at /docs): "
                    "max_model_len %d, %d KV blocks", model_names[0], url or "its socket",
                    engine.max_model_len, engine.num_blocks)
        if engine.pooling is None:
            state.grammars = GrammarChecker(
                grammar_backend(state), limits.grammar_check_workers,
                limits.grammar_check_timeout, limits.max_grammar_bytes,
                limits.grammar_cache_bytes)
            metrics.watch_grammar_checks(state.grammars.cache)
        watch = asyncio.create_task(_exit_when_dead(app, engine))
        yield
        watch.cancel()
        if grpc_server is not None:
            await grpc_server.stop()
        await engine.shutdown()
        state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        if state.grammars is not None:
            state.grammars.shutdown()

    limits = limits or Limits()
    app = FastAPI(title="runtime", lifespan=lifespan)
    app.state.server = ServerState(engine, metrics, model_names, chat_template, api_key,
                                   log_requests, tool_call_parser=tool_call_parser,
                                   enable_auto_tool_choice=enable_auto_tool_choice,
                                   lora_modules=dict(lora_modules or {}),
                                   next_lora_id=len(lora_modules or {}) + 1)
    app.state.exit_code = 0
    generating = [Depends(pooling_api.generation_only)]  # a pooling model refuses them
    app.include_router(openai_api.router, dependencies=generating)
    app.include_router(anthropic_api.router, dependencies=generating)
    app.include_router(responses_api.router, dependencies=generating)
    app.include_router(tokens_api.router, dependencies=generating)
    if dev_mode:
        app.include_router(dev_api.router)
    if enable_runtime_lora_updating:
        app.include_router(lora_api.router, dependencies=generating)
    app.include_router(pooling_api.router)
    app.include_router(router)
    app.add_middleware(RequestContext, api_key=api_key, api_key_scope=api_key_scope,
                       max_body_bytes=max_body_bytes, body_timeout_s=limits.body_timeout)
    app.state.limits = limits
    # Outermost: a browser's preflight is answered before the API key is checked.
    app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                       allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                       allow_credentials=cors.allow_credentials)
    guarded = None if api_key is None else lambda path: needs_key(path, api_key_scope)
    app.openapi = lambda: app.openapi_schema or _cache(app, build_openapi(app, guarded))

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        log = logger.error if e.status >= 500 else logger.warning
        log("request %s: %d on %s: %s", request.state.request_id, e.status, request.url.path,
            e.message)
        return e.response(is_anthropic_path(route_path(request.scope)))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'] if p != 'body')}: "
                             f"{err['msg']}" for err in e.errors())
        fields = [[p for p in err.get("loc", ()) if p != "body"] for err in e.errors()]
        param = next((str(f[0]) for f in fields if f), None)
        return await api_error(request, bad_request(f"invalid request: {problems}", param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return await api_error(request, APIError(e.status_code, str(e.detail),
                                                 headers=e.headers))

    @app.exception_handler(ClientDisconnected)
    async def client_left(request: Request, e: ClientDisconnected) -> Response:
        logger.info("request %s: the client disconnected; aborted", request.state.request_id)
        return Response(status_code=499)

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestFailedError)
    async def engine_failed(request: Request, e: Exception) -> JSONResponse:
        return await api_error(request, APIError(500, str(e)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("request %s: unexpected error on %s", request.state.request_id,
                         request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}").response(
            is_anthropic_path(route_path(request.scope)))

    return app


def _cache(app: FastAPI, schema: dict) -> dict:
    app.openapi_schema = schema
    return schema


async def _exit_when_dead(app: FastAPI, engine: AsyncLLM) -> None:
    reason = await engine.wait_fatal()
    logger.critical("the engine is dead for good (%s): the server exits", reason)
    app.state.exit_code = 1
    stop = getattr(app.state, "stop_server", None)
    if stop is not None:
        stop()


@router.get("/health", response_class=Response)
async def health(raw: Request) -> Response:
    engine = state_of(raw).engine
    if engine.is_healthy:
        return Response(status_code=200)
    reason = engine.dead_reason or "the engine core is restarting"
    return APIError(503, reason, headers={"Retry-After": "1"}).response()


@router.get("/version")
async def version() -> dict:
    return {"version": runtime.__version__}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(raw: Request) -> Response:
    return Response(state_of(raw).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> Response:
    state = state_of(raw)
    check_model(state, body.model)
    if body.messages is None and body.prompt is None:
        raise bad_request("give a prompt or messages", param="prompt")
    messages = None if body.messages is None else \
        [{"role": m.role, "content": text_of(m.content)} for m in body.messages]
    # Tokenizing and rendering the answer both scale with the body: off the event loop.
    return Response(await state.off_loop(_tokenize, state, body, messages),
                    media_type="application/json")


def _tokenize(state: ServerState, body: TokenizeRequest, messages: list[dict] | None) -> bytes:
    tokenizer = state.engine.tokenizer
    if messages is not None:
        tokens = render_chat(tokenizer, messages, state.chat_template, body.add_generation_prompt)
    else:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return json.dumps({"tokens": tokens, "count": len(tokens),
                       "max_model_len": state.engine.max_model_len}).encode()


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> dict:
    state = state_of(raw)
    check_model(state, body.model)
    vocab = state.engine.hf_config.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": await state.off_loop(state.engine.tokenizer.decode, body.tokens)}


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, taken before the model loads: a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror} "
                         "(choose another --port or --host)") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown ends the streams still running after
    `shutdown_timeout` with their error event instead of cutting them."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(
            self.shutdown_timeout, self.engine.fail_all,
            f"the server is shutting down (--shutdown-timeout {self.shutdown_timeout:g} s)")
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


@dataclass
class TLS:
    keyfile: str
    certfile: str


def run_server(app: FastAPI, sock: socket.socket, shutdown_timeout: float,
               tls: TLS | None = None, root_path: str = "",
               uvicorn_log_level: str | None = None) -> int:
    """Serve on `sock` until SIGINT or SIGTERM; then stop taking connections, give in-flight
    requests up to `shutdown_timeout` seconds, end the rest with an error and stop the engine.
    Returns the exit code: 0 after a normal shutdown, 1 if the server never started (the
    engine failed to load) or the engine died for good."""
    runtime_level = logging.getLogger("runtime").getEffectiveLevel()
    level = uvicorn_log_level or runtime_level
    engine = app.state.server.engine
    protocol = type("H11Protocol", (GuardedH11Protocol,),
                    {"header_timeout_s": app.state.limits.header_timeout})
    server = _Server(uvicorn.Config(
        app, http=protocol, log_level=level, lifespan="on",
        access_log=runtime_level <= logging.INFO,
        timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE_S, root_path=root_path,
        ssl_keyfile=tls.keyfile if tls else None, ssl_certfile=tls.certfile if tls else None),
        engine, shutdown_timeout)
    app.state.stop_server = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it has shut down; the shutdown was
    # graceful, so the process then exits normally instead of dying of the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    return app.state.exit_code if server.started else 1
