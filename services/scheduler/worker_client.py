"""The scheduler's handle on one remote worker: a grpc.aio channel and its Step call.

The step loop sees plain StepDelta / StepResult and two errors: WorkerForgot when the worker
answers FAILED_PRECONDITION (it does not hold a sequence it was sent: worker.proto asks for a
re-send in full), and WorkerLost for whatever else went wrong on the wire (UNAVAILABLE,
DEADLINE_EXCEEDED, a cancelled step...).
"""
from __future__ import annotations

import asyncio
import time

import grpc

from pagedserve.internal.v1 import worker_pb2_grpc
from services.rpc import internal_codec
from services.core.step import StepDelta, StepResult, WorkerInfo

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class WorkerLost(RuntimeError):
    """A Step failed, timed out or was cancelled: drop the worker and recompute its sequences elsewhere."""


class WorkerForgot(RuntimeError):
    """The worker does not hold a sequence the step named (FAILED_PRECONDITION): keep the worker,
    re-send its sequences in full."""


class RemoteWorker:
    def __init__(self, worker_id: str, address: str, info: WorkerInfo, step_timeout_s: float | None = None):
        self.worker_id, self.address, self.info = worker_id, address, info
        self.step_timeout_s = step_timeout_s  # a hung worker still heartbeats: only a deadline catches it
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.last_seen = time.monotonic()
        self.dropped = False
        self.forgot = False  # its last step answered FAILED_PRECONDITION (re-sent in full since)
        self._call = None

    async def step(self, delta: StepDelta) -> StepResult:
        self._call = self.stub.Step(internal_codec.delta_to_proto(delta), timeout=self.step_timeout_s)
        try:
            result = internal_codec.result_from_proto(await self._call)
            self.last_seen = time.monotonic()
            return result
        except grpc.RpcError as error:
            kind = WorkerForgot if error.code() == grpc.StatusCode.FAILED_PRECONDITION else WorkerLost
            raise kind(f"{error.code().name}: {error.details()}") from error
        except asyncio.CancelledError:
            if self.dropped:  # cancelled by close(), not by the loop's own shutdown
                raise WorkerLost("dropped while stepping") from None
            raise
        finally:
            self._call = None

    async def close(self) -> None:
        """Cancel an in-flight step and close the channel."""
        self.dropped = True
        if self._call is not None:
            self._call.cancel()
        await self.channel.close()
