"""OpenAI request bodies -> the frontend's GenerateRequests (one per prompt)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from services.core.errors import InvalidArgument, check
from services.core.sampling_params import SamplingParams
from services.core.structured import Constraint
from services.frontend import reasoning, tool_calls
from services.frontend.tool_calls import ToolPlan
from services.frontend.core import FrontendCore
from services.frontend.http.models import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, SamplingFields
from services.frontend.http.responses import Echo
from services.frontend.types import GenerateRequest, Prompt

# Fields whose names and meanings are the same in the request and in SamplingParams.
PASSED_AS_IS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "min_tokens", "ignore_eos", "include_stop_str_in_output",
                "skip_special_tokens")


def completion_requests(body: CompletionRequest, request_id: str) -> list[GenerateRequest]:
    prompts = _prompts(body.prompt)
    check(not body.stream or body.prompt_logprobs is None, "prompt_logprobs", "is not available with stream: true")
    check(body.max_tokens != 0 or body.echo, "max_tokens", "0 scores the prompt alone, which needs echo: true")
    check(body.max_tokens != 0 or not body.min_tokens, "min_tokens",
          f"must be in [0, max_tokens], got {body.min_tokens} with max_tokens 0")
    # max_tokens 0: the prompt alone; the one token generated after it is not shown (CompletionRenderer.shown)
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    # echo with logprobs: the prompt's tokens' logprobs too, with as many top tokens as the generated ones'
    prompt_logprobs = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    params = sampling_params(body, max_tokens, body.logprobs, prompt_logprobs=max(prompt_logprobs, default=None))
    return [GenerateRequest(prompt=prompt, params=params, request_id=f"{request_id}-{i}", model=body.model or "",
                            priority=body.priority)
            for i, prompt in enumerate(prompts)]


async def echo_prompts(core: FrontendCore, requests: list[GenerateRequest]) -> list[Echo]:
    """Each request's prompt as echo returns it; a text prompt is tokenized here (its request then
    carries the token ids, so it is tokenized once)."""
    echoes = []
    for request in requests:
        prompt = request.prompt
        if prompt.token_ids is None:
            request.prompt = Prompt(token_ids=await core.tokenize(prompt))
            echoes.append(Echo(prompt.text, request.prompt.token_ids))
        else:
            text = await core.detokenize(prompt.token_ids, request.params.skip_special_tokens, "prompt")
            echoes.append(Echo(text, prompt.token_ids))
    return echoes


async def chat_request(core: FrontendCore, body: ChatCompletionRequest,
                       request_id: str) -> tuple[GenerateRequest, ToolPlan]:
    check(body.top_logprobs is None or body.logprobs, "top_logprobs", "needs logprobs: true")
    check(not body.stream or body.prompt_logprobs is None, "prompt_logprobs", "is not available with stream: true")
    core.check_model(body.model or "")
    tool_choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    tool_plan = tool_calls.plan([t.model_dump(exclude_none=True) for t in body.tools or []], tool_choice,
                           body.parallel_tool_calls)
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    check(body.chat_template is None or core.trust_request_chat_template, "chat_template",
          "this server does not take a request's chat template (--trust-request-chat-template)")
    template = ChatTemplate(body.chat_template_kwargs, body.chat_template,
                            Budget(body.max_reasoning_tokens, "max_reasoning_tokens"))
    return await conversation_request(
        core, [_message(i, m) for i, m in enumerate(body.messages)], tool_plan, request_id,
        lambda max_tokens: sampling_params(body, max_tokens, logprobs, tool_plan.constraint(), body.prompt_logprobs),
        getattr(body, field),
        body.model or "", body.priority, field, template), tool_plan


@dataclass(frozen=True)
class Budget:
    """A reasoning budget in tokens (None: none) and the request field that gave it."""

    max_tokens: int | None = None
    field: str = "max_reasoning_tokens"


@dataclass(frozen=True)
class ChatTemplate:
    """A request's say over its chat template and its thinking."""

    kwargs: dict | None = None  # chat_template_kwargs, over the server's defaults
    source: str | None = None  # a template of its own
    budget: Budget = Budget()


async def conversation_request(core: FrontendCore, messages: list[dict], tool_plan: ToolPlan, request_id: str,
                               params: Callable[[int], SamplingParams], max_tokens: int | None, model: str,
                               priority: int = 0, max_tokens_field: str = "max_tokens",
                               template: ChatTemplate = ChatTemplate()) -> GenerateRequest:
    """A chat (messages as the chat template takes them, tool calls as OpenAI's) rendered and
    tokenized here, so max_tokens can default to what the context leaves. Every API's chat-like
    endpoint (chat completions, responses, messages) comes through here; `max_tokens_field` is the
    name the client gave max_tokens (the core checks the room it leaves, naming it). Under a reasoning parser the prompt's end says whether the
    model thinks (`tool_plan.thinking`, which its readers then split off); a constraint and the
    reasoning budget then apply after the thinking (reasoning.thinking_constraint)."""
    prompt_ids = await conversation_tokens(core, messages, tool_plan, template)
    card = await core.model_card()
    if max_tokens is None:
        max_tokens = max(card.max_model_len - len(prompt_ids), 1)  # a too-long prompt is refused by the core
    tool_plan.thinking = core.thinking(prompt_ids)
    sampling = params(max_tokens)
    budget = template.budget
    if budget.max_tokens is not None:
        check(core.reasoning_parser is not None, budget.field, "needs a reasoning model (--reasoning-parser)")
    if tool_plan.thinking is not None:
        constraint = reasoning.thinking_constraint(tool_plan.thinking, sampling.structured_outputs,
                                                   budget.max_tokens, core.marker_token)
        harmony = tool_plan.thinking.parser.harmony  # its channels are special tokens: the reader needs them
        sampling = replace(sampling, structured_outputs=constraint,
                           skip_special_tokens=False if harmony else sampling.skip_special_tokens)
    return GenerateRequest(prompt=Prompt(token_ids=prompt_ids), params=sampling, request_id=request_id,
                           model=model, priority=priority, max_tokens_field=max_tokens_field)


async def conversation_tokens(core: FrontendCore, messages: list[dict], tool_plan: ToolPlan,
                              template: ChatTemplate = ChatTemplate()) -> list[int]:
    """The chat's prompt tokens: its messages and the plan's tools through the chat template."""
    source = template.source or core.tokenizer.template_source
    messages, template_tools = tool_calls.template_messages(messages, tool_plan, source)
    if core.reasoning_parser is not None and core.reasoning_parser.harmony:  # gpt-oss's template calls it thinking
        messages = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]
    return await core.tokenize(Prompt(messages=messages, tools=template_tools, template_kwargs=template.kwargs,
                                      chat_template=template.source))


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    tool_constraint: Constraint | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    kwargs = {name: value for name in PASSED_AS_IS if (value := getattr(body, name)) is not None}
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    constraint = _constraint(body)
    check(constraint is None or tool_constraint is None, "tool_choice",
          "a required or named tool choice cannot be combined with response_format or structured_outputs")
    return SamplingParams(**kwargs, logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop=body.stop or (), stop_token_ids=body.stop_token_ids or (),
                          logit_bias=_logit_bias(body.logit_bias or {}),
                          structured_outputs=constraint or tool_constraint)


def _constraint(body: SamplingFields) -> Constraint | None:
    """response_format (OpenAI) or structured_outputs (vLLM), not both."""
    fmt, options = body.response_format, body.structured_outputs
    check(options is None or fmt is None or fmt.type == "text", "structured_outputs",
          "cannot be combined with response_format")
    if options is not None:
        return Constraint.from_options(options.options(), "structured_outputs")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object", "", "response_format")
    check(fmt.json_schema is not None, "response_format.json_schema", "is required with type json_schema")
    schema = fmt.json_schema.schema_
    return Constraint.json_schema(schema if schema is not None else {}, "response_format.json_schema.schema")


def _message(i: int, m) -> dict:
    """A request message as the chat template gets it (tool calls and ids as plain values)."""
    tool_calls, tool_call_id = getattr(m, "tool_calls", None), getattr(m, "tool_call_id", None)
    message = {"role": m.role, "content": _text(m.content) if m.content is not None else ""}
    if m.content is None:
        check(m.role == "assistant" and tool_calls, f"messages[{i}].content",
              "is required (it may be null only on an assistant message with tool_calls)")
    if m.name:
        message["name"] = m.name
    if tool_calls:
        message["tool_calls"] = [c.model_dump() for c in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    reasoning_content = getattr(m, "reasoning_content", None) or getattr(m, "reasoning", None)
    if reasoning_content is not None:  # an earlier turn's thinking: the template keeps or drops it
        message["reasoning_content"] = reasoning_content
    return message


def _prompts(prompt: str | list) -> list[Prompt]:
    if isinstance(prompt, str):
        return [Prompt(text=prompt)]
    check(len(prompt) > 0, "prompt", "must not be empty")
    if isinstance(prompt[0], int):
        return [Prompt(token_ids=prompt)]
    check(len(prompt) <= MAX_PROMPTS, "prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    return [Prompt(text=p) if isinstance(p, str) else Prompt(token_ids=p) for p in prompt]


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidArgument("logit_bias", "keys must be token ids (integers as strings)") from None
