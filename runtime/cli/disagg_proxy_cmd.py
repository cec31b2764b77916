"""`runtime disagg-proxy`: the proxy in front of prefill and decode instances
(runtime.entrypoints.disagg_proxy, docs/kv_connectors.md)."""
from __future__ import annotations

import argparse
from typing import Any

HELP = "send each OpenAI request to a prefill instance, then to a decode one"
DESCRIPTION = ("Disaggregated prefill: each /v1/completions and /v1/chat/completions request is "
               "prefilled by a --prefill instance (kv_role kv_producer) and decoded by a "
               "--decode instance (kv_consumer) that loads its KV; several of each are taken "
               "in turn.")


def add_disagg_proxy_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("disagg-proxy", help=HELP, description=DESCRIPTION)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=disagg_proxy_command)
    return p


def disagg_proxy_command(args: argparse.Namespace) -> int:
    import uvicorn

    from runtime.entrypoints.disagg_proxy import build_app
    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port,
                log_level="warning")
    return 0
