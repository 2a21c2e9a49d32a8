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

A builder gives payloads, and this module alone turns them into bytes (`encode`, `event_text`): a
declared response model (schemas.py and each API's *_schemas.py: what the builder built is what the
schema states) as its set fields; its events are unnamed (`data:` only, OpenAI's chunks, ended by
DONE) or, where `output.named`, named by their `type` (the Responses and Messages APIs').
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from services.core.errors import REFUSALS
from services.frontend.core import FrontendCore
from services.frontend.http.streams import Events, merge, start
from services.frontend.types import GenerateRequest

Payload = Union[BaseModel, str]  # a model: its JSON; a str: the data as it is (DONE)
DONE = "[DONE]"  # the data of OpenAI's last event
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs and metrics do


class Output(Protocol):
    """One response of one API, from the merged (prompt index, event) pairs of its generations."""

    named: bool  # its events are named by their type

    async def collect(self, events: Events) -> BaseModel:
        """The whole (non-streamed) body."""

    def sse(self, events: Events) -> AsyncIterator[Payload]:
        """The streamed body, event by event."""

    def refusal(self, error: Exception) -> list[Payload]:
        """The events that end a stream a refusal (services.core.errors.REFUSALS) cut short."""


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
        if body is None:
            return Response(status_code=CLIENT_CLOSED)
        return Response(encode(body), media_type="application/json")
    return StreamingResponse(sse(output, events), media_type="text/event-stream", headers={"cache-control": "no-cache"})


async def sse(output: Output, events: Events) -> AsyncIterator[str]:
    """The output's events, ended by its refusal event if a refusal cuts the stream short."""
    try:
        async for payload in output.sse(events):
            yield event_text(payload, output.named)
    except REFUSALS as error:
        for payload in output.refusal(error):
            yield event_text(payload, output.named)
    finally:
        await events.aclose()


def encode(payload: BaseModel) -> str:
    """A payload's JSON: a model's set fields (model_construct's, so what the builder gave)."""
    return payload.model_dump_json(exclude_unset=True)


def event_text(payload: Payload, named: bool) -> str:
    """One server-sent event: unnamed (OpenAI's chunks and DONE) or named by the payload's `type`."""
    data = payload if isinstance(payload, str) else encode(payload)
    if not named:
        return f"data: {data}\n\n"
    return f"event: {payload.type}\ndata: {data}\n\n"


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
