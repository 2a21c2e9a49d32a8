"""One Submit call's view of its request: the queue the step loop feeds and when it is done."""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import structlog

from services.core.sequence import Request, SeqStatus, SeqUpdate

log = structlog.get_logger("scheduler")


class RequestStream:
    """Each step's updates for one request go into `queue` as a list; None ends the stream and
    an exception ends it with that error."""

    def __init__(self, request: Request):
        self.request = request
        self.queue: asyncio.Queue[list[SeqUpdate] | Exception | None] = asyncio.Queue()
        self.finish_reasons: dict[int, str] = {}
        self.num_output_tokens = 0
        self.started = time.monotonic()
        self.queue_time_s = 0.0  # from Submit until the first step that ran it (set once it ran)
        self.scheduled = False

    @property
    def done(self) -> bool:
        return len(self.finish_reasons) == self.request.params.n

    def push(self, updates: list[SeqUpdate]) -> None:
        self.queue.put_nowait(updates)
        for update in updates:
            self.num_output_tokens += len(update.new_token_ids)
            if update.finish_reason:
                self.finish_reasons[update.sample_index] = update.finish_reason

    def mark_scheduled(self, now: float) -> None:
        if not self.scheduled and any(s.status is SeqStatus.RUNNING for s in self.request.seqs):
            self.scheduled, self.queue_time_s = True, now - self.started

    def stopped(self, sample_index: int) -> SeqUpdate:
        """The update that ends one sample the frontend stopped (a stop string matched)."""
        request = self.request
        return SeqUpdate(request.request_id, sample_index, [], None, "stop", None, None,
                         len(request.prompt_token_ids), request.num_cached_tokens, request.seed)

    def close(self, event: str) -> None:
        self.queue.put_nowait(None)
        log.info(event, request_id=self.request.request_id, num_prompt_tokens=len(self.request.prompt_token_ids),
                 num_output_tokens=self.num_output_tokens, finish_reasons=sorted(set(self.finish_reasons.values())),
                 seconds=round(time.monotonic() - self.started, 4))


class StreamRouter:
    """request_id -> RequestStream; routes a step's updates and closes finished streams."""

    def __init__(self):
        self.streams: dict[str, RequestStream] = {}

    def __len__(self) -> int:
        return len(self.streams)

    def open(self, request: Request) -> RequestStream:
        stream = self.streams[request.request_id] = RequestStream(request)
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
            stream.queue.put_nowait(error)
            log.warning("request_failed", request_id=request_id, error=str(error))

    def close(self, request_id: str, event: str) -> bool:
        """End the stream if it is open; False when it already ended."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return False
        stream.close(event)
        return True
