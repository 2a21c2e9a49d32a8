"""The worker process's parts wired together: gRPC server, registration/heartbeats, shutdown."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import structlog

from pagedserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.rpc.grpc_server import GrpcServer
from services.worker.registrar import Registrar
from services.core.config import CacheConfig, WorkerConfig
from services.worker.config import WorkerServiceConfig
from services.worker.servicer import WorkerServicer, torch_thread
from services.worker.worker import Worker
from services.worker.worker_group import WorkerGroup, start_worker as start_worker_or_group

log = structlog.get_logger("worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServer:
    def __init__(self, worker: Worker | WorkerGroup, config: WorkerServiceConfig, executor: ThreadPoolExecutor | None = None):
        self.worker, self.config = worker, config
        self.broken = asyncio.Event()  # a worker group lost a rank: the process exits (the launcher restarts it)
        # executor: the thread that built the worker
        self.servicer = WorkerServicer(worker, executor, on_broken=self.broken.set)
        self.grpc = GrpcServer(lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, server),
                               SERVICE_NAME, config.reflection)
        self.registration: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.grpc.port

    async def start(self) -> int:
        """Serve first, then register (the scheduler may step us as soon as it accepts)."""
        port = await self.grpc.start(self.config.host, self.config.port)
        await self.grpc.set_serving(False)
        address = f"{self.config.advertise_host}:{port}"
        registrar = Registrar(self.config.scheduler_address, self.config.worker_id, address, self.worker.info,
                              on_registered=lambda: self.grpc.set_serving(True), on_forgotten=self._forgotten)
        self.registration = asyncio.create_task(registrar.run(), name="registration")
        log.info("worker_serving", worker_id=self.config.worker_id, address=address)
        return port

    async def _forgotten(self) -> None:
        await self.grpc.set_serving(False)
        await self.servicer.forget_all()

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, stop heartbeating (the scheduler drops us and recomputes elsewhere), stop serving."""
        if self.registration is not None:
            self.registration.cancel()
            await asyncio.gather(self.registration, return_exceptions=True)
        await self.grpc.stop(grace)
        self.servicer.close()
        self.worker.close()
        log.info("worker_stopped", worker_id=self.config.worker_id)


async def start_worker(worker_config: WorkerConfig, cache: CacheConfig, config: WorkerServiceConfig) -> WorkerServer:
    """Load the model on the thread that will run its steps (see torch_thread), then serve and register."""
    executor = torch_thread()
    worker = await asyncio.get_running_loop().run_in_executor(executor, start_worker_or_group, worker_config, cache)
    server = WorkerServer(worker, config, executor)
    await server.start()
    return server
