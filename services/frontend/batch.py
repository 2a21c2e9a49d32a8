"""Many requests over one call (the public GenerateBatch RPC), transport-free.

Each request runs through FrontendCore.generate exactly as a Generate call would; what
changes is the delivery. Everything the requests produced since the last message goes out
as one message, usually one scheduler step's worth, so a job of N requests costs about one
message per step instead of N. On a small machine that matters: one streamed message costs
~60-70 us of Python in the frontend and as much in the client.

A request that is refused or fails ends alone, as an error item; the others go on. The run
ends once the client has sent everything and every request has ended; closing the run early
(the client went away) aborts the requests still running.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import structlog

from services.core.errors import REFUSALS, InvalidArgument
from services.frontend.core import FrontendCore
from services.frontend.types import GenerateEvent, GenerateRequest
from services.rpc.fan_in import FanIn


@dataclass
class BatchError:
    """Request `index` (its place in the client's stream, from 0) ended with this error."""

    index: int
    request_id: str
    error: Exception


BatchItem = GenerateEvent | BatchError
MAX_ITEMS_PER_MESSAGE = 256  # keeps a message far under gRPC's 4 MB default even with logprobs
ROOM_POLL_S = 0.05  # how often a batch waiting for room under max_pending looks again
log = structlog.get_logger("frontend")


def run_batch(core: FrontendCore, requests: AsyncIterator[tuple[str, GenerateRequest | Exception]]
              ) -> AsyncIterator[list[BatchItem]]:
    """Lists of items, each list what was ready since the previous one. `requests` gives the
    client's requests in order as (request_id, request); an Exception in a request's place is one
    that could not be read (a bad field), reported as that request's error. Closing the iterator
    early aborts the requests still running."""
    return BatchRun(core).run(requests)


class BatchRun:
    """One GenerateBatch call: a reader task that starts a task per request (`_read`), the
    request tasks (`_one`), and the outbox they all put their items in, which `run` drains."""

    def __init__(self, core: FrontendCore):
        self.core = core
        self.outbox: FanIn[BatchItem] = FanIn(MAX_ITEMS_PER_MESSAGE)
        self.tasks: set[asyncio.Task] = set()
        self.seen: set[str] = set()
        self.num_open = 1  # the reader, plus every request it started
        self.room = asyncio.Event()  # set whenever one of this batch's requests ends

    async def run(self, requests) -> AsyncIterator[list[BatchItem]]:
        reader = asyncio.create_task(self._read(requests))
        try:
            # everything that is ready goes out in one message (up to a size), until all have ended
            while (items := await self.outbox.take(lambda: self.num_open == 0)) is not None:
                yield items
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # the client's stream broke: the call fails, not "all done"
        finally:
            reader.cancel()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(reader, *self.tasks, return_exceptions=True)

    def _ended(self) -> None:
        """A request, or the reader, ended."""
        self.num_open -= 1
        self.outbox.wake()

    async def _one(self, index: int, request: GenerateRequest) -> None:
        try:
            async with aclosing(self.core.generate(request)) as events:
                async for event in events:
                    self.outbox.put(event)
        except Exception as error:  # noqa: BLE001 - reported to the client as this request's error
            if not isinstance(error, REFUSALS):
                log.exception("batch_request_failed", request_id=request.request_id)
            self.outbox.put(BatchError(index, request.request_id, error))
        finally:
            self.room.set()
            self._ended()

    async def _wait_for_room(self) -> None:
        """Under max_pending a batch waits for room instead of having its requests refused."""
        core = self.core
        while core.max_pending and max(core.num_pending, len(self.tasks)) >= core.max_pending:
            self.room.clear()
            try:
                await asyncio.wait_for(self.room.wait(), ROOM_POLL_S)  # other clients' requests end unseen
            except TimeoutError:
                pass

    async def _read(self, requests) -> None:
        try:
            async for index, (request_id, request) in _numbered(requests):
                problem = request if isinstance(request, Exception) else _check_id(request_id, self.seen)
                if problem is not None:
                    self.outbox.put(BatchError(index, request_id, problem))
                    continue
                self.seen.add(request_id)
                await self._wait_for_room()
                self.num_open += 1
                task = asyncio.create_task(self._one(index, request))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        finally:
            self._ended()


async def _numbered(requests):
    index = 0
    async for request in requests:
        yield index, request
        index += 1


def _check_id(request_id: str, seen: set[str]) -> InvalidArgument | None:
    if not request_id:
        return InvalidArgument("request_id", "required in GenerateBatch: responses are matched to requests by it")
    if request_id in seen:
        return InvalidArgument("request_id", f"{request_id!r} is used twice in this batch")
    return None
