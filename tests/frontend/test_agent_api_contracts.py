"""The Responses and Messages APIs' contracts in front of the fake echo scheduler: the response
store's bounds (entries, bytes, TTL) and 404s, each API's error shape, x-api-key, and the raw
event sequences (what the SDKs hide: Anthropic's ping)."""
from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest

from tests.frontend.frontend_harness import MODEL_ID
from services.frontend.response_store import ResponseStore, ResponseStoreLimits
from test_http_api import http_harness, raw

QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def harness(tiny_llama):
    harness = http_harness(tiny_llama, api_key="sekret",
                           responses=ResponseStoreLimits(max_entries=2, max_bytes=1 << 20, ttl_s=1.0))
    yield harness
    harness.close()


def post(harness, path: str, body: dict, key: str = "sekret", header: str = "x-api-key") -> tuple[int, dict | str]:
    status, text = raw(harness.url + path, body, headers={header: key} if header == "x-api-key" else
                       {"authorization": f"Bearer {key}"})
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text.decode()


def get(harness, path: str, method: str = "GET") -> tuple[int, dict]:
    import urllib.request
    request = urllib.request.Request(harness.url + path, method=method, headers={"x-api-key": "sekret"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_store_evicts_the_oldest_and_unknown_ids_are_a_404(harness):
    ids = [post(harness, "/v1/responses", {"input": f"hello {i}", "max_output_tokens": 2})[1]["id"] for i in range(3)]
    status, body = get(harness, f"/v1/responses/{ids[0]}")  # evicted: max_entries 2
    assert status == 404 and body["error"]["code"] == "not_found" and ids[0] in body["error"]["message"]
    assert get(harness, f"/v1/responses/{ids[2]}")[1]["output"][0]["content"][0]["text"]
    assert get(harness, f"/v1/responses/{ids[1]}", "DELETE") == (200, {"id": ids[1], "object": "response.deleted",
                                                                     "deleted": True})
    assert get(harness, f"/v1/responses/{ids[1]}")[0] == 404
    assert get(harness, f"/v1/responses/{ids[1]}", "DELETE")[0] == 404
    status, body = post(harness, "/v1/responses", {"input": "x", "previous_response_id": ids[0]})
    assert status == 400 and body["error"]["param"] == "previous_response_id"


def test_stored_responses_expire_after_their_ttl(harness):
    response_id = post(harness, "/v1/responses", {"input": "hello", "max_output_tokens": 2})[1]["id"]
    assert get(harness, f"/v1/responses/{response_id}")[0] == 200
    time.sleep(1.1)
    assert get(harness, f"/v1/responses/{response_id}")[0] == 404


def test_the_store_bounds_bytes_and_entries_and_forgets_expired_ones():
    now = [0.0]
    store = ResponseStore(ResponseStoreLimits(max_entries=3, max_bytes=300, ttl_s=10), clock=lambda: now[0])
    assert store.put("a", {"text": "x" * 100}, []) and store.put("b", {"text": "y" * 100}, [])
    assert store.put("c", {"text": "z" * 100}, [])  # over 300 bytes with a and b: a goes
    assert store.get("a") is None and store.get("b") is not None and store.num_bytes <= 300
    assert not store.put("huge", {"text": "w" * 400}, []) and store.get("huge") is None
    now[0] = 10.0
    assert store.get("b") is None and store.get("c") is None and len(store) == 0 and store.num_bytes == 0


def test_each_api_has_its_own_error_shape_and_takes_either_key_header(harness):
    status, body = post(harness, "/v1/messages", {"model": MODEL_ID, "messages": QUESTION})
    assert status == 400 and body == {"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": "max_tokens: Field required"}}
    status, body = post(harness, "/v1/messages", {"model": "claude-x", "messages": QUESTION, "max_tokens": 2})
    assert status == 404 and body["error"]["type"] == "not_found_error" and "claude-x" in body["error"]["message"]
    status, body = post(harness, "/v1/messages", {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 2}, "bad")
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    status, body = post(harness, "/v1/messages", {"model": MODEL_ID, "max_tokens": 2, "messages": QUESTION,
                                                  "tools": [{"name": "f", "input_schema": {}}],
                                                  "tool_choice": {"type": "tool", "name": "g"}})
    assert status == 400 and body["error"]["message"].startswith("tool_choice.name:")
    status, body = post(harness, "/v1/responses", {"input": "x", "temperature": 3})
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body = post(harness, "/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "bad name"}]})
    assert status == 400 and body["error"]["param"] == "tools[0].name"
    assert post(harness, "/v1/responses", {"input": "x"}, "bad", "authorization")[0] == 401
    assert post(harness, "/v1/responses", {"input": "x", "max_output_tokens": 1}, header="authorization")[0] == 200
    assert post(harness, "/v1/messages/count_tokens", {"model": MODEL_ID, "messages": QUESTION})[0] == 200
    codex_style = {"input": "x", "max_output_tokens": 1, "include": [], "prompt_cache_key": "k", "store": False,
                   "reasoning": {"effort": "low", "summary": "auto"}, "service_tier": "auto"}
    assert post(harness, "/v1/responses", codex_style)[0] == 200


def test_settings_a_client_sends_that_ask_for_what_the_server_does_anyway_are_accepted(harness):
    """`thinking: disabled` (no thinking: this server's only way), a `service_tier` (there is one tier),
    `text.verbosity` (a hint, as `reasoning` is) are taken, not refused; thinking enabled on a model
    served without a reasoning parser is a 400 naming thinking.budget_tokens, in Anthropic's shape."""
    message = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 1}
    for extra in ({"thinking": {"type": "disabled"}}, {"service_tier": "auto"}, {"service_tier": "standard_only"}):
        status, body = post(harness, "/v1/messages", {**message, **extra})
        assert status == 200 and body["usage"]["output_tokens"] == 1, (extra, body)
    counted = post(harness, "/v1/messages/count_tokens", {"model": MODEL_ID, "messages": QUESTION,
                                                          "thinking": {"type": "disabled"}})
    assert counted == post(harness, "/v1/messages/count_tokens", {"model": MODEL_ID, "messages": QUESTION})
    assert counted[0] == 200
    status, body = post(harness, "/v1/messages", {**message, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert status == 400 and body["type"] == "error" and body["error"]["message"].startswith(
        "thinking.budget_tokens: needs a reasoning model")
    status, body = post(harness, "/v1/responses", {"input": "x", "max_output_tokens": 1, "text": {"verbosity": "low"}})
    assert status == 200 and body["text"]["verbosity"] == "low", body


def test_the_raw_event_sequences(harness):
    status, text = post(harness, "/v1/messages", {"model": MODEL_ID, "messages": QUESTION, "max_tokens": 3,
                                                  "stream": True})
    names = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
    assert status == 200 and names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"} and names[-3:] == ["content_block_stop", "message_delta",
                                                                          "message_stop"]
    status, text = post(harness, "/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events][-1] == "response.incomplete"


def test_the_clients_see_the_same_output_in_every_api(harness, tiny_llama):
    """The fake scheduler echoes the prompt: the three APIs render the same chat to the same tokens."""
    oai = openai.OpenAI(base_url=harness.url + "/v1", api_key="sekret", max_retries=0)
    claude = anthropic.Anthropic(base_url=harness.url, api_key="sekret", max_retries=0)
    chat = oai.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_completion_tokens=5)
    response = oai.responses.create(model=MODEL_ID, input=QUESTION, max_output_tokens=5)
    message = claude.messages.create(model=MODEL_ID, messages=QUESTION, max_tokens=5)
    assert chat.choices[0].message.content == response.output_text == message.content[0].text
    counted = claude.messages.count_tokens(model=MODEL_ID, messages=QUESTION)
    assert counted.input_tokens == chat.usage.prompt_tokens == response.usage.input_tokens \
        == message.usage.input_tokens


def test_a_failure_after_the_first_event_is_each_apis_failure_event():
    """Once the stream has begun the status is sent: the Responses API ends with response.failed,
    the Messages API with an error event in Anthropic's shape."""
    import asyncio

    from services.core.errors import Unavailable
    from services.frontend.http import messages_api, respond, responses_api
    from services.frontend.tool_calls import plan
    from services.frontend.types import GenerateEvent, SampleEvent

    async def events():
        yield 0, GenerateEvent(request_id="r", samples=[SampleEvent(index=0, text="Hel", token_ids=[1])])
        raise Unavailable("the scheduler went away")

    async def lines(stream) -> list[dict]:
        return [json.loads(line[len("data: "):]) async for chunk in stream for line in chunk.splitlines()
                if line.startswith("data: ")]

    async def keep(final):
        raise AssertionError("a failed response is not stored")

    reader = plan([], "none", None).stream()
    sent = asyncio.run(lines(respond.sse(responses_api.ResponseBuilder("resp_1", {}, reader, keep), events())))
    assert [e["type"] for e in sent][-2:] == ["response.output_text.delta", "response.failed"]
    assert sent[-1]["response"]["error"]["message"] == "the scheduler went away"
    assert sent[-1]["response"]["status"] == "failed"
    builder = messages_api.MessageBuilder("msg_1", MODEL_ID, plan([], "none", None).stream(), 3)
    sent = asyncio.run(lines(respond.sse(builder, events())))
    assert sent[-2]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert sent[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "the scheduler went away"}}
