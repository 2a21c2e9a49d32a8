"""The frontend's side of a scheduler failover: which scheduler is active, and waiting for one.

When the SubmitMany call breaks (the scheduler died, or the way to it did), the open requests
are kept (SchedulerClient.submit resubmits each as a continuation, services/frontend/progress.py)
and `SchedulerPool` looks for a scheduler that serves again: the restarted one at the same
address, or another of `--scheduler-address`'s, one active at a time. A scheduler serves when it
answers GetStats with a registered worker (before the workers re-register it would refuse the
continuations). A request waits at most `--scheduler-failover-timeout` from when it lost its
scheduler; then it fails with UNAVAILABLE naming the scheduler. The search goes on in the
background until one serves, so health turns SERVING again as soon as it does.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import structlog

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.core.errors import Unavailable
from services.rpc.grpc_server import RECONNECT_OPTIONS

log = structlog.get_logger("frontend")
PROBE_TIMEOUT_S = 1.0
MAX_PROBE_BACKOFF_S = 1.0  # a restarted scheduler is found within about a second


def backoff(attempt: int) -> float:
    """Seconds before try `attempt` (from 1): 0.05 doubling to MAX_PROBE_BACKOFF_S."""
    return min(0.05 * 2 ** (attempt - 1), MAX_PROBE_BACKOFF_S)


class SchedulerLost(Unavailable):
    """The SubmitMany call broke, or the scheduler refused a request with UNAVAILABLE (it has no
    worker yet, or is shutting down): the request waits for a scheduler that serves, and is
    carried over."""


class SchedulerPool:
    """The scheduler addresses, the active one, and the search for a serving one after a loss."""

    def __init__(self, addresses: Sequence[str], failover_timeout_s: float):
        self.addresses = list(addresses)
        self.failover_timeout_s = failover_timeout_s
        self.active = 0
        self.last_error = ""
        self.lost_since = 0.0  # when the search under way began (event loop time)
        self.lost_event = asyncio.Event()  # set on a loss: health need not wait for its next poll
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, scheduler_pb2_grpc.SchedulerStub] = {}
        self._search: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.addresses[self.active]

    def stub(self, index: int | None = None) -> scheduler_pb2_grpc.SchedulerStub:
        """The active scheduler's stub (or that of address `index`); channels are opened once."""
        index = self.active if index is None else index
        if index not in self._stubs:
            self._channels[index] = grpc.aio.insecure_channel(self.addresses[index], options=RECONNECT_OPTIONS)
            self._stubs[index] = scheduler_pb2_grpc.SchedulerStub(self._channels[index])
        return self._stubs[index]

    @property
    def searching(self) -> bool:
        return self._search is not None and not self._search.done()

    def lost(self, reason: str) -> None:
        """The active scheduler is gone: start looking for one (once per outage)."""
        if not self.searching:
            self.lost_since = asyncio.get_running_loop().time()
            self.last_error = f"{self.address}: {reason}"
            log.warning("scheduler_lost", scheduler=self.address, reason=reason,
                        failover_timeout_s=self.failover_timeout_s)
            self._search = asyncio.ensure_future(self._find())
            self.lost_event.set()

    async def wait(self, lost_since: float, attempt: int) -> None:
        """Until a scheduler serves (after the `attempt`-th loss in a row, at least a backoff:
        a scheduler that refuses with UNAVAILABLE answers GetStats all the same); Unavailable once
        the failover timeout passed since `lost_since`."""
        remaining = lost_since + self.failover_timeout_s - asyncio.get_running_loop().time()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            if self.searching:
                await asyncio.wait_for(asyncio.shield(self._search), remaining)
            elif attempt > 1:
                if remaining < backoff(attempt):
                    raise asyncio.TimeoutError
                await asyncio.sleep(backoff(attempt))
        except asyncio.TimeoutError:
            raise Unavailable(f"scheduler {', '.join(self.addresses)} did not come back within the failover "
                              f"timeout ({self.failover_timeout_s:g} s); last: {self.last_error}") from None

    async def _find(self) -> None:
        attempt = 0
        while True:
            for k in range(len(self.addresses)):
                index = (self.active + k) % len(self.addresses)
                if await self._serves(index):
                    log.info("scheduler_found", scheduler=self.addresses[index], was=self.address)
                    self.active = index
                    return
            attempt += 1
            await asyncio.sleep(backoff(attempt))

    async def _serves(self, index: int) -> bool:
        address = self.addresses[index]
        try:
            stats = await self.stub(index).GetStats(scheduler_pb2.GetStatsRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            self.last_error = f"{address}: {error.code().name} ({error.details()})"
            return False
        if not stats.workers:
            self.last_error = f"{address}: no worker has registered yet"
        return bool(stats.workers)

    async def close(self) -> None:
        if self._search is not None:
            self._search.cancel()
            await asyncio.gather(self._search, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
