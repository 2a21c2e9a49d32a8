"""The frontend when its scheduler is lost (the fake scheduler of frontend_harness.py): open
requests wait for a scheduler (another address of --scheduler-address here) and go on there as
continuations; with none back within --scheduler-failover-timeout they fail with UNAVAILABLE
naming the scheduler, and health is NOT_SERVING meanwhile. The real services under `pagedserve
up`, with kill -9: tests/e2e/test_scheduler_failover.py."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.frontend.frontend_harness import Harness
from pagedserve import Client, GenerationError

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def make_harness(tiny_llama):
    from services.core.tokenizer import Tokenizer

    vocab_size, made = Tokenizer(tiny_llama).vocab_size, []

    def make(**kwargs) -> Harness:
        harness = Harness(tiny_llama, vocab_size, **kwargs)
        made.append(harness)
        assert harness.wait_for(lambda: harness.health() == SERVING)
        return harness

    yield make
    for harness in made:
        harness.close()


def stream_while(harness: Harness, kwargs: dict, fault) -> tuple[object, BaseException | None, float]:
    """Stream a request; `fault()` once its first delta arrived. (result, error, seconds after the fault)."""
    with Client(harness.address) as client:
        stream = client.stream("a long echo for failover", **kwargs)
        deltas = iter(stream)
        next(deltas)
        fault()
        faulted = time.monotonic()
        try:
            list(deltas)
        except GenerationError as error:
            return stream.result, error, time.monotonic() - faulted
        return stream.result, None, time.monotonic() - faulted


def test_requests_go_on_at_the_next_scheduler_address_when_theirs_is_lost(make_harness):
    harness = make_harness(num_schedulers=2, scheduler_failover_timeout_s=10)
    first, second = harness.fakes
    first.step_s = second.step_s = 0.01
    with Client(harness.address) as client:
        want = client.generate("a long echo for failover", max_tokens=50, n=2, logprobs=2, seed=9)
    got, error, _ = stream_while(harness, dict(max_tokens=50, n=2, logprobs=2, seed=9),
                                 lambda: harness.run(harness.fake_servers[0].stop(0)))
    assert error is None
    assert got.samples == want.samples  # text, token ids, logprobs of both samples
    assert got.seed == want.seed == 9 and got.num_completion_tokens == want.num_completion_tokens
    continuation = second.submitted[-1]
    assert [c.sample_index for c in continuation.continued_samples] == [0, 1]
    assert continuation.params.seed == 9 and continuation.params.max_tokens == 50
    assert harness.frontend.scheduler.pool.address == harness.scheduler_addresses[1]
    assert harness.wait_for(lambda: harness.health() == SERVING)
    assert harness.wait_for(lambda: harness.frontend.core.num_pending == 0)


@pytest.mark.parametrize("status, carried_over", [
    ((grpc.StatusCode.UNAVAILABLE, "Socket closed"), True),
    ((grpc.StatusCode.INTERNAL, "Internal error from Core"), True),  # gRPC's words for a scheduler killed mid-step
    ((grpc.StatusCode.INTERNAL, "RuntimeError: a bug in the scheduler"), False),  # the scheduler's own
])
def test_a_call_ended_by_the_transport_is_carried_over_and_one_ended_by_the_scheduler_is_not(
        make_harness, status, carried_over):
    harness = make_harness()
    harness.fake.step_s = 0.01

    def end_the_call() -> None:
        harness.fake.drop_status = status
        harness.fake.drop_calls = True

    got, error, _ = stream_while(harness, dict(max_tokens=30, seed=5), end_the_call)
    if carried_over:
        assert error is None and len(got.samples[0].token_ids) == 30
    else:
        assert error is not None and error.code == grpc.StatusCode.INTERNAL and "a bug" in error.details


def test_a_continuation_refused_as_already_running_is_tried_again(make_harness):
    """The call broke but the scheduler lived: it may still be aborting the request when its
    continuation arrives, and refuse it as already running; the frontend tries again."""
    harness = make_harness()
    harness.fake.step_s = 0.01
    with Client(harness.address) as client:
        want = client.generate("a long echo for failover", max_tokens=40, seed=5)

    def break_the_call() -> None:
        harness.fake.refuse_next = [(grpc.StatusCode.INVALID_ARGUMENT, "request_id: 'x' is already running")]
        harness.fake.drop_calls = True

    got, error, _ = stream_while(harness, dict(max_tokens=40, seed=5), break_the_call)
    assert error is None and got.samples == want.samples
    assert not harness.fake.refuse_next and harness.fake.submitted[-1].continued_samples


def test_with_no_scheduler_back_open_requests_fail_unavailable_at_the_failover_timeout(make_harness):
    timeout = 1.5
    harness = make_harness(scheduler_failover_timeout_s=timeout)
    harness.fake.step_s = 0.01
    healths: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            healths.append(harness.health())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)

    def kill() -> None:
        harness.run(harness.fake_server.stop(0))
        watcher.start()

    _, error, seconds = stream_while(harness, dict(max_tokens=100), kill)
    watching.set()
    watcher.join(5)
    assert error is not None and error.code == grpc.StatusCode.UNAVAILABLE
    assert harness.scheduler_addresses[0] in error.details and "failover timeout (1.5 s)" in error.details
    assert timeout - 0.2 < seconds < timeout + 2
    assert healths and set(healths) == {NOT_SERVING}
    assert harness.wait_for(lambda: harness.frontend.core.num_pending == 0)
    with Client(harness.address) as client:  # a new request, once the timeout passed: refused at once
        started = time.monotonic()
        with pytest.raises(GenerationError) as refused:
            client.generate("another", max_tokens=3)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 1.0


@pytest.mark.slow
def test_real_services_carry_streams_over_a_restarted_scheduler_and_the_worker_forgets_the_old_one(tiny_llama):
    """In process: a scheduler, a worker and a frontend; the scheduler stopped outright mid-stream
    and a new one started at its port. The streams finish with the tokens and logprobs of an
    undisturbed run, and the worker holds no sequence of the dead scheduler."""
    import asyncio

    from pagedserve import AsyncClient
    from services.core.config import SchedulerConfig
    from services.frontend.config import FrontendConfig
    from services.frontend.server import FrontendServer
    from services.scheduler.config import SchedulerServiceConfig
    from services.scheduler.server import SchedulerServer
    from tests.cluster import Cluster

    kinds = [dict(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1),
             dict(temperature=1.0, seed=3, n=2, max_tokens=24, ignore_eos=True, logprobs=2),
             dict(temperature=0.8, seed=4, max_tokens=24, repetition_penalty=1.2, ignore_eos=True),
             dict(temperature=1.0, seed=5, max_tokens=24, min_tokens=20)]

    async def main():
        cluster = await Cluster(tiny_llama).start(num_workers=1)
        port = cluster.scheduler.port
        frontend = FrontendServer(FrontendConfig(model=str(tiny_llama), scheduler_address=f"127.0.0.1:{port}",
                                                 host="127.0.0.1", grpc_port=0, health_poll_s=0.05), tiny_llama)
        await frontend.start()
        client = AsyncClient(f"127.0.0.1:{frontend.port}")
        try:
            while not await frontend.core.refresh():
                await asyncio.sleep(0.05)
            want = await asyncio.gather(*(client.complete([7, 8, 9, i], **kw) for i, kw in enumerate(kinds)))
            num_tokens, stopped = [0], asyncio.Event()

            async def one(i, kw):
                stream = client.generate([7, 8, 9, i], **kw)
                async for delta in stream:
                    num_tokens[0] += len(delta.token_ids)
                    if num_tokens[0] >= 16 and not stopped.is_set():
                        stopped.set()
                        await cluster.scheduler.stop(0)  # every call cancelled, the worker's beats refused
                return stream.result

            streams = asyncio.gather(*(one(i, kw) for i, kw in enumerate(kinds)))
            await stopped.wait()
            await asyncio.sleep(0.3)
            cluster.scheduler = SchedulerServer(SchedulerServiceConfig(host="127.0.0.1", port=port,
                                                                       scheduler=SchedulerConfig()))
            await cluster.scheduler.start()
            got = await asyncio.wait_for(streams, 60)
            for g, w in zip(got, want):
                assert g.samples == w.samples  # text, token ids, logprobs, finish reasons
                assert (g.num_prompt_tokens, g.num_completion_tokens, g.seed) == \
                    (w.num_prompt_tokens, w.num_completion_tokens, g.seed)
            # a worker forgets a finished sequence at the next step: after one more request it holds
            # that one only, none of the dead scheduler's (whose seq ids the new one reuses from 0)
            await client.complete([7, 8, 9], max_tokens=2, temperature=0.0)
            held = cluster.workers["w0"].worker.runner.seqs.values()
            assert [s.prompt_token_ids for s in held] == [[7, 8, 9]]
            await cluster.wait_idle(num_workers=1)
        finally:
            await client.close()
            await frontend.drain()
            await cluster.close()

    asyncio.run(asyncio.wait_for(main(), 120))
