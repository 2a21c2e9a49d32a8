"""The scheduler and worker services over real gRPC on loopback, against the in-process LLM."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.internal.v1 import scheduler_pb2, worker_pb2, worker_pb2_grpc
from services.core.sampling_params import SamplingParams
from tests.conftest import greedy, random_prompts
from tests.cluster import VOCAB, Cluster, Generation, OneRequestCall, assert_same, mixed_params, reference, run


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama", "tiny")


def test_two_workers_match_in_process_generate(model):
    prompts = random_prompts(16, VOCAB, 1, 60, seed=3)
    params = [mixed_params(i) for i in range(16)]
    want = reference(model, prompts, params)

    async def main():
        async with Cluster(model, num_workers=2) as cluster:
            got = await asyncio.gather(*(cluster.generate(f"r{i}", p, sp)
                                         for i, (p, sp) in enumerate(zip(prompts, params))))
            stats = await cluster.stats()
        for g, w in zip(got, want):
            assert_same(g, w)
        assert [w.prefix_cache_queries > 0 for w in stats.workers] == [True, True], "both workers got requests"
        assert stats.num_steps > 0 and stats.vocab_size == VOCAB and stats.max_model_len == 2048

    run(main())


def test_a_served_worker_steps_on_the_thread_that_loaded_its_model(model, monkeypatch):
    """Two OpenMP thread teams on the cores (model loaded on one thread, stepped on another)
    made every step of a served worker 1.6-1.8x slower than the same step in-process."""
    import threading

    from services.worker.worker import Worker

    threads = {"load": set(), "step": set()}
    load, step = Worker.__init__, Worker.step
    monkeypatch.setattr(Worker, "__init__", lambda self, *a: (threads["load"].add(threading.get_ident()),
                                                              load(self, *a))[1])
    monkeypatch.setattr(Worker, "step", lambda self, d: (threads["step"].add(threading.get_ident()), step(self, d))[1])

    async def main():
        async with Cluster(model, num_workers=1) as cluster:
            got = await cluster.generate("r0", random_prompts(1, VOCAB, 5, 20, seed=9)[0], greedy(4))
        assert len(got.samples[0].token_ids) == 4

    run(main())
    assert len(threads["load"]) == 1 and threads["step"] == threads["load"]
    assert threads["load"] != {threading.get_ident()}, "the model loads off the event loop's thread"


def test_cancelled_streams_free_every_block(model):
    prompts = random_prompts(10, VOCAB, 20, 80, seed=4)

    async def read_then_cancel(cluster, i, prompt):
        call = cluster.submit(f"c{i}", prompt, greedy(500))
        for _ in range(2):
            await call.read()
        call.cancel()

    async def main():
        async with Cluster(model, num_workers=2) as cluster:
            await asyncio.gather(*(read_then_cancel(cluster, i, p) for i, p in enumerate(prompts)))
            await cluster.check_idle_and_serving(prompts[0], num_workers=2)

    run(main())


def test_worker_started_after_the_scheduler_registers_and_serves(model):
    prompt = random_prompts(1, VOCAB, 30, 30, seed=5)[0]
    want = reference(model, [prompt], [greedy(8)])[0]

    async def main():
        async with Cluster(model) as cluster:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await cluster.generate("early", prompt, greedy(8))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            worker = await cluster.add_worker("late")
            await cluster.wait_for_workers(1)
            assert_same(await cluster.generate("late-1", prompt, greedy(8)), want)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING

    run(main())


@pytest.mark.slow
def test_killed_worker_requests_complete_without_repeats(model):
    prompts = random_prompts(8, VOCAB, 10, 60, seed=6)
    params = [mixed_params(i, max_tokens=40) for i in range(8)]
    want = reference(model, prompts, params)

    async def main():
        async with Cluster(model, num_workers=2) as cluster:
            requests = [(f"k{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
            got, _ = await cluster.generate_killing(requests, after_messages=3)
        for g, w in zip(got, want):
            assert_same(g, w)  # same ids and logprobs, and no token streamed twice

    run(main())


def test_a_hung_worker_is_dropped_at_the_step_timeout_and_its_requests_complete_elsewhere(model):
    """A worker whose step never returns still heartbeats; the step deadline catches it."""
    import time

    prompts = random_prompts(4, VOCAB, 10, 30, seed=12)
    params = [greedy(12) for _ in prompts]
    want = reference(model, prompts, params)

    async def main():
        async with Cluster(model, step_timeout_s=1.0, num_workers=2) as cluster:
            hung = asyncio.Event()
            worker = cluster.workers["w0"].worker
            real_step = worker.step

            def step(delta):
                if delta.cached_seqs and not hung.is_set():  # once, in a decode step: stuck for 3 s
                    hung.set()
                    time.sleep(3)
                return real_step(delta)

            worker.step = step
            dropped = []
            loop, real_drop = cluster.scheduler.loop, cluster.scheduler.loop.drop

            async def drop(worker_id, reason):
                dropped.append((worker_id, reason))
                await real_drop(worker_id, reason)

            loop.drop = drop
            got = await asyncio.gather(*(cluster.generate(f"h{i}", p, sp) for i, (p, sp) in
                                         enumerate(zip(prompts, params))))
        assert hung.is_set() and dropped and dropped[0][0] == "w0" and "DEADLINE_EXCEEDED" in dropped[0][1]
        for g, w in zip(got, want):
            assert_same(g, w)  # recomputed on w1: the same tokens, none twice

    run(main())


def test_bad_submits_are_invalid_argument_and_the_next_one_works(model):
    async def main():
        async with Cluster(model, max_model_len=64, num_workers=1) as cluster:
            for prompt, params, field in [([], greedy(), "prompt"), ([5] * 64, greedy(), "prompt"),
                                          ([5, 6], greedy(), "request_id"), ([5, VOCAB], greedy(), "prompt_token_ids")]:
                request_id = "" if field == "request_id" else "bad"
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await cluster.generate(request_id, prompt, params)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.value.details().startswith(field), error.value.details()
            bad_params = scheduler_pb2.SubmitRequest(request_id="bad", prompt_token_ids=[5])  # top_p 0, n 0...
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await OneRequestCall(cluster.stub, bad_params).read()
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            good = await cluster.generate("good", [5, 6, 7], greedy(5))
            assert len(good.samples[0].token_ids) == 5

    run(main())


def test_unknown_sequence_is_failed_precondition(model):
    async def main():
        cluster = Cluster(model)
        worker = await cluster.add_worker("lonely", scheduler_address="127.0.0.1:1")  # never registers
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
                step = worker_pb2.StepRequest(step_id=1, cached_seqs=[worker_pb2.CachedSequence(
                    seq_id=999, new_token_ids=[5], num_computed_tokens=3, num_scheduled_tokens=1)])
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await worker_pb2_grpc.WorkerStub(channel).Step(step)
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "999" in error.value.details()
        finally:
            await worker.stop(None)

    run(main())


def test_dropped_worker_re_registers_and_a_silent_one_is_dropped(model):
    async def main():
        async with Cluster(model, heartbeat_timeout_s=0.4, num_workers=1) as cluster:
            await cluster.scheduler.loop.drop("w0", "test")  # the worker's next heartbeat hears "unknown"
            await cluster.wait_for_workers(1, timeout=5)
            assert len((await cluster.generate("again", [5, 6, 7], greedy(3))).samples[0].token_ids) == 3
            cluster.workers["w0"].registration.cancel()  # no more heartbeats
            await cluster.wait_for_workers(0, timeout=5)

    run(main())


def test_graceful_shutdown_finishes_running_requests_and_refuses_new_ones(model):
    async def main():
        async with Cluster(model, num_workers=1) as cluster:
            call = cluster.submit("long", [5, 6, 7], greedy(60))
            responses = [await call.read()]
            shutdown = asyncio.create_task(cluster.scheduler.shutdown(grace=1))
            await asyncio.sleep(0.01)
            health = await health_pb2_grpc.HealthStub(cluster.channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await cluster.generate("late", [5, 6], greedy(2))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            while (response := await call.read()) != grpc.aio.EOF:
                responses.append(response)
            assert sum(len(d.token_ids) for r in responses for d in r.deltas) == 60
            await shutdown

    run(main())


@pytest.mark.slow
def test_a_burst_of_a_thousand_submits_all_complete(model):
    prompts = random_prompts(1000, VOCAB, 1, 8, seed=7)

    async def main():
        async with Cluster(model, max_num_seqs=256, num_workers=2) as cluster:
            got = await asyncio.gather(*(cluster.generate(f"b{i}", p, greedy(2)) for i, p in enumerate(prompts)))
        assert [len(g.samples[0].token_ids) for g in got] == [2] * len(prompts)

    run(main())


def test_stop_one_sample_then_cancel_the_request_on_the_call(model):
    """A stop string's end of a sample travels on the request's SubmitMany call (no per-request
    RPC), so it is ordered after everything sent for the request before it."""
    async def main():
        async with Cluster(model, num_workers=1) as cluster:
            call = cluster.submit("a", [5, 6, 7], SamplingParams(n=2, seed=1, max_tokens=100, ignore_eos=True))
            got = Generation()
            async for response in call:
                got.add("a", response)
                if got.num_messages == 2:  # the frontend matched a stop string in sample 1
                    await call.call.write(scheduler_pb2.SubmitManyRequest(
                        stop_sample=scheduler_pb2.StopSample(request_id="a", sample_index=1)))
                if got.num_messages == 4:
                    await call.call.write(scheduler_pb2.SubmitManyRequest(cancel="a"))
                    break
            await cluster.wait_idle(num_workers=1)
        # the stop was written after message 2; a step the scheduler had already answered may still
        # bring sample 1 one more token before it reads the stop (each worker steps on its own)
        assert got.samples[1].finish_reason == "stop" and len(got.samples[1].token_ids) in (2, 3)
        assert got.samples[0].finish_reason is None and 3 <= len(got.samples[0].token_ids) < 100

    run(main())


def test_a_worker_restarted_under_the_same_id_replaces_the_old_one(model):
    prompts = random_prompts(4, VOCAB, 10, 40, seed=8)
    params = [mixed_params(i, max_tokens=30) for i in range(4)]
    want = reference(model, prompts, params)

    async def main():
        cluster = await Cluster(model).start(num_workers=1)
        old = cluster.workers["w0"]
        restarted = []

        async def restart_once(generation):
            # the flag is set before the await: another stream reaching 3 messages while the new
            # worker starts must not start a second one (it was never stopped, and its server's
            # finalizer hung the test process at exit)
            if generation.num_messages == 3 and not restarted:
                restarted.append(True)
                old.registration.cancel()  # the old process is gone as far as membership goes
                await cluster.add_worker("w0")  # same id, fresh mirror, new port

        try:
            got = await asyncio.gather(*(cluster.generate(f"s{i}", p, sp, on_message=restart_once)
                                         for i, (p, sp) in enumerate(zip(prompts, params))))
            stats = await cluster.stats()
        finally:
            await old.stop(None)
            await cluster.close()
        assert cluster.workers["w0"] is not old
        assert [w.address for w in stats.workers] == [f"127.0.0.1:{cluster.workers['w0'].port}"]
        for g, w in zip(got, want):
            assert_same(g, w)

    run(main())


def test_a_failing_step_ends_open_streams_with_internal_and_the_scheduler_keeps_serving(model):
    """A bug in a step (not a worker failure) must not leave clients waiting forever."""
    async def main():
        async with Cluster(model, num_workers=1) as cluster:
            core = cluster.scheduler.loop.core
            real_update, calls = core.update, []

            def broken_update(worker_id, result):
                calls.append(worker_id)
                if len(calls) == 2:
                    raise RuntimeError("injected fault")
                return real_update(worker_id, result)

            core.update = broken_update
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(cluster.generate("doomed", [5, 6, 7], greedy(20)), 10)
            assert error.value.code() == grpc.StatusCode.INTERNAL
            await cluster.wait_idle()
            core.update = real_update
            good = await cluster.generate("good", [5, 6, 7], greedy(5))
            assert len(good.samples[0].token_ids) == 5

    run(main())


def test_a_worker_that_answers_failed_precondition_gets_its_sequences_re_sent_in_full(model):
    """worker.proto: a step naming a sequence the worker does not hold is answered FAILED_PRECONDITION,
    re-send it in full. The worker here loses its sequences once, mid-stream (as one restarted at the
    same address would): the scheduler keeps it, recomputes its sequences, and the streams go on with
    the tokens they would have had."""
    prompts = random_prompts(3, VOCAB, 10, 40, seed=11)
    params = [greedy(24), SamplingParams(temperature=0.9, seed=5, max_tokens=24), greedy(24)]
    want = reference(model, prompts, params)

    async def main():
        async with Cluster(model, num_workers=1) as cluster:
            worker = cluster.workers["w0"].servicer.worker
            real_step, forgot = worker.step, []

            def step(delta):  # runs on the worker's torch thread, like every step
                if delta.cached_seqs and len(forgot) == 0 and delta.step_id > 4:
                    forgot.append(delta.step_id)
                    worker.runner.seqs.clear()
                return real_step(delta)

            worker.step = step
            handle = cluster.scheduler.loop.workers["w0"]
            got = await asyncio.gather(*(cluster.generate(f"f{i}", p, sp)
                                         for i, (p, sp) in enumerate(zip(prompts, params))))
            stats = await cluster.wait_idle()
            assert forgot, "the worker never lost its sequences: the test did not test anything"
            assert cluster.scheduler.loop.workers["w0"] is handle, "the worker was dropped, not re-sent to"
            assert len(stats.workers) == 1
        for g, w in zip(got, want):
            assert_same(g, w)

    run(main())
