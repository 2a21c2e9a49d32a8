"""The OpenAI Responses API's request body (POST /v1/responses) as pydantic models: FastAPI
validates with these and builds /openapi.json from them. Unknown fields are refused (400 naming
them). Items the server itself returned (`response.output`) are accepted back as input, with
their ids, statuses and annotations."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from services.core.sampling_params import MAX_STOP_STRINGS
from services.core.widths import SEED_END, UINT32_MAX
from services.frontend.http.models import TEMPLATE_KWARGS, Int, Priority, StopString, Strict, Text, priority_field
from services.frontend.types import MAX_CHAT_MESSAGES


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = Field(None, description="Accepted on output_text; not used.")
    logprobs: list[Any] | None = Field(None, description="Accepted on output_text; not used.")


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]
    id: Text | None = None
    status: Text | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text = Field(description="The arguments as JSON text.")
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: Text = Field(description="The function_call this answers.")
    output: Text
    id: Text | None = None
    status: Text | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    content: Annotated[list[ReasoningText], Field(max_length=64)] | None = Field(
        None, description="An earlier turn's thinking: the chat template keeps or drops it.")
    summary: Annotated[list[dict[str, Any]], Field(max_length=64)] | None = Field(None, description="Accepted.")
    encrypted_content: Text | None = Field(None, description="Accepted; not used.")
    id: Text | None = None
    status: Text | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(union_mode="left_to_right")]


TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # services/frontend/tool_calls.py NAME


class FunctionTool(Strict):
    type: Literal["function"]
    name: Text = Field(pattern=TOOL_NAME)
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = Field(None, description="Accepted; a required or named call always follows the schema.")


class NamedFunction(Strict):
    type: Literal["function"]
    name: Text = Field(pattern=TOOL_NAME)


class TextFormat(Strict):
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["name"], "properties": {"name": {"type": "string"}}}})

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(None, description="json_schema: the schema's name (not used by the server).")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: the JSON schema.")
    description: Text | None = None
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema exactly.")


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted; not used.")


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# Rules between fields, stated in the schema as chat's are (models.py CHAT_RULES); the server checks each.
RESPONSE_RULES = [
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": ["none", None]}}}},
     "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [
        {"const": "required"}, {"type": "object"}]}}},
     "then": {"properties": {"text": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"format": {
         "anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}]}}}}]


class ResponseRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"allOf": RESPONSE_RULES})

    model: Text | None = Field(None, description="The served model's id; omitted: the served model.")
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)] = Field(
        description="A user message's text, or a list of items: messages, function_call, function_call_output.")
    instructions: Text | None = Field(None, description="A system message placed first (not carried over).")
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = Field(
        None, description="Default: auto with tools, none without.")
    parallel_tool_calls: bool | None = Field(None, description="Allow more than one call (default true).")
    text: TextOptions | None = Field(None, description="The output's format: text, json_object or json_schema.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: Int(ge=1, le=UINT32_MAX) | None = Field(None, description="Default: what the context leaves.")
    seed: Int(ge=0, le=SEED_END - 1) | None = Field(None, description="Same seed, same tokens (the deterministic mode).")
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="An extension: stop strings, cut from the text.")
    store: bool = Field(True, description="Keep the response (in memory, bounded, with a TTL) for GET and "
                                          "previous_response_id.")
    previous_response_id: Text | None = Field(None, description="Continue a stored response's conversation.")
    stream: bool = False
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: Text | None = Field(None, description="The caller's id; echoed in the response.")
    truncation: Literal["disabled"] | None = None
    # what agent clients (codex) send that changes nothing here: accepted and not used
    include: Annotated[list[Text], Field(max_length=16)] | None = Field(
        None, description="Accepted; no extra output is added.")
    prompt_cache_key: Text | None = Field(None, description="Accepted; the prefix cache is automatic.")
    reasoning: Reasoning | None = Field(None, description=(
        "A reasoning model's thinking (--reasoning-parser) is given as a reasoning item; effort none asks the "
        "chat template not to think (enable_thinking false); other values are accepted and not used."))
    max_reasoning_tokens: Int(ge=1, le=UINT32_MAX) | None = Field(None, description=(
        "An extension: the thinking's budget in tokens; the thinking is then closed and the answer follows."))
    chat_template_kwargs: dict[str, Any] | None = Field(None, json_schema_extra=TEMPLATE_KWARGS, description=(
        "An extension: more variables for the chat template, e.g. {\"enable_thinking\": false}."))
    service_tier: Literal["auto", "default", "flex", "priority"] | None = Field(None, description="Accepted.")
    safety_identifier: Text | None = Field(None, description="Accepted; not used.")
    priority: Priority = priority_field()
