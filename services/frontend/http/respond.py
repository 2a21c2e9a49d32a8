"""The one skeleton of every route that generates (completions, chat completions, Responses, Messages).

A route turns its body into GenerateRequests and an `Output` (its API's builder of bodies and events,
which knows only its own schema) and returns `respond(request, core, requests, output, stream)`:

1. every prompt's generation is started first, so a refusal is an error status, not a broken stream.
   A request waits for its first event while it is queued, so the client is watched from the start:
   one that leaves a queued request, streamed or not, aborts it at once;
2. not streamed: `output.collect(events)`, the client still watched (a non-streamed response only
   notices a disconnect by looking), then the body as JSON; a client that left gets 499;
3. streamed: `output.sse(events)` as server-sent events. Once streaming has begun the status is
   sent, so a later refusal becomes `output.refusal(error)`, the API's own error event.
Closing the merged events (on any exit) aborts every generation still running.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.core.errors import REFUSALS
from services.frontend.core import FrontendCore
from services.frontend.http.streams import Events, merge, start
from services.frontend.types import GenerateRequest

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs and metrics do


class Output(Protocol):
    """One response of one API, from the merged (prompt index, event) pairs of its generations."""

    async def collect(self, events: Events) -> dict:
        """The whole (non-streamed) body."""

    def sse(self, events: Events) -> AsyncIterator[str]:
        """The streamed body, server-sent event by event (`data_event`, `named_event`)."""

    def refusal(self, error: Exception) -> str:
        """The event that ends a stream a refusal (services.core.errors.REFUSALS) cut short."""


async def respond(request: Request, core: FrontendCore, requests: list[GenerateRequest], output: Output,
                  stream: bool) -> Response:
    streams = await unless_disconnected(request, start([core.generate(r) for r in requests]))
    if streams is None:
        return Response(status_code=CLIENT_CLOSED)
    events = merge(streams)
    if not stream:
        try:
            body = await unless_disconnected(request, output.collect(events))
        finally:
            await events.aclose()  # a client that left: closing the streams aborts the generations
        return Response(status_code=CLIENT_CLOSED) if body is None else JSONResponse(body)
    return StreamingResponse(sse(output, events), media_type="text/event-stream", headers={"cache-control": "no-cache"})


async def sse(output: Output, events: Events) -> AsyncIterator[str]:
    """The output's events, ended by its refusal event if a refusal cuts the stream short."""
    try:
        async for chunk in output.sse(events):
            yield chunk
    except REFUSALS as error:
        yield output.refusal(error)
    finally:
        await events.aclose()


def data_event(data: dict | str) -> str:
    """An unnamed event (OpenAI's chat and completions chunks, and their closing `[DONE]`)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def named_event(event: dict) -> str:
    """An event named by its `type` (the Responses and Messages APIs')."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def unless_disconnected(request: Request, work):
    """The work's result, or None once the client has gone away (the work is then cancelled).
    A streamed response notices a disconnect when it writes; a non-streamed one must look."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
