"""The Worker gRPC service: thin, convert -> Worker.step -> convert. Errors map in services.rpc_errors
(an unknown sequence, core UnknownSequence, becomes FAILED_PRECONDITION)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pagedserve.internal.v1 import worker_pb2_grpc
from services import convert
from services.rpc_errors import rpc_errors
from services.worker.worker import Worker


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker):
        self.worker = worker
        # One step at a time, off the event loop (torch releases the GIL), so heartbeats keep flowing.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="step")

    @rpc_errors
    async def Step(self, request, context):
        delta = convert.delta_from_proto(request)
        result = await asyncio.get_running_loop().run_in_executor(self._executor, self.worker.step, delta)
        return convert.result_to_proto(result)

    @rpc_errors
    async def GetInfo(self, request, context):
        return convert.info_to_proto(self.worker.info)

    async def forget_all(self) -> None:
        """The scheduler dropped this worker: its mirrored sequences will never be named again."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.worker.runner.seqs.clear)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
