"""The frontend's side of the scheduler boundary: SubmitMany and GetStats over grpc.aio.

Every request of this frontend travels on one SubmitMany call (`SubmitManyCall`): one message a step for
all of them instead of one per request and token (the scheduler and the frontend used ~30% less
CPU for the same offline pass; bench/RESULTS.md). The scheduler's refusals come back as core errors
(ResourceExhausted, Unavailable, InvalidArgument), so services.rpc.status passes them on to the
client with the same status.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog

from pagedserve.internal.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.rpc import internal_codec
from services.rpc.status import StatusError, code_of, core_error, scheduler_lost
from services.core.errors import InvalidArgument, Unavailable
from services.core.sampling_params import SamplingParams
from services.core.sequence import ContinuedSample, SeqUpdate
from services.core.stats import SchedulerStats
from services.frontend.failover_client import SchedulerLost, SchedulerPool
from services.frontend.progress import Progress

log = structlog.get_logger("frontend")


@dataclass
class SubmitStep:
    """What one scheduler step added to a request."""

    updates: list[SeqUpdate]
    queue_time_s: float  # seconds the request waited before its first step


class SubmitManyCall:
    """The frontend's end of its one SubmitMany call and the requests waiting on it: it
    demultiplexes (each RequestNews to its request's queue) and writes one message per submit or
    cancel, so it is not a FanIn (services/rpc/fan_in.py), which the scheduler's end uses.

    Two tasks own the call: a writer that sends what the requests put in `outbox`, and a reader
    that hands each RequestNews to its request's queue. A request never touches the call itself: grpc.aio cancels the whole call
    when a task is cancelled while it writes, so a client that went away (its task cancelled,
    over and over under an HTTP server's cancel scope) would fail every other request. When the
    call breaks, every waiting request gets the error: SchedulerLost when the scheduler went away
    (UNAVAILABLE, or the call ended under open requests), which the requests survive."""

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
            self._fail(SchedulerLost(f"scheduler: the SubmitMany call ended ({detail})"))

    async def _read(self) -> None:
        error: Exception = SchedulerLost("scheduler: the SubmitMany call ended")
        try:
            async for response in self.call:
                for news in response.news:
                    queue = self.queues.get(news.request_id)
                    if queue is not None:
                        queue.put_nowait(news)
        except grpc.aio.AioRpcError as rpc_error:
            error = core_error(rpc_error.code(), rpc_error.details(), "scheduler")
            if scheduler_lost(rpc_error.code(), rpc_error.details() or ""):
                error = SchedulerLost(str(error))
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
    """The active scheduler of `addresses` (SchedulerPool). A request whose scheduler is lost
    waits for one that serves (at most failover_timeout_s) and is resubmitted there as a
    continuation (services/frontend/progress.py): its stream sees a pause, not an error."""

    def __init__(self, addresses: str | Sequence[str], failover_timeout_s: float = 30.0):
        self.pool = SchedulerPool(addresses.split(",") if isinstance(addresses, str) else addresses,
                                  failover_timeout_s)
        self._submit_many: SubmitManyCall | None = None
        self._open: dict[str, Progress] = {}

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return self.pool.stub()

    def _call(self) -> SubmitManyCall:
        """The SubmitMany call, opened again after it broke (the scheduler restarted or another took over)."""
        if self._submit_many is None or self._submit_many.broken is not None:
            self._submit_many = SubmitManyCall(self.stub)
        return self._submit_many

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int, lora_name: str = "") -> AsyncIterator[SubmitStep]:
        """Each step's updates; closing the iterator early (or being cancelled) cancels the
        request at the scheduler, which aborts it and frees its blocks. A lost scheduler is waited
        for (while the pool searches, a new request waits too, from when it was lost) and the
        request resubmitted; Unavailable once the failover timeout passes (at once for a new
        request when the scheduler has been away longer)."""
        if request_id in self._open:
            raise InvalidArgument("request_id", f"{request_id!r} is already running")
        progress = self._open[request_id] = Progress(params)
        lost_since, attempt = None, 0  # since when this request has had no scheduler, and how many losses
        try:
            while not progress.done:
                if self.pool.searching and lost_since is None:
                    lost_since = self.pool.lost_since
                if lost_since is not None:
                    await self.pool.wait(lost_since, attempt)
                mux = self._call()
                resubmit = progress.reported or lost_since is not None
                sent_params, continued = progress.resubmission() if resubmit else (params, ())
                try:
                    async with aclosing(self._run(mux, request_id, prompt_token_ids, sent_params, priority,
                                                  continued, resubmit, lora_name)) as steps:
                        async for step in steps:
                            progress.apply(step.updates)
                            lost_since, attempt = None, 0
                            yield step
                    return
                except SchedulerLost as error:
                    if mux is self._submit_many:  # else an older call's loss, and a new call is open already
                        self.pool.lost(str(error))
                    now = asyncio.get_running_loop().time()
                    lost_since = lost_since or (self.pool.lost_since if self.pool.searching else now)
                    attempt += 1
                    log.info("request_waits_for_scheduler", request_id=request_id, reason=str(error),
                             num_tokens=sum(map(len, progress.token_ids)))
        finally:
            self._open.pop(request_id, None)

    async def _run(self, mux: SubmitManyCall, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   priority: int, continued: tuple[ContinuedSample, ...], resubmit: bool,
                   lora_name: str = "") -> AsyncIterator[SubmitStep]:
        """One submission of the request on `mux`, until its last news. A resubmission refused as
        "already running" reached a scheduler that is still aborting it (the call broke, the
        scheduler lived): it is tried again like a lost one."""
        if request_id in mux.queues:
            raise InvalidArgument("request_id", f"{request_id!r} is already running")
        queue = mux.queues[request_id] = asyncio.Queue()
        finished = False
        try:
            mux.send(scheduler_pb2.SubmitManyRequest(submit=internal_codec.submit_to_proto(
                request_id, prompt_token_ids, params, priority, continued, lora_name)))
            while True:
                news = await queue.get()
                if isinstance(news, Exception):
                    finished = True
                    raise news
                if news.error_code:
                    finished = True
                    code = code_of(news.error_code)
                    error = core_error(code, news.error_message, "scheduler")
                    if scheduler_lost(code) or (resubmit and isinstance(error, InvalidArgument)
                                              and error.field == "request_id"):
                        raise SchedulerLost(str(error))
                    raise error
                if news.HasField("response"):
                    yield SubmitStep(internal_codec.updates_from_response(request_id, news.response),
                                     news.response.queue_time_s)
                if news.done:
                    finished = True
                    return
        finally:
            mux.queues.pop(request_id, None)
            # (a broken call aborts its requests by itself)
            if not finished and not _ended(queue) and mux.broken is None:
                mux.send(scheduler_pb2.SubmitManyRequest(cancel=request_id))

    def stop_sample(self, request_id: str, sample_index: int) -> None:
        """End one sample of a running request (a stop string matched), on the SubmitMany call the
        request runs on, after everything sent for it before. A request that is being carried to
        another scheduler is resubmitted without the ended sample, so a broken call is no error here."""
        progress = self._open.get(request_id)
        if progress is not None:
            progress.end_sample(sample_index)
        mux = self._submit_many
        if mux is None or mux.broken is not None or request_id not in mux.queues:
            return
        mux.send(scheduler_pb2.SubmitManyRequest(
            stop_sample=scheduler_pb2.StopSample(request_id=request_id, sample_index=sample_index)))

    async def stats(self, timeout: float | None = None) -> SchedulerStats:
        """Raises Unavailable when the scheduler does not answer (or a failover is under way)."""
        if self.pool.searching:
            raise Unavailable(f"scheduler {self.pool.last_error}; looking for one that serves")
        try:
            response = await self.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            _raise_core_error(error)
        return internal_codec.stats_from_proto(response)

    async def lora(self, load: bool, name: str, path: str = "") -> list[str]:
        """Load (or unload) a LoRA adapter on every worker; every adapter the scheduler serves after."""
        call = self.stub.LoadLoraAdapter if load else self.stub.UnloadLoraAdapter
        try:
            response = await call(common_pb2.LoraAdapterRequest(lora_name=name, lora_path=path))
        except grpc.aio.AioRpcError as error:
            _raise_core_error(error)
        return list(response.lora_names)

    async def close(self) -> None:
        if self._submit_many is not None:
            await self._submit_many.close()
        await self.pool.close()


def _ended(queue: asyncio.Queue) -> bool:
    """Whether the request's last news already arrived unread (the caller stopped at its last
    tokens): then there is nothing to cancel at the scheduler."""
    while not queue.empty():
        news = queue.get_nowait()
        if isinstance(news, Exception) or news.done or news.error_code:
            return True
    return False


def _raise_core_error(error: grpc.aio.AioRpcError):
    """Raise the scheduler's status as the core error that maps back to it; others as they are."""
    core = core_error(error.code(), error.details(), "scheduler")
    if isinstance(core, StatusError):
        raise error
    raise core from error
