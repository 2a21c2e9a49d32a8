"""The scheduler process's parts wired together: gRPC server, step loop, heartbeat watch, shutdown."""
from __future__ import annotations

import asyncio

import structlog

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.rpc.grpc_server import GrpcServer
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.loop import StepLoop
from services.scheduler.servicer import SchedulerServicer

log = structlog.get_logger("scheduler")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


class SchedulerServer:
    def __init__(self, config: SchedulerServiceConfig):
        self.config = config
        self.loop = StepLoop(config)
        servicer = SchedulerServicer(self.loop)
        self.grpc = GrpcServer(lambda server: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server),
                               SERVICE_NAME, config.reflection)
        self._tasks: list[asyncio.Task] = []

    @property
    def port(self) -> int:
        return self.grpc.port

    async def start(self) -> int:
        port = await self.grpc.start(self.config.host, self.config.port)
        self._tasks = [asyncio.create_task(self.loop.run(), name="step-loop"),
                       asyncio.create_task(self.loop.watch_heartbeats(), name="heartbeats")]
        for task in self._tasks:
            task.add_done_callback(_log_crash)
        await self.grpc.set_serving(True)
        log.info("scheduler_serving", host=self.config.host, port=port)
        return port

    async def shutdown(self, grace: float = 5.0) -> None:
        """Graceful: NOT_SERVING, refuse new Submits (UNAVAILABLE), let running requests finish, stop."""
        log.info("scheduler_draining", num_requests=len(self.loop.router))
        await self.grpc.set_serving(False)
        await self.loop.drain()
        await self.stop(grace)

    async def stop(self, grace: float | None = None) -> None:
        await self.grpc.stop(grace)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.loop.close()
        log.info("scheduler_stopped")


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("task_crashed", task=task.get_name(), exc_info=task.exception())
