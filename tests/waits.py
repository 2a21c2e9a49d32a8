"""Waiting on a running cluster, written once for every test: poll until a condition holds, read the
scheduler's stats (GetStats) and the frontend's /health, and wait until the cluster is idle: nothing
running or waiting and every worker's KV blocks free. Idle is what a user checks after a cancel, a
disconnect or a crash: no block leaked, no sequence left behind.

The in-process cluster (tests/cluster.py) waits the same way asynchronously: `Cluster.wait_idle`.
"""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Callable

import grpc

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc


def poll(predicate: Callable, timeout: float, what: str, *, every: float = 0.1,
         retry_on: tuple[type[BaseException], ...] = (grpc.RpcError,), logs: Callable[[], str] | None = None):
    """predicate()'s first truthy value, asked every `every` seconds; an exception of `retry_on` (a
    service restarting) counts as not yet. After `timeout` seconds: an AssertionError naming `what`,
    with `logs()` when given."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except retry_on:
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            tail = f":\n{logs()}" if logs else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
        time.sleep(every)


def scheduler_stats(address: str | int) -> scheduler_pb2.GetStatsResponse:
    """GetStats of the scheduler at `address` ("host:port", or a loopback port)."""
    target = f"127.0.0.1:{address}" if isinstance(address, int) else address
    with grpc.insecure_channel(target) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)


def http_healthy(base: str | int) -> bool:
    """The frontend's GET /health answers 200 (`base`: "http://host:port", or a loopback port)."""
    url = f"http://127.0.0.1:{base}" if isinstance(base, int) else base
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def is_idle(stats, num_workers: int | None = None) -> bool:
    """Nothing running or waiting and every worker's KV blocks free (and `num_workers` registered, when
    given). `stats`: a GetStatsResponse or the in-process SchedulerStats."""
    return (stats.num_running == 0 and stats.num_waiting == 0
            and all(w.num_free_gpu_blocks == w.num_gpu_blocks for w in stats.workers)
            and (num_workers is None or len(stats.workers) == num_workers))


def describe(stats) -> str:
    """What keeps `stats` from idle, for a failure message."""
    workers = ", ".join(f"{w.worker_id} {w.num_free_gpu_blocks}/{w.num_gpu_blocks} blocks free" for w in stats.workers)
    return f"{stats.num_running} running, {stats.num_waiting} waiting, {len(stats.workers)} workers: {workers}"


def wait_idle(get_stats: Callable | str | int, timeout: float = 30.0, num_workers: int | None = None,
              logs: Callable[[], str] | None = None):
    """The scheduler's stats once the cluster is idle (is_idle). `get_stats`: a callable returning
    stats, or the scheduler's address for scheduler_stats. Fails saying what is still held."""
    if not callable(get_stats):
        address = get_stats
        get_stats = lambda: scheduler_stats(address)  # noqa: E731
    last = []

    def idle():
        last[:] = [get_stats()]
        return is_idle(last[0], num_workers) and last[0]

    try:
        return poll(idle, timeout, "an idle cluster")
    except AssertionError:
        held = describe(last[0]) if last else "no stats (the scheduler never answered)"
        raise AssertionError(f"not idle after {timeout:.0f}s ({num_workers or 'any'} workers wanted): {held}"
                             + (f"\n{logs()}" if logs else "")) from None
