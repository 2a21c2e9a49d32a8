"""OpenAI request bodies -> the frontend's GenerateRequests (one per prompt)."""
from __future__ import annotations

from services.core.errors import InvalidArgument, check
from services.core.sampling_params import SamplingParams
from services.frontend.core import FrontendCore
from services.frontend.http.models import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, SamplingFields
from services.frontend.types import GenerateRequest, Prompt

# Fields whose names and meanings are the same in the request and in SamplingParams.
PASSED_AS_IS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "min_tokens", "ignore_eos", "include_stop_str_in_output",
                "skip_special_tokens")


def completion_requests(body: CompletionRequest, request_id: str) -> list[GenerateRequest]:
    prompts = _prompts(body.prompt)
    params = sampling_params(body, body.max_tokens, body.logprobs)
    return [GenerateRequest(prompt, params, f"{request_id}-{i}", body.model or "", body.priority)
            for i, prompt in enumerate(prompts)]


async def chat_request(core: FrontendCore, body: ChatCompletionRequest, request_id: str) -> GenerateRequest:
    """The messages rendered and tokenized here, so max_tokens can default to what the context leaves."""
    check(body.top_logprobs is None or body.logprobs, "top_logprobs", "needs logprobs: true")
    core.check_model(body.model or "")
    messages = [{"role": m.role, "content": _text(m.content), **({"name": m.name} if m.name else {})}
                for m in body.messages]
    prompt_ids = await core.tokenize(Prompt(messages=messages))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        card = await core.model_card()
        max_tokens = max(card.max_model_len - len(prompt_ids), 1)  # a too-long prompt is refused by the core
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs)
    return GenerateRequest(Prompt(token_ids=prompt_ids), params, request_id, body.model or "", body.priority)


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    kwargs = {name: value for name in PASSED_AS_IS if (value := getattr(body, name)) is not None}
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    return SamplingParams(**kwargs, logprobs=logprobs, stop=body.stop or (), stop_token_ids=body.stop_token_ids or (),
                          logit_bias=_logit_bias(body.logit_bias or {}))


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
