"""The OpenAI Responses API and the Anthropic Messages API, driven by the official `openai` and
`anthropic` clients, in front of a real scheduler and worker (tiny random model): text and
streamed text, tool loops, json_schema outputs valid at temperature 1, count_tokens, and the same
tokens for a seeded request through chat completions, responses and messages."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

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
    first = client.responses.create(model=served.model, input=QUESTION, instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=100,
                                    temperature=1.0, extra_body={"seed": 5})
    [call] = first.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), next(t["parameters"] for t in RESPONSES_TOOLS
                                                         if t["name"] == call.name))
    with client.responses.stream(model=served.model, input=QUESTION, instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=100,
                                 temperature=1.0, extra_body={"seed": 5}) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert len(pieces) > 1 and "".join(pieces) == streamed.output[0].arguments == call.arguments
    second = client.responses.create(
        model=served.model, previous_response_id=first.id, tools=RESPONSES_TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"forecast": "sunny"})}],
        max_output_tokens=6, temperature=0, extra_body={"seed": 1})
    assert second.output[0].type == "message" and second.output_text and second.previous_response_id == first.id
    # the same conversation given in full, without the store, is the same prompt (instructions are not
    # carried over by previous_response_id)
    again = client.responses.create(
        model=served.model, tools=RESPONSES_TOOLS, tool_choice="none", store=False, max_output_tokens=6,
        temperature=0, extra_body={"seed": 1},
        input=[{"role": "user", "content": QUESTION}, call,
               {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"forecast": "sunny"})}])
    assert again.usage.input_tokens == second.usage.input_tokens and again.output_text == second.output_text
    assert raw(f"{served.url}/v1/responses/{again.id}")[0] == 404  # store=False


def test_responses_json_schema_is_valid_at_temperature_1_for_every_seed(served, client):
    fmt = {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}
    for seed in range(6):
        result = client.responses.create(model=served.model, input=QUESTION, text={"format": fmt},
                                         max_output_tokens=80, temperature=1.0, store=False,
                                         extra_body={"seed": seed})
        assert result.status == "completed"
        jsonschema.validate(json.loads(result.output_text), SCHEMA)


def test_messages_output_config_json_schema_is_valid(served, claude):
    for seed in range(3):
        message = claude.messages.create(model=served.model, messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=80, output_config={"format": {"type": "json_schema",
                                                                                  "schema": SCHEMA}},
                                         extra_body={"seed": seed, "temperature": 1.0})
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), SCHEMA)


def test_messages_create_and_stream(served, claude):
    kwargs = dict(model=served.model, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
                  max_tokens=12, extra_body={"seed": 3, "temperature": 1.0})  # (not in this SDK's signature)
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12 and whole.content[0].type == "text"
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == \
        ("max_tokens", 12, whole.usage.input_tokens)
    events = [e.type for e in claude.messages.create(**kwargs, stream=True)]  # (the SDK drops the ping)
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    stop = claude.messages.create(**{**kwargs, "max_tokens": 40}, stop_sequences=[whole.content[0].text[3:6]])
    assert (stop.stop_reason, stop.stop_sequence) == ("stop_sequence", whole.content[0].text[3:6])


def test_messages_tool_loop_and_streamed_input_json(served, claude):
    kwargs = dict(model=served.model, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
                  tools=ANTHROPIC_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  max_tokens=100, extra_body={"seed": 5, "temperature": 1.0})
    first = claude.messages.create(**kwargs)
    [use] = first.content
    assert first.stop_reason == "tool_use" and use.type == "tool_use"
    jsonschema.validate(use.input, next(t["input_schema"] for t in ANTHROPIC_TOOLS if t["name"] == use.name))
    with claude.messages.stream(**kwargs) as stream:
        pieces = [e.delta.partial_json for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        streamed = stream.get_final_message()
    assert len(pieces) > 1 and json.loads("".join(pieces)) == streamed.content[0].input == use.input
    history = kwargs["messages"] + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                  "content": "sunny"}]}]
    final = claude.messages.create(**{**kwargs, "messages": history, "tool_choice": {"type": "none"},
                                      "max_tokens": 6})
    assert final.content[0].type == "text" and final.stop_reason in ("max_tokens", "end_turn")
    counted = claude.messages.count_tokens(model=served.model, system=SYSTEM, messages=history,
                                           tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
    assert counted.input_tokens == final.usage.input_tokens


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
