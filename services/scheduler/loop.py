"""The scheduler's step loops over the core Scheduler, one per worker, and its worker registry.

Each worker has its own loop (an asyncio task on the one event loop): wait until there is
work; `schedule_worker()`; send the worker its Step; `update()` with the result; route the
updates to the requests' streams; again. The workers step at their own pace: a slow, paused or
hung worker delays only the sequences it runs, never another worker's (the core keeps each
worker's queues and blocks apart, services/core/worker_scheduler.py). A worker whose Step
fails, or that stops heartbeating, is dropped with `Scheduler.remove_worker`: its sequences are
recomputed elsewhere, and since only applied tokens are streamed, a client sees no error and no
repeated token. Everything here runs on the one event loop thread, so the core is only touched
between awaits.
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
from services.core.worker_scheduler import STALL_MIN_S
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.kv_publisher import KVEventPublisher
from services.scheduler.streams import Delivery, UpdateStream, StreamRouter
from services.scheduler.worker_client import RemoteWorker, WorkerForgot, WorkerLost, probe_worker

log = structlog.get_logger("scheduler")
STALL_RECHECK_S = STALL_MIN_S / 4  # how often an idle worker looks again while something waits


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
        self._wake = asyncio.Event()  # the supervisor's: a worker joined
        self._loops: dict[str, tuple[RemoteWorker, asyncio.Task, asyncio.Event]] = {}  # worker_id -> its loop
        events = config.scheduler.kv_events_config
        self.kv_events = KVEventPublisher(events) if events and events.enable_kv_cache_events else None

    # ---- requests --------------------------------------------------------------
    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
               continued: tuple[ContinuedSample, ...], deliver: Callable[[Delivery], None],
               lora_name: str = "") -> UpdateStream:
        """Admit a request (a continuation when `continued`; under the LoRA adapter `lora_name`); its updates
        go to `deliver`."""
        if self.draining:
            raise Unavailable("the scheduler is shutting down")
        if self.core is None or not self.workers:
            refused = f"; the last worker that tried was refused: {self.last_refusal}" if self.last_refusal else ""
            raise Unavailable(f"no worker is registered yet{refused}")
        check(bool(request_id), "request_id", "must not be empty")
        check(request_id not in self.router.streams, "request_id", f"{request_id!r} is already running")
        stream = self.router.open(self.core.add_request(request_id, prompt, params, priority, continued,
                                                         lora_name), deliver)
        self._wake_all()
        return stream

    def release(self, request_id: str) -> None:
        """The request's call ended or cancelled it; if it is still running the client went away: abort it."""
        if self.router.close(request_id, "request_cancelled"):
            self.core.abort(request_id)
            self._wake_all()

    def stop_sample(self, request_id: str, sample_index: int) -> None:
        """End one sample of a running request (a stop string matched at the frontend): reason stop."""
        if self.core is None:
            return
        stream = self.router.streams.get(request_id)
        self.core.stop_sample(request_id, sample_index)
        if stream is not None and sample_index not in stream.finish_reasons:
            self.router.route([stream.stopped(sample_index)])
        self._wake_all()

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
                 num_cpu_blocks=info.num_cpu_blocks, device=info.device, dtype=info.dtype,
                 rank=self.core.worker_ranks[worker_id])  # its KV events' data_parallel_rank
        self._wake_all()
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
        self._publish_kv_events()
        log.warning("worker_dropped", worker_id=worker_id, address=handle.address, reason=reason,
                    num_recomputed=num_moved)
        self._wake_all()
        await handle.close()

    async def close(self) -> None:
        """Close every worker channel (the process is stopping), and the KV-event sockets."""
        for handle in self.workers.values():
            await handle.close()
        self.workers.clear()
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)

    async def watch_heartbeats(self) -> None:
        """Drop workers that have been silent (no heartbeat, no step) for heartbeat_timeout_s."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            deadline = time.monotonic() - self.config.heartbeat_timeout_s
            for handle in [h for h in self.workers.values() if h.last_seen < deadline]:
                await self.drop(handle.worker_id, "missed heartbeats")

    # ---- the loops -------------------------------------------------------------
    async def run(self) -> None:
        """Keep one step loop running per registered worker (started when it joins, ended when it
        is dropped); cancelling this cancels them all."""
        try:
            while True:
                for worker_id, handle in list(self.workers.items()):
                    if worker_id not in self._loops or self._loops[worker_id][0] is not handle:
                        wake = asyncio.Event()
                        task = asyncio.create_task(self._worker_loop(handle, wake), name=f"step-loop-{worker_id}")
                        self._loops[worker_id] = (handle, task, wake)
                await self._wake.wait()
                self._wake.clear()
        finally:
            tasks = [task for _, task, _ in self._loops.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loops.clear()

    def _wake_all(self) -> None:
        """Something changed that any worker's loop may act on (a request, an abort, a worker)."""
        self._wake.set()
        for _, _, wake in self._loops.values():
            wake.set()

    def _wake_others(self, worker_id: str) -> None:
        for other, (_, _, wake) in self._loops.items():
            if other != worker_id:
                wake.set()

    async def _worker_loop(self, handle: RemoteWorker, wake: asyncio.Event) -> None:
        """Step one worker while it is registered: step after step while it has work, else sleep
        until woken."""
        worker_id = handle.worker_id
        while self.workers.get(worker_id) is handle:
            wake.clear()
            try:
                progressed = self.core.has_unfinished() and await self.step_worker(handle)
            except Exception as error:  # a bug, not a worker failure: fail what is in flight, keep serving
                log.exception("step_failed", worker_id=worker_id, step=self.core.step_id)
                self._fail_all(error)
                continue
            if not progressed:  # nothing fits now: wait for a new worker, request, abort or free seat
                await handle.idle()
                await self._idle(wake)
        if self._loops.get(worker_id, (None,))[0] is handle:
            del self._loops[worker_id]

    async def _idle(self, wake: asyncio.Event) -> None:
        """Sleep until woken; while anything waits, look again every STALL_RECHECK_S too. A worker
        becoming stalled is no event (its step is simply still out), and what waits for it is this
        worker's to take once it is (Scheduler.schedule_worker)."""
        if not len(self.core.waiting):
            await wake.wait()
            return
        try:
            await asyncio.wait_for(wake.wait(), STALL_RECHECK_S)
        except asyncio.TimeoutError:
            pass

    def _fail_all(self, error: Exception) -> None:
        """End every open stream with the error and abort its request, so its blocks are freed."""
        for request_id in list(self.router.streams):
            self.core.abort(request_id)
            self.router.fail(request_id, error)

    async def step_worker(self, handle: RemoteWorker) -> bool:
        """One step of one worker; False when it had nothing to do."""
        worker_id = handle.worker_id
        delta = self.core.schedule_worker(worker_id)
        if delta is None:
            return False
        if delta.new_seqs:
            self._mark_scheduled(delta)
        try:
            result = await handle.step(delta)
        except WorkerForgot as error:
            if self.workers.get(worker_id) is handle:
                await self._resend_in_full(handle, str(error))
            return True
        except WorkerLost as error:
            if self.workers.get(worker_id) is handle:  # not a restarted worker registered under its id since
                await self.drop(worker_id, str(error))
            return True
        self.num_steps += 1
        if self.workers.get(worker_id) is not handle:
            return True  # dropped while stepping; its sequences are already waiting again
        handle.forgot = False
        updates = self.core.update(worker_id, result)
        self.router.route(updates)
        if self.kv_events is not None:
            self._publish_kv_events()
        if len(self.core.waiting):  # a finished sequence may have freed room another worker's turn can use
            self._wake_others(worker_id)
        return True  # no log line per step: a step is the hot path (GetStats and /metrics count them)

    def _mark_scheduled(self, delta) -> None:
        """The queue time of each request whose sequence this step starts."""
        now = time.monotonic()
        for new in delta.new_seqs:
            seq = self.core.seqs.get(new.seq_id)
            stream = self.router.streams.get(seq.request.request_id) if seq is not None else None
            if stream is not None:
                stream.mark_scheduled(now)

    async def _resend_in_full(self, handle: RemoteWorker, reason: str) -> None:
        """FAILED_PRECONDITION: the worker does not hold a sequence it was sent. Its sequences are
        re-sent in full (recomputed) and the worker stays; a worker that answers so twice in a row
        is dropped instead, since re-sending did not help."""
        if handle.forgot:
            await self.drop(handle.worker_id, f"{reason} (again after a re-send in full)")
            return
        handle.forgot = True
        num_resent = self.core.reset_worker(handle.worker_id)
        self._publish_kv_events()
        log.warning("worker_state_lost", worker_id=handle.worker_id, reason=reason, num_resent=num_resent)
        self._wake_all()

    def _publish_kv_events(self) -> None:
        """What every worker's prefix cache gained and lost since the last call (services/core/kv_events.py)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.core.drain_kv_events())

    # ---- LoRA adapters -----------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> list[str]:
        """Serve adapter `name`: loaded on every registered worker (each checks it; past max_cpu_loras it drops
        its least recently used idle one), then in the core's registry, from which a worker that does not hold
        it (it dropped it, restarted, or joined later) loads it when a request under it is placed there.
        Returns every adapter served."""
        check(bool(name) and bool(path), "lora_name" if not name else "lora_path", "must not be empty")
        if self.core is None or not self.workers:
            raise Unavailable("no worker is registered yet")
        for worker_id, handle in list(self.workers.items()):
            held = await handle.lora(True, name, path)
            if worker_id in self.core.workers:
                self.core.set_worker_loras(worker_id, held)
        self.core.register_lora(name, path)
        log.info("lora_loaded", lora_name=name, path=path, num_workers=len(self.workers))
        self._wake_all()
        return sorted(self.core.loras)

    async def unload_lora(self, name: str) -> list[str]:
        """Unload adapter `name` from every worker; refused while requests under it run or wait."""
        if self.core is None:
            raise Unavailable("no worker is registered yet")
        for worker_id in self.core.retire_lora(name):  # no await before this: nothing is admitted under it after
            handle = self.workers.get(worker_id)
            if handle is not None:
                held = await handle.lora(False, name)
                if worker_id in self.core.workers:
                    self.core.set_worker_loras(worker_id, held)
        log.info("lora_unloaded", lora_name=name)
        return sorted(self.core.loras)

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
