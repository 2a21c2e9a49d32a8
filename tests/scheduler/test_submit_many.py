"""SubmitMany: many requests over one scheduler call, one message a step (what the frontend uses)."""
from __future__ import annotations

import grpc
import pytest

from pagedserve.internal.v1 import scheduler_pb2
from services.rpc import internal_codec
from services.core.sampling_params import SamplingParams
from tests.conftest import greedy, random_prompts
from tests.cluster import VOCAB, Cluster, Generation, assert_same, mixed_params, reference, run


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("llama", "tiny")


def submit(request_id: str, prompt: list[int], params: SamplingParams) -> scheduler_pb2.SubmitManyRequest:
    return scheduler_pb2.SubmitManyRequest(submit=internal_codec.submit_to_proto(request_id, prompt, params))


async def collect(call, generations: dict[str, Generation], errors: dict[str, tuple[int, str]],
                  until_done: set[str]) -> int:
    """Read the call until every request in until_done has its last message; the number of messages."""
    num_messages = 0
    while until_done:
        response = await call.read()
        assert response is not grpc.aio.EOF, f"the call ended with {sorted(until_done)} open"
        num_messages += 1
        for news in response.news:
            if news.HasField("response"):
                generations.setdefault(news.request_id, Generation()).add(news.request_id, news.response)
            if news.error_code:
                errors[news.request_id] = (news.error_code, news.error_message)
            if news.done:
                until_done.discard(news.request_id)
    return num_messages


def test_many_requests_on_one_call_match_in_process_generate_in_one_message_a_step(model):
    prompts = random_prompts(12, VOCAB, 1, 40, seed=7)
    params = [mixed_params(i) for i in range(12)]
    want = reference(model, prompts, params)

    async def main():
        async with Cluster(model, num_workers=2) as cluster:
            call = cluster.stub.SubmitMany()
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                await call.write(submit(f"m{i}", prompt, sp))
            got, errors = {}, {}
            num_messages = await collect(call, got, errors, {f"m{i}" for i in range(12)})
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF  # nothing open and no more input: the call ends
            stats = await cluster.stats()
            served = sum(w.worker.runner.async_steps.num_used for w in cluster.workers.values())
        assert errors == {}
        assert served > 0  # async scheduling: decode steps answered from their continuation run early
        for i, w in enumerate(want):
            assert_same(got[f"m{i}"], w)
        # one message per step for the whole call, far fewer than one per request and token
        assert num_messages <= stats.num_steps + 1 < sum(g.num_messages for g in got.values())

    run(main())


def test_a_refused_request_gets_its_error_and_the_others_run_on(model):
    prompt = random_prompts(1, VOCAB, 5, 10, seed=8)[0]

    async def main():
        async with Cluster(model, num_workers=1) as cluster:
            call = cluster.stub.SubmitMany()
            bad = submit("bad", prompt, greedy(6))
            bad.submit.params.max_tokens = 0  # what a buggy client could send
            await call.write(submit("good", prompt, greedy(6)))
            await call.write(bad)
            await call.write(submit("", prompt, greedy(6)))
            got, errors = {}, {}
            await collect(call, got, errors, {"good", "bad", ""})
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
        assert errors["bad"][0] == errors[""][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert errors["bad"][1].startswith("max_tokens: ")
        assert errors[""][1].startswith("request_id: ")
        assert "good" not in errors and len(got["good"].samples[0].token_ids) == 6

    run(main())


def test_cancel_and_ending_the_call_free_every_block(model):
    prompts = random_prompts(6, VOCAB, 20, 60, seed=9)

    async def main():
        async with Cluster(model, num_workers=2) as cluster:
            call = cluster.stub.SubmitMany()
            for i, prompt in enumerate(prompts):
                await call.write(submit(f"c{i}", prompt, greedy(500)))
            await call.read()
            await call.read()
            for i in range(3):  # three clients went away
                await call.write(scheduler_pb2.SubmitManyRequest(cancel=f"c{i}"))
            await cluster.wait_for(lambda s: s.num_running + s.num_waiting == 3, timeout=5)
            call.cancel()  # the frontend went away: the other three end too
            await cluster.check_idle_and_serving(prompts[0], num_workers=2)

    run(main())


def test_a_burst_fills_the_free_seats_before_the_waiting_room_refuses(model):
    """16 seats and 8 waiting allowed: a burst of 64 gets at least 24 admitted (it got 9 when the
    free seats were not counted), every other one RESOURCE_EXHAUSTED, and the admitted all finish."""
    prompts = random_prompts(64, VOCAB, 4, 12, seed=10)

    async def main():
        async with Cluster(model, max_num_seqs=16, max_waiting_requests=8, num_workers=1) as cluster:
            call = cluster.stub.SubmitMany()
            for i, prompt in enumerate(prompts):
                await call.write(submit(f"b{i}", prompt, greedy(8)))
            got, errors = {}, {}
            await collect(call, got, errors, {f"b{i}" for i in range(64)})
            await call.done_writing()
        return got, errors

    got, errors = run(main())
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert all(code == exhausted for code, _ in errors.values())
    finished = [g for g in got.values() if g.samples and g.samples[0].finish_reason == "length"]
    assert len(finished) == 64 - len(errors) >= 24
