"""Structured outputs and tool calling through the OpenAI HTTP API, driven by the official openai
client, in front of a real scheduler and worker (tiny random model): every sampled output is valid,
bad constraints are a 400 naming the field, and the SDK's tool loop and stream helpers work."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import openai
import pytest

from test_http_api import raw
from services.core.sampling_params import SamplingParams
from tests.conftest import make_llm
from test_http_cluster import client, served  # noqa: F401 - the module's fixtures: a real cluster over HTTP

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "developer", "content": "Answer with tools."}, {"role": "user", "content": "Weather in Oslo?"}]


def test_response_format_json_schema_outputs_are_valid_for_every_seed(served, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    for seed in range(6):
        chat = client.chat.completions.create(model=served.model, messages=MESSAGES, max_completion_tokens=80,
                                              temperature=1.0, seed=seed, response_format=fmt)
        [choice] = chat.choices
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_structured_outputs_on_completions(served, client):
    cases = [({"regex": r"[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
             ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'},
              lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", t))]
    for options, valid in cases:
        result = client.completions.create(model=served.model, prompt="x", max_tokens=60, temperature=1.0,
                                           seed=3, n=4, extra_body={"structured_outputs": options})
        for choice in result.choices:
            assert choice.finish_reason == "stop" and valid(choice.text), (options, choice.text)
    # any JSON object: a random model's keys may run past max_tokens; every finished one parses
    result = client.completions.create(model=served.model, prompt="x", max_tokens=150, temperature=1.0, seed=3,
                                       n=6, extra_body={"structured_outputs": {"json_object": True}})
    finished = [c.text for c in result.choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(t), dict) for t in finished)
    assert all(c.text.startswith("{") for c in result.choices)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
])
def test_bad_constraints_are_a_400_naming_the_field(served, body, field):
    status, text = raw(served.url + "/v1/chat/completions", {"model": served.model, "messages": MESSAGES, **body})
    assert status == 400, text
    assert json.loads(text)["error"]["message"].startswith(field + ":"), text


def test_hostile_constraints_are_refused_and_the_server_keeps_serving(served, client):
    deep = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    recursive = {"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/n"}}]}},
                 "$ref": "#/$defs/n"}
    hostile = [{"structured_outputs": {"json": deep}},
               {"structured_outputs": {"choice": ["x" * 70000]}}]
    for body in hostile:
        started = time.monotonic()
        status, text = raw(served.url + "/v1/completions", {"model": served.model, "prompt": "x", **body})
        assert status == 400 and json.loads(text)["error"]["message"].startswith("structured_outputs"), text
        assert time.monotonic() - started < 30
    # backtracking bombs are harmless to a matcher that does not backtrack, and a recursive schema is
    # bounded per token: they are served, and the server still answers
    for options in ({"json": recursive}, {"regex": "((a*)*)*b"}, {"regex": "(a{1,1000}){1,1000}" * 8},
                    {"regex": "(.{1,50}){1,50}z"}, {"regex": "\\w{1000}{1000}"}):
        result = client.completions.create(model=served.model, prompt="x", max_tokens=30, temperature=1.0, seed=1,
                                           extra_body={"structured_outputs": options})
        assert result.choices[0].finish_reason in ("stop", "length")
    # and still serves what it served before: the same bits as the in-process engine
    after = client.completions.create(model=served.model, prompt="x", max_tokens=4, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True})
    [want] = make_llm(served.model, dtype="float32").generate(
        ["x"], SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True), use_tqdm=False)
    assert (after.choices[0].text, after.choices[0].finish_reason, after.usage.completion_tokens) == \
        (want.outputs[0].text, "length", 4)


def test_openai_tool_loop_call_result_final_answer(served, client):
    tools = [WEATHER, TIME]
    first = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_completion_tokens=100, temperature=1.0, seed=5)
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, next(t for t in tools if t["function"]["name"] == call.function.name)
                        ["function"]["parameters"])
    history = MESSAGES + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    assert history[-2]["role"] == "assistant" and "content" not in history[-2]  # content: null, as the SDK sends
    history[-2]["content"] = None
    final = client.chat.completions.create(model=served.model, messages=history, tools=tools, tool_choice="none",
                                           max_completion_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.choices[0].finish_reason == "length"


def test_named_tool_choice_and_parallel_calls(served, client):
    named = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           max_completion_tokens=40, temperature=1.0, seed=2)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    for seed in range(4):
        many = client.chat.completions.create(model=served.model, messages=MESSAGES, tools=[WEATHER, TIME],
                                              tool_choice="required", max_completion_tokens=200, temperature=1.0,
                                              seed=seed)
        choice = many.choices[0]
        if choice.finish_reason == "tool_calls":
            assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls) >= 1


def test_streamed_tool_calls_parse_with_the_sdk_stream_helper(served, client):
    kwargs = dict(model=served.model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False, max_completion_tokens=100, temperature=1.0, seed=5)
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    [call], [expected] = final.choices[0].message.tool_calls, whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (expected.function.name, expected.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    assert deltas and all(d.index == 0 for d in deltas)
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == expected.function.name
    pieces = [d.function.arguments for d in deltas if d.function.arguments]
    assert len(pieces) > 1 and "".join(pieces) == expected.function.arguments  # as generated, piece by piece


def test_the_public_grpc_api_takes_the_constraint_oneof(served):
    from pagedserve import Client, GenerationError

    with Client(f"127.0.0.1:{served.frontend.port}") as grpc_client:
        for seed in range(3):
            result = grpc_client.generate("x", json_schema=json.dumps(SCHEMA), temperature=1.0, seed=seed,
                                          max_tokens=80)
            jsonschema.validate(json.loads(result.text), SCHEMA)
        assert grpc_client.generate("x", choice=["on", "off"], seed=1, max_tokens=5).text in ("on", "off")
        with pytest.raises(GenerationError) as error:
            grpc_client.generate("x", regex="[unclosed", max_tokens=5)
        assert error.value.field == "params.regex"


def test_the_compile_limits_are_configurable_and_refuse_with_the_field(tiny_llama):
    import asyncio

    from services.core.errors import InvalidArgument
    from services.core.structured import Constraint, GrammarLimits
    from services.core.tokenizer import Tokenizer
    from services.frontend.grammar_check import GrammarCheck

    tokenizer = Tokenizer(tiny_llama)
    schema = Constraint.json_schema(SCHEMA, "response_format.json_schema.schema")
    slow = GrammarCheck(tokenizer, GrammarLimits(compile_timeout_s=1e-6))
    with pytest.raises(InvalidArgument, match=r"^response_format.json_schema.schema: the json did not compile within"):
        asyncio.run(slow.check(schema, tokenizer.vocab_size))
    small = GrammarCheck(tokenizer, GrammarLimits(max_bytes=16))
    with pytest.raises(InvalidArgument, match=r"^response_format.json_schema.schema: the constraint is \d+ bytes"):
        asyncio.run(small.check(schema, tokenizer.vocab_size))
    cache = GrammarCheck(tokenizer, GrammarLimits(max_entries=2))
    for pattern in ("a+", "b+", "c+", "a+"):
        asyncio.run(cache.check(Constraint("regex", pattern), tokenizer.vocab_size))
    assert len(cache._cache) == 2 and cache._cache.num_compiled == 4  # bounded: "a+" was evicted and rebuilt
