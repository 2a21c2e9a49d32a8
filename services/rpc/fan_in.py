"""FanIn: many producers, one consumer that takes everything ready at once.

This is how many requests share one stream on this project's wires: what all of them produced
since the last message goes out as one message (usually one scheduler step's worth), so the
per-message cost (~60-70 us of Python at each end on a small machine) is paid once a step, not
once a request and token. Its users: the scheduler's end of a SubmitMany call (StreamMux,
services/scheduler/streams.py) and the frontend's GenerateBatch (services/frontend/batch.py).

The frontend's end of its SubmitMany call (SubmitManyCall, services/frontend/scheduler_client.py)
is the other direction and not a fan-in: it hands each incoming RequestNews to its request's
queue, and writes one outgoing message per submit or cancel (a SubmitManyRequest holds one).
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FanIn(Generic[T]):
    """`put` never waits (a producer may be a callback of the step loop); `take` waits for the
    first item and returns every item put since, at most `max_items` of them."""

    def __init__(self, max_items: int | None = None):
        self.max_items = max_items
        self._items: deque[T] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        self._items.append(item)
        self._ready.set()

    def wake(self) -> None:
        """Make a waiting `take` ask its `finished` again (a producer ended)."""
        self._ready.set()

    async def take(self, finished: Callable[[], bool]) -> list[T] | None:
        """The items ready now, in the order they were put; None once none is left and
        `finished()` says no more will come."""
        while not self._items:
            if finished():
                return None
            self._ready.clear()
            await self._ready.wait()
        count = len(self._items) if self.max_items is None else min(self.max_items, len(self._items))
        return [self._items.popleft() for _ in range(count)]
