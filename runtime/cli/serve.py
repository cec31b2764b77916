"""`runtime serve`: the OpenAI- and Anthropic-compatible HTTP server."""
from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

from runtime.cli.engine_args import add_engine_args, engine_kwargs

API_KEY_SCOPES = ("v1", "all")
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
METRICS_PREFIXES = ("both", "vllm", "runtime")  # runtime.metrics.METRICS_PREFIXES
# runtime.entrypoints.reasoning.REASONING_PARSERS (a copy: the parser imports nothing heavy)
REASONING_PARSER_NAMES = ("deepseek_r1", "granite", "openai_gptoss", "qwen3")


class _Default:
    """A value the command line did not give (so a --config file may replace it)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a model over HTTP to OpenAI and Anthropic clients",
        description="Serve a model at http://HOST:PORT/v1 (OpenAI: /v1/completions, "
                    "/v1/chat/completions, /v1/responses, /v1/models; Anthropic: "
                    "/v1/messages), with "
                    "/health, /metrics, /tokenize and /detokenize.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model (same as --model)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) clients use (default: the model as given, or "
                        "SmolLM2-135M-Instruct)")
    g.add_argument("--api-key", default=None,
                   help="require this key on /v1 routes (default: RUNTIME_API_KEY, else none)")
    g.add_argument("--api-key-scope", choices=API_KEY_SCOPES, default="v1",
                   help="what --api-key guards: the /v1 routes (v1, as vLLM), or also "
                        "/tokenize, /detokenize and /metrics (all)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) to use instead "
                        "of the model's")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); the calls '
                        "are read by --tool-call-parser, by default the parser of the call "
                        "format the chat template teaches")
    g.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="how the model writes tool calls, to read them back for "
                        'tool_choice "auto" (hermes: Hermes, Qwen)')
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_NAMES,
                   help="how the model marks its reasoning, to return it apart from the "
                        "content (`reasoning` on chat messages and deltas, reasoning items "
                        "on Responses); structured outputs and forced tool calls then apply "
                        "after the reasoning")
    g.add_argument("--max-queue-len", type=int, default=1024,
                   help="sequences that may wait for the running batch; more get HTTP 503")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM; then "
                        "they end with an error")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get HTTP 413 (default: 32 MiB)")
    g.add_argument("--grammar-check-timeout", type=float, default=10.0,
                   help="seconds a request's grammar may take to check (in a worker "
                        "process); longer gets HTTP 400")
    g.add_argument("--max-grammar-bytes", type=int, default=2**20,
                   help="larger grammars, schemas, regexes and choice lists get HTTP 400 "
                        "(default: 1 MiB)")
    g.add_argument("--grammar-cache-bytes", type=int, default=64 * 2**20,
                   help="bytes of checked grammars the API process keeps (LRU; default: "
                        "64 MiB)")
    g.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a connection may take to send a request's headers; then "
                        "HTTP 408 and the connection is closed")
    g.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request's body may take to arrive; then HTTP 408")
    g.add_argument("--max-core-restarts", type=int, default=2,
                   help="times a dead engine core is restarted within a minute; one more "
                        "death and the server exits with code 1")
    g.add_argument("--allowed-origins", type=json.loads, default=["*"],
                   help='CORS: allowed origins, as JSON (default: ["*"])')
    g.add_argument("--allowed-methods", type=json.loads, default=["*"],
                   help='CORS: allowed methods, as JSON (default: ["*"])')
    g.add_argument("--allowed-headers", type=json.loads, default=["*"],
                   help='CORS: allowed headers, as JSON (default: ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    g.add_argument("--root-path", default="",
                   help="the path prefix a proxy in front of the server strips (FastAPI's "
                        "root_path)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log every generating request (its prompt lengths and parameters)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not log requests (the default; kept for vLLM's old name)")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: --log-level)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='LoRA adapters to serve (with --enable-lora), each name=path or '
                        'JSON {"name": ..., "path": ...}; a request picks one by its "model"')
    g.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    g.add_argument("--grpc-port", type=int, default=None,
                   help="also serve vLLM's VllmEngine gRPC service (token in, token out, as "
                        "smg routers drive it), grpc.health.v1 and reflection on this port")
    g.add_argument("--metrics-prefix", choices=METRICS_PREFIXES, default="both",
                   help="the names /metrics serves: vLLM's (vllm:*, for vLLM's dashboards, "
                        "llm-d and the gateway API inference extension), ours (runtime:*), "
                        "or both")
    g.add_argument("--config", default=None,
                   help="a YAML file of these options (e.g. max_num_seqs: 64); flags win")
    for action in p._actions:
        if action.dest not in ("help", "config"):
            action.default = _Default(action.default)
    p.set_defaults(func=serve_command)
    return p


def resolve_options(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options the command line left out from --config, else their defaults."""
    given: dict[str, Any] = {}
    if args.config is not None:
        from runtime.config import load_options_file
        given = load_options_file(args.config)
        unknown = sorted(set(given) - (set(vars(args)) - {"func", "config"}))
        if unknown:
            raise ValueError(f"{args.config}: unknown options {unknown}")
    for name, value in vars(args).items():
        if isinstance(value, _Default):
            setattr(args, name, given.get(name, value.value))
    if isinstance(args.served_model_name, str):
        args.served_model_name = [args.served_model_name]
    return args


def server_url(sock: socket.socket, https: bool, root_path: str = "") -> str:
    """The address a client reaches the bound socket at, e.g. http://127.0.0.1:8000."""
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if https else 'http'}://{host}:{port}{root_path}"


def serve_command(args: argparse.Namespace) -> int:
    args = resolve_options(args)
    try:
        from runtime.engine.async_llm import AsyncLLM
        from runtime.entrypoints.chat import load_chat_template
        from runtime.lora.adapter import load_adapter
        from runtime.lora.request import parse_lora_modules
        from runtime.entrypoints.dev_api import DEV_MODE_ENV
        from runtime.entrypoints.server import (CORS, TLS, Limits, bind_socket, create_app,
                                                run_server)
        from runtime.metrics import Metrics
    except ImportError as e:
        raise SystemExit(f"error: {e}: the server needs the serve extra: "
                         "pip install 'runtime[serve]'") from None
    from runtime.config import EngineConfig
    from runtime.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME
    from runtime.stat_logger import StatLogger

    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SystemExit("error: HTTPS needs both --ssl-keyfile and --ssl-certfile")
    sock = bind_socket(args.host, args.port)  # a busy port fails now, not after loading
    grpc_server = None
    if args.grpc_port is not None:
        grpc_server = make_grpc_server(args.host, args.grpc_port, args.shutdown_timeout)
    kwargs = engine_kwargs(args)
    kwargs["model"] = args.model_tag or kwargs["model"]
    names = args.served_model_name or [
        DEFAULT_MODEL_NAME if kwargs["model"] in (None, DEFAULT_MODEL_ALIAS) else kwargs["model"]]
    try:
        lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if (lora_modules or args.enable_runtime_lora_updating) and not args.enable_lora:
        raise SystemExit("error: --lora-modules and --enable-runtime-lora-updating need "
                         "--enable-lora")
    metrics = Metrics(names[0], args.metrics_prefix)
    config = EngineConfig.from_kwargs(**kwargs)
    engine = AsyncLLM(
        config, args.max_queue_len, metrics if config.disable_log_stats else StatLogger(metrics),
        args.max_core_restarts)
    for lora in lora_modules.values():  # a bad adapter stops the server before it listens
        try:
            load_adapter(lora, engine.hf_config, config.max_lora_rank)
        except ValueError as e:
            raise SystemExit(f"error: --lora-modules: {e}") from None
    cors = CORS(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                args.allow_credentials)
    tls = TLS(args.ssl_keyfile, args.ssl_certfile) if args.ssl_keyfile else None
    app = create_app(engine, metrics, names, load_chat_template(args.chat_template),
                     args.api_key or os.environ.get("RUNTIME_API_KEY"), args.api_key_scope,
                     args.max_request_body_bytes, cors,
                     args.enable_log_requests and not args.disable_log_requests,
                     args.tool_call_parser, args.enable_auto_tool_choice, lora_modules,
                     args.enable_runtime_lora_updating,
                     Limits(grammar_check_timeout=args.grammar_check_timeout,
                            max_grammar_bytes=args.max_grammar_bytes,
                            grammar_cache_bytes=args.grammar_cache_bytes,
                            header_timeout=args.header_timeout,
                            body_timeout=args.body_timeout),
                     url=server_url(sock, tls is not None, args.root_path),
                     grpc_server=grpc_server, dev_mode=os.environ.get(DEV_MODE_ENV) == "1",
                     reasoning_parser=args.reasoning_parser)
    return run_server(app, sock, args.shutdown_timeout, tls, args.root_path,
                      args.uvicorn_log_level)


def make_grpc_server(host: str, port: int, grace_s: float) -> Any:
    """The gRPC server beside the HTTP one, its port checked now."""
    try:
        import grpc  # noqa: F401
        import grpc_health.v1  # noqa: F401
        import grpc_reflection.v1alpha  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: {e}: --grpc-port needs the serve extra: "
                         "pip install 'runtime[serve]'") from None
    from runtime.entrypoints.grpc.server import GrpcServer, check_port
    check_port(host, port)
    return GrpcServer(host, port, grace_s)
