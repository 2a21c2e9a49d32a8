"""A worker's side of membership: RegisterWorker (with backoff), then Heartbeat every interval.

Told it is unknown (the scheduler restarted or dropped it), the worker forgets its mirrored
sequences and registers again. A refusal is final: the block size or the model does not match, or
the scheduler could not reach the worker at the address it advertised (`probe_worker` in
services/scheduler/worker_client.py); the worker logs the reason and exits with status 2
(services/worker/__main__.py), since registering again with the same flags cannot help.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import grpc
import structlog

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.rpc import internal_codec
from services.core.step import WorkerInfo
from services.rpc.grpc_server import RECONNECT_OPTIONS
from services.scheduler.config import REGISTER_TIMEOUT_S

log = structlog.get_logger("worker")
MAX_BACKOFF_S = 5.0
HEARTBEAT_RETRY_S = 0.25  # after a failed beat: a scheduler that is back hears from us (and re-admits us) soon


class Refused(RuntimeError):
    """The scheduler will not take this worker."""


class Registrar:
    def __init__(self, scheduler_address: str, worker_id: str, address: str, info: WorkerInfo,
                 on_registered: Callable[[], Awaitable[None]], on_forgotten: Callable[[], Awaitable[None]]):
        self.scheduler_address, self.worker_id, self.address = scheduler_address, worker_id, address
        self.request = scheduler_pb2.RegisterWorkerRequest(worker_id=worker_id, address=address,
                                                           info=internal_codec.info_to_proto(info))
        self.on_registered, self.on_forgotten = on_registered, on_forgotten

    async def run(self) -> None:
        """Register, then heartbeat until cancelled; raises Refused when the scheduler refuses."""
        async with grpc.aio.insecure_channel(self.scheduler_address, options=RECONNECT_OPTIONS) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while True:
                interval = await self._register(stub)
                await self.on_registered()
                await self._heartbeat(stub, interval)
                await self.on_forgotten()

    async def _register(self, stub) -> float:
        backoff = 0.1
        while True:
            try:
                response = await stub.RegisterWorker(self.request, timeout=REGISTER_TIMEOUT_S)
                break
            except grpc.RpcError as error:
                log.info("register_retry", scheduler=self.scheduler_address, code=error.code().name,
                         retry_in_s=backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
        if not response.accepted:
            raise Refused(response.reason)
        log.info("worker_registered", worker_id=self.worker_id, address=self.address,
                 scheduler=self.scheduler_address)
        return response.heartbeat_interval_s

    async def _heartbeat(self, stub, interval: float) -> None:
        """Returns when the scheduler no longer knows this worker."""
        request = scheduler_pb2.HeartbeatRequest(worker_id=self.worker_id)
        failing = False
        while True:
            await asyncio.sleep(min(HEARTBEAT_RETRY_S, interval) if failing else interval)
            try:
                response = await stub.Heartbeat(request, timeout=max(interval, 1.0))
            except grpc.RpcError as error:
                if not failing:  # once per outage, not every retry
                    log.warning("heartbeat_failed", code=error.code().name, retry_every_s=HEARTBEAT_RETRY_S)
                failing = True
                continue
            if failing:
                log.info("heartbeat_restored", worker_id=self.worker_id)
            failing = False
            if not response.known:
                log.warning("worker_forgotten", worker_id=self.worker_id)
                return
