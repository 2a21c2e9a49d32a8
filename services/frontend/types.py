"""Plain request and event types of the frontend, shared by every transport (gRPC, HTTP).

No protobuf here: the gRPC servicer and the HTTP layer convert to and from these.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.core.errors import InvalidArgument
from services.core.sampling_params import SamplingParams
from services.core.step import Logprobs

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHAT_MESSAGES = 4096  # messages in one chat; checked before anything is done with them


class UnknownModel(InvalidArgument):
    """The request named a model this frontend does not serve (HTTP maps it to 404)."""

    def __init__(self, model: str, served: str):
        super().__init__("model", f"{model!r} is not served here; the served model is {served!r}")


class ResponseNotFound(InvalidArgument):
    """An unknown (or evicted, or expired) stored response (HTTP maps it to 404)."""


@dataclass(kw_only=True)
class Prompt:
    """Exactly one of text, token_ids and messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True  # for text
    add_generation_prompt: bool = True  # for messages
    tools: list[dict] | None = None  # for messages: tool definitions the chat template shows
    template_kwargs: dict | None = None  # for messages: more variables for the template (over the server's)
    chat_template: str | None = None  # for messages: a template to use instead of the model's


@dataclass(kw_only=True)
class GenerateRequest:
    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""  # empty: the frontend assigns one
    model: str = ""  # empty: the served model
    priority: int = 0
    max_tokens_field: str = "max_tokens"  # the name the client gave params.max_tokens (an error names it)


@dataclass(kw_only=True)
class SampleEvent:
    """What one sample gained since the previous event."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # set when the sample ended with this event
    stop_reason: int | str | None = None  # the stop token id or stop string


@dataclass(kw_only=True)
class Summary:
    finish_reasons: list[str]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    seed: int


@dataclass(kw_only=True)
class GenerateEvent:
    request_id: str
    samples: list[SampleEvent] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None  # in the first event, when asked
    summary: Summary | None = None  # in the last event only


@dataclass(kw_only=True)
class ModelCard:
    id: str
    max_model_len: int
    vocab_size: int
    batch_invariant: bool = False  # the workers' deterministic mode (docs/ARCHITECTURE.md rule 4)
