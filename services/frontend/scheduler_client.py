"""The frontend's side of the scheduler boundary: SubmitMany, Abort and GetStats over grpc.aio.

Every request of this frontend travels on one SubmitMany call (`_Mux`): one message a step for
all of them instead of one per request and token (the scheduler and the frontend used ~30% less
CPU for the same offline pass; bench/RESULTS.md). The scheduler's refusals come back as core errors
(ResourceExhausted, Unavailable, InvalidArgument), so services.rpc_errors passes them on to the
client with the same status.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services import convert
from services.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.core.sampling_params import SamplingParams
from services.core.sequence import SeqUpdate
from services.grpc_server import RECONNECT_OPTIONS

_CORE_ERROR = {grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted, grpc.StatusCode.UNAVAILABLE: Unavailable,
               grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable}


@dataclass
class SubmitStep:
    """What one scheduler step added to a request."""

    updates: list[SeqUpdate]
    queue_time_s: float  # seconds the request waited before its first step


@dataclass(kw_only=True)
class WorkerStats:
    worker_id: str
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up, since the worker registered
    prefix_cache_hits: int  # prompt tokens found


@dataclass(kw_only=True)
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


class _Mux:
    """One SubmitMany call and the requests waiting on it. Two tasks own the call: a writer that
    sends what the requests put in `outbox`, and a reader that hands each RequestNews to its
    request's queue. A request never touches the call itself: grpc.aio cancels the whole call
    when a task is cancelled while it writes, so a client that went away (its task cancelled,
    over and over under an HTTP server's cancel scope) would fail every other request. When the
    call breaks, every waiting request gets the error."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub):
        self.call = stub.SubmitMany()
        self.queues: dict[str, asyncio.Queue] = {}
        self.broken: Exception | None = None
        self.outbox: asyncio.Queue[scheduler_pb2.SubmitManyRequest] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())
        self._writer = asyncio.ensure_future(self._write())

    def send(self, message: scheduler_pb2.SubmitManyRequest) -> None:
        """Queue a message for the writer; never waits, so a cancelled caller can still send."""
        if self.broken is not None:
            raise self.broken
        self.outbox.put_nowait(message)

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self.outbox.get())
        except asyncio.CancelledError:
            return  # closed (close(), or the reader saw the call end)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):  # the reader has the status
                await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            self._fail(Unavailable(f"scheduler: the SubmitMany call ended ({detail})"))

    async def _read(self) -> None:
        error: Exception = Unavailable("scheduler: the SubmitMany call ended")
        try:
            async for response in self.call:
                for news in response.news:
                    queue = self.queues.get(news.request_id)
                    if queue is not None:
                        queue.put_nowait(news)
        except grpc.aio.AioRpcError as rpc_error:
            error = _core_error(rpc_error.code(), rpc_error.details())
        except asyncio.CancelledError:
            error = Unavailable("scheduler: the frontend closed the SubmitMany call")
        self._fail(error)
        self._writer.cancel()

    def _fail(self, error: Exception) -> None:
        """The call is gone: every request on it ends with `error` (once)."""
        if self.broken is not None:
            return
        self.broken = error
        for queue in self.queues.values():
            queue.put_nowait(error)

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        self._writer.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class SchedulerClient:
    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self._mux: _Mux | None = None

    def _call(self) -> _Mux:
        """The SubmitMany call, opened again after it broke (the scheduler restarted)."""
        if self._mux is None or self._mux.broken is not None:
            self._mux = _Mux(self.stub)
        return self._mux

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int) -> AsyncIterator[SubmitStep]:
        """Each step's updates; closing the iterator early (or being cancelled) cancels the
        request at the scheduler, which aborts it and frees its blocks."""
        mux = self._call()
        if request_id in mux.queues:
            raise InvalidArgument("request_id", f"{request_id!r} is already running")
        queue = mux.queues[request_id] = asyncio.Queue()
        finished = False
        try:
            mux.send(scheduler_pb2.SubmitManyRequest(
                submit=convert.submit_to_proto(request_id, prompt_token_ids, params, priority)))
            while True:
                news = await queue.get()
                if isinstance(news, Exception):
                    finished = True
                    raise news
                if news.error_code:
                    finished = True
                    code = _STATUS_BY_VALUE.get(news.error_code, grpc.StatusCode.UNKNOWN)
                    raise _core_error(code, news.error_message)
                if news.HasField("response"):
                    yield SubmitStep(convert.updates_from_response(request_id, news.response),
                                     news.response.queue_time_s)
                if news.done:
                    finished = True
                    return
        finally:
            mux.queues.pop(request_id, None)
            # (a broken call aborts its requests by itself)
            if not finished and not _ended(queue) and mux.broken is None:
                mux.send(scheduler_pb2.SubmitManyRequest(cancel=request_id))

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
        workers = [WorkerStats(worker_id=w.worker_id, num_gpu_blocks=w.num_gpu_blocks,
                               num_free_gpu_blocks=w.num_free_gpu_blocks, prefix_cache_queries=w.prefix_cache_queries,
                               prefix_cache_hits=w.prefix_cache_hits) for w in response.workers]
        return SchedulerStats(num_workers=len(workers), max_model_len=response.max_model_len,
                              vocab_size=response.vocab_size, model=response.model,
                              batch_invariant=response.batch_invariant, num_waiting=response.num_waiting,
                              num_running=response.num_running, num_swapped=response.num_swapped,
                              num_preemptions=response.num_preemptions, workers=workers)

    async def close(self) -> None:
        if self._mux is not None:
            await self._mux.close()
        await self.channel.close()


def _ended(queue: asyncio.Queue) -> bool:
    """Whether the request's last news already arrived unread (the caller stopped at its last
    tokens): then there is nothing to cancel at the scheduler."""
    while not queue.empty():
        news = queue.get_nowait()
        if isinstance(news, Exception) or news.done or news.error_code:
            return True
    return False


_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def _core_error(code: grpc.StatusCode, details: str | None) -> Exception:
    """The scheduler's status as the core error that maps back to it (others: SchedulerError)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, message = (details or "").partition(": ")
        return InvalidArgument(field, message)
    kind = _CORE_ERROR.get(code, SchedulerError)
    return kind(f"scheduler: {details or code.name}")


class SchedulerError(RuntimeError):
    """A scheduler status with no core error of its own (INTERNAL: a step failed)."""


def _raise_core_error(error: grpc.aio.AioRpcError):
    """Raise the scheduler's status as the core error that maps back to it; others as they are."""
    core = _core_error(error.code(), error.details())
    if isinstance(core, SchedulerError):
        raise error
    raise core from error
