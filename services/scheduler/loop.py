"""The scheduler's async step loop over the core Scheduler, and its worker registry.

Each round: wait until there is work and a worker; `schedule()`; send every worker its
Step concurrently; `update()` with each result; route the updates to the requests'
streams. A worker whose Step fails, or that stops heartbeating, is dropped with
`Scheduler.remove_worker`: its sequences are recomputed elsewhere, and since only applied
tokens are streamed, a client sees no error and no repeated token. Everything here runs
on the one event loop thread, so the core is only touched between awaits.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import structlog

from services.core.errors import InvalidArgument, Unavailable, check
from services.core.sampling_params import SamplingParams
from services.core.scheduler import Scheduler
from services.core.sequence import ContinuedSample
from services.core.stats import SchedulerStats
from services.core.step import WorkerInfo
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.streams import Delivery, UpdateStream, StreamRouter
from services.scheduler.worker_client import RemoteWorker, WorkerForgot, WorkerLost, probe_worker

log = structlog.get_logger("scheduler")


class StepLoop:
    def __init__(self, config: SchedulerServiceConfig):
        self.config = config
        self.core: Scheduler | None = None  # built when the first worker tells the model's limits
        self.model: WorkerInfo | None = None
        self.workers: dict[str, RemoteWorker] = {}
        self.router = StreamRouter()
        self.num_steps = 0
        self.draining = False
        self.last_refusal: str | None = None  # why the last worker refused was refused (told to clients)
        self._wake = asyncio.Event()

    # ---- requests --------------------------------------------------------------
    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
               continued: tuple[ContinuedSample, ...], deliver: Callable[[Delivery], None]) -> UpdateStream:
        """Admit a request (a continuation when `continued`); its updates go to `deliver`."""
        if self.draining:
            raise Unavailable("the scheduler is shutting down")
        if self.core is None or not self.workers:
            refused = f"; the last worker that tried was refused: {self.last_refusal}" if self.last_refusal else ""
            raise Unavailable(f"no worker is registered yet{refused}")
        check(bool(request_id), "request_id", "must not be empty")
        check(request_id not in self.router.streams, "request_id", f"{request_id!r} is already running")
        stream = self.router.open(self.core.add_request(request_id, prompt, params, priority, continued), deliver)
        self._wake.set()
        return stream

    def release(self, request_id: str) -> None:
        """The request's call ended or cancelled it; if it is still running the client went away: abort it."""
        if self.router.close(request_id, "request_cancelled"):
            self.core.abort(request_id)
            self._wake.set()

    def stop_sample(self, request_id: str, sample_index: int) -> None:
        """End one sample of a running request (a stop string matched at the frontend): reason stop."""
        if self.core is None:
            return
        stream = self.router.streams.get(request_id)
        self.core.stop_sample(request_id, sample_index)
        if stream is not None and sample_index not in stream.finish_reasons:
            self.router.route([stream.stopped(sample_index)])
        self._wake.set()

    async def drain(self) -> None:
        """Refuse new requests and wait until the running ones finish."""
        self.draining = True
        while len(self.router):
            await asyncio.sleep(0.05)

    # ---- workers ---------------------------------------------------------------
    async def register(self, worker_id: str, address: str, info: WorkerInfo) -> str | None:
        """Add a worker once its advertised address answered as that worker (probe_worker); returns
        why it was refused, or None. A known id is a restart: dead + new."""
        if worker_id in self.workers:
            await self.drop(worker_id, "re-registered after a restart")
        try:
            reason = await probe_worker(worker_id, address, info, self.config.worker_probe_timeout_s)
            if reason is None:
                self._admit(worker_id, info)
        except InvalidArgument as error:
            reason = str(error)
        if reason is not None:
            log.warning("worker_refused", worker_id=worker_id, address=address, reason=reason)
            self.last_refusal = reason
            return reason
        self.workers[worker_id] = RemoteWorker(worker_id, address, info, self.config.step_timeout_s)
        log.info("worker_registered", worker_id=worker_id, address=address, num_gpu_blocks=info.num_gpu_blocks,
                 num_cpu_blocks=info.num_cpu_blocks, device=info.device, dtype=info.dtype)
        self._wake.set()
        return None

    def _admit(self, worker_id: str, info: WorkerInfo) -> None:
        """The first worker settles the model's limits; the core refuses one that does not fit."""
        core = self.core or Scheduler(self.config.scheduler.for_model(info.max_model_len))
        core.add_worker(worker_id, info)
        if self.core is None:
            self.core, self.model = core, info

    def heartbeat(self, worker_id: str) -> bool:
        handle = self.workers.get(worker_id)
        if handle is not None:
            handle.last_seen = time.monotonic()
        return handle is not None

    async def drop(self, worker_id: str, reason: str) -> None:
        handle = self.workers.pop(worker_id, None)
        if handle is None:
            return
        num_moved = self.core.remove_worker(worker_id)
        log.warning("worker_dropped", worker_id=worker_id, address=handle.address, reason=reason,
                    num_recomputed=num_moved)
        self._wake.set()
        await handle.close()

    async def close(self) -> None:
        """Close every worker channel (the process is stopping)."""
        for handle in self.workers.values():
            await handle.close()
        self.workers.clear()

    async def watch_heartbeats(self) -> None:
        """Drop workers that have been silent (no heartbeat, no step) for heartbeat_timeout_s."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            deadline = time.monotonic() - self.config.heartbeat_timeout_s
            for handle in [h for h in self.workers.values() if h.last_seen < deadline]:
                await self.drop(handle.worker_id, "missed heartbeats")

    # ---- the loop --------------------------------------------------------------
    async def run(self) -> None:
        while True:
            while not (self.core and self.workers and self.core.has_unfinished()):
                await self._sleep()
            try:
                progressed = await self.step()
            except Exception as error:  # a bug, not a worker failure: fail what is in flight, keep serving
                log.exception("step_failed", step=self.core.step_id)
                self._fail_all(error)
                continue
            if not progressed:
                await self._sleep()  # nothing fits now: wait for a new worker, request or abort

    def _fail_all(self, error: Exception) -> None:
        """End every open stream with the error and abort its request, so its blocks are freed."""
        for request_id in list(self.router.streams):
            self.core.abort(request_id)
            self.router.fail(request_id, error)

    async def _sleep(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    async def step(self) -> bool:
        """One round over every worker; False when no worker had anything to do."""
        deltas = self.core.schedule()
        if not deltas:
            return False
        now = time.monotonic()
        for stream in self.router.streams.values():
            stream.mark_scheduled(now)
        handles = [self.workers[worker_id] for worker_id in deltas]
        results = await asyncio.gather(*(h.step(deltas[h.worker_id]) for h in handles), return_exceptions=True)
        self.num_steps += 1
        updates = []
        for handle, result in zip(handles, results):
            if self.workers.get(handle.worker_id) is not handle:
                continue  # dropped while stepping; its sequences are already waiting again
            if isinstance(result, WorkerForgot):
                await self._resend_in_full(handle, str(result))
            elif isinstance(result, WorkerLost):
                await self.drop(handle.worker_id, str(result))
            elif isinstance(result, BaseException):
                raise result
            else:
                handle.forgot = False
                updates += self.core.update(handle.worker_id, result)
        self.router.route(updates)
        log.debug("step", step=self.core.step_id, num_workers=len(deltas), num_updates=len(updates),
                  num_tokens=sum(d.num_scheduled_tokens for d in deltas.values()))
        return True

    async def _resend_in_full(self, handle: RemoteWorker, reason: str) -> None:
        """FAILED_PRECONDITION: the worker does not hold a sequence it was sent. Its sequences are
        re-sent in full (recomputed) and the worker stays; a worker that answers so twice in a row
        is dropped instead, since re-sending did not help."""
        if handle.forgot:
            await self.drop(handle.worker_id, f"{reason} (again after a re-send in full)")
            return
        handle.forgot = True
        num_resent = self.core.reset_worker(handle.worker_id)
        log.warning("worker_state_lost", worker_id=handle.worker_id, reason=reason, num_resent=num_resent)
        self._wake.set()

    # ---- stats -----------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """The core's stats and what only the service knows: addresses, steps, the model."""
        if self.core is None:
            return SchedulerStats(num_steps=self.num_steps)
        core = self.core.stats()
        addresses = {worker_id: handle.address for worker_id, handle in self.workers.items()}
        workers = tuple(dataclasses.replace(w, address=addresses.get(w.worker_id, "")) for w in core.workers)
        return dataclasses.replace(core, workers=workers, num_steps=self.num_steps,
                                   vocab_size=self.model.vocab_size, model=self.model.model,
                                   batch_invariant=self.model.batch_invariant)
