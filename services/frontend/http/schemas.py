"""The response bodies as pydantic models: the one declaration of each shape. The renderers
(responses.py, tool_responses.py) build them (`model_construct`: no validation on the hot path, the
fields set are the ones sent) and respond() serialises them; /openapi.json states them, and
test_openapi checks every response against them.

`describe(app)` makes the schema true to the server: the 200s have their real shapes (JSON, or
server-sent events when `stream` is true), errors are the 4xx/5xx the server answers, in
OpenAI's error shape, and FastAPI's 422 (which this server never answers) is gone. Once a worker
has registered, it also states what the served model decides (its id, vocabulary and context), so
that every request the schema allows is one the server serves (test_openapi, positive mode), but
for the few limits no JSON Schema can state (a prompt's length in tokens, min_tokens <= max_tokens,
unique tool names, JSON text or a grammar that compiles), which the descriptions say in words.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Literal, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticUndefined

from services.frontend.types import ModelCard

BaseModelT = TypeVar("BaseModelT", bound=BaseModel)


def new(model_class: type[BaseModelT], /, **fields) -> BaseModelT:
    """model_class.model_construct(**fields) (no validation; the fields given are the set ones, what is sent),
    without model_construct's walk over every field on each call: a streamed chunk is three models, and
    model_construct made it 1.6x json.dumps of the dict it replaced; this about 0.6x
    (tests/frontend/test_openapi.py checks it against model_construct)."""
    made = model_class.__new__(model_class)
    defaults = _defaults(model_class)
    object.__setattr__(made, "__dict__", {**defaults, **fields} if defaults else fields)
    object.__setattr__(made, "__pydantic_fields_set__", set(fields))
    object.__setattr__(made, "__pydantic_extra__", None)
    object.__setattr__(made, "__pydantic_private__", None)
    return made


@cache
def _defaults(model: type[BaseModel]) -> dict:
    return {name: field.default for name, field in model.model_fields.items()
            if field.default is not PydanticUndefined}


class Body(BaseModel):
    """A response model: a float that is not finite (a logprob of -inf) is sent as JSON's Infinity / NaN,
    as Python's json module writes it, not as null."""

    model_config = ConfigDict(ser_json_inf_nan="constants")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(Body):
    cached_tokens: int


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionTokensDetails(Body):
    reasoning_tokens: int = Field(description=(
        "The tokens generated inside a reasoning model's thinking (--reasoning-parser; the end marker's "
        "included), every choice's; 0 without thinking."))


class ChatUsage(Usage):
    completion_tokens_details: CompletionTokensDetails


class CompletionLogprobs(Body):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="With echo, the prompt's first token's is null.")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Body):
    logprob: float
    rank: int = Field(description="1: the most likely token.")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
PROMPT_LOGPROBS = Field(None, description=(
    "With prompt_logprobs: per prompt token (the first: null), its token id's and the top tokens' logprobs."))


class CompletionChoice(Body):
    index: int
    text: str = Field(description="With echo, the prompt and then the completion.")
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = PROMPT_LOGPROBS


class Completion(Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]  # the token's own UTF-8 bytes


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[TokenLogprob]


class ToolCallFunction(Body):
    name: str
    arguments: str = Field(description="JSON text of the arguments.")


class ToolCall(Body):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, description="The calls of a request with tools.")
    reasoning_content: str | None = Field(None, description=(
        "A reasoning model's thinking (--reasoning-parser), apart from content; streamed as "
        "delta.reasoning_content."))
    reasoning: str | None = Field(None, description="The same as reasoning_content (vLLM's newer name).")


class ChatChoice(Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: ChatUsage
    prompt_logprobs: PromptLogprobs | None = PROMPT_LOGPROBS


class CompletionChunk(Completion):
    """A streamed chunk of a completion (its choices' new text); usage only with stream_options.include_usage
    (null but in the last chunk)."""

    usage: Usage | None = None


class ToolCallFunctionDelta(Body):
    name: str | None = None
    arguments: str


class ToolCallDelta(Body):
    """A streamed tool call: its first delta has id, type and function.name (arguments ""), the next ones
    more of function.arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta


class ChatDelta(Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Body):
    """A streamed chunk of a chat completion; usage as CompletionChunk's."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: ChatUsage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model id (vLLM's field)


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


def describe(app: FastAPI, served: Callable[[], ModelCard | None] = lambda: None) -> None:
    """Drop the 422 responses and validation-error schemas FastAPI adds: a body that does not
    validate is a 400 in OpenAI's error shape here. Once a worker has registered, `served()` gives
    the served model, and the schema states its limits too (state_served_limits)."""
    generate = app.openapi
    built_for: list = [object()]

    def openapi() -> dict:
        card = served()
        if app.openapi_schema is None or built_for[0] != card:
            app.openapi_schema = None
            schema = generate()
            for path in schema["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            if card is not None:
                state_served_limits(schema, card)
            built_for[0] = card
        return app.openapi_schema
    app.openapi = openapi


REQUEST_MODELS = ("CompletionRequest", "ChatCompletionRequest",  # another API's request model: add it here
                  "ResponseRequest", "MessagesRequest", "CountTokensRequest", "TokenizeCompletionRequest",
                  "TokenizeChatRequest", "DetokenizeRequest")
TOKEN_ID_FIELDS = ("prompt", "stop_token_ids", "tokens")
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens")


def state_served_limits(schema: dict, card: ModelCard) -> None:
    """What only the served model decides: its id (the only `model` served), its vocabulary (every
    token id, logit_bias's keys) and its context (no max_tokens can exceed max_model_len - 1)."""
    components = schema["components"]["schemas"]
    for name in REQUEST_MODELS:
        properties = components[name]["properties"]
        if "model" in properties:
            _set_string(properties["model"], {"enum": [card.id, ""]})  # "": the served model
        for field in TOKEN_ID_FIELDS:
            if field in properties:
                _set_integer(properties[field], {"maximum": card.vocab_size - 1})
        for field in LENGTH_FIELDS:
            if field in properties:
                _set_integer(properties[field], {"maximum": card.max_model_len - 1})
        for member in properties.get("logit_bias", {}).get("anyOf", []):
            if "patternProperties" in member:
                member["patternProperties"] = {number_below(card.vocab_size): next(
                    iter(member["patternProperties"].values()))}
    for parameter in schema["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
        _set_string(parameter["schema"], {"enum": [card.id]})


def _set_integer(spec: dict, bounds: dict) -> None:
    """Every integer in spec (through anyOf members and array items) gets bounds."""
    if spec.get("type") == "integer":
        spec.update(bounds)
    for member in spec.get("anyOf", []):
        _set_integer(member, bounds)
    if "items" in spec:
        _set_integer(spec["items"], bounds)


def _set_string(spec: dict, bounds: dict) -> None:
    if spec.get("type") == "string":
        spec.update(bounds)
    for member in spec.get("anyOf", []):
        _set_string(member, bounds)


def number_below(n: int) -> str:
    """A regular expression for the decimal numbers in [0, n) (leading zeros allowed, as int() reads them)."""
    top = str(n - 1)
    alternatives = [f"[1-9][0-9]{{{length - 1}}}" for length in range(2, len(top))]
    if len(top) > 1:
        alternatives.insert(0, "[0-9]")
    for i, digit in enumerate(top):
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{len(top) - i - 1}}}"
                                                                           if i < len(top) - 1 else ""))
    alternatives.append(top)
    return f"^0*({'|'.join(alternatives)})$"
