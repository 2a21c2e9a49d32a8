"""The Worker gRPC service: thin, convert -> Worker.step -> convert (services.rpc.internal_codec). Errors map in services.rpc.status
(an unknown sequence, core UnknownSequence, becomes FAILED_PRECONDITION)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pagedserve.internal.v1 import common_pb2, worker_pb2_grpc
from services.rpc import internal_codec
from services.rpc.status import rpc_errors
from services.worker.worker import Worker
from services.worker.worker_group import GroupBroken, WorkerGroup


def torch_thread() -> ThreadPoolExecutor:
    """The one thread that loads the model and runs every step. OpenMP keeps a thread team per
    calling thread: a model loaded on one thread and stepped on another leaves two teams of
    workers on the cores, and libgomp then stops spinning at its barriers (more threads than
    CPUs), which made a bf16 step 1.6-1.8x slower on 2 cores (25.7 vs 47 ms, batch 16)."""
    return ThreadPoolExecutor(1, thread_name_prefix="torch")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker | WorkerGroup, executor: ThreadPoolExecutor | None = None, on_broken=None):
        self.worker = worker
        self.on_broken = on_broken  # called once a worker group lost a rank (the process then exits)
        # One step at a time, off the event loop (torch releases the GIL), so heartbeats keep flowing.
        # Pass the executor that built the worker (see torch_thread): one thread does all torch work.
        self._executor = executor or torch_thread()

    @rpc_errors
    async def Step(self, request, context):
        return await self._step(request)

    @rpc_errors
    async def StepStream(self, request_iterator, context):
        """Step after step on one call (worker.proto): each request answered before the next is read."""
        async for request in request_iterator:
            yield await self._step(request)

    async def _step(self, request):
        delta = internal_codec.delta_from_proto(request)
        step = asyncio.get_running_loop().run_in_executor(self._executor, self.worker.step, delta)
        if delta.async_next_step:  # queued right behind the step: it runs while the result travels back
            self._executor.submit(self.worker.run_async_step)
        try:
            result = await step
        except GroupBroken:
            if self.on_broken is not None:
                self.on_broken()
            raise
        return internal_codec.result_to_proto(result)

    @rpc_errors
    async def GetInfo(self, request, context):
        return internal_codec.info_to_proto(self.worker.info)

    @rpc_errors
    async def LoadLora(self, request, context):
        """On the torch thread, between steps (the adapter is packed there)."""
        load = lambda: self.worker.load_lora(request.lora_name, request.lora_path)  # noqa: E731
        await asyncio.get_running_loop().run_in_executor(self._executor, load)
        return common_pb2.LoraAdapterResponse(lora_names=self.worker.lora_names())

    @rpc_errors
    async def UnloadLora(self, request, context):
        unload = lambda: self.worker.unload_lora(request.lora_name)  # noqa: E731
        await asyncio.get_running_loop().run_in_executor(self._executor, unload)
        return common_pb2.LoraAdapterResponse(lora_names=self.worker.lora_names())

    async def forget_all(self) -> None:
        """The scheduler dropped this worker: its mirrored sequences will never be named again."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.worker.forget_all)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
