"""One request's view for the call that submitted it: where the step loop delivers its updates
(its SubmitMany call's StreamMux) and when it is done."""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable

import structlog

from services.core.sequence import Request, SeqStatus, SeqUpdate
from services.rpc.fan_in import FanIn

log = structlog.get_logger("scheduler")
# How long a SubmitMany call's writer, woken by a delivery, lets other deliveries join the message:
# the workers step apart, so without it a message carries one or two workers' steps, and each
# message is a write (a syscall that wakes the frontend) on the scheduler's one core. 1 ms merges
# the steps that end within it (at 8 workers, messages per worker-step 0.23 -> 0.16 and ~20% less
# scheduler CPU per worker-step, bench/results/scheduler_scale.md) for at most 1 ms more per token.
NEWS_COALESCE_S = 0.001


Delivery = list[SeqUpdate] | Exception | None


class UpdateStream:
    """Each step's updates for one request are delivered as a list to `deliver`; None ends the
    stream and an exception ends it with that error."""

    def __init__(self, request: Request, deliver: Callable[[Delivery], None]):
        self.request = request
        self.deliver = deliver
        self.finish_reasons: dict[int, str] = {}
        self.num_output_tokens = 0
        self.started = time.monotonic()
        self.queue_time_s = 0.0  # from admission until the first step that ran it (set once it ran)
        self.scheduled = False
        # a continuation runs only the samples it names (each a sequence already)
        self.num_samples = len(request.seqs) if request.forked else request.params.n

    @property
    def done(self) -> bool:
        return len(self.finish_reasons) == self.num_samples

    def push(self, updates: list[SeqUpdate]) -> None:
        self.deliver(updates)
        for update in updates:
            self.num_output_tokens += len(update.token_ids)
            if update.finish_reason:
                self.finish_reasons[update.sample_index] = update.finish_reason

    def mark_scheduled(self, now: float) -> None:
        if not self.scheduled and any(s.status is SeqStatus.RUNNING for s in self.request.seqs):
            self.scheduled, self.queue_time_s = True, now - self.started

    def stopped(self, sample_index: int) -> SeqUpdate:
        """The update that ends one sample the frontend stopped (a stop string matched)."""
        request = self.request
        return SeqUpdate(request_id=request.request_id, sample_index=sample_index, token_ids=[], logprobs=None,
                         finish_reason="stop", stop_token_id=None, prompt_logprobs=None,
                         num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=request.num_cached_tokens,
                         seed=request.seed)

    def close(self, event: str) -> None:
        self.deliver(None)
        log.info(event, request_id=self.request.request_id, num_prompt_tokens=len(self.request.prompt_token_ids),
                 num_output_tokens=self.num_output_tokens, finish_reasons=sorted(set(self.finish_reasons.values())),
                 seconds=round(time.monotonic() - self.started, 4))


class StreamRouter:
    """request_id -> UpdateStream; routes a step's updates and closes finished streams."""

    def __init__(self):
        self.streams: dict[str, UpdateStream] = {}

    def __len__(self) -> int:
        return len(self.streams)

    def open(self, request: Request, deliver: Callable[[Delivery], None]) -> UpdateStream:
        stream = self.streams[request.request_id] = UpdateStream(request, deliver)
        return stream

    def route(self, updates: list[SeqUpdate]) -> None:
        by_request: dict[str, list[SeqUpdate]] = defaultdict(list)
        for update in updates:
            by_request[update.request_id].append(update)
        for request_id, request_updates in by_request.items():
            stream = self.streams.get(request_id)
            if stream is None:
                continue
            stream.push(request_updates)
            if stream.done:
                self.close(request_id, "request_finished")

    def fail(self, request_id: str, error: Exception) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.deliver(error)
            log.warning("request_failed", request_id=request_id, error=str(error))

    def close(self, request_id: str, event: str) -> bool:
        """End the stream if it is open; False when it already ended."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return False
        stream.close(event)
        return True


class StreamMux:
    """The requests of one SubmitMany call. Whatever the step loop delivers for any of them
    waits in a FanIn as (request_id, queue_time_s, delivery) until the call's writer takes it
    all at once (`next`): one message a step for the whole call instead of one per request, and,
    since the workers step apart, one for the steps that end within NEWS_COALESCE_S of each other."""

    def __init__(self):
        self.streams: dict[str, UpdateStream] = {}  # open on this call
        self.reading = True  # the client may still send requests
        self._news: FanIn[tuple[str, float, Delivery]] = FanIn()

    def sink(self, request_id: str) -> Callable[[Delivery], None]:
        """The deliver function of a request opened on this call (add its stream to `streams`)."""
        def deliver(item: Delivery) -> None:
            stream = self.streams.get(request_id)
            self.put(request_id, stream.queue_time_s if stream is not None else 0.0, item)
            if item is None or isinstance(item, Exception):
                self.streams.pop(request_id, None)
        return deliver

    def put(self, request_id: str, queue_time_s: float, item: Delivery) -> None:
        self._news.put((request_id, queue_time_s, item))

    def end_of_input(self) -> None:
        self.reading = False
        self._news.wake()

    async def next(self) -> list[tuple[str, float, Delivery]] | None:
        """Everything delivered since the last call; None once the client sends no more requests
        and none is open."""
        news = await self._news.take(lambda: not self.reading and not self.streams)
        if news is not None:  # the workers step apart: what their steps deliver meanwhile goes too
            await asyncio.sleep(NEWS_COALESCE_S)
            while len(self._news):
                news += await self._news.take(lambda: True)
        return news
