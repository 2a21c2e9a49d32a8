"""The chat and completions renderers, and the Responses and Messages builders, build the models
services/frontend/http/*schemas.py declare, and respond() serialises them: what is sent is the declared
shape, field for field (a body read back through its model and dumped again is the body sent: an
undeclared field would be dropped), streamed or not.
No server: the renderers and builders driven by hand-made events, as respond() drives them."""
from __future__ import annotations

import asyncio
import json

import pytest

from services.frontend import tool_calls
from services.frontend.http import respond, schemas
from services.frontend.http.responses import ChatRenderer, CompletionRenderer
from services.frontend.http.tool_responses import ToolChatRenderer
from services.frontend.types import GenerateEvent, SampleEvent, Summary

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = ['Let me check.\n<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']


def _renderer(kind: str, include_usage: bool = False):
    shared = dict(id="x-1", model="m", fingerprint="f", tokenizer=None, n=1, include_usage=include_usage)
    if kind == "tools":
        return ToolChatRenderer(**shared, plan=tool_calls.plan([WEATHER], "auto", None))
    return ChatRenderer(**shared) if kind == "chat" else CompletionRenderer(**shared)


def _events(pieces: list[str]):
    async def events():
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield 0, GenerateEvent(request_id="r", samples=[SampleEvent(
                index=0, text=text, token_ids=[i], finish_reason="stop" if last else None)],
                summary=Summary(finish_reasons=["stop"], num_prompt_tokens=4, num_completion_tokens=len(pieces),
                                num_cached_tokens=0, seed=0) if last else None)
    return events()


def _sent(renderer, pieces: list[str]) -> list[dict | str]:
    async def run():
        return [chunk async for chunk in respond.sse(renderer, _events(pieces))]
    return [json.loads(e[len("data: "):]) if e != "data: [DONE]\n\n" else "[DONE]" for e in asyncio.run(run())]


def _declared(model: type, body: dict) -> bool:
    """body is model's shape: read through the model and dumped again (the fields it was given), it is body."""
    return model.model_validate(body).model_dump(exclude_unset=True) == body


@pytest.mark.parametrize("kind, chunk, whole", [("chat", schemas.ChatCompletionChunk, schemas.ChatCompletion),
                                                ("tools", schemas.ChatCompletionChunk, schemas.ChatCompletion),
                                                ("completion", schemas.CompletionChunk, schemas.Completion)])
def test_streamed_and_whole_bodies_are_the_declared_models(kind, chunk, whole):
    sent = _sent(_renderer(kind, include_usage=True), CALL)
    assert sent[-1] == "[DONE]" and sent[-2]["usage"]["total_tokens"] == 6
    assert all(_declared(chunk, body) for body in sent[:-1])
    body = json.loads(respond.encode(asyncio.run(_renderer(kind).collect(_events(CALL)))))
    assert _declared(whole, body)
    if kind == "tools":  # the call, streamed in pieces and whole
        [call] = body["choices"][0]["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        streamed = [c for s in sent[:-1] for choice in s["choices"] for c in choice["delta"].get("tool_calls", [])]
        assert "".join(c["function"]["arguments"] for c in streamed) == call["function"]["arguments"]


def test_a_chunk_without_include_usage_has_no_usage_field():
    sent = _sent(_renderer("chat"), ["a", "b"])
    assert sent[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in body for body in sent[:-1])


def test_new_is_model_construct():
    """schemas.new, the renderers' cheap model_construct: the same model, the same fields set, the same JSON."""
    for model, fields in [(schemas.ChatDelta, {"content": "hi"}), (schemas.ChatDelta, {}),
                          (schemas.Usage, {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                                           "prompt_tokens_details": schemas.PromptTokensDetails(cached_tokens=0)})]:
        made, constructed = schemas.new(model, **fields), model.model_construct(**fields)
        assert made == constructed and made.model_fields_set == constructed.model_fields_set
        assert made.model_dump_json(exclude_unset=True) == constructed.model_dump_json(exclude_unset=True)


def test_the_messages_events_and_message_are_the_declared_models():
    """Anthropic's stream (a text block, then a tool_use block in pieces) and the whole message."""
    from services.frontend.http import messages_api, messages_schemas as ms

    models = {"message_start": ms.MessageStart, "ping": ms.Ping, "content_block_start": ms.ContentBlockStart,
              "content_block_delta": ms.ContentBlockDelta, "content_block_stop": ms.ContentBlockStop,
              "message_delta": ms.MessageDelta, "message_stop": ms.MessageStop}

    def builder():
        return messages_api.MessageBuilder("msg_1", "m", tool_calls.plan([WEATHER], "auto", None).stream(), 4)

    async def run():
        return [chunk async for chunk in respond.sse(builder(), _events(CALL))]

    sent = [e.split("\n") for e in asyncio.run(run())]
    assert all(name[len("event: "):] == json.loads(data[len("data: "):])["type"] for name, data, *_ in sent)
    events = [json.loads(data[len("data: "):]) for _, data, *_ in sent]
    assert all(_declared(models[e["type"]], e) for e in events)
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["text", "tool_use"]
    message = json.loads(respond.encode(asyncio.run(builder().collect(_events(CALL)))))
    assert _declared(ms.MessageObject, message) and message["stop_reason"] == "tool_use"
    assert message["content"][1]["input"] == {"city": "Oslo"}


def _responses_builder(keep=None):
    from services.frontend.http import responses_api
    from services.frontend.http.responses_models import ResponseRequest
    from services.frontend.reasoning import PARSERS, Thinking

    request = ResponseRequest.model_validate({"model": "m", "input": "Weather in Oslo?", "tool_choice": "auto",
                                              "tools": [{"type": "function", "name": "get_weather",
                                                         "parameters": {"type": "object"}}]})
    plan = responses_api._tool_plan(request)
    plan.thinking = Thinking(PARSERS["qwen3"], False)
    return responses_api.ResponseBuilder("resp_1", responses_api._echo(request, "m"), plan.stream(), keep)


THOUGHT_CALL = ["<think>Oslo, ", "then.</think>" + CALL[0], CALL[1]]  # reasoning, a message, a call in pieces


def _named_events(builder, events) -> list[dict]:
    async def run():
        return [chunk async for chunk in respond.sse(builder, events)]

    sent = [e.split("\n") for e in asyncio.run(run())]
    assert all(name[len("event: "):] == json.loads(data[len("data: "):])["type"] for name, data, *_ in sent)
    return [json.loads(data[len("data: "):]) for _, data, *_ in sent]


def _as_client_reads(client_type, body: dict):
    """body as the openai client reads a response or an event (its construct_type: unvalidated, each
    object its declared type by its `type`)."""
    from openai._models import construct_type

    return construct_type(type_=client_type, value=body)


def test_the_responses_events_and_response_are_the_declared_models():
    """OpenAI's Responses stream (reasoning, a message, a function call in pieces) and the whole response:
    every event is its declared model, and the official client reads each one as its own type."""
    from openai.types.responses import Response, ResponseStreamEvent

    from services.frontend.http import responses_schemas as rs

    kept = []

    async def keep(final):
        kept.append(final)

    events = _named_events(_responses_builder(keep), _events(THOUGHT_CALL))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(_declared(rs.EVENTS[e["type"]], e) for e in events)
    read = [_as_client_reads(ResponseStreamEvent, e) for e in events]
    assert [type(e).__name__ for e in read[:4]] == ["ResponseCreatedEvent", "ResponseInProgressEvent",
                                                    "ResponseOutputItemAddedEvent", "ResponseContentPartAddedEvent"]
    assert all(e.type == sent["type"] and e.sequence_number == sent["sequence_number"] for e, sent in zip(read, events))
    done = {e["item"]["type"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert done["reasoning"]["content"][0]["text"] == "Oslo, then."
    assert done["message"]["content"][0]["text"] == "Let me check.\n"
    assert done["function_call"]["arguments"] == '{"city": "Oslo"}'
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["output"] == list(done.values())
    assert final["response"]["usage"]["total_tokens"] == 7 and kept == [final["response"]]
    body = json.loads(respond.encode(asyncio.run(_responses_builder().collect(_events(THOUGHT_CALL)))))
    assert _declared(rs.ResponseObject, body) and _as_client_reads(Response, body).output[2].name == "get_weather"
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]


def test_a_responses_item_is_added_empty_and_the_client_builds_it_from_the_deltas():
    """output_item.added shows the item as opened (no content part yet: content_part.added brings it), so
    the official client's stream, which appends each part it is told of, shows each text once. The added
    item once shared its content list with the growing item, and the client saw the text twice."""
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    events = _named_events(_responses_builder(), _events(["Hello", " there"]))
    [added] = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added["content"] == [] and added["status"] == "in_progress"
    state, snapshots = ResponseStreamState(input_tools=[], text_format=omit), []
    for event in events:
        for seen in state.handle_event(_as_client_reads(ResponseStreamEvent, event)):
            if seen.type == "response.output_text.delta":
                snapshots.append(seen.snapshot)
    assert snapshots == ["Hello", "Hello there"]
