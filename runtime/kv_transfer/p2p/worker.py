"""The P2pTcpConnector's worker side: on a prefill instance, this rank's staged KV and the
socket that serves it (kv_port + rank); on a decode instance, fetching it from the same rank.

One exchange per request and rank: the decode side sends a length-prefixed JSON line
{"request_id", "first", "count"}; the prefill side answers with a length-prefixed torch.save of
{"hashes": [hex, ...], "layers": [tensor per layer, its blocks stacked]} (or {"error": why})
and forgets the request's KV. KV nobody fetched is dropped after `kv_expiry` seconds.

Fetches run in background threads while the step's forward runs: the blocks they fill belong
to requests admitted without compute this step and are not in the prefix cache until the step
ends, so no layer reads them; `get_finished` waits for them.
"""
from __future__ import annotations

import io
import json
import logging
import socket
import socketserver
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from runtime.kv_transfer.disagg import PRODUCES
from runtime.kv_transfer.p2p.scheduler import DEFAULT_IP, DEFAULT_PORT
from runtime.plugins.kv_connector import (KVCacheLayer, KVConnectorContext, KVConnectorOutput,
                                          KVConnectorWorker)

logger = logging.getLogger(__name__)

DEFAULT_EXPIRY_S = 120.0
DEFAULT_FETCH_TIMEOUT_S = 30.0
FETCH_THREADS = 4  # requests fetched at once by one rank


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(len(payload).to_bytes(8, "little") + payload)


def _receive(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        chunks = []
        while n:
            chunk = sock.recv(min(n, 1 << 20))
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)
    return exactly(int.from_bytes(exactly(8), "little"))


def _encode(obj: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class P2pTcpWorker(KVConnectorWorker):
    def __init__(self, context: KVConnectorContext) -> None:
        super().__init__(context)
        extra = context.extra_config
        self.expiry = float(extra.get("kv_expiry", DEFAULT_EXPIRY_S))
        self.fetch_timeout = float(extra.get("fetch_timeout", DEFAULT_FETCH_TIMEOUT_S))
        self.layers: list[KVCacheLayer] = []
        # request id -> (staged at, block hashes, one tensor per layer: its blocks stacked)
        self.staged: dict[str, tuple[float, list[bytes], list[torch.Tensor]]] = {}
        self.lock = threading.Lock()
        self.server: socketserver.ThreadingTCPServer | None = None
        self.output = KVConnectorOutput()
        self.fetcher = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kv-p2p-fetch")
        self.fetches: list[Future[KVConnectorOutput]] = []  # this step's, until get_finished
        if context.role in PRODUCES:
            self._serve(str(extra.get("kv_ip", DEFAULT_IP)),
                        int(extra.get("kv_port", DEFAULT_PORT)) + context.rank)

    def _serve(self, ip: str, port: int) -> None:
        worker = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    ask = json.loads(_receive(self.request))
                    _send(self.request, worker._answer(ask))
                except (OSError, ValueError) as e:
                    logger.warning("a KV fetch from %s failed: %s", self.client_address, e)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((ip, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True,
                         name=f"kv-p2p-{port}").start()
        logger.info("serving prefilled KV on %s:%d", ip, port)

    def _answer(self, ask: dict[str, Any]) -> bytes:
        with self.lock:
            staged = self.staged.pop(ask.get("request_id"), None)
        if staged is None:
            return _encode({"error": f"no KV for request {ask.get('request_id')!r} (never "
                                     "prefilled here, fetched already or expired)"})
        _, hashes, layers = staged
        first, count = int(ask["first"]), int(ask["count"])
        return _encode({"hashes": [h.hex() for h in hashes[first:first + count]],
                        "layers": [t[first:first + count] for t in layers]})

    def register_kv_caches(self, layers: list[KVCacheLayer]) -> None:
        self.layers = layers

    def start_load_kv(self, meta: Any) -> None:
        for order in meta or ():
            if order[0] == "stage":
                started = time.perf_counter()
                self._stage(*order[1:])
                self.output.save_seconds += time.perf_counter() - started
            else:
                self.fetches.append(self.fetcher.submit(self._fetch, *order[1:]))

    def _stage(self, request_id: str, block_ids: list[int], hashes: list[bytes]) -> None:
        index = torch.tensor(block_ids, dtype=torch.long)
        layers = [layer.tensor.index_select(layer.block_dim, index.to(layer.tensor.device))
                  .movedim(layer.block_dim, 0).cpu() for layer in self.layers]
        now = time.monotonic()
        with self.lock:
            for old in [r for r, (at, _, _) in self.staged.items() if now - at > self.expiry]:
                del self.staged[old]
            self.staged[request_id] = (now, list(hashes), layers)
        self.output.bytes_saved += sum(t.nbytes for t in layers)

    def _fetch(self, host: str, port: int, remote_request_id: str, first: int,
               hashes: list[bytes], block_ids: list[int], request_id: str
               ) -> KVConnectorOutput:
        """One request's blocks from the producer's rank into `block_ids` (in a fetch thread);
        what it did, as this step's report will count it."""
        started, done = time.perf_counter(), KVConnectorOutput()
        address = (host, port + self.context.rank)
        try:
            with socket.create_connection(address, timeout=self.fetch_timeout) as sock:
                _send(sock, json.dumps({"request_id": remote_request_id, "first": first,
                                        "count": len(block_ids)}).encode())
                reply = torch.load(io.BytesIO(_receive(sock)), weights_only=True)
        except (OSError, ValueError, RuntimeError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        why = self._mismatch(reply, hashes)
        if why is not None:
            logger.warning("request %s: its KV could not be fetched from %s:%d (%s): "
                           "computing it", request_id, *address, why)
            done.failed_loads[request_id] = first
        else:
            for layer, blocks in zip(self.layers, reply["layers"]):
                layer.tensor.index_copy_(layer.block_dim,
                                         torch.tensor(block_ids, device=layer.tensor.device),
                                         blocks.movedim(0, layer.block_dim)
                                         .to(layer.tensor.device))
                done.bytes_loaded += blocks.nbytes
        done.load_seconds = time.perf_counter() - started
        return done

    def _mismatch(self, reply: Any, hashes: list[bytes]) -> str | None:
        """Why the fetched KV cannot be used (None: it can)."""
        if not isinstance(reply, dict) or "error" in reply:
            return reply.get("error") if isinstance(reply, dict) else "a malformed reply"
        if reply.get("hashes") != [h.hex() for h in hashes]:
            return "it is the KV of other tokens"
        for layer, blocks in zip(self.layers, reply.get("layers", [])):
            block = layer.tensor.select(layer.block_dim, 0)
            if blocks.dtype != block.dtype or tuple(blocks.shape[1:]) != tuple(block.shape) \
                    or blocks.shape[0] != len(hashes):
                return "its layout differs"
        if len(reply.get("layers", [])) != len(self.layers):
            return "its layers differ"
        return None

    def get_finished(self) -> KVConnectorOutput:
        output, self.output = self.output, KVConnectorOutput()
        for fetch in self.fetches:
            done = fetch.result()
            output.failed_loads.update(done.failed_loads)
            output.bytes_loaded += done.bytes_loaded
            output.load_seconds = max(output.load_seconds, done.load_seconds)
        self.fetches = []
        return output

    def shutdown(self) -> None:
        self.fetcher.shutdown(wait=True)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
