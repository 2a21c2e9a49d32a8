"""The frontend's side of the scheduler boundary: Submit, Abort and GetStats over grpc.aio.

The scheduler's refusals come back as core errors (ResourceExhausted, Unavailable,
InvalidArgument), so services.rpc_errors passes them on to the client with the same status.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services import convert
from services.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.core.sampling_params import SamplingParams
from services.core.sequence import SeqUpdate

_CORE_ERROR = {grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted, grpc.StatusCode.UNAVAILABLE: Unavailable,
               grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable}


@dataclass
class SubmitStep:
    """What one scheduler step added to a request."""

    updates: list[SeqUpdate]
    queue_time_s: float  # seconds the request waited before its first step


@dataclass
class WorkerStats:
    worker_id: str
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up, since the worker registered
    prefix_cache_hits: int  # prompt tokens found


@dataclass
class SchedulerStats:
    num_workers: int
    max_model_len: int
    vocab_size: int
    model: str
    batch_invariant: bool = False  # the workers' deterministic mode
    num_waiting: int = 0  # sequences
    num_running: int = 0
    num_swapped: int = 0
    num_preemptions: int = 0  # since the scheduler started
    workers: list[WorkerStats] = field(default_factory=list)


class SchedulerClient:
    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int) -> AsyncIterator[SubmitStep]:
        """Each step's updates; closing the iterator early (or being cancelled) cancels the call,
        which aborts the request at the scheduler and frees its blocks."""
        call = self.stub.Submit(convert.submit_to_proto(request_id, prompt_token_ids, params, priority))
        try:
            async for response in call:
                yield SubmitStep(convert.updates_from_response(request_id, response), response.queue_time_s)
        except grpc.aio.AioRpcError as error:
            _raise_core_error(error)
        finally:
            call.cancel()

    async def abort(self, request_id: str, sample_index: int = -1) -> None:
        """End one sample (sample_index >= 0) or the whole request."""
        try:
            await self.stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id, sample_index=sample_index))
        except grpc.aio.AioRpcError as error:
            _raise_core_error(error)

    async def stats(self, timeout: float | None = None) -> SchedulerStats:
        """Raises Unavailable when the scheduler does not answer."""
        try:
            response = await self.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            _raise_core_error(error)
        workers = [WorkerStats(w.worker_id, w.num_gpu_blocks, w.num_free_gpu_blocks, w.prefix_cache_queries,
                               w.prefix_cache_hits) for w in response.workers]
        return SchedulerStats(len(workers), response.max_model_len, response.vocab_size, response.model,
                              response.batch_invariant, response.num_waiting, response.num_running,
                              response.num_swapped, response.num_preemptions, workers)

    async def close(self) -> None:
        await self.channel.close()


def _raise_core_error(error: grpc.aio.AioRpcError):
    """Raise the scheduler's status as the core error that maps back to it; others as they are."""
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, message = (error.details() or "").partition(": ")
        raise InvalidArgument(field, message) from error
    kind = _CORE_ERROR.get(error.code())
    if kind is None:
        raise error
    raise kind(f"scheduler: {error.details() or error.code().name}") from error
