"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes a chat (instructions, then a stored previous response's conversation, then the
input items) and goes the chat completions way (openai_requests.conversation_request: the chat
template, tool plan, grammar). Its output is read by the tool-call reader as it is generated and
turned into output items and events by one builder (this API's Output, respond.py), streamed or not,
so a streamed response ends with exactly the non-streamed one. Stored responses live in a
ResponseStore (in memory, bounded).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from services.core.errors import InvalidArgument, check
from services.core.sampling_params import SamplingParams
from services.core.structured import Constraint
from services.frontend import reasoning, tool_calls
from services.frontend.core import FrontendCore
from services.frontend.http import responses_schemas as schemas
from services.frontend.http.openai_requests import Budget, ChatTemplate, conversation_request
from services.frontend.http.respond import respond
from services.frontend.http.responses_models import ResponseRequest
from services.frontend.http.schemas import BaseModelT, new
from services.frontend.http.streams import Events, build
from services.frontend.response_store import ResponseStore
from services.frontend.tool_stream import Piece, ToolCallStream
from services.frontend.types import ResponseNotFound, SampleEvent, Summary

TOOL_FIELDS = tool_calls.ToolFields(name="tools[{i}].name", parameters="tools[{i}].parameters",
                                    choice_name="tool_choice.name")  # a function tool is flat here
FINAL = ("response.completed", "response.incomplete")  # the events that carry the final response


def add_routes(app: FastAPI, core: FrontendCore, store: ResponseStore) -> None:
    @app.post("/v1/responses", response_model=None, responses=schemas.create_responses())
    async def create_response(body: ResponseRequest, request: Request) -> Response:
        response_id = request.state.request_id = f"resp_{uuid.uuid4().hex}"
        core.check_model(body.model or "")
        history = _history(store, body.previous_response_id)
        messages = history + _input_messages(body.input)
        plan = _tool_plan(body)
        generate_request = await conversation_request(
            core, _instructions(body.instructions) + messages, plan, response_id,
            lambda max_tokens: _sampling_params(body, max_tokens, plan.constraint()), body.max_output_tokens,
            body.model or "", body.priority, max_tokens_field="max_output_tokens", template=_template(body))

        async def keep(final: dict) -> None:
            if body.store:
                store.put(response_id, final, messages + [builder.assistant_message()])

        builder = ResponseBuilder(response_id, _echo(body, core.served_name(body.model or "")), plan.stream(), keep)
        return await respond(request, core, [generate_request], builder, body.stream)

    @app.get("/v1/responses/{response_id}", response_model=schemas.ResponseObject,
             responses=schemas.errors(401, 404))
    async def get_response(response_id: str) -> dict:
        """A stored response (until it is evicted or its TTL passes)."""
        return _stored(store, response_id).body

    @app.delete("/v1/responses/{response_id}", response_model=schemas.Deleted, responses=schemas.errors(401, 404))
    async def delete_response(response_id: str) -> dict:
        _stored(store, response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _stored(store: ResponseStore, response_id: str):
    entry = store.get(response_id)
    if entry is None:
        raise ResponseNotFound("response_id", f"no stored response with id {response_id!r} (it may have expired "
                                              "or been evicted)")
    return entry


def _history(store: ResponseStore, previous_response_id: str | None) -> list[dict]:
    if previous_response_id is None:
        return []
    entry = store.get(previous_response_id)
    check(entry is not None, "previous_response_id",
          f"no stored response with id {previous_response_id!r} (it may have expired or been evicted)")
    return list(entry.messages)


def _template(body: ResponseRequest) -> ChatTemplate:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning is not None and body.reasoning.effort == "none":
        kwargs.setdefault("enable_thinking", False)
    return ChatTemplate(kwargs=kwargs or None, budget=Budget(body.max_reasoning_tokens, "max_reasoning_tokens"))


def _instructions(instructions: str | None) -> list[dict]:
    return [{"role": "system", "content": instructions}] if instructions else []


def _input_messages(items: str | list) -> list[dict]:
    """The input items as chat messages; consecutive function_calls are one assistant message, and
    a reasoning item is the reasoning_content of the assistant message it comes before."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        last = messages[-1] if messages else None
        if item.type == "reasoning":
            thought = "".join(part.text for part in item.content or [])
            messages.append({"role": "assistant", "content": "", "reasoning_content": thought, "open": True})
        elif item.type == "message":
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            if item.role == "assistant" and last is not None and last.pop("open", False):
                last["content"] = text
            else:
                messages.append({"role": item.role, "content": text})
        elif item.type == "function_call":
            try:
                json.loads(item.arguments)
            except ValueError:
                raise InvalidArgument(f"input[{i}].arguments", "must be JSON text") from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    check(bool(messages), "input", "must not be empty")
    for message in messages:
        message.pop("open", None)
    return messages


def _tool_plan(body: ResponseRequest) -> tool_calls.ToolPlan:
    definitions = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                   for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    return tool_calls.plan(definitions, choice, body.parallel_tool_calls, TOOL_FIELDS)


def _sampling_params(body: ResponseRequest, max_tokens: int, tool_constraint: Constraint | None) -> SamplingParams:
    constraint = _format_constraint(body)
    check(constraint is None or tool_constraint is None, "tool_choice",
          "a required or named tool choice cannot be combined with text.format json_object or json_schema")
    kwargs = {name: value for name in ("temperature", "top_p", "seed") if (value := getattr(body, name)) is not None}
    return SamplingParams(**kwargs, max_tokens=max_tokens, stop=body.stop or (),
                          structured_outputs=constraint or tool_constraint)


def _format_constraint(body: ResponseRequest) -> Constraint | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object", "", "text.format")
    check(fmt.name is not None, "text.format.name", "is required with type json_schema")
    return Constraint.json_schema(fmt.schema_ if fmt.schema_ is not None else {}, "text.format.schema")


def _echo(body: ResponseRequest, model_id: str) -> dict:
    """The request's settings as the response object repeats them."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {"model": model_id, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(), "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                     **({"verbosity": body.text.verbosity} if body.text is not None and body.text.verbosity else {})},
            "store": body.store, "metadata": body.metadata or {}, "user": body.user, "truncation": "disabled"}


class ResponseBuilder:
    """One response's output items and events, from its sample's text as it arrives: the models
    responses_schemas.py declares. The items are kept as dicts while they grow (a delta appends to the
    open one in place); each event that shows an item or part shows it as it is then (`_item`, `_part`:
    new models, so a later delta never changes an event already built). `keep` is given the final
    response (completed or incomplete; never a failed one), to store it."""

    named = True  # its events are named by their type (respond.py)

    def __init__(self, response_id: str, echo: dict, reader: ToolCallStream,
                 keep: Callable[[dict], Awaitable[None]] | None = None):
        self.id, self.echo, self.reader, self.keep = response_id, echo, reader, keep
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being generated
        self.sequence_number = 0
        self.truncated = False
        self.num_reasoning_tokens = 0  # tokens generated while the model was thinking

    def event(self, model: type[BaseModelT], **fields) -> BaseModelT:
        self.sequence_number += 1
        return new(model, type=EVENT_TYPES[model], sequence_number=self.sequence_number - 1, **fields)

    def body(self, status: str, usage: schemas.ResponseUsage | None = None,
             error: schemas.ResponseError | None = None) -> schemas.ResponseObject:
        incomplete = new(schemas.IncompleteDetails, reason="max_output_tokens") if status == "incomplete" else None
        return new(schemas.ResponseObject, id=self.id, object="response", created_at=self.created_at, status=status,
                   error=error, incomplete_details=incomplete, **self.echo,
                   output=[_item(i) for i in self.output] if status != "in_progress" else [], usage=usage)

    def begin(self) -> list[BaseModel]:
        return [self.event(schemas.ResponseCreated, response=self.body("in_progress")),
                self.event(schemas.ResponseInProgress, response=self.body("in_progress"))]

    def feed(self, sample: SampleEvent) -> list[BaseModel]:
        self.num_reasoning_tokens += reasoning.num_reasoning_tokens(self.reader, sample.token_ids)
        events = self._pieces(self.reader.feed(sample.text))
        if sample.finish_reason is not None:
            self.truncated = sample.finish_reason == "length"
            events += self._pieces(self.reader.finish())
        return events

    def end(self, summary: Summary | None) -> list[BaseModel]:
        events = []
        if all(item["type"] == "reasoning" for item in self.output):  # an answer, if only an empty one
            events = self._close() + self._open_message()
        events += self._close()
        status = "incomplete" if self.truncated else "completed"
        final = schemas.ResponseIncomplete if self.truncated else schemas.ResponseCompleted
        return events + [self.event(final, response=self.body(status, _usage(summary, self.num_reasoning_tokens)))]

    async def collect(self, events: Events) -> schemas.ResponseObject:
        final = None
        async for batch in build(self, events):
            if batch and batch[-1].type in FINAL:
                final = batch[-1].response
        await self._keep(final)
        return final

    async def sse(self, events: Events) -> AsyncIterator[BaseModel]:
        async for batch in build(self, events):
            for event in batch:
                if event.type in FINAL:
                    await self._keep(event.response)
                yield event

    def refusal(self, error: Exception) -> list[BaseModel]:
        failure = new(schemas.ResponseError, code="server_error", message=str(error))
        return [self.event(schemas.ResponseFailed, response=self.body("failed", error=failure))]

    async def _keep(self, final: schemas.ResponseObject) -> None:
        if self.keep is not None:
            await self.keep(final.model_dump(exclude_unset=True))  # what GET /v1/responses/{id} returns

    def assistant_message(self) -> dict:
        """The output as the chat message a continuation (previous_response_id) sees."""
        text = "".join(c["text"] for item in self.output if item["type"] == "message" for c in item["content"])
        message = {"role": "assistant", "content": text}
        thought = "".join(c["text"] for item in self.output if item["type"] == "reasoning" for c in item["content"])
        if thought:
            message["reasoning_content"] = thought
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        return {**message, "tool_calls": calls} if calls else message

    def _pieces(self, pieces: list[Piece]) -> list[BaseModel]:
        events = []
        for piece in pieces:
            if piece.kind == "reasoning":
                if self.open is None or self.open["type"] != "reasoning":
                    events += self._close() + self._open_reasoning()
                self.open["content"][0]["text"] += piece.text
                events.append(self.event(schemas.ReasoningTextDelta, item_id=self.open["id"],
                                         output_index=len(self.output) - 1, content_index=0, delta=piece.text))
            elif piece.kind == "content":
                if self.open is None or self.open["type"] != "message":
                    events += self._close() + self._open_message()
                self.open["content"][0]["text"] += piece.text
                events.append(self.event(schemas.OutputTextDelta, item_id=self.open["id"],
                                         output_index=len(self.output) - 1, content_index=0, delta=piece.text,
                                         logprobs=[]))
            elif piece.kind == "call":
                events += self._close()
                call = self.reader.calls[piece.index]
                events += self._add({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id,
                                     "name": call.name, "arguments": "", "status": "in_progress"})
            else:
                self.open["arguments"] += piece.text
                events.append(self.event(schemas.FunctionCallArgumentsDelta, item_id=self.open["id"],
                                         output_index=len(self.output) - 1, delta=piece.text))
        return events

    def _add(self, item: dict, part: dict | None = None) -> list[BaseModel]:
        """Open an item (shown as added: no content parts yet), then its one content part, if it has one."""
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        events = [self.event(schemas.OutputItemAdded, output_index=index, item=_item(item))]
        if part is None:
            return events
        item["content"].append(part)
        return events + [self.event(schemas.ContentPartAdded, item_id=item["id"], output_index=index,
                                    content_index=0, part=_part(part))]

    def _open_message(self) -> list[BaseModel]:
        return self._add({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                          "role": "assistant", "content": []},
                         {"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _open_reasoning(self) -> list[BaseModel]:
        return self._add({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [],
                          "status": "in_progress"}, {"type": "reasoning_text", "text": ""})

    def _close(self) -> list[BaseModel]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = len(self.output) - 1, []
        item["status"] = "incomplete" if self.truncated else "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event(schemas.OutputTextDone, item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]),
                       self.event(schemas.ContentPartDone, item_id=item["id"], output_index=index,
                                  content_index=0, part=_part(part))]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [self.event(schemas.ReasoningTextDone, item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"]),
                       self.event(schemas.ContentPartDone, item_id=item["id"], output_index=index,
                                  content_index=0, part=_part(part))]
        else:
            events.append(self.event(schemas.FunctionCallArgumentsDone, item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        return events + [self.event(schemas.OutputItemDone, output_index=index, item=_item(item))]


EVENT_TYPES = {model: name for name, model in schemas.EVENTS.items()}
PARTS = {"output_text": schemas.OutputText, "reasoning_text": schemas.ReasoningText}


def _part(part: dict) -> schemas.ContentPart:
    """A content part as it is now (its lists are never changed in place, so shared)."""
    return new(PARTS[part["type"]], **part)


def _item(item: dict) -> schemas.OutputItem:
    """An output item as it is now: a delta appended later changes the dict, never this model."""
    if item["type"] == "function_call":
        return new(schemas.FunctionCall, **item)
    model = schemas.OutputMessage if item["type"] == "message" else schemas.ReasoningItem
    return new(model, **{**item, "content": [_part(p) for p in item["content"]]})


def _usage(summary: Summary | None, num_reasoning_tokens: int = 0) -> schemas.ResponseUsage:
    prompt = summary.num_prompt_tokens if summary else 0
    completion = summary.num_completion_tokens if summary else 0
    cached = new(schemas.InputTokensDetails, cached_tokens=summary.num_cached_tokens if summary else 0)
    return new(schemas.ResponseUsage, input_tokens=prompt, input_tokens_details=cached, output_tokens=completion,
               output_tokens_details=new(schemas.OutputTokensDetails, reasoning_tokens=num_reasoning_tokens),
               total_tokens=prompt + completion)
