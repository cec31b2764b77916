"""The gRPC server's lifetime: bound before the model loads, started in the HTTP server's
event loop once the engine is up, stopped before the engine."""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)

SERVICE = "vllm.grpc.engine.VllmEngine"
HEALTH_POLL_S = 1.0  # how often grpc.health.v1 learns whether the engine is up


def check_port(host: str, port: int) -> None:
    """Fail now, not after the model has loaded, if `port` is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise SystemExit(f"error: cannot listen on {host}:{port} for gRPC: {e.strerror} "
                             "(choose another --grpc-port)") from None


class GrpcServer:
    """VllmEngine, grpc.health.v1 and server reflection on HOST:PORT (plaintext)."""

    def __init__(self, host: str, port: int, grace_s: float) -> None:
        self.host, self.port, self.grace_s = host, port, grace_s
        self.server: Any = None
        self._watch: asyncio.Task | None = None

    async def start(self, state: Any) -> None:
        """Serve `state` (the HTTP server's ServerState); call once its engine is up."""
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        from runtime.entrypoints.grpc import vllm_engine_pb2, vllm_engine_pb2_grpc
        from runtime.entrypoints.grpc.servicer import VllmEngineServicer

        self.server = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(state),
                                                              self.server)
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, self.server)
        reflection.enable_server_reflection(
            (vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self.server.add_insecure_port(address)
        await self.server.start()
        self._watch = asyncio.create_task(self._follow_health(state.engine, checks, health_pb2))
        logger.info("Serving gRPC (%s, grpc.health.v1, reflection) on %s", SERVICE, address)

    @staticmethod
    async def _follow_health(engine: Any, checks: Any, health_pb2: Any) -> None:
        while True:
            status = health_pb2.HealthCheckResponse.SERVING if engine.is_healthy \
                else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in ("", SERVICE):
                await checks.set(service, status)
            await asyncio.sleep(HEALTH_POLL_S)

    async def stop(self) -> None:
        """Stop taking calls; those in flight get `grace_s` seconds, then are cancelled."""
        if self._watch is not None:
            self._watch.cancel()
        if self.server is not None:
            await self.server.stop(self.grace_s)
