"""The response bodies as pydantic models, for /openapi.json only: responses.py builds the bodies
as dicts (the hot path), and test_openapi checks every response against these.

`describe(app)` makes the schema true to the server: the 200s have their real shapes (JSON, or
server-sent events when `stream` is true), errors are the 4xx/5xx the server answers, in
OpenAI's error shape, and FastAPI's 422 (which this server never answers) is gone.
"""
from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's own UTF-8 bytes


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


SSE = {"text/event-stream": {"schema": {  # one server-sent event
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "description": "With stream: true, events whose data is a chunk's JSON (object text_completion or "
                   "chat.completion.chunk), then [DONE]; a failure after the first event is an {\"error\": ...} event."}}}


def errors(*statuses: int) -> dict:
    return {status: {"model": ErrorResponse, "description": _ERROR_WHEN[status]} for status in statuses}


_ERROR_WHEN = {
    400: "A parameter is invalid; `param` names it.",
    401: "Missing or wrong API key.",
    404: "Unknown model (`param` is model) or route.",
    413: "The body is over the configured limit.",
    429: "The queue is full; retry after the Retry-After header's seconds.",
    503: "No worker is ready, or the server is shutting down.",
}
GENERATE_ERRORS = errors(400, 401, 404, 413, 429, 503)


def completion_responses(body: type[BaseModel]) -> dict:
    return {200: {"model": body, "description": "The whole result, or (stream: true) server-sent events.",
                  "content": SSE}, **GENERATE_ERRORS}


def describe(app: FastAPI) -> None:
    """Drop the 422 responses and validation-error schemas FastAPI adds: a body that does not
    validate is a 400 in OpenAI's error shape here."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for path in schema["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema
    app.openapi = openapi
