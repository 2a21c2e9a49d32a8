"""The Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

The request becomes a chat (system, then the messages; tool_use blocks are an assistant's tool
calls, tool_result blocks tool messages, thinking blocks its reasoning_content) and goes the chat completions way
(openai_requests.conversation_request: the chat template, tool plan, grammar). Tool choice auto,
any (a call is required), tool (that one) and none map onto the same plan. The output is read by
the reasoning and tool-call readers as it is generated and turned into content blocks (thinking,
text, tool_use) and events by one builder, streamed or not. Errors are in Anthropic's shape (errors.py).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from services.core.errors import check
from services.core.sampling_params import SamplingParams
from services.core.structured import Constraint
from services.frontend import tool_calls
from services.frontend.core import FrontendCore
from services.frontend.http import messages_schemas as schemas
from services.frontend.http.errors import anthropic_error_body
from services.frontend.http.messages_models import CountTokensRequest, MessagesRequest
from services.frontend.http.openai_requests import Budget, ChatTemplate, conversation_request, conversation_tokens
from services.frontend.http.respond import respond
from services.frontend.http.schemas import new
from services.frontend.http.streams import Events, build
from services.frontend.reasoning import ReasoningReader
from services.frontend.tool_stream import Piece, ToolCallStream
from services.frontend.types import SampleEvent, Summary

TOOL_FIELDS = tool_calls.ToolFields(name="tools[{i}].name", parameters="tools[{i}].input_schema",
                                    choice_name="tool_choice.name")


def add_routes(app: FastAPI, core: FrontendCore) -> None:
    @app.post("/v1/messages", response_model=None, responses=schemas.create_responses())
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        message_id = request.state.request_id = f"msg_{uuid.uuid4().hex}"
        core.check_model(body.model)
        plan = _tool_plan(body)
        generate_request = await conversation_request(
            core, chat_messages(body), plan, message_id, lambda max_tokens: _sampling_params(body, max_tokens, plan),
            body.max_tokens, body.model, body.priority, template=_template(body))
        builder = MessageBuilder(message_id, body.model, plan.stream(), len(generate_request.prompt.token_ids))
        return await respond(request, core, [generate_request], builder, body.stream)

    @app.post("/v1/messages/count_tokens", response_model=schemas.TokenCount,
              responses=schemas.errors(400, 401, 404, 413, 503))
    async def count_tokens(body: CountTokensRequest) -> dict:
        """The prompt's tokens, as /v1/messages would render the same system, messages and tools."""
        core.check_model(body.model)
        plan = _tool_plan(body)
        return {"input_tokens": len(await conversation_tokens(core, chat_messages(body), plan, _template(body)))}


def _template(body: CountTokensRequest) -> ChatTemplate:
    """thinking: enabled asks the template to think (over a server default) within a budget,
    disabled turns the template's thinking off."""
    thinking = body.thinking
    if thinking is None or thinking.type == "adaptive":
        return ChatTemplate()
    if thinking.type == "disabled":
        return ChatTemplate(kwargs={"enable_thinking": False})
    budget = Budget(thinking.budget_tokens, "thinking.budget_tokens")
    return ChatTemplate(kwargs={"enable_thinking": True}, budget=budget)


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """System and messages as chat messages (tool calls and results as OpenAI's chat has them)."""
    messages = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for message in body.messages:  # (the models keep tool_use to assistants, tool_result to users)
        blocks = message.content if isinstance(message.content, list) else None
        if blocks is None:
            messages.append({"role": message.role, "content": message.content})
            continue
        text = "".join(b.text for b in blocks if b.type == "text")
        thought = "".join(b.thinking for b in blocks if b.type == "thinking")
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if b.type == "tool_use"]
        results = [b for b in blocks if b.type == "tool_result"]
        for result in results:
            content = result.content if isinstance(result.content, str) or result.content is None \
                else "".join(b.text for b in result.content)
            messages.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": content or ""})
        if calls:
            messages.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif text or thought or not results:
            messages.append({"role": message.role, "content": text})
        if thought:
            messages[-1]["reasoning_content"] = thought
    return messages


def _tool_plan(body: CountTokensRequest) -> tool_calls.ToolPlan:
    definitions = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                     **({"description": t.description} if t.description else {})}}
                   for t in body.tools or []]
    choice, parallel = body.tool_choice, None
    if choice is not None:
        parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
        check(choice.type != "tool" or choice.name is not None, "tool_choice.name", "is required with type tool")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
    return tool_calls.plan(definitions, choice, parallel, TOOL_FIELDS)


def _sampling_params(body: MessagesRequest, max_tokens: int, plan: tool_calls.ToolPlan) -> SamplingParams:
    kwargs = {name: value for name in ("temperature", "top_p", "top_k", "seed")
              if (value := getattr(body, name)) is not None}
    fmt = body.output_config.format if body.output_config is not None else None
    constraint = Constraint.json_schema(fmt.schema_, "output_config.format.schema") if fmt is not None else None
    check(constraint is None or plan.constraint() is None, "tool_choice",
          "a tool choice of any or tool cannot be combined with output_config.format")
    return SamplingParams(**kwargs, max_tokens=max_tokens, stop=body.stop_sequences or (),
                          structured_outputs=constraint or plan.constraint())


class MessageBuilder:
    """One message's content blocks and stream events, from its sample's text as it arrives: the models
    messages_schemas.py declares (the blocks kept as dicts while they grow)."""

    named = True  # its events are named by their type (respond.py)

    def __init__(self, message_id: str, model: str, reader: ToolCallStream | ReasoningReader,
                 num_prompt_tokens: int):
        self.id, self.model, self.reader = message_id, model, reader
        self.num_prompt_tokens = num_prompt_tokens
        self.content: list[dict] = []
        self.open = False
        self.stop_reason, self.stop_sequence = None, None

    def message(self, usage: schemas.MessageUsage, content: list | None = None) -> schemas.MessageObject:
        return new(schemas.MessageObject, id=self.id, type="message", role="assistant", model=self.model,
                   content=[_block(b) for b in self.content] if content is None else content,
                   stop_reason=self.stop_reason, stop_sequence=self.stop_sequence, usage=usage)

    def begin(self) -> list[BaseModel]:
        start = new(schemas.MessageStart, type="message_start", message=self.message(self._usage(0), content=[]))
        return [start, new(schemas.Ping, type="ping")]

    def feed(self, sample: SampleEvent) -> list[BaseModel]:
        events = self._pieces(self.reader.feed(sample.text))
        if sample.finish_reason is not None:
            events += self._pieces(self.reader.finish())
            self.stop_reason = "end_turn"
            if sample.finish_reason == "length":
                self.stop_reason = "max_tokens"
            elif self.reader.calls:
                self.stop_reason = "tool_use"
            elif isinstance(sample.stop_reason, str):
                self.stop_reason, self.stop_sequence = "stop_sequence", sample.stop_reason
        return events

    def end(self, summary: Summary | None) -> list[BaseModel]:
        usage = self._usage(summary.num_completion_tokens if summary else 0, summary)
        self.final = self.message(usage)
        stop = new(schemas.StopDelta, stop_reason=self.stop_reason, stop_sequence=self.stop_sequence)
        return self._close() + [new(schemas.MessageDelta, type="message_delta", delta=stop, usage=usage),
                                new(schemas.MessageStop, type="message_stop")]

    async def collect(self, events: Events) -> schemas.MessageObject:
        async for _ in build(self, events):
            pass
        return self.final

    async def sse(self, events: Events) -> AsyncIterator[BaseModel]:
        async for batch in build(self, events):
            for event in batch:
                yield event

    def refusal(self, error: Exception) -> list[BaseModel]:  # an event named error
        return [schemas.AnthropicError.model_validate_json(anthropic_error_body(503, str(error)))]

    def _usage(self, output_tokens: int, summary: Summary | None = None) -> schemas.MessageUsage:
        return new(schemas.MessageUsage, input_tokens=self.num_prompt_tokens, output_tokens=output_tokens,
                   cache_read_input_tokens=summary.num_cached_tokens if summary else 0, cache_creation_input_tokens=0)

    def _pieces(self, pieces: list[Piece]) -> list[BaseModel]:
        events = []
        for piece in pieces:
            if piece.kind == "reasoning" and not (self.open and self.content[-1]["type"] == "thinking"):
                events += self._close() + self._start({"type": "thinking", "thinking": "", "signature": ""})
            elif piece.kind == "content" and not (self.open and self.content[-1]["type"] == "text"):
                events += self._close() + self._start({"type": "text", "text": ""})
            elif piece.kind == "call":
                call = self.reader.calls[piece.index]
                events += self._close() + self._start({"type": "tool_use", "id": call.id, "name": call.name,
                                                       "input": {}, "arguments": ""})
                continue
            block = self.content[-1]
            if piece.kind == "reasoning":
                block["thinking"] += piece.text
                delta = new(schemas.ThinkingDelta, type="thinking_delta", thinking=piece.text)
            elif piece.kind == "content":
                block["text"] += piece.text
                delta = new(schemas.TextDelta, type="text_delta", text=piece.text)
            else:
                block["arguments"] += piece.text
                delta = new(schemas.InputJsonDelta, type="input_json_delta", partial_json=piece.text)
            events.append(new(schemas.ContentBlockDelta, type="content_block_delta", index=len(self.content) - 1,
                              delta=delta))
        return events

    def _start(self, block: dict) -> list[BaseModel]:
        self.content.append(block)
        self.open = True
        shown = new(BLOCKS[block["type"]], **{k: v for k, v in block.items() if k != "arguments"})
        return [new(schemas.ContentBlockStart, type="content_block_start", index=len(self.content) - 1,
                    content_block=shown)]

    def _close(self) -> list[BaseModel]:
        if not self.open:
            return []
        self.open = False
        return [new(schemas.ContentBlockStop, type="content_block_stop", index=len(self.content) - 1)]


BLOCKS = {"text": schemas.TextContent, "thinking": schemas.ThinkingContent, "tool_use": schemas.ToolUseContent}


def _block(block: dict) -> schemas.Block:
    if block["type"] in ("text", "thinking"):
        return new(BLOCKS[block["type"]], **block)
    try:
        arguments = json.loads(block["arguments"]) if block["arguments"] else {}
    except ValueError:  # cut short by max_tokens
        arguments = {}
    return new(schemas.ToolUseContent, type="tool_use", id=block["id"], name=block["name"],
               input=arguments if isinstance(arguments, dict) else {})
