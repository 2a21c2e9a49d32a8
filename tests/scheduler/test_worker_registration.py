"""Registration: the scheduler dials a worker at the address it advertised before it accepts it
(services/scheduler/worker_client.py probe_worker), over real gRPC on loopback."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from structlog.testing import capture_logs

from pagedserve.internal.v1 import scheduler_pb2, worker_pb2_grpc
from services.core.config import CacheConfig, WorkerConfig
from services.core.step import StepDelta, StepResult
from services.rpc import internal_codec
from services.scheduler.worker_client import RemoteWorker, probe_worker
from services.worker.__main__ import serve
from services.worker.config import WorkerServiceConfig
from tests.conftest import greedy, random_prompts
from tests.cluster import NUM_GPU_BLOCKS, Cluster, run

VOCAB = 512
PROBE_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama", "tiny")


def unreachable_worker(model, cluster: Cluster, worker_id: str):
    """serve() of a worker that listens on 127.0.0.1 but tells the scheduler to dial 127.0.0.2:
    the connection is refused, as it is for a container's loopback or a name only the worker resolves."""
    return serve(WorkerConfig(model=str(model), dtype="float32"),
                 CacheConfig(block_size=16, num_gpu_blocks=NUM_GPU_BLOCKS),
                 WorkerServiceConfig(scheduler_address=f"127.0.0.1:{cluster.scheduler.port}", worker_id=worker_id,
                                     host="127.0.0.1", advertise_host="127.0.0.2"))


def test_a_worker_the_scheduler_cannot_reach_is_refused_and_exits_2_while_a_running_request_completes(model):
    """Before the probe the scheduler accepted it, failed its first step, dropped it, and it registered
    again every 2.5 s forever; its log only ever said worker_forgotten."""
    prompt = random_prompts(1, VOCAB, 20, 20, seed=3)[0]

    async def main():
        async with Cluster(model, worker_probe_timeout_s=PROBE_TIMEOUT_S, num_workers=1) as cluster:
            seen_workers: set[str] = set()
            async def watch():
                while True:
                    seen_workers.update(w.worker_id for w in (await cluster.stats()).workers)
                    await asyncio.sleep(0.02)
            watcher = asyncio.create_task(watch())
            running = asyncio.create_task(cluster.generate("long", prompt, greedy(64)))
            with capture_logs() as logs:
                code = await asyncio.wait_for(unreachable_worker(model, cluster, "lost"), 60)
            got = await asyncio.wait_for(running, 60)
            watcher.cancel()
        assert code == 2
        refused = [e for e in logs if e["event"] == "registration_refused"]
        assert len(refused) == 1, logs
        reason = refused[0]["reason"]
        assert "127.0.0.2:" in reason and "--advertise-host" in reason and "'lost'" in reason
        assert seen_workers == {"w0"}  # never accepted, so never sent a step
        assert len(got.samples[0].token_ids) == 64 and got.samples[0].finish_reason == "length"

    asyncio.run(asyncio.wait_for(main(), 150))  # generous: the first test of a loaded machine's session


def test_a_request_sent_when_only_an_unreachable_worker_tried_is_refused_at_once_with_the_reason(model):
    """Before: the worker was accepted, the request went to it, the step failed, the worker was dropped,
    and the request waited in the scheduler with no worker to run it."""
    prompt = random_prompts(1, VOCAB, 20, 20, seed=4)[0]

    async def main():
        async with Cluster(model, worker_probe_timeout_s=PROBE_TIMEOUT_S) as cluster:
            assert await asyncio.wait_for(unreachable_worker(model, cluster, "lost"), 30) == 2
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(cluster.generate("early", prompt, greedy(8)), 5)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "127.0.0.2:" in error.value.details() and "--advertise-host" in error.value.details()

    run(main())


def test_a_registration_naming_another_workers_address_is_refused(model):
    """Two workers that advertise the same host:port from different hosts: the address answers, but as
    another worker, and the scheduler must not send this one's steps there."""
    async def main():
        async with Cluster(model, worker_probe_timeout_s=PROBE_TIMEOUT_S, num_workers=1) as cluster:
            worker = cluster.workers["w0"]
            info = internal_codec.info_to_proto(worker.worker.info)
            info.num_gpu_blocks += 1
            answer = await cluster.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
                worker_id="impostor", address=f"127.0.0.1:{worker.port}", info=info))
            stats = await cluster.stats()
        assert not answer.accepted
        assert "answers as another worker" in answer.reason and "--advertise-host" in answer.reason
        assert [w.worker_id for w in stats.workers] == ["w0"]

    run(main())


def test_an_address_that_never_answers_is_refused_at_the_probe_deadline():
    """A firewall that drops packets, or something that accepts connections and says nothing: the
    scheduler used to wait 20 s a step for it. The probe gives up at its deadline, naming why."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts (the kernel does), never speaks HTTP/2
    address = f"127.0.0.1:{silent.getsockname()[1]}"

    async def main():
        start = asyncio.get_running_loop().time()
        reason = await probe_worker("w", address,
                                    internal_codec.info_from_proto(scheduler_pb2.RegisterWorkerRequest().info), 0.5)
        return reason, asyncio.get_running_loop().time() - start

    try:
        reason, elapsed = run(main())
    finally:
        silent.close()
    assert reason is not None and address in reason and "--advertise-host" in reason
    assert "timed out" in reason or "DEADLINE_EXCEEDED" in reason
    assert elapsed < 5


def test_a_worker_without_step_stream_is_stepped_by_unary_calls():
    """A worker of a release before StepStream answers it UNIMPLEMENTED: the scheduler steps it with a
    unary Step call a step instead of dropping it (workers may be upgraded after their scheduler)."""
    class OldWorker(worker_pb2_grpc.WorkerServicer):  # StepStream left to the base: UNIMPLEMENTED
        def __init__(self):
            self.steps = []

        async def Step(self, request, context):
            self.steps.append(request.step_id)
            return internal_codec.result_to_proto(StepResult(step_id=request.step_id))

    async def main():
        server, old = grpc.aio.server(), OldWorker()
        worker_pb2_grpc.add_WorkerServicer_to_server(old, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        remote = RemoteWorker("old", f"127.0.0.1:{port}", None, step_timeout_s=30)
        try:
            results = [await remote.step(StepDelta(step_id=step_id)) for step_id in (1, 2, 3)]
        finally:
            await remote.close()
            await server.stop(None)
        return [r.step_id for r in results], old.steps, remote.unary

    assert asyncio.run(main()) == ([1, 2, 3], [1, 2, 3], True)
