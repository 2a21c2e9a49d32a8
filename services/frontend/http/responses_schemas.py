"""The Responses API's response bodies as pydantic models, for /openapi.json only (responses_api.py
builds them as dicts; test_openapi checks every response against these)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from services.frontend.http.schemas import GENERATE_ERRORS, errors  # noqa: F401 - the routes' error statuses


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's thinking (--reasoning-parser), before the answer."""

    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None
    incomplete_details: dict[str, str] | None
    model: str
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any] | None
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    store: bool
    metadata: dict[str, str]
    user: str | None
    truncation: str
    output: list[ReasoningItem | OutputMessage | FunctionCall]
    usage: ResponseUsage | None


class Deleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


RESPONSE_EVENTS = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "description": "With stream: true, events named by their type (response.created, response.in_progress, "
                   "response.output_item.added, response.content_part.added, response.reasoning_text.delta, "
                   "response.reasoning_text.done, response.output_text.delta, "
                   "response.output_text.done, response.content_part.done, response.function_call_arguments.delta, "
                   "response.function_call_arguments.done, response.output_item.done, then response.completed, "
                   "response.incomplete or response.failed), each's data its JSON."}}}


def create_responses() -> dict:
    return {200: {"model": ResponseObject, "description": "The response, or (stream: true) server-sent events.",
                  "content": RESPONSE_EVENTS}, **GENERATE_ERRORS}
