"""The Responses and Messages API checks the in-process cluster (tests/frontend/test_agent_apis.py)
and `pagedserve up` (tests/e2e/test_agent_apis_up.py) both run, driven by the official `openai` and
`anthropic` clients. Each takes the client, the model and the tools, asserts what a user of the API
sees, and returns what the caller checks further."""
from __future__ import annotations

import json

import jsonschema


def responses_tool_loop(client, model: str, system: str, question: str, tools: list[dict], output: str,
                        **sampling) -> tuple:
    """A required tool call (valid arguments, streamed in pieces that add up to it), its result sent back
    through previous_response_id, and the same conversation given whole without the store: the same
    prompt, the same answer. `sampling`: the answering turn's (max_output_tokens, temperature, extra_body).
    Returns (the first response, its call, the answering response, the same without the store)."""
    ask = dict(model=model, input=question, instructions=system, tools=tools, tool_choice="required",
               parallel_tool_calls=False, max_output_tokens=100, temperature=1.0, extra_body={"seed": 5})
    first = client.responses.create(**ask)
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), next(t["parameters"] for t in tools if t["name"] == call.name))
    with client.responses.stream(**ask) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert len(pieces) > 1 and "".join(pieces) == streamed.output[0].arguments == call.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": output}
    second = client.responses.create(model=model, previous_response_id=first.id, input=[result], tools=tools,
                                     tool_choice="none", **sampling)
    assert second.previous_response_id == first.id and second.output[0].type == "message" and second.output_text
    # the whole conversation again without the store (instructions are not carried over by previous_response_id)
    again = client.responses.create(model=model, input=[{"role": "user", "content": question}, call, result],
                                    tools=tools, tool_choice="none", store=False, **sampling)
    assert (again.usage.input_tokens, again.output_text) == (second.usage.input_tokens, second.output_text)
    return first, call, second, again


def responses_json_schema_is_valid(client, model: str, question: str, schema: dict, seeds) -> None:
    """A json_schema text format at temperature 1: every seed's output completes and is valid."""
    fmt = {"type": "json_schema", "name": "forecast", "schema": schema, "strict": True}
    for seed in seeds:
        result = client.responses.create(model=model, input=question, text={"format": fmt}, max_output_tokens=80,
                                         temperature=1.0, store=False, extra_body={"seed": seed})
        assert result.status == "completed", result
        jsonschema.validate(json.loads(result.output_text), schema)


def messages_create_and_stream_agree(claude, model: str, system: str, question: str, max_tokens: int):
    """A seeded message cut by max_tokens: created whole, streamed by the SDK's helper and as raw events,
    the same text and usage, the events in Anthropic's order. Returns (the whole message, its kwargs)."""
    kwargs = dict(model=model, system=system, messages=[{"role": "user", "content": question}],
                  max_tokens=max_tokens, extra_body={"seed": 3, "temperature": 1.0})  # (not in the SDK's signature)
    whole = claude.messages.create(**kwargs)
    assert (whole.stop_reason, whole.usage.output_tokens, whole.content[0].type) == ("max_tokens", max_tokens, "text")
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == \
        ("max_tokens", whole.usage.input_tokens, max_tokens)
    events = [e.type for e in claude.messages.create(**kwargs, stream=True)]  # (the SDK drops the ping)
    assert events[:2] == ["message_start", "content_block_start"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    return whole, kwargs


def messages_tool_loop(claude, model: str, system: str, question: str, tools: list[dict], tool_result: str,
                       assistant_content=lambda content: content):
    """A tool_use forced by tool_choice any (valid input, streamed as input_json deltas that add up to
    it), its tool_result sent back with the SDK's blocks as the assistant turn (`assistant_content`
    turns them into what the caller sends), a text answer, and count_tokens counting that prompt as
    the answer's usage does. Returns (the tool_use message, its kwargs)."""
    kwargs = dict(model=model, system=system, messages=[{"role": "user", "content": question}], tools=tools,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=100,
                  extra_body={"seed": 5, "temperature": 1.0})
    first = claude.messages.create(**kwargs)
    [use] = first.content
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.id
    jsonschema.validate(use.input, next(t["input_schema"] for t in tools if t["name"] == use.name))
    with claude.messages.stream(**kwargs) as stream:
        pieces = [e.delta.partial_json for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        streamed = stream.get_final_message()
    assert len(pieces) > 1 and json.loads("".join(pieces)) == streamed.content[0].input == use.input
    history = kwargs["messages"] + [{"role": "assistant", "content": assistant_content(first.content)},
                                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                  "content": tool_result}]}]
    final = claude.messages.create(**{**kwargs, "messages": history, "tool_choice": {"type": "none"}, "max_tokens": 6})
    assert final.content[0].type == "text" and final.stop_reason in ("max_tokens", "end_turn")
    counted = claude.messages.count_tokens(model=model, system=system, messages=history, tools=tools,
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == final.usage.input_tokens
    return first, kwargs
