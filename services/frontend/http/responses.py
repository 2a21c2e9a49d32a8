"""FrontendCore events -> OpenAI response bodies and server-sent-event chunks, as the models schemas.py
declares (built by model_construct, serialised by respond()).

Choice `prompt_index * n + sample_index`, as OpenAI and vLLM number them. A renderer
knows the shape of one endpoint (completions or chat) and is that endpoint's Output
(services/frontend/http/respond.py): its `collect` and `sse` drive it.

Prompt scoring (docs/guide/scoring.md): completions' `echo` puts each prompt before its choices'
text and, with `logprobs`, its tokens' logprobs before theirs (the first token's null), from the
request's prompt logprobs; `max_tokens: 0` shows the prompt alone (the one token generated to get
there is dropped: `CompletionRenderer.shown`). vLLM's `prompt_logprobs` come as vLLM returns them:
a list per prompt, null first, then {token id: {logprob, rank, decoded_token}} (the prompt's token
and the top k), on each completions choice, or beside a chat's choices.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import ClassVar

from services.core.step import Logprobs
from services.core.tokenizer import Tokenizer
from services.frontend.http import schemas
from services.frontend.http.schemas import new
from services.frontend.http.respond import DONE, Payload
from services.frontend.http.streams import Events
from services.frontend.types import SampleEvent, Summary

PromptLogprobs = list[Logprobs | None]  # a prompt's, position 0 None (services/core/step.py StepResult)


@dataclass
class Choice:
    text: str = ""
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(kw_only=True)
class Renderer:
    """The fields every body of one response shares, and the logprob format."""

    id: str
    model: str
    fingerprint: str
    tokenizer: Tokenizer
    n: int
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: this many top tokens per prompt position
    prompt_entries: dict[int, PromptLogprobs] = field(default_factory=dict)  # prompt index -> its logprobs
    num_prompts: int = 1
    with_logprobs: bool = False  # the request asked for the sampled tokens' logprobs
    include_usage: bool = False  # streamed: stream_options.include_usage, a last chunk with the usage
    object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"
    whole_model: ClassVar[type] = schemas.Completion
    chunk_model: ClassVar[type] = schemas.CompletionChunk
    named: ClassVar[bool] = False  # OpenAI's events are unnamed (respond.py)

    async def collect(self, events: Events) -> schemas.Body:
        return await _collect(self, events)

    def sse(self, events: Events) -> AsyncIterator[Payload]:
        return _sse(self, events)

    def refusal(self, error: Exception) -> list[Payload]:
        detail = schemas.ErrorDetail(message=str(error), type="service_unavailable", param=None, code="unavailable")
        return [schemas.ErrorResponse(error=detail), DONE]

    def body(self, choices: list[schemas.Body], usage: schemas.Usage) -> schemas.Body:
        """The whole (non-streamed) response."""
        return new(self.whole_model, id=self.id, object=self.object, created=self.created, model=self.model,
                   system_fingerprint=self.fingerprint, choices=choices, usage=usage, **self.extra())

    def chunk(self, choices: list[schemas.Body], usage: schemas.Usage | None = None) -> schemas.Body:
        """A streamed chunk; usage (null but in the last chunk) only with stream_options.include_usage."""
        with_usage = {"usage": usage} if self.include_usage else {}
        return new(self.chunk_model, id=self.id, object=self.chunk_object, created=self.created, model=self.model,
                   system_fingerprint=self.fingerprint, choices=choices, **with_usage)

    def extra(self) -> dict:
        """The whole response's fields besides its choices and usage."""
        return {}

    def observe(self, index: int, sample: SampleEvent) -> None:
        """A sample event of choice `index` of a whole (non-streamed) response, as it arrives."""

    def shown(self, sample: SampleEvent) -> SampleEvent:
        """What the response shows of a sample event."""
        return sample

    def vllm_prompt_logprobs(self, prompt_index: int) -> schemas.PromptLogprobs:
        """vLLM's shape: null for the first token, then each position's token and its top k."""
        out: schemas.PromptLogprobs = []
        for lp in self.prompt_entries.get(prompt_index, []):
            if lp is None:
                out.append(None)
                continue
            ranked = [(t, p, rank) for rank, (t, p) in enumerate(lp.top[:self.prompt_logprobs], 1)]
            if lp.token_id not in dict(lp.top[:self.prompt_logprobs]):
                ranked.insert(0, (lp.token_id, lp.logprob, lp.rank))
            out.append({str(t): new(schemas.PromptLogprob, logprob=p, rank=rank, decoded_token=self.token(t))
                        for t, p, rank in ranked})
        return out

    def usage(self, summaries: list[Summary]) -> schemas.Usage:
        return usage(summaries)

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def choice_index(self, prompt_index: int, sample: SampleEvent) -> int:
        return prompt_index * self.n + sample.index


@dataclass(frozen=True)
class Echo:
    """A prompt as echo returns it: its text (as given, or its token ids decoded) and token ids."""

    text: str
    token_ids: list[int]


@dataclass(kw_only=True)
class CompletionRenderer(Renderer):
    echoes: list[Echo] | None = None  # echo: each prompt's, by prompt index
    top_k: int | None = None  # the request's logprobs (top tokens per position)
    score_only: bool = False  # max_tokens 0: the prompt alone

    def choice(self, index: int, choice: Choice, logprobs: bool) -> schemas.CompletionChoice:
        prompt_index = index // self.n
        echo = self.echoes[prompt_index] if self.echoes else None
        shown = self.logprobs(choice.logprobs) if logprobs else None
        if echo is not None and logprobs:
            shown = self.echo_logprobs(echo, prompt_index, shown)
        extra = {} if self.prompt_logprobs is None else {"prompt_logprobs": self.vllm_prompt_logprobs(prompt_index)}
        return new(schemas.CompletionChoice, index=index, text=(echo.text if echo else "") + choice.text,
                   logprobs=shown, finish_reason=choice.finish_reason, **extra)

    def chunk_choice(self, index: int, sample: SampleEvent, offset: int) -> schemas.CompletionChoice:
        logprobs = self.logprobs(sample.logprobs, offset) if sample.logprobs is not None else None
        return new(schemas.CompletionChoice, index=index, text=sample.text, logprobs=logprobs,
                   finish_reason=sample.finish_reason)

    def echo_chunk(self, index: int, prompt_index: int, logprobs: bool) -> schemas.CompletionChoice:
        """A streamed choice's first chunk under echo: its prompt."""
        echo = self.echoes[prompt_index]
        shown = self.echo_logprobs(echo, prompt_index, None) if logprobs else None
        return new(schemas.CompletionChoice, index=index, text=echo.text, logprobs=shown, finish_reason=None)

    def echo_logprobs(self, echo: Echo, prompt_index: int,
                      generated: schemas.CompletionLogprobs | None) -> schemas.CompletionLogprobs:
        """The prompt's tokens in the legacy logprobs object, before the generated ones (if any):
        the first token's logprob and top are null, as it has no position before it."""
        entries = self.prompt_entries.get(prompt_index) or [None] * len(echo.token_ids)
        tokens = [self.token(t) for t in echo.token_ids]
        token_logprobs = [lp.logprob if lp else None for lp in entries]
        top_logprobs = [self.top(lp.top[:self.top_k]) if lp else None for lp in entries]
        offsets = _offsets(tokens)
        if generated is not None:
            end = sum(len(t) for t in tokens)
            tokens, token_logprobs = tokens + generated.tokens, token_logprobs + generated.token_logprobs
            top_logprobs += generated.top_logprobs
            offsets += [end + o for o in generated.text_offset]
        return new(schemas.CompletionLogprobs, tokens=tokens, token_logprobs=token_logprobs,
                   top_logprobs=top_logprobs, text_offset=offsets)

    def logprobs(self, entries: list[Logprobs], offset: int = 0) -> schemas.CompletionLogprobs:
        tokens = [self.token(lp.token_id) for lp in entries]
        return new(schemas.CompletionLogprobs, tokens=tokens, token_logprobs=[lp.logprob for lp in entries],
                   top_logprobs=[self.top(lp.top) for lp in entries], text_offset=_offsets(tokens, offset))

    def top(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """Token text -> logprob, best first; of two tokens with one text the better one's (what a
        harness reads as the best logprob: lm-evaluation-harness's is_greedy)."""
        shown: dict[str, float] = {}
        for token_id, logprob in top:
            shown.setdefault(self.token(token_id), logprob)
        return shown

    def shown(self, sample: SampleEvent) -> SampleEvent:
        if not self.score_only:
            return sample
        return SampleEvent(index=sample.index, text="", token_ids=[], logprobs=[] if sample.logprobs else None,
                           finish_reason="length" if sample.finish_reason else None)

    def usage(self, summaries: list[Summary]) -> schemas.Usage:
        shown = usage(summaries)
        if self.score_only:
            shown.completion_tokens, shown.total_tokens = 0, shown.prompt_tokens
        return shown


def _offsets(tokens: list[str], offset: int = 0) -> list[int]:
    """Each token's place in the text the tokens make, from offset."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return offsets


class ChatRenderer(Renderer):
    object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"
    whole_model: ClassVar[type] = schemas.ChatCompletion
    chunk_model: ClassVar[type] = schemas.ChatCompletionChunk
    num_reasoning_tokens: int = 0  # a reasoning model's thinking tokens, every choice's (tool_responses.py)

    def usage(self, summaries: list[Summary]) -> schemas.ChatUsage:
        details = new(schemas.CompletionTokensDetails, reasoning_tokens=self.num_reasoning_tokens)
        return new(schemas.ChatUsage, **dict(usage(summaries)), completion_tokens_details=details)

    def choice(self, index: int, choice: Choice, logprobs: bool) -> schemas.ChatChoice:
        message = new(schemas.AssistantMessage, role="assistant", content=choice.text)
        return new(schemas.ChatChoice, index=index, message=message,
                   logprobs=self.logprobs(choice.logprobs) if logprobs else None, finish_reason=choice.finish_reason)

    def chunk_choice(self, index: int, sample: SampleEvent, offset: int) -> schemas.ChatChunkChoice:
        logprobs = self.logprobs(sample.logprobs) if sample.logprobs is not None else None
        delta = new(schemas.ChatDelta, **({"content": sample.text} if sample.text else {}))
        return new(schemas.ChatChunkChoice, index=index, delta=delta, logprobs=logprobs,
                   finish_reason=sample.finish_reason)

    def extra(self) -> dict:
        if self.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": self.vllm_prompt_logprobs(0)}  # vLLM's place for a chat's: beside the choices

    def role_chunk(self, index: int) -> schemas.ChatChunkChoice:
        delta = new(schemas.ChatDelta, role="assistant", content="")
        return new(schemas.ChatChunkChoice, index=index, delta=delta, logprobs=None, finish_reason=None)

    def logprobs(self, entries: list[Logprobs], offset: int = 0) -> schemas.ChatLogprobs:
        return new(schemas.ChatLogprobs, content=[
            new(schemas.TokenLogprob, **self._entry(lp.token_id, lp.logprob),
                top_logprobs=[new(schemas.TopLogprob, **self._entry(t, p)) for t, p in lp.top])
            for lp in entries])

    def _entry(self, token_id: int, logprob: float) -> dict:
        # the token's own bytes: its text is U+FFFD where it ends inside a character
        return {"token": self.token(token_id), "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token_id))}


def usage(summaries: list[Summary]) -> schemas.Usage:
    prompt = sum(s.num_prompt_tokens for s in summaries)
    completion = sum(s.num_completion_tokens for s in summaries)
    cached = new(schemas.PromptTokensDetails, cached_tokens=sum(s.num_cached_tokens for s in summaries))
    return new(schemas.Usage, prompt_tokens=prompt, completion_tokens=completion,
               total_tokens=prompt + completion, prompt_tokens_details=cached)


async def _collect(renderer: Renderer, events: Events) -> dict:
    """The whole (non-streamed) response body."""
    choices = [Choice() for _ in range(renderer.num_prompts * renderer.n)]
    summaries = []
    async for prompt_index, event in events:
        if event.prompt_logprobs is not None:
            renderer.prompt_entries[prompt_index] = event.prompt_logprobs
        for sample in map(renderer.shown, event.samples):
            index = renderer.choice_index(prompt_index, sample)
            renderer.observe(index, sample)
            choice = choices[index]
            choice.text += sample.text
            choice.logprobs += sample.logprobs or []
            choice.finish_reason = sample.finish_reason or choice.finish_reason
        if event.summary is not None:
            summaries.append(event.summary)
    return renderer.body([renderer.choice(i, c, renderer.with_logprobs) for i, c in enumerate(choices)],
                         renderer.usage(summaries))


async def _sse(renderer: Renderer, events: Events) -> AsyncIterator[Payload]:
    """Server-sent events: a chunk per sample event that carries something, then usage, then [DONE].
    Under echo each choice's first chunk is its prompt (with its logprobs when asked)."""
    num_prompts, include_usage, logprobs = renderer.num_prompts, renderer.include_usage, renderer.with_logprobs
    data = renderer.chunk
    if isinstance(renderer, ChatRenderer):
        for index in range(num_prompts * renderer.n):
            yield data([renderer.role_chunk(index)])
    offsets: dict[int, int] = {}
    summaries = []
    echoed: set[int] = set()
    async for prompt_index, event in events:
        if event.prompt_logprobs is not None:
            renderer.prompt_entries[prompt_index] = event.prompt_logprobs
        if isinstance(renderer, CompletionRenderer) and renderer.echoes and prompt_index not in echoed:
            echoed.add(prompt_index)
            for index in range(prompt_index * renderer.n, (prompt_index + 1) * renderer.n):
                yield data([renderer.echo_chunk(index, prompt_index, logprobs)])
                offsets[index] = len(renderer.echoes[prompt_index].text)
        for sample in map(renderer.shown, event.samples):
            if sample.text or sample.finish_reason or sample.logprobs:
                index = renderer.choice_index(prompt_index, sample)
                chunk = renderer.chunk_choice(index, sample, offsets.get(index, 0))
                if chunk is not None:  # None: held back (a tool call is sent whole when it ends)
                    yield data([chunk])
                offsets[index] = offsets.get(index, 0) + len(sample.text)
        if event.summary is not None:
            summaries.append(event.summary)
    if include_usage:
        yield data([], renderer.usage(summaries))
    yield DONE
