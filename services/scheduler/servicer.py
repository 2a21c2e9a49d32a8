"""The Scheduler gRPC service: thin, convert -> StepLoop -> convert. Errors map in services.rpc_errors."""
from __future__ import annotations

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services import convert
from services.rpc_errors import rpc_errors
from services.scheduler.loop import StepLoop


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: StepLoop):
        self.loop = loop

    @rpc_errors
    async def Submit(self, request, context):
        stream = self.loop.submit(*convert.submit_from_proto(request))
        try:
            while (updates := await stream.queue.get()) is not None:
                if isinstance(updates, Exception):
                    raise RuntimeError(f"the scheduler failed a step: {updates}") from updates
                response = convert.updates_to_response(updates)
                response.queue_time_s = stream.queue_time_s
                yield response
        finally:  # also when the client cancels: abort the request, free its blocks
            self.loop.release(request.request_id)

    @rpc_errors
    async def Abort(self, request, context):
        self.loop.abort(request.request_id, request.sample_index)
        return scheduler_pb2.AbortResponse()

    @rpc_errors
    async def GetStats(self, request, context):
        stats = self.loop.stats()
        workers = [scheduler_pb2.WorkerStats(
            worker_id=worker_id, address=w["address"], num_gpu_blocks=w["num_blocks"],
            num_free_gpu_blocks=w["num_free_blocks"], num_cpu_blocks=w["num_cpu_blocks"],
            num_free_cpu_blocks=w["num_free_cpu_blocks"], prefix_cache_queries=w["prefix_cache_queries"],
            prefix_cache_hits=w["prefix_cache_hits"], num_running=w["num_running"])
            for worker_id, w in sorted(stats.pop("workers").items())]
        return scheduler_pb2.GetStatsResponse(workers=workers, **stats)

    @rpc_errors
    async def RegisterWorker(self, request, context):
        reason = await self.loop.register(request.worker_id, request.address, convert.info_from_proto(request.info))
        return scheduler_pb2.RegisterWorkerResponse(accepted=reason is None, reason=reason or "",
                                                    heartbeat_interval_s=self.loop.config.heartbeat_interval_s)

    @rpc_errors
    async def Heartbeat(self, request, context):
        return scheduler_pb2.HeartbeatResponse(known=self.loop.heartbeat(request.worker_id))
