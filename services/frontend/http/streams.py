"""Several prompts' event streams as one: started together, merged as events arrive."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from services.frontend.types import GenerateEvent

Started = tuple[GenerateEvent, AsyncGenerator[GenerateEvent, None]]  # (first event, the rest)
Events = AsyncIterator[tuple[int, GenerateEvent]]  # merged: (prompt index, event)
_END = object()


async def start(generations: list[AsyncGenerator[GenerateEvent, None]]) -> list[Started]:
    """Each generation's first event: FrontendCore refuses a request (raises) before its first
    event, so after this nothing is refused. On a refusal the others are closed (aborted)."""
    started = []
    try:
        for generation in generations:
            started.append((await anext(generation), generation))
    except BaseException:
        for generation in generations:
            await generation.aclose()
        raise
    return started


async def merge(started: list[Started]) -> Events:
    """(prompt index, event) in arrival order. Closing it early closes (aborts) every generation."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, first: GenerateEvent, rest: AsyncGenerator) -> None:
        try:
            queue.put_nowait((index, first))
            async for event in rest:
                queue.put_nowait((index, event))
            queue.put_nowait((index, _END))
        except Exception as error:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, first, rest)) for i, (first, rest) in enumerate(started)]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get())[1] is not _END:
                if isinstance(item[1], Exception):
                    raise item[1]
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, rest in started:
            await rest.aclose()


async def build(builder, events: Events) -> AsyncIterator:
    """What a response builder (the Responses and Messages APIs') makes of merged events: its
    opening, what each sample adds, and its close with the last summary seen."""
    yield builder.begin()
    summary = None
    async for _, event in events:
        for sample in event.samples:
            yield builder.feed(sample)
        summary = event.summary or summary
    yield builder.end(summary)
