"""The OpenAI request bodies as pydantic models: FastAPI validates with these and builds
/openapi.json from them, so the schema is exactly what the server accepts.

The ranges here are SamplingParams' own (services/core/sampling_params.py, which checks them
again for every transport; test_openapi checks that the two agree), written out so that the
schema states them. Unknown fields are refused rather than ignored, so a field this server
does not implement (`functions`) is a 400 naming it. Every text must be valid
Unicode (JSON can carry a lone surrogate such as "\\ud800"; no tokenizer can take it), and an
integer may come as a whole-number float (`4.0`), as OpenAI accepts it. Every integer is bounded
by the width that carries it further (services/core/widths.py: top_k is an int32, token ids and
max_tokens uint32...), so a number too wide for the wire is a 400 naming it, never a 500. Another
API's request models (e.g. /v1/responses, /v1/messages) reuse these types: Int, TokenId, Text.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from services.core.sampling_params import LOGIT_BIAS_RANGE, MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, float_bounds
from services.core.widths import INT32_MAX, INT32_MIN, SEED_END, UINT32_MAX
from services.frontend.tool_calls import MAX_TOOLS
from services.frontend.types import MAX_CHAT_MESSAGES

MAX_PROMPTS = 64  # prompts in one completions request


def _whole_number(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"is not valid Unicode: a lone surrogate at character {error.start}") from None
    return text


def Int(**bounds):  # noqa: N802 - a type
    """An integer within bounds (stated in the schema), also given as a whole-number float."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


Text = Annotated[str, AfterValidator(_valid_unicode)]
PromptText = Annotated[Text, Field(min_length=1)]  # an empty prompt is a 400
TokenId = Int(ge=0, le=UINT32_MAX)
StopString = Annotated[Text, Field(min_length=1)]

from services.frontend.http.structured_models import NamedToolChoice, ResponseFormat, StructuredOutputs, Tool, ToolCallIn


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` and no choices.")


# Rules between fields, stated in the schema (JSON Schema's if/then); the server checks each itself.
CONSTRAINED = {"anyOf": [
    {"required": ["structured_outputs"], "properties": {"structured_outputs": {"type": "object"}}},
    {"required": ["response_format"], "properties": {"response_format": {
        "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}]}
SAMPLING_RULES = [
    {"if": CONSTRAINED, "then": {"properties": {"min_tokens": {"enum": [0, None]}}}},
    {"if": {"required": ["structured_outputs"], "properties": {"structured_outputs": {"type": "object"}}},
     "then": {"properties": {"response_format": {"anyOf": [
         {"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}}]
CHAT_RULES = [
    {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
     "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": ["none", None]}}}},
     "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"type": "object"}}},
     "then": {"properties": {"min_tokens": {"enum": [0, None]}}}},
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
     "then": {"properties": {"min_tokens": {"enum": [0, None]}}}}]


Priority = Int(ge=INT32_MIN, le=INT32_MAX)


def priority_field():
    """vLLM's `priority`, on every API (the Responses and Messages APIs take it as an extra field)."""
    return Field(0, description="Lower runs first under the scheduler's priority policy "
                                "(--scheduling-policy priority); ignored under the others.")


class SamplingFields(Strict):
    """What completions and chat share. None means the server's default."""

    model_config = ConfigDict(json_schema_extra={"allOf": SAMPLING_RULES})

    model: Text | None = Field(None, description="The served model's id; omitted: the served model.")
    n: Int(ge=1, le=MAX_N) | None = Field(None, description="Samples per prompt.")
    temperature: float | None = Field(None, **float_bounds("temperature"), description="0 is greedy; default 1.")
    top_p: float | None = Field(None, **float_bounds("top_p"))
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = \
        Field(None, description="Stop strings, cut from the text.")
    seed: Int(ge=0, le=SEED_END - 1) | None = Field(None, description="Same seed, same tokens (the deterministic mode).")
    presence_penalty: float | None = Field(None, **float_bounds("presence_penalty"))
    frequency_penalty: float | None = Field(None, **float_bounds("frequency_penalty"))
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^0*[0-9]{1,10}$")],
                               Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]],
                          Field(json_schema_extra={"additionalProperties": False})] | None = \
        Field(None, description="Token id (as a string) -> bias.")
    user: Text | None = Field(None, description="The caller's id, logged.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: Int(ge=-1, le=INT32_MAX) | None = Field(None, description="-1: off.")
    min_p: float | None = Field(None, **float_bounds("min_p"))
    repetition_penalty: float | None = Field(None, **float_bounds("repetition_penalty"))
    min_tokens: Int(ge=0, le=UINT32_MAX) | None = Field(None, description="At most max_tokens.")
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: Priority = priority_field()
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema.")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's constraints (one of them).")


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


PROMPT_LOGPROBS_DESCRIPTION = (
    "vLLM's extension: the log probability of each prompt token (the first has none: null) and of this "
    "many top tokens at its position, as {token id: {logprob, rank, decoded_token}}. Not with stream.")
# (JSON Schema's if/then, as SAMPLING_RULES; the server checks each itself)
PROMPT_LOGPROBS_RULE = {"if": {"required": ["prompt_logprobs"], "properties": {"prompt_logprobs": {"type": "integer"}}},
                        "then": {"properties": {"stream": {"const": False}}}}
COMPLETION_RULES = [
    PROMPT_LOGPROBS_RULE,
    {"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
     "then": {"required": ["echo"], "properties": {"echo": {"const": True}, "min_tokens": {"enum": [0, None]}}}}]


class CompletionRequest(SamplingFields):
    prompt: PromptText | TokenIds | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
            description="A text, token ids, a list of texts, or a list of token-id lists.")
    max_tokens: Int(ge=0, le=UINT32_MAX) | None = Field(16, description=(
        "Tokens to generate per sample; the prompt's tokens and these must fit in max_model_len (else a 400). "
        "0 (only with echo): score the prompt alone, nothing generated."))
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="Log probabilities of the sampled and this many top tokens (with echo, of the prompt's "
                          "tokens first, the first one's null).")
    echo: bool = Field(False, description="Return the prompt before the completion, in text and in logprobs.")
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(None, description=PROMPT_LOGPROBS_DESCRIPTION)

    model_config = ConfigDict(json_schema_extra={"allOf": SAMPLING_RULES + COMPLETION_RULES})


class TextPart(Strict):
    type: Literal["text"]
    text: Text


Content = Text | list[TextPart]


class TextMessage(Strict):
    role: Literal["system", "developer", "user"] = Field(description="Who said it.")
    content: Content
    name: Text | None = None


class AssistantMessage(Strict):
    """An earlier answer: its content, its tool calls, or both."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]})
    role: Literal["assistant"]
    content: Content | None = Field(None, description="May be null when tool_calls has calls.")
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="Its tool calls.")
    reasoning_content: Text | None = Field(None, description=(
        "Its thinking (a reasoning model's; the chat template keeps or drops it, as the model was trained)."))
    reasoning: Text | None = Field(None, description="vLLM's newer name of reasoning_content.")


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: Text = Field(description="The call it answers.")
    name: Text | None = None


MESSAGE_TAGS = {"assistant": "assistant-message", "tool": "tool-message"}  # not identifiers: no part of a param


def _message_tag(message) -> str:
    """Which model reads a message, by its role (an unknown role: TextMessage, which names it)."""
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return MESSAGE_TAGS.get(role, "text-message")


ChatMessage = Annotated[Union[Annotated[TextMessage, Tag("text-message")],
                              Annotated[AssistantMessage, Tag("assistant-message")],
                              Annotated[ToolMessage, Tag("tool-message")]], Discriminator(_message_tag)]


# names the server gives the chat template itself (services/core/tokenizer.py RESERVED_TEMPLATE_NAMES)
TEMPLATE_KWARGS = {"propertyNames": {"not": {"enum": ["messages", "tools", "add_generation_prompt", "bos_token",
                                                      "eos_token"]}}}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES,
                                        description="Rendered with the model's own chat template.")
    max_completion_tokens: Int(ge=1, le=UINT32_MAX) | None = Field(None, description=(
        "An upper bound on the tokens generated per choice. Omitted (with max_tokens): up to what the context "
        "leaves, max_model_len less the prompt's tokens, so a chat may generate up to the whole context. "
        "More than that is a 400."))
    max_tokens: Int(ge=1, le=UINT32_MAX) | None = Field(None, description=(
        "Deprecated name of max_completion_tokens (which wins when both are given). Omitted: up to what the "
        "context leaves."))
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="With logprobs: this many top tokens per position.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS,
                                     description="Functions the model may call (their names unique).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without. auto, required or a named function need "
                          "tools, and a named one must be one of them.")
    parallel_tool_calls: bool | None = Field(None, description="Allow more than one call (default true).")
    chat_template_kwargs: dict[str, Any] | None = Field(None, json_schema_extra=TEMPLATE_KWARGS, description=(
        "More variables for the chat template, over the server's --default-chat-template-kwargs, e.g. "
        "{\"enable_thinking\": false} (Qwen3: no thinking)."))
    chat_template: Text | None = Field(None, description=(
        "A Jinja chat template to use instead of the model's (only when the server trusts request templates: "
        "--trust-request-chat-template)."))
    max_reasoning_tokens: Int(ge=1, le=UINT32_MAX) | None = Field(None, description=(
        "A reasoning model's thinking budget: after this many thinking tokens the thinking is closed and the "
        "answer (under response_format or a tool choice, if any) follows. Needs --reasoning-parser."))
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(None, description=PROMPT_LOGPROBS_DESCRIPTION)

    model_config = ConfigDict(json_schema_extra={"allOf": SAMPLING_RULES + CHAT_RULES + [PROMPT_LOGPROBS_RULE]})
