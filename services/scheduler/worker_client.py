"""The scheduler's handle on one remote worker: a grpc.aio channel and its StepStream call; and, before a
worker is accepted, the probe of the address it advertised (`probe_worker`).

The step loop sees plain StepDelta / StepResult and two errors: WorkerForgot when the worker
answers FAILED_PRECONDITION (it does not hold a sequence it was sent: worker.proto asks for a
re-send in full), and WorkerLost for whatever else went wrong on the wire (UNAVAILABLE,
no answer within --step-timeout-s, a cancelled step...).

Steps travel on one StepStream call while the worker has work, not a unary Step call each: grpc.aio
makes a call object, a C call stack, headers both ways and a status for every call, and a round trip
on an open call costs the event loop thread about a third of one on a new call (a microbenchmark of
8 loops on loopback: 62-78 against 175-196 us of CPU; bench/scheduler_scale.py measures the
scheduler). A stream has no per-step deadline, so a timer cancels the call when a step outlasts
step_timeout_s. Any error ends the call (the next step opens another), and so does the worker going
idle (`idle`).

The probe: a worker registers by telling the scheduler where to reach it (`--advertise-host` and the
port it listens on). An address the scheduler cannot reach (a container's loopback, a host name only
the worker resolves, a firewall that drops packets) used to be accepted: the first step failed, the
worker was dropped, it registered again, and a request sent to it waited meanwhile. So
`probe_worker` calls the worker's GetInfo at that address first, with a short deadline, and the
registration is refused with a reason naming the address and the fix unless the answer comes from
this very worker (the same WorkerInfo). No step is ever sent to a worker that has not passed it.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from pagedserve.internal.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.rpc import internal_codec
from services.core.step import StepDelta, StepResult, WorkerInfo
from services.rpc.grpc_server import RECONNECT_OPTIONS
from services.rpc.status import core_error, not_served, worker_forgot

log = structlog.get_logger("scheduler")
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
PROBE_RETRY_S = 0.2  # between attempts while the address is UNAVAILABLE (a name not resolvable yet, a refused connection)
ADVERTISE_FIX = ("start the worker with --advertise-host (PAGEDSERVE_ADVERTISE_HOST) set to a host name or IP "
                 "address at which the scheduler reaches it, and --host listening on that interface")


LORA_TIMEOUT_S = 120.0  # loading an adapter reads and packs its tensors

class WorkerLost(RuntimeError):
    """A Step failed, timed out or was cancelled: drop the worker and recompute its sequences elsewhere."""


class WorkerForgot(RuntimeError):
    """The worker does not hold a sequence the step named (FAILED_PRECONDITION): keep the worker,
    re-send its sequences in full."""


class StreamNotServed(WorkerLost):
    """The worker answered UNIMPLEMENTED: to StepStream, a worker of an older release (stepped by unary Step
    from then on); to Step, lost."""


async def _failure(call, error: Exception) -> Exception:
    """WorkerForgot or WorkerLost, from the status the step's call ended with."""
    if isinstance(error, grpc.RpcError):
        code, details = error.code(), error.details()
    else:  # written to a call that had already ended
        code, details = await call.code(), await call.details()
    kind = WorkerForgot if worker_forgot(code) else StreamNotServed if not_served(code) else WorkerLost
    return kind(f"{code.name}: {details}")


class RemoteWorker:
    def __init__(self, worker_id: str, address: str, info: WorkerInfo, step_timeout_s: float | None = None):
        self.worker_id, self.address, self.info = worker_id, address, info
        self.step_timeout_s = step_timeout_s  # a hung worker still heartbeats: only a deadline catches it
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.last_seen = time.monotonic()
        self.dropped = False
        self.forgot = False  # its last step answered FAILED_PRECONDITION (re-sent in full since)
        self._call = None  # the open StepStream call
        self._expired = False  # the step deadline cancelled the call
        self.unary = False  # the worker serves no StepStream (an older release): a unary Step call a step

    async def step(self, delta: StepDelta) -> StepResult:
        """One step on the worker's StepStream call (opened by the first step after an idle time or an
        error): send the delta, wait for its result. A worker of a release without StepStream answers
        UNIMPLEMENTED, before it reads the delta: it is stepped by unary Step calls from then on."""
        if self.unary:
            return await self._step_unary(delta)
        call = self._call
        if call is None:
            call, self._expired = self.stub.StepStream(), False
            self._call = call
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.step_timeout_s, self._expire, call) if self.step_timeout_s else None
        try:
            await call.write(internal_codec.delta_to_proto(delta))
            response = await call.read()
        except (grpc.RpcError, asyncio.InvalidStateError) as error:  # the call ended with a status
            self._call = None
            failure = await _failure(call, error)
            if not isinstance(failure, StreamNotServed):
                raise failure from error
            self.unary = True
            log.info("worker_steps_unary", worker_id=self.worker_id, reason=str(failure))
            return await self._step_unary(delta)
        except asyncio.CancelledError:
            self._call = None
            if asyncio.current_task().cancelling():  # the loop's own shutdown
                raise
            if self.dropped:  # the call cancelled by close()
                raise WorkerLost("dropped while stepping") from None
            if self._expired:
                raise WorkerLost(f"DEADLINE_EXCEEDED: no answer to a step within {self.step_timeout_s:g} s "
                                 "(--step-timeout-s)") from None
            raise
        finally:
            if deadline is not None:
                deadline.cancel()
        if response is grpc.aio.EOF:
            self._call = None
            raise WorkerLost("the worker ended its step stream without answering the step")
        self.last_seen = time.monotonic()
        return internal_codec.result_from_proto(response)

    async def _step_unary(self, delta: StepDelta) -> StepResult:
        """One step as its own Step call, with step_timeout_s as its deadline."""
        try:
            response = await self.stub.Step(internal_codec.delta_to_proto(delta), timeout=self.step_timeout_s)
        except grpc.RpcError as error:
            raise await _failure(None, error) from error
        self.last_seen = time.monotonic()
        return internal_codec.result_from_proto(response)

    def _expire(self, call) -> None:
        """The step outlasted step_timeout_s: a hung worker still heartbeats, only this catches it."""
        self._expired = True
        call.cancel()

    async def idle(self) -> None:
        """The worker has nothing to run: end its StepStream call (the next step opens another), so no
        call stays open through idle time, where something on the path may time it out."""
        call, self._call = self._call, None
        if call is not None:
            try:
                await call.done_writing()
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass  # it had ended already

    async def lora(self, load: bool, name: str, path: str = "") -> list[str]:
        """Load (or unload) a LoRA adapter; the adapters held after, least recently used first. InvalidArgument
        as the worker named it."""
        call = self.stub.LoadLora if load else self.stub.UnloadLora
        try:
            answer = await call(common_pb2.LoraAdapterRequest(lora_name=name, lora_path=path), timeout=LORA_TIMEOUT_S)
        except grpc.RpcError as error:
            raise core_error(error.code(), error.details(), f"worker {self.worker_id}") from error
        return list(answer.lora_names)

    async def close(self) -> None:
        """Cancel an in-flight step and close the channel."""
        self.dropped = True
        if self._call is not None:
            self._call.cancel()
        await self.channel.close()


async def probe_worker(worker_id: str, address: str, info: WorkerInfo, timeout_s: float) -> str | None:
    """Why the scheduler cannot use the worker that registered as `worker_id` at `address`, or None
    once that address answered GetInfo with the worker's own `info` within `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                answer = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=max(remaining, 0.01))
                break
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or remaining <= PROBE_RETRY_S:
                    return unreachable_reason(worker_id, address, timeout_s,
                                              f"{error.code().name}: {error.details()}")
            await asyncio.sleep(PROBE_RETRY_S)
    got = internal_codec.info_from_proto(answer)
    if got != info:
        return (f"the address {address} that worker {worker_id!r} advertised answers as another worker "
                f"(model {got.model!r} with {got.num_gpu_blocks} KV blocks; this one has {info.model!r} with "
                f"{info.num_gpu_blocks}); {ADVERTISE_FIX}")
    return None


def unreachable_reason(worker_id: str, address: str, timeout_s: float, detail: str) -> str:
    """The refusal a worker logs and exits on: the address, what went wrong, and the fix."""
    return (f"the scheduler cannot reach worker {worker_id!r} at the address it advertised, {address} "
            f"(tried for {timeout_s:g} s; {detail}); {ADVERTISE_FIX}")
