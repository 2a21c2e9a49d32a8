"""The Anthropic Messages API's request bodies (POST /v1/messages and /v1/messages/count_tokens)
as pydantic models: FastAPI validates with these and builds /openapi.json from them. Unknown
fields and what this server cannot do (an image block) are refused, a 400 in Anthropic's error
shape naming them."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from services.core.sampling_params import MAX_STOP_STRINGS
from services.core.widths import INT32_MAX, SEED_END, UINT32_MAX
from services.frontend.http.models import Int, Priority, StopString, Strict, Text, priority_field
from services.frontend.types import MAX_CHAT_MESSAGES


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Text | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = Field(None, description="Accepted; the prefix cache is automatic.")
    citations: list[Any] | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = Field(None, description="Accepted (as the SDK returns it); not used.")
    toolset_name: Text | None = Field(None, description="Accepted (as the SDK returns it); not used.")


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: Text = Field(description="An earlier turn's thinking: the chat template keeps or drops it.")
    signature: Text | None = Field(None, description="Accepted (as the SDK returns it); not checked.")


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: Text = Field(description="Accepted; dropped (this server never redacts).")


UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
                           Field(discriminator="type")]


class UserMessage(Strict):
    role: Literal["user"]
    content: Text | list[UserBlock] = Field(description="Text, and tool_result blocks answering tool_use blocks.")


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Text | list[AssistantBlock] = Field(description="Text, and the tool_use blocks of the calls.")


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # services/frontend/tool_calls.py NAME


class AnthropicTool(Strict):
    name: Text = Field(pattern=TOOL_NAME)
    description: Text | None = None
    input_schema: dict[str, Any] = Field(description="A JSON schema of the input object.")
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(Strict):
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "tool"}}},
        "then": {"required": ["name"], "properties": {"name": {"type": "string"}}}})

    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(pattern=TOOL_NAME)] | None = Field(None, description="type tool: the tool to call.")
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the output follows.")


class OutputConfig(Strict):
    format: JsonOutputFormat | None = Field(None, description="Structured output, through the grammar.")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(None, description="Accepted; not used.")


class Metadata(Strict):
    user_id: Text | None = None


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"] = Field(description=(
        "A reasoning model's thinking (--reasoning-parser), given as thinking blocks. enabled: at most "
        "budget_tokens of it, then the answer; disabled: the chat template is asked not to think "
        "(enable_thinking false); adaptive, or thinking omitted: as the model's template does by default."))
    budget_tokens: Int(ge=1, le=UINT32_MAX) | None = Field(None, description=(
        "With enabled: the thinking's budget in tokens (no minimum here); the thinking is then closed. "
        "Omitted: no budget."))


# Rules between fields, stated in the schema as chat's are (models.py CHAT_RULES); the server checks each.
NEEDS_TOOLS = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
    "type": "object", "properties": {"type": {"not": {"const": "none"}}}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
FORCED_CALL_HAS_NO_FORMAT = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
    "type": "object", "properties": {"type": {"enum": ["any", "tool"]}}}}},
    "then": {"properties": {"output_config": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "format": {"type": "null"}}}]}}}}


class CountTokensRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"allOf": [NEEDS_TOOLS]})

    model: Text = Field(description="The served model's id.")
    messages: list[Message] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [NEEDS_TOOLS, FORCED_CALL_HAS_NO_FORMAT]})

    max_tokens: Int(ge=1, le=UINT32_MAX) = Field(description="Tokens to generate at most.")
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(None, ge=0, le=1, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int(ge=1, le=INT32_MAX) | None = None
    stream: bool = False
    metadata: Metadata | None = None
    seed: Int(ge=0, le=SEED_END - 1) | None = Field(None, description="An extension: same seed, same tokens.")
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = Field(None, description="Accepted; the prefix cache is automatic.")
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="Accepted; there is one tier.")
    priority: Priority = priority_field()
