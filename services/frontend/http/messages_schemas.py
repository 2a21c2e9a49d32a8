"""The Messages API's response bodies and stream events as pydantic models, each declared once:
messages_api.py's MessageBuilder builds them (schemas.new) and respond() serialises them; /openapi.json
states the body, and test_openapi checks every response against it. Its errors are in Anthropic's shape:
{"type": "error", "error": {"type", "message"}}."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class TextContent(BaseModel):
    type: Literal["text"]
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageObject(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


Block = ThinkingContent | TextContent | ToolUseContent


class MessageStart(BaseModel):
    type: Literal["message_start"]
    message: MessageObject


class Ping(BaseModel):
    type: Literal["ping"]


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"]
    index: int
    content_block: Block


class TextDelta(BaseModel):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"]
    partial_json: str


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(BaseModel):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None


class MessageDelta(BaseModel):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: MessageUsage


class MessageStop(BaseModel):
    type: Literal["message_stop"]


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


_WHEN = {400: "A parameter is invalid; the message names it.", 401: "Missing or wrong API key (x-api-key).",
         404: "Unknown model.", 413: "The body is over the configured limit.",
         429: "The queue is full; retry after the Retry-After header's seconds.",
         503: "No worker is ready, or the server is shutting down."}


def errors(*statuses: int) -> dict:
    return {status: {"model": AnthropicError, "description": _WHEN[status]} for status in statuses}


MESSAGE_EVENTS = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "description": "With stream: true: message_start, ping, then per content block content_block_start, "
                   "content_block_delta (text_delta or input_json_delta) and content_block_stop, then "
                   "message_delta and message_stop; a failure after the first event is an error event."}}}


def create_responses() -> dict:
    return {200: {"model": MessageObject, "description": "The message, or (stream: true) server-sent events.",
                  "content": MESSAGE_EVENTS}, **errors(400, 401, 404, 413, 429, 503)}
