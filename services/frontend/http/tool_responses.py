"""Chat responses of a request with tools, or of a reasoning model: `message.tool_calls` and
finish_reason "tool_calls"; `message.reasoning_content` (and `reasoning`, vLLM's newer name) apart
from `content`, streamed as `delta.reasoning_content` (and `delta.reasoning`).

Non-streamed, the whole output is read (ToolPlan.parse). Streamed, each sample's text goes through
the same reader as it arrives (services/frontend/tool_stream.py): content is sent as soon as it is
known not to be a call, a call's first delta carries `index`, `id`, `type` and `function.name`
(arguments ""), and its arguments follow piece by piece in `function.arguments`, as OpenAI streams
them; joined, they are the non-streamed call's arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.frontend.http import schemas
from services.frontend.http.schemas import new
from services.frontend.http.responses import ChatRenderer, Choice
from services.frontend import reasoning
from services.frontend.reasoning import ReasoningReader
from services.frontend.tool_stream import Piece, ToolCallStream
from services.frontend.tool_calls import ToolCall, ToolPlan
from services.frontend.types import SampleEvent


@dataclass
class ToolChatRenderer(ChatRenderer):
    plan: ToolPlan = None
    _readers: dict[int, ToolCallStream | ReasoningReader] = field(default_factory=dict)  # choice index -> its reader

    def choice(self, index: int, choice: Choice, logprobs: bool) -> schemas.ChatChoice:
        body = super().choice(index, choice, logprobs)
        thought, content, calls = self.plan.read(choice.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tool_call(c) for c in calls]
            body.finish_reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        if self.plan.thinking is not None:
            message.update(reasoning_content=thought, reasoning=thought)
        body.message = new(schemas.AssistantMessage, **message)
        return body

    def observe(self, index: int, sample: SampleEvent) -> None:
        self._feed(index, sample)  # only to count the reasoning tokens: the whole text is read in choice()

    def chunk_choice(self, index: int, sample: SampleEvent, offset: int) -> schemas.ChatChunkChoice | None:
        reader, pieces = self._feed(index, sample)
        chunk = super().chunk_choice(index, sample, offset)
        if sample.finish_reason is not None:
            pieces += reader.finish()
            if reader.calls and sample.finish_reason == "stop":
                chunk.finish_reason = "tool_calls"
        chunk.delta = openai_delta(pieces, reader)
        return chunk if chunk.delta.model_fields_set or chunk.finish_reason or chunk.logprobs else None

    def _feed(self, index: int, sample: SampleEvent) -> tuple[ToolCallStream | ReasoningReader, list[Piece]]:
        """The choice's reader, fed the sample's text, and the pieces it gave; the thinking's tokens counted."""
        reader = self._readers.setdefault(index, self.plan.stream())
        self.num_reasoning_tokens += reasoning.num_reasoning_tokens(reader, sample.token_ids)
        return reader, reader.feed(sample.text)


def tool_call(call: ToolCall) -> schemas.ToolCall:
    function = new(schemas.ToolCallFunction, name=call.name, arguments=call.arguments)
    return new(schemas.ToolCall, id=call.id, type="function", function=function)


def openai_delta(pieces: list[Piece], reader: ToolCallStream | ReasoningReader) -> schemas.ChatDelta:
    """A chat chunk's delta from the reader's pieces: reasoning, content, then tool_calls entries."""
    delta: dict = {}
    entries: dict[int, dict] = {}
    for piece in pieces:
        if piece.kind == "reasoning":
            delta["reasoning_content"] = delta.get("reasoning_content", "") + piece.text
            delta["reasoning"] = delta["reasoning_content"]
        elif piece.kind == "content":
            delta["content"] = delta.get("content", "") + piece.text
        elif piece.kind == "call":
            call = reader.calls[piece.index]
            entries[piece.index] = {"index": piece.index, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}
        else:
            entry = entries.setdefault(piece.index, {"index": piece.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += piece.text
    if entries:
        delta["tool_calls"] = [
            new(schemas.ToolCallDelta, **{**entry, "function": new(schemas.ToolCallFunctionDelta, **entry["function"])})
            for entry in entries.values()]
    return new(schemas.ChatDelta, **delta)
