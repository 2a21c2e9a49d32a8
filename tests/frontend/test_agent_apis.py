"""The OpenAI Responses API and the Anthropic Messages API, driven by the official `openai` and
`anthropic` clients, in front of a real scheduler and worker (tiny random model): text and
streamed text, tool loops, json_schema outputs valid at temperature 1, count_tokens, and the same
tokens for a seeded request through chat completions, responses and messages."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.agent_checks import (messages_create_and_stream_agree, messages_tool_loop, responses_json_schema_is_valid,
                                responses_tool_loop)
from tests.conftest import make_llm
from services.core.sampling_params import SamplingParams
from test_http_api import raw
from test_http_cluster import client, served  # noqa: F401 - the module's fixtures: a real cluster over HTTP
from test_structured_http import SCHEMA, TIME, WEATHER

pytestmark = pytest.mark.slow
SYSTEM, QUESTION = "Answer with tools.", "Weather in Oslo?"
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)


def test_responses_create_and_stream_give_the_same_response(served, client):
    kwargs = dict(model=served.model, input=QUESTION, instructions=SYSTEM, max_output_tokens=12, temperature=1.0,
                  extra_body={"seed": 7})
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0 and whole.output_text
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    with client.responses.stream(**{**kwargs, "max_output_tokens": 200}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert final.output_text.startswith(whole.output_text) or len(deltas) > 1
    events = [e.type for e in client.responses.create(**kwargs, stream=True)]
    assert events[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added"]
    assert events[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                           "response.incomplete"]
    assert client.responses.retrieve(whole.id).output_text == whole.output_text


def test_responses_tool_loop_through_previous_response_id(served, client):
    *_, again = responses_tool_loop(client, served.model, SYSTEM, QUESTION, RESPONSES_TOOLS,
                                    json.dumps({"forecast": "sunny"}), max_output_tokens=6, temperature=0,
                                    extra_body={"seed": 1})
    assert raw(f"{served.url}/v1/responses/{again.id}")[0] == 404  # store=False


def test_responses_json_schema_is_valid_at_temperature_1_for_every_seed(served, client):
    responses_json_schema_is_valid(client, served.model, QUESTION, SCHEMA, range(6))


def test_messages_output_config_json_schema_is_valid(served, claude):
    for seed in range(3):
        message = claude.messages.create(model=served.model, messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=80, output_config={"format": {"type": "json_schema",
                                                                                  "schema": SCHEMA}},
                                         extra_body={"seed": seed, "temperature": 1.0})
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), SCHEMA)


def test_messages_create_and_stream(served, claude):
    whole, kwargs = messages_create_and_stream_agree(claude, served.model, SYSTEM, QUESTION, max_tokens=12)
    stop = claude.messages.create(**{**kwargs, "max_tokens": 40}, stop_sequences=[whole.content[0].text[3:6]])
    assert (stop.stop_reason, stop.stop_sequence) == ("stop_sequence", whole.content[0].text[3:6])


def test_messages_tool_loop_and_streamed_input_json(served, claude):
    messages_tool_loop(claude, served.model, SYSTEM, QUESTION, ANTHROPIC_TOOLS, "sunny",
                       assistant_content=lambda content: [block.model_dump() for block in content])


def test_a_seeded_request_gives_the_same_tokens_through_every_api(served, client, claude):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=served.model, messages=messages, max_completion_tokens=24,
                                          temperature=1.0, top_p=0.9, seed=11)
    response = client.responses.create(model=served.model, input=messages, max_output_tokens=24, temperature=1.0,
                                       top_p=0.9, store=False, extra_body={"seed": 11})
    message = claude.messages.create(model=served.model, system=SYSTEM, messages=messages[1:], max_tokens=24,
                                     extra_body={"seed": 11, "temperature": 1.0, "top_p": 0.9})
    assert chat.choices[0].message.content == response.output_text == message.content[0].text
    assert chat.usage.prompt_tokens == response.usage.input_tokens == message.usage.input_tokens
    # and in process (rule 4: the seed, not the batch or the process, decides the tokens)
    [in_process] = make_llm(served.model, dtype="float32").chat(
        messages, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11), use_tqdm=False)
    assert in_process.outputs[0].text == message.content[0].text
    assert len(in_process.prompt_token_ids) == chat.usage.prompt_tokens
