"""FanIn, the one helper by which many requests share one stream (SubmitMany, GenerateBatch)."""
from __future__ import annotations

import asyncio

from services.rpc.fan_in import FanIn


def test_take_returns_everything_ready_in_order_up_to_max_items_then_none_once_finished():
    async def main():
        fan_in: FanIn[int] = FanIn(max_items=3)
        done = False
        for i in range(5):
            fan_in.put(i)
        assert await fan_in.take(lambda: done) == [0, 1, 2]
        assert await fan_in.take(lambda: done) == [3, 4]
        waiting = asyncio.ensure_future(fan_in.take(lambda: done))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing ready, not finished: it waits
        fan_in.put(5)
        fan_in.put(6)
        assert await waiting == [5, 6]
        waiting = asyncio.ensure_future(fan_in.take(lambda: done))
        await asyncio.sleep(0.01)
        done = True
        fan_in.wake()
        assert await waiting is None
        fan_in.put(7)
        assert await fan_in.take(lambda: True) == [7]  # items put before the end still come out

    asyncio.run(asyncio.wait_for(main(), 10))
