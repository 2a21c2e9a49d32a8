"""A grpc.aio server with health checking and optional reflection, shared by the services' mains."""
from __future__ import annotations

from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.rpc.reflection import enable_reflection
from services.rpc.status import DecodeErrors

# A burst of thousands of streams on one connection must not queue in HTTP/2.
SERVER_OPTIONS = [
    ("grpc.max_concurrent_streams", 1 << 16),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]
INTERNAL_MAX_RECEIVE_BYTES = 64 << 20  # between our own services (a step's delta can be large)

# For the internal clients' channels (worker -> scheduler, frontend -> scheduler): after an outage
# gRPC waits up to 120 s between reconnect attempts by default, so a scheduler that is back went
# unnoticed for seconds. On loopback or a compose network a reconnect attempt costs nothing.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The health name that says only "this process answers": SERVING from start to stop, whether or not the
# service is ready (a worker waiting for its scheduler, a frontend with no worker yet). Kubernetes' gRPC
# liveness probes ask it (deploy/kubernetes), so a missing scheduler restarts nobody; readiness asks "".
LIVENESS = "liveness"


class GrpcServer:
    """Owns the grpc.aio server and its health servicer; `port` is known after `start`."""

    def __init__(self, add_servicer: Callable[[grpc.aio.Server], None], service_name: str, reflection_on: bool,
                 max_receive_bytes: int = INTERNAL_MAX_RECEIVE_BYTES):
        """A message over max_receive_bytes is refused by gRPC itself (RESOURCE_EXHAUSTED) before
        any handler sees it."""
        options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_receive_bytes)]
        self.server = grpc.aio.server(options=options, maximum_concurrent_rpcs=None, interceptors=[DecodeErrors()])
        add_servicer(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_name = service_name
        if reflection_on:
            enable_reflection(self.server, (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        await self.server.start()
        await self.health.set(LIVENESS, SERVING)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", self.service_name):
            await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        await self.set_serving(False)
        await self.health.set(LIVENESS, NOT_SERVING)
        await self.server.stop(grace)
