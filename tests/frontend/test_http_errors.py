"""Every HTTP error status with OpenAI's body, /health, the API key, and a client that goes away."""
from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from tests.frontend.frontend_harness import MAX_MODEL_LEN, MODEL_ID
from test_http_api import http_harness, raw

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_PARAMETERS = [  # (route, body, the param the error must name)
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "n": "two"}, "n"),
    ("completions", {"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("completions", {}, "prompt"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat/completions", {**CHAT, "chat_template": "{{ evil }}"}, "chat_template"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
]


@pytest.fixture(scope="module")
def harness(tiny_llama):
    harness = http_harness(tiny_llama, max_body_bytes=4096)
    yield harness
    harness.close()


def assert_error(status: int, body: bytes, expected_status: int, code: str, param: str | None = None) -> dict:
    error = json.loads(body)["error"]
    assert (status, error["code"], error["param"]) == (expected_status, code, param), error
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("route, body, param", BAD_PARAMETERS)
def test_invalid_parameters_are_400_naming_the_parameter(harness, route, body, param):
    num_submitted = len(harness.fake.submitted)
    status, response = raw(f"{harness.url}/v1/{route}", body)
    error = assert_error(status, response, 400, "invalid_parameter", param)
    assert error["type"] == "invalid_request_error" and param in error["message"]
    assert len(harness.fake.submitted) == num_submitted  # refused before the scheduler


@pytest.mark.parametrize("route, body, param", [
    ("chat/completions", {"messages": CHAT["messages"], "max_tokens": MAX_MODEL_LEN - 1}, "max_tokens"),
    ("chat/completions", {"messages": CHAT["messages"], "max_completion_tokens": MAX_MODEL_LEN - 1},
     "max_completion_tokens"),
    ("responses", {"input": "hi", "max_output_tokens": MAX_MODEL_LEN - 1}, "max_output_tokens")])
def test_a_chat_without_room_for_its_max_tokens_names_the_clients_field(harness, route, body, param):
    """The room a chat's rendered prompt leaves is checked once, in the core, under the client's name."""
    status, response = raw(f"{harness.url}/v1/{route}", body)
    error = assert_error(status, response, 400, "invalid_parameter", param)
    assert "-token prompt exceeds max_model_len" in error["message"], error


def test_the_openai_client_sees_400_and_404(harness):
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_ID, prompt="hi", presence_penalty=3)
    assert bad.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    assert (missing.value.body["code"], missing.value.body["param"]) == ("model_not_found", "model")
    assert "gpt-4" in missing.value.body["message"]


def test_unknown_route_and_bad_json(harness):
    assert_error(*raw(harness.url + "/v1/images/generations", {"prompt": "x"}), 404, "not_found")
    assert_error(*raw(harness.url + "/v1/completions", data=b"{not json"), 400, "invalid_parameter")


@pytest.mark.parametrize("method, path, allowed", [("GET", "/v1/completions", "POST"),
                                                    ("DELETE", "/v1/chat/completions", "POST"),
                                                    ("POST", "/v1/models", "GET")])
def test_a_wrong_method_is_405_saying_which_are_allowed(harness, method, path, allowed):
    """RFC 9110: a 405 carries Allow (it came without one)."""
    request = urllib.request.Request(harness.url + path, method=method)
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=10)
    assert_error(error.value.code, error.value.read(), 405, "method_not_allowed")
    assert allowed in [m.strip() for m in error.value.headers["allow"].split(",")]


def test_body_over_the_limit_is_413_before_parsing(harness):
    big = json.dumps({"prompt": "x" * 5000}).encode()
    assert_error(*raw(harness.url + "/v1/completions", data=big), 413, "request_too_large")
    status, _ = raw(harness.url + "/v1/completions", data=b"[" * 5000)  # not parsed: no recursion, no 400
    assert status == 413


@pytest.mark.parametrize("stream", [False, True])
def test_scheduler_queue_full_is_429_and_no_worker_is_503(harness, stream):
    try:
        harness.fake.refuse = (grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full (8)")
        request = urllib.request.Request(harness.url + "/v1/completions", json.dumps(
            {"prompt": "hi", "stream": stream}).encode(), {"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.headers["retry-after"] == "1"  # seconds
        error = assert_error(refused.value.code, refused.value.read(), 429, "queue_full")
        assert "queue is full" in error["message"] and error["type"] == "rate_limit_error"
        # UNAVAILABLE: the request waits for a scheduler that serves, for the failover timeout
        harness.fake.refuse = (grpc.StatusCode.UNAVAILABLE, "no worker is registered yet")
        harness.frontend.scheduler.pool.failover_timeout_s = 0.5
        error = assert_error(*raw(harness.url + "/v1/chat/completions", {**CHAT, "stream": stream}), 503,
                             "unavailable")
        assert "failover timeout (0.5 s)" in error["message"] and "no worker is registered yet" in error["message"]
    finally:
        harness.fake.refuse = None
        harness.frontend.scheduler.pool.failover_timeout_s = 30.0
        assert harness.wait_for(lambda: raw(harness.url + "/health")[0] == 200)  # NOT_SERVING while it waited


def test_health_is_503_until_a_worker_is_ready_and_requests_are_503_meanwhile(harness):
    assert raw(harness.url + "/health") == (200, b'{"status":"ok"}')
    harness.fake.num_workers = 0
    try:
        assert harness.wait_for(lambda: raw(harness.url + "/health")[0] == 503)
        assert_error(*raw(harness.url + "/v1/models"), 503, "unavailable")
    finally:
        harness.fake.num_workers = 1
    assert harness.wait_for(lambda: raw(harness.url + "/health")[0] == 200)
    assert raw(harness.url + "/v1/models")[0] == 200


@contextlib.contextmanager
def slow_steps(harness, step_s: float = 0.05):
    """100 tokens take 5 s: the generation certainly outlives a client that leaves early."""
    harness.fake.step_s = step_s
    try:
        yield
    finally:
        harness.fake.step_s = 0.002


def test_a_client_leaving_a_stream_aborts_the_request(harness):
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key="unused", max_retries=0)
    with slow_steps(harness):
        stream = client.completions.create(model=MODEL_ID, prompt="a long echo", max_tokens=100, stream=True)
        next(iter(stream))
        stream.close()
        assert harness.wait_for(lambda: harness.fake.cancelled and harness.frontend.core.num_pending == 0)


def test_api_key_on_every_route_but_health(tiny_llama):
    harness = http_harness(tiny_llama, api_key="s3cret")
    try:
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            assert_error(*raw(harness.url + path), 401, "invalid_api_key")
            assert_error(*raw(harness.url + path, headers={"authorization": "Bearer wrong"}), 401, "invalid_api_key")
            assert raw(harness.url + path, headers={"authorization": "Bearer s3cret"})[0] == 200
        assert raw(harness.url + "/health")[0] == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=harness.url + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=harness.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL_ID, prompt="ok", max_tokens=2).usage.completion_tokens == 2
    finally:
        harness.close()


def test_a_client_leaving_a_non_streamed_request_aborts_it(harness):
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key="unused", max_retries=0, timeout=0.3)
    with slow_steps(harness):
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model=MODEL_ID, prompt="a long echo", max_tokens=100)
        assert harness.wait_for(lambda: harness.frontend.core.num_pending == 0, timeout=2.0)
