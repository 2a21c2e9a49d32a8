"""uvicorn inside the frontend's own event loop, beside grpc.aio (one process, one loop)."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class EmbeddedServer(uvicorn.Server):
    """Leaves the signals to the frontend's main, which drains gRPC and HTTP together."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    def __init__(self, app, host: str, port: int):
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.server = EmbeddedServer(uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning",
                                                    access_log=False, timeout_graceful_shutdown=5))
        self._task: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                await self._task  # raises why it could not start
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        await self._task
        self.socket.close()
