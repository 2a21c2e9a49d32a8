"""The OpenAI request bodies as pydantic models: FastAPI validates with these and builds
/openapi.json from them, so the schema is exactly what the server accepts.

Types only; value ranges are checked once, by SamplingParams and FrontendCore (the same
checks the gRPC API gets). Unknown fields are refused rather than ignored, so a field this
server does not implement (a `chat_template`, `functions`) is a 400 naming it.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.frontend.http.structured_models import NamedToolChoice, ResponseFormat, StructuredOutputs, Tool, ToolCallIn


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` and no choices.")


class SamplingFields(Strict):
    """What completions and chat share. None means the server's default."""

    model: str | None = Field(None, description="The served model's id; omitted: the served model.")
    n: int | None = Field(None, description="Samples per prompt, 1..64.")
    temperature: float | None = Field(None, description="0 is greedy; default 1.")
    top_p: float | None = None
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings, cut from the text.")
    seed: int | None = Field(None, description="Same seed, same tokens (the deterministic mode).")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100].")
    user: str | None = Field(None, description="The caller's id, logged.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, description="-1: off.")
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int = Field(0, description="Lower runs first under the scheduler's priority policy.")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema.")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's constraints (one of them).")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, a list of texts, token ids, or a list of token-id lists.")
    max_tokens: int | None = Field(16, description="Tokens to generate per sample.")
    logprobs: int | None = Field(None, description="Log probabilities of the sampled and this many top tokens.")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: str = Field(description="system, developer, user, assistant or tool.")
    content: str | list[TextPart] | None = Field(None, description="May be null on an assistant message with tool_calls.")
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant message's tool calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(description="Rendered with the model's own chat template.")
    max_completion_tokens: int | None = Field(None, description="Default: what the context leaves.")
    max_tokens: int | None = Field(None, description="Deprecated name of max_completion_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description="With logprobs: this many top tokens per position.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without.")
    parallel_tool_calls: bool | None = Field(None, description="Allow more than one call (default true).")
