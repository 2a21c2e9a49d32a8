"""Bad requests get INVALID_ARGUMENT naming the field before anything reaches the scheduler;
the scheduler's statuses pass through; health and SIGTERM draining."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.frontend.frontend_harness import MAX_MODEL_LEN, Harness
from pagedserve.v1 import generate_pb2 as pb
from pagedserve import Client, GenerationError, build_request
from services.core.tokenizer import Tokenizer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
INVALID = [  # (prompt, sampling and request keywords, the field the message must name)
    ("", {}, "prompt"),
    ([], {}, "prompt"),
    ([{"role": "wizard", "content": "hi"}], {}, "messages[0].role"),
    ("hello", {"model": "another-model"}, "model"),
    ("hello", {"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("hello", {"top_p": 1.5}, "top_p"),
    ("hello " * MAX_MODEL_LEN, {"max_tokens": 1}, "prompt"),
    ([5, 99999], {}, "prompt"),
    ("hello", {"logit_bias": {99999: 1.0}}, "logit_bias"),
    ("hello", {"stop_token_ids": [99999]}, "stop_token_ids"),
    ("hello", {"n": 0}, "n"),
    ("hello", {"temperature": -1.0}, "temperature"),
    ("hello", {"logprobs": 21}, "logprobs"),
    ("hello", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("hello", {"stop": [""]}, "stop"),
]


@pytest.fixture
def harness(tiny_llama):
    harness = Harness(tiny_llama, Tokenizer(tiny_llama).vocab_size)
    assert harness.wait_for(lambda: harness.health() == SERVING)
    yield harness
    harness.close()


def send_raw(address: str, request: bytes) -> None:
    """A Generate call with hand-made bytes (a newer client's field this server does not know)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/pagedserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
        list(call(request))


def test_invalid_requests_name_the_field_and_never_reach_the_scheduler(harness):
    with Client(harness.address) as client:
        for prompt, kwargs, field in INVALID:
            with pytest.raises(GenerationError) as error:
                client.generate(prompt, **kwargs)
            assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT, (prompt, kwargs)
            assert error.value.field == field, error.value.details
        unknown_field = b"\xf8\x06\x01"  # field 111, varint 1
        for request in (build_request("hello").SerializeToString() + unknown_field,
                        build_request("hello").SerializeToString() + b"\x32\x03" + unknown_field):  # inside params
            with pytest.raises(grpc.RpcError) as rpc_error:
                send_raw(harness.address, request)
            assert rpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown field number 111" in rpc_error.value.details()
        assert harness.fake.submitted == []
        assert client.generate("hello", max_tokens=3).samples[0].finish_reason == "length"


def test_scheduler_statuses_pass_through(harness):
    harness.fake.refuse = (grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full")
    with Client(harness.address) as client, pytest.raises(GenerationError) as error:
        client.generate("hello")
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in error.value.details


def test_not_serving_and_unavailable_without_a_worker(harness):
    harness.fake.num_workers = 0
    assert harness.wait_for(lambda: harness.health() == NOT_SERVING)
    harness.frontend.core.card = None
    with Client(harness.address) as client:
        with pytest.raises(GenerationError) as error:
            client.generate("hello")
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        harness.fake.num_workers = 1
        assert harness.wait_for(lambda: harness.health() == SERVING)
        assert client.generate("hello", max_tokens=2).token_ids


def test_sigterm_drain_finishes_running_requests_and_refuses_new_ones(harness):
    harness.fake.step_s = 0.01
    with Client(harness.address) as client:
        running = client.stream("keep going", max_tokens=40)
        deltas = iter(running)
        first = next(deltas)
        drain = asyncio.run_coroutine_threadsafe(harness.frontend.drain(), harness.loop)  # as SIGTERM does
        assert harness.wait_for(lambda: harness.frontend.core.draining)
        assert harness.health() == NOT_SERVING
        with pytest.raises(GenerationError) as error:
            client.generate("too late")
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        rest = list(deltas)
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 40
        assert running.result.samples[0].finish_reason == "length"
        drain.result(5)


def test_max_pending_refuses_with_resource_exhausted(tiny_llama):
    harness = Harness(tiny_llama, Tokenizer(tiny_llama).vocab_size, max_pending=1)
    harness.fake.step_s = 0.01
    try:
        with Client(harness.address) as client:
            running = iter(client.stream("hold the only slot", max_tokens=20))
            next(running)
            with pytest.raises(GenerationError) as error:
                client.generate("one too many")
            assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert sum(len(d.token_ids) for d in running) == 19
            assert client.generate("fits again", max_tokens=2).token_ids
    finally:
        harness.close()


def test_unreachable_scheduler_is_unavailable(tiny_llama):
    harness = Harness(tiny_llama, Tokenizer(tiny_llama).vocab_size)
    try:
        harness.run(harness.fake_server.stop(0))
        harness.frontend.core.card = None
        with Client(harness.address) as client, pytest.raises(GenerationError) as error:
            client.generate("hello")
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        assert harness.wait_for(lambda: harness.health() == NOT_SERVING)
    finally:
        harness.close()


def reflected_services(address: str) -> list[str]:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(address) as channel:
        try:
            return sorted(ProtoReflectionDescriptorDatabase(channel).get_services())
        except grpc.RpcError as error:
            return [error.code().name]


def test_reflection_is_on_by_default_and_can_be_turned_off(harness, tiny_llama):
    assert "pagedserve.v1.Generation" in reflected_services(harness.address)  # grpcurl works out of the box
    without = Harness(tiny_llama, Tokenizer(tiny_llama).vocab_size, reflection=False)
    try:
        assert reflected_services(without.address) == ["UNIMPLEMENTED"]
    finally:
        without.close()


def test_reflection_answers_under_v1_as_newer_grpcurl_asks_first(harness):
    """grpc.reflection.v1 was UNIMPLEMENTED (only v1alpha was served). Its messages are v1alpha's
    under another package, so a v1 call is made here with v1alpha's message classes."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as messages

    with grpc.insecure_channel(harness.address) as channel:
        call = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=messages.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=messages.ServerReflectionResponse.FromString)
        answers = list(call(iter([
            messages.ServerReflectionRequest(list_services=""),
            messages.ServerReflectionRequest(file_containing_symbol="pagedserve.v1.Generation"),
            messages.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection")]),
            timeout=10))
    services = {s.name for s in answers[0].list_services_response.service}
    assert {"pagedserve.v1.Generation", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= services
    for answer, package in zip(answers[1:], ("pagedserve.v1", "grpc.reflection.v1")):
        files = [descriptor_pb2.FileDescriptorProto.FromString(f)
                 for f in answer.file_descriptor_response.file_descriptor_proto]
        assert package in {f.package for f in files}, answer
