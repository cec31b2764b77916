"""`runtime serve --grpc-port N`: vLLM's VllmEngine gRPC service (the one smg routers drive)
beside the HTTP server, on the same engine. grpcio and protobuf are imported only when the
gRPC server starts; the stubs of vllm_engine.proto are checked in (compile_protos.py)."""
from __future__ import annotations

from runtime.entrypoints.grpc.server import GrpcServer

__all__ = ["GrpcServer"]
