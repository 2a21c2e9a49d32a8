"""The Scheduler gRPC service: thin, convert -> StepLoop -> convert (services.rpc.internal_codec). Errors map in services.rpc.status."""
from __future__ import annotations

import asyncio

from pagedserve.internal.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.rpc import internal_codec
from services.core.errors import REFUSALS
from services.rpc.status import rpc_errors, status_of
from services.scheduler.loop import StepLoop
from services.scheduler.streams import Delivery, StreamMux


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: StepLoop):
        self.loop = loop

    @rpc_errors
    async def SubmitMany(self, request_iterator, context):
        mux = StreamMux()
        reader = asyncio.ensure_future(self._admit_many(request_iterator, mux))
        try:
            while (news := await mux.next()) is not None:
                yield scheduler_pb2.SubmitManyResponse(news=[_news(*entry) for entry in news])
            await reader  # raises what reading raised
        finally:  # the call ended or the client went away: abort what still runs on it
            reader.cancel()
            for request_id in list(mux.streams):
                self.loop.release(request_id)

    async def _admit_many(self, request_iterator, mux: StreamMux) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "cancel":
                    if mux.streams.pop(message.cancel, None) is not None:
                        self.loop.release(message.cancel)
                    continue
                if kind == "stop_sample":  # only a request of this call
                    if message.stop_sample.request_id in mux.streams:
                        self.loop.stop_sample(message.stop_sample.request_id, message.stop_sample.sample_index)
                    continue
                request_id = message.submit.request_id
                try:  # StepLoop.submit refuses an empty or running request_id
                    args = internal_codec.submit_from_proto(message.submit)
                    *args, lora_name = args
                    mux.streams[request_id] = self.loop.submit(*args, deliver=mux.sink(request_id), lora_name=lora_name)
                except REFUSALS as error:  # that request only
                    mux.put(request_id, 0.0, error)
        finally:
            mux.end_of_input()

    @rpc_errors
    async def GetStats(self, request, context):
        return internal_codec.stats_to_proto(self.loop.stats())

    @rpc_errors
    async def RegisterWorker(self, request, context):
        reason = await self.loop.register(request.worker_id, request.address, internal_codec.info_from_proto(request.info))
        return scheduler_pb2.RegisterWorkerResponse(accepted=reason is None, reason=reason or "",
                                                    heartbeat_interval_s=self.loop.config.heartbeat_interval_s)

    @rpc_errors
    async def Heartbeat(self, request, context):
        return scheduler_pb2.HeartbeatResponse(known=self.loop.heartbeat(request.worker_id))

    @rpc_errors
    async def LoadLoraAdapter(self, request, context):
        return common_pb2.LoraAdapterResponse(lora_names=await self.loop.load_lora(request.lora_name, request.lora_path))

    @rpc_errors
    async def UnloadLoraAdapter(self, request, context):
        return common_pb2.LoraAdapterResponse(lora_names=await self.loop.unload_lora(request.lora_name))


def _news(request_id: str, queue_time_s: float, item: Delivery) -> scheduler_pb2.RequestNews:
    """One delivery of a SubmitMany request as its RequestNews (a failed step is INTERNAL)."""
    if item is None:
        return scheduler_pb2.RequestNews(request_id=request_id, done=True)
    if isinstance(item, Exception):
        error = item if isinstance(item, REFUSALS) else \
            RuntimeError(f"the scheduler failed a step: {item}")
        code, message = status_of(error)
        return scheduler_pb2.RequestNews(request_id=request_id, done=True, error_code=code.value[0],  # status.code_of reads it
                                         error_message=message)
    response = internal_codec.updates_to_response(item)
    response.queue_time_s = queue_time_s
    return scheduler_pb2.RequestNews(request_id=request_id, response=response)
