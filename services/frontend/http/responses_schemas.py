"""The Responses API's response object, output items, content parts and stream events as pydantic
models, each declared once: responses_api.py's ResponseBuilder builds them (schemas.new) and respond()
serialises them (their set fields, in the order declared here, which is the order sent); /openapi.json
states the body, and test_openapi checks every response against it."""
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


OutputItem = ReasoningItem | OutputMessage | FunctionCall
ContentPart = OutputText | ReasoningText


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


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
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
    output: list[OutputItem]
    usage: ResponseUsage | None


# The stream events, in the order a response sends them; each has its sequence_number (0, 1, ...).

class ResponseCreated(BaseModel):
    type: Literal["response.created"]
    sequence_number: int
    response: ResponseObject


class ResponseInProgress(BaseModel):
    type: Literal["response.in_progress"]
    sequence_number: int
    response: ResponseObject


class OutputItemAdded(BaseModel):
    """An item as it is opened: in progress, its text and arguments empty, no content parts yet."""

    type: Literal["response.output_item.added"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartAdded(BaseModel):
    type: Literal["response.content_part.added"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class ReasoningTextDelta(BaseModel):
    type: Literal["response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(BaseModel):
    type: Literal["response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class OutputTextDelta(BaseModel):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class OutputTextDone(BaseModel):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class FunctionCallArgumentsDelta(BaseModel):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(BaseModel):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ContentPartDone(BaseModel):
    """A content part whole."""

    type: Literal["response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class OutputItemDone(BaseModel):
    """An item whole: its text or arguments all there, its status completed (incomplete when cut short)."""

    type: Literal["response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ResponseCompleted(BaseModel):
    type: Literal["response.completed"]
    sequence_number: int
    response: ResponseObject


class ResponseIncomplete(BaseModel):
    type: Literal["response.incomplete"]
    sequence_number: int
    response: ResponseObject


class ResponseFailed(BaseModel):
    """A refusal after the stream began (the scheduler went away): the response failed, its error."""

    type: Literal["response.failed"]
    sequence_number: int
    response: ResponseObject


EVENTS = {model.model_fields["type"].annotation.__args__[0]: model for model in (
    ResponseCreated, ResponseInProgress, OutputItemAdded, ContentPartAdded, ReasoningTextDelta, ReasoningTextDone,
    OutputTextDelta, OutputTextDone, FunctionCallArgumentsDelta, FunctionCallArgumentsDone, ContentPartDone,
    OutputItemDone, ResponseCompleted, ResponseIncomplete, ResponseFailed)}  # each event's model, by its type


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
