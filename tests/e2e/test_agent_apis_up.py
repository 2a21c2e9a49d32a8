"""The official `openai` and `anthropic` clients end to end against `pagedserve up` (issue 29): one
real deployment (two workers, a tiny random model, an API key) for the whole module, driven as a user
would: the Responses API (create, stream, a tool loop through previous_response_id and
function_call_output, json_schema valid at temperature 1), the Messages API (create, stream, a
tool_use/tool_result loop, count_tokens, x-api-key), and the same seeded request giving the same
tokens through chat completions, responses and messages; and, on a deployment of its own, a reasoning
template's thinking as reasoning_content. The in-process cluster versions of these
checks: tests/frontend/test_agent_apis.py."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Literal

import anthropic
import openai
import pydantic
import pytest

from services.launch.deployment import free_ports
from tests.agent_checks import (messages_create_and_stream_agree, messages_tool_loop, responses_json_schema_is_valid,
                                responses_tool_loop)
from tests.e2e.test_launcher import REAL_SERVICES, Up, up_args

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]

KEY = "sk-agent-test"
SYSTEM, QUESTION = "Answer with tools.", "Weather in Oslo?"
# (strings and numbers bounded: a random model would ramble on in an unbounded one)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
                   {"type": "function", "name": "get_time", "parameters": TIME}]
ANTHROPIC_TOOLS = [{"name": t["name"], "input_schema": t["parameters"]} for t in RESPONSES_TOOLS]
FORECAST = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "celsius": {"type": "integer", "minimum": -40, "maximum": 45},
                                             "sky": {"enum": ["sunny", "cloudy", "rain"]}},
            "required": ["city", "celsius", "sky"], "additionalProperties": False}


def post(url: str, body: dict, headers: dict) -> tuple[int, dict]:
    """Status and JSON body of one plain POST (no SDK choosing the headers)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


class Sky(pydantic.BaseModel):
    """What the SDKs' parse helpers turn into a json_schema (enums and booleans: a random model ends them)."""
    sky: Literal["sunny", "cloudy", "rain"]
    windy: bool
    unit: Literal["C", "F"]


class Deployment:
    def __init__(self, up: Up, http_port: int, model: str):
        self.up, self.url, self.model = up, f"http://127.0.0.1:{http_port}", model


@pytest.fixture(scope="module")
def deployed(tiny_llama):
    ports = free_ports(3)
    up = Up(up_args(tiny_llama, ports, workers=2) + ["--dtype", "float32", "--num-gpu-blocks", "128",
                                                     "--startup-timeout", "240", "--api-key", KEY])
    try:
        up.wait_ready(timeout=300)
        yield Deployment(up, ports[1], str(tiny_llama))
        up.stop()
    finally:
        up.kill_all()


@pytest.fixture(scope="module")
def client(deployed):
    with openai.OpenAI(base_url=deployed.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(deployed):
    with anthropic.Anthropic(base_url=deployed.url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def test_responses_create_and_stream_agree_and_the_events_come_in_order(deployed, client):
    kwargs = dict(model=deployed.model, input=QUESTION, instructions=SYSTEM, max_output_tokens=200,
                  temperature=1.0, extra_body={"seed": 7})
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed" and whole.usage.output_tokens < 200 and whole.output_text
    [message] = whole.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == whole.output_text
    assert (final.status, final.usage.output_tokens, final.usage.input_tokens) == \
        ("completed", whole.usage.output_tokens, whole.usage.input_tokens)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert next(e for e in events if e.type == "response.output_text.done").text == whole.output_text
    # cut short by max_output_tokens: incomplete, streamed or not (the SDK's stream helper wants a
    # response.completed, so the raw events here)
    short = client.responses.create(**{**kwargs, "max_output_tokens": 8})
    assert (short.status, short.incomplete_details.reason, short.usage.output_tokens) == \
        ("incomplete", "max_output_tokens", 8)
    assert whole.output_text.startswith(short.output_text)
    raw_events = list(client.responses.create(**{**kwargs, "max_output_tokens": 8}, stream=True))
    assert raw_events[-1].type == "response.incomplete"
    assert raw_events[-1].response.output_text == short.output_text
    assert "".join(e.delta for e in raw_events if e.type == "response.output_text.delta") == short.output_text
    # a stored response comes back by id, and goes when deleted
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)


def test_responses_tool_loop_through_previous_response_id_and_function_call_output(deployed, client):
    _, _, second, _ = responses_tool_loop(client, deployed.model, SYSTEM, QUESTION, RESPONSES_TOOLS,
                                          json.dumps({"celsius": 21}), max_output_tokens=8, temperature=1.0,
                                          extra_body={"seed": 9})
    # and a third turn continues the second (the chain, not just one step back)
    third = client.responses.create(model=deployed.model, previous_response_id=second.id, input="Thanks.",
                                    max_output_tokens=4, temperature=0, store=False)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=deployed.model, previous_response_id="resp_unknown", input="hi",
                                max_output_tokens=4)


def test_responses_json_schema_is_valid_at_temperature_1_over_several_seeds(deployed, client):
    responses_json_schema_is_valid(client, deployed.model, QUESTION, FORECAST, range(5))
    # the SDK's own structured-output helpers: a pydantic model in, a parsed object out
    parsed = client.responses.parse(model=deployed.model, input=QUESTION, text_format=Sky, max_output_tokens=60,
                                    temperature=1.0, store=False, extra_body={"seed": 1})
    assert isinstance(parsed.output_parsed, Sky)


def test_messages_json_schema_through_the_sdks_parse_helper(deployed, claude):
    for seed in range(3):
        parsed = claude.messages.parse(model=deployed.model, max_tokens=60, output_format=Sky,
                                       messages=[{"role": "user", "content": QUESTION}],
                                       extra_body={"seed": seed, "temperature": 1.0})
        assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, Sky)


def test_messages_create_and_stream_agree(deployed, claude):
    whole, kwargs = messages_create_and_stream_agree(claude, deployed.model, SYSTEM, QUESTION, max_tokens=16)
    # settings the SDK sends that ask for what the server does anyway change nothing
    same = claude.messages.create(**kwargs, thinking={"type": "disabled"}, service_tier="standard_only")
    assert same.content[0].text == whole.content[0].text
    with pytest.raises(anthropic.BadRequestError, match="thinking.budget_tokens"):
        claude.messages.create(**kwargs, thinking={"type": "enabled", "budget_tokens": 1024})


def test_messages_tool_use_and_tool_result_loop_and_count_tokens(deployed, claude):
    first, kwargs = messages_tool_loop(claude, deployed.model, SYSTEM, QUESTION, ANTHROPIC_TOOLS, "sunny, 21 C")
    assert claude.messages.count_tokens(model=deployed.model, system=SYSTEM, messages=kwargs["messages"],
                                        tools=ANTHROPIC_TOOLS, tool_choice=kwargs["tool_choice"]).input_tokens == \
        first.usage.input_tokens


def test_the_api_key_is_required_and_x_api_key_carries_it(deployed, claude):
    """`up --api-key`: the key as `x-api-key` (what Anthropic's API and older SDKs send) or as a Bearer
    token (what this anthropic SDK and the openai one send) is let in; a wrong one is a 401 in each
    API's own error shape."""
    body = {"model": deployed.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status, counted = post(f"{deployed.url}/v1/messages/count_tokens", {k: body[k] for k in ("model", "messages")},
                           {"x-api-key": KEY})
    assert status == 200 and counted["input_tokens"] > 0, counted
    status, refused = post(f"{deployed.url}/v1/messages", body, {"x-api-key": "wrong"})
    assert status == 401 and refused["error"]["type"] == "authentication_error"
    assert post(f"{deployed.url}/v1/messages", body, {})[0] == 401
    with anthropic.Anthropic(base_url=deployed.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(**body)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"
    with openai.OpenAI(base_url=deployed.url + "/v1", api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.responses.create(model=deployed.model, input="hi", max_output_tokens=4)
    assert caught.value.code == "invalid_api_key"


def test_a_seeded_request_gives_the_same_tokens_through_every_api(deployed, client, claude):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for seed in (11, 12):
        chat = client.chat.completions.create(model=deployed.model, messages=messages, max_completion_tokens=24,
                                              temperature=1.0, top_p=0.9, seed=seed, logprobs=True)
        response = client.responses.create(model=deployed.model, input=messages, max_output_tokens=24,
                                           temperature=1.0, top_p=0.9, store=False, extra_body={"seed": seed})
        message = claude.messages.create(model=deployed.model, system=SYSTEM, messages=messages[1:], max_tokens=24,
                                         extra_body={"seed": seed, "temperature": 1.0, "top_p": 0.9})
        assert chat.choices[0].message.content == response.output_text == message.content[0].text
        assert chat.usage.prompt_tokens == response.usage.input_tokens == message.usage.input_tokens
        assert chat.usage.completion_tokens == response.usage.output_tokens == message.usage.output_tokens == 24
        streamed = client.chat.completions.create(model=deployed.model, messages=messages, max_completion_tokens=24,
                                                  temperature=1.0, top_p=0.9, seed=seed, logprobs=True, stream=True)
        chunks = [c for c in streamed if c.choices]
        assert [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content] == \
            [t.token for t in chat.choices[0].logprobs.content]


def test_a_reasoning_template_gives_reasoning_content_apart_under_the_three_services(model_dir, tmp_path):
    """`pagedserve up --reasoning-parser auto` on a tiny random model with DeepSeek-R1's template (the
    prompt opens the thinking): the budget closes the thinking, the choice constrains the answer only,
    and the thinking comes back as reasoning_content, its tokens in usage."""
    import shutil

    from tests.frontend.reasoning_models import MARKERS, VOCAB_SIZE, reasoning_model

    model = tmp_path / "r1-tiny"
    shutil.copytree(model_dir("llama", "tiny", vocab_size=VOCAB_SIZE + len(MARKERS)), model)
    reasoning_model(model, "deepseek_r1.jinja")
    ports = free_ports(3)
    up = Up(up_args(model, ports, workers=1) + ["--dtype", "float32", "--num-gpu-blocks", "64",
                                                "--reasoning-parser", "auto"])
    try:
        up.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[1]}/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(
            model=str(model), messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=30, temperature=1.0,
            seed=1, logprobs=True,
            extra_body={"max_reasoning_tokens": 5, "structured_outputs": {"choice": ["yes", "no"]}})
        tokens = [t.token for t in chat.choices[0].logprobs.content]
        assert "</think>" in tokens[:6], tokens
        end = tokens.index("</think>")
        assert chat.choices[0].message.content in ("yes", "no"), tokens
        assert (chat.choices[0].message.reasoning_content or "") == "".join(tokens[:end]).strip()
        assert chat.usage.completion_tokens_details.reasoning_tokens == end + 1  # the end marker's token too
        up.stop()
    finally:
        up.kill_all()
