"""GenerateBatch: many requests over one call, in front of the fake scheduler (frontend_harness.py)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.frontend.frontend_harness import Harness
from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve import AsyncClient, Client, GenerationError
from services.core.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def harness(tiny_llama):
    harness = Harness(tiny_llama, Tokenizer(tiny_llama).vocab_size)
    assert harness.wait_for(lambda: harness.health() == health_pb2.HealthCheckResponse.SERVING)
    yield harness
    harness.close()


def prompts(n: int) -> list[list[int]]:
    return [[5 + i, 40 + 3 * i, 90 + i, 7] for i in range(n)]


def test_same_results_as_one_call_each(harness):
    """(That a message carries a whole step is tested against the real scheduler in
    tests/e2e/test_three_services.py: the fake's requests do not step together.)"""
    requests = [{"prompt": p, "max_tokens": 4 + i, "logprobs": 1, "n": 1 + i % 2} for i, p in enumerate(prompts(8))]
    requests.append({"prompt": "some text to echo", "max_tokens": 6})
    with Client(harness.address) as client:
        alone = [client.generate(**r) for r in requests]
        stream = client.generate_batch(requests)
        pairs = list(stream)
        batched = stream.results
    for one, many in zip(alone, batched):
        assert [s.token_ids for s in many.samples] == [s.token_ids for s in one.samples]
        assert [s.text for s in many.samples] == [s.text for s in one.samples]
        assert [s.logprobs for s in many.samples] == [s.logprobs for s in one.samples]
        assert [s.finish_reason for s in many.samples] == ["length"] * len(one.samples)
        assert (many.num_prompt_tokens, many.num_completion_tokens, many.seed) == \
            (one.num_prompt_tokens, one.num_completion_tokens, one.seed)
    assert {index for index, _ in pairs} == set(range(len(requests)))
    assert harness.fake.num_calls == 1  # and the scheduler saw one SubmitMany call throughout


def test_a_bad_request_fails_alone_with_its_field_named(harness):
    good = [5, 6, 7]
    raw = [pb.GenerateRequest(request_id="ok-1", token_ids=pb.TokenIds(ids=good), params=pb.SamplingParams(max_tokens=3)),
           pb.GenerateRequest(token_ids=pb.TokenIds(ids=good)),  # no request_id
           pb.GenerateRequest(request_id="ok-1", token_ids=pb.TokenIds(ids=good)),  # used twice
           pb.GenerateRequest(request_id="bad-top-p", token_ids=pb.TokenIds(ids=good), params=pb.SamplingParams(top_p=2)),
           pb.GenerateRequest(request_id="bad-token", token_ids=pb.TokenIds(ids=[10 ** 6])),
           pb.GenerateRequest(request_id="ok-2", text="hello", params=pb.SamplingParams(max_tokens=2))]
    with grpc.insecure_channel(harness.address) as channel:
        messages = list(generate_pb2_grpc.GenerationStub(channel).GenerateBatch(iter(raw)))
    errors = {e.index: e for m in messages for e in m.errors}
    assert sorted(errors) == [1, 2, 3, 4]
    assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for e in errors.values())
    assert [errors[i].message.split(":")[0] for i in (1, 2, 3, 4)] == ["request_id", "request_id", "top_p", "prompt"]
    assert (errors[3].request_id, errors[4].request_id) == ("bad-top-p", "bad-token")
    summaries = {r.request_id: r.summary for m in messages for r in m.responses if r.HasField("summary")}
    assert {k: v.num_completion_tokens for k, v in summaries.items()} == {"ok-1": 3, "ok-2": 2}


def test_the_client_gets_a_generation_error_in_place_of_a_refused_request(harness):
    with Client(harness.address) as client:
        results = client.complete_batch([{"prompt": [5, 6], "max_tokens": 2}, {"prompt": [5, 6], "temperature": -1}])
    assert results[0].token_ids == [5, 6]
    assert isinstance(results[1], GenerationError) and results[1].field == "temperature"


def test_cancelling_the_call_aborts_every_running_request(harness):
    async def leave_early():
        async with AsyncClient(harness.address) as client:
            stream = client.generate_batch([{"prompt": "a long echo", "max_tokens": 100, "request_id": f"gone-{i}"}
                                            for i in range(3)])
            async for index, _ in stream:
                # all three running first: on a loaded machine the first tokens can come back
                # before the frontend has read the third request, which then never starts
                for _ in range(300):
                    if len(harness.fake.submitted) == 3:
                        break
                    await asyncio.sleep(0.01)
                stream.cancel()
                break

    # slow steps, so that no request can finish its 100 tokens before the cancel arrives, however
    # late the loaded machine starts the third one (at 2 ms a step all three once ended first)
    step_s, harness.fake.step_s = harness.fake.step_s, 0.1
    try:
        asyncio.run(leave_early())
        assert harness.wait_for(lambda: {"gone-0", "gone-1", "gone-2"} <= set(harness.fake.cancelled))
    finally:
        harness.fake.step_s = step_s
    assert harness.wait_for(lambda: harness.frontend.core.num_pending == 0)


def test_the_client_refuses_two_requests_with_one_id(harness):
    with Client(harness.address) as client, pytest.raises(ValueError, match="request_id"):
        client.complete_batch([{"prompt": [5], "request_id": "same"}, {"prompt": [6], "request_id": "same"}])


def test_a_large_batch_waits_for_room_under_max_pending(tiny_llama):
    """max_pending bounds the requests in flight; a batch beyond it is paced, not refused."""
    harness = Harness(tiny_llama, Tokenizer(tiny_llama).vocab_size, max_pending=3)
    try:
        assert harness.wait_for(lambda: harness.health() == health_pb2.HealthCheckResponse.SERVING)
        with Client(harness.address) as client:
            results = client.complete_batch([{"prompt": [5 + i, 6], "max_tokens": 3} for i in range(10)])
        assert [r.token_ids for r in results] == [[5 + i, 6, 5 + i] for i in range(10)]
    finally:
        harness.close()
