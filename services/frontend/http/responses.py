"""FrontendCore events -> OpenAI response bodies and server-sent-event chunks.

Choice `prompt_index * n + sample_index`, as OpenAI and vLLM number them. A renderer
knows the shape of one endpoint (completions or chat); `collect` and `sse` drive it.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import ClassVar

from services.core.step import Logprobs
from services.core.tokenizer import Tokenizer
from services.frontend.types import GenerateEvent, SampleEvent, Summary

Events = AsyncIterator[tuple[int, GenerateEvent]]  # (prompt index, event)


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
    object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"

    def body(self, object_name: str, choices: list[dict], usage: dict | None) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, "usage": usage}

    def observe(self, index: int, sample: SampleEvent) -> None:
        """A sample event of choice `index` of a whole (non-streamed) response, as it arrives."""

    def usage(self, summaries: list[Summary]) -> dict:
        return usage(summaries)

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def choice_index(self, prompt_index: int, sample: SampleEvent) -> int:
        return prompt_index * self.n + sample.index


class CompletionRenderer(Renderer):
    def choice(self, index: int, choice: Choice, logprobs: bool) -> dict:
        return {"index": index, "text": choice.text, "logprobs": self.logprobs(choice.logprobs) if logprobs else None,
                "finish_reason": choice.finish_reason}

    def chunk_choice(self, index: int, sample: SampleEvent, offset: int) -> dict:
        logprobs = self.logprobs(sample.logprobs, offset) if sample.logprobs is not None else None
        return {"index": index, "text": sample.text, "logprobs": logprobs, "finish_reason": sample.finish_reason}

    def logprobs(self, entries: list[Logprobs], offset: int = 0) -> dict:
        tokens = [self.token(lp.token_id) for lp in entries]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in entries],
                "top_logprobs": [{self.token(t): p for t, p in lp.top} for lp in entries], "text_offset": offsets}


class ChatRenderer(Renderer):
    object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"
    num_reasoning_tokens: int = 0  # a reasoning model's thinking tokens, every choice's (tool_responses.py)

    def usage(self, summaries: list[Summary]) -> dict:
        return {**usage(summaries), "completion_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens}}

    def choice(self, index: int, choice: Choice, logprobs: bool) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": self.logprobs(choice.logprobs) if logprobs else None, "finish_reason": choice.finish_reason}

    def chunk_choice(self, index: int, sample: SampleEvent, offset: int) -> dict:
        logprobs = self.logprobs(sample.logprobs) if sample.logprobs is not None else None
        return {"index": index, "delta": {"content": sample.text} if sample.text else {}, "logprobs": logprobs,
                "finish_reason": sample.finish_reason}

    def role_chunk(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def logprobs(self, entries: list[Logprobs], offset: int = 0) -> dict:
        return {"content": [dict(self._entry(lp.token_id, lp.logprob),
                                 top_logprobs=[self._entry(t, p) for t, p in lp.top]) for lp in entries]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        # the token's own bytes: its text is U+FFFD where it ends inside a character
        return {"token": self.token(token_id), "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token_id))}


def usage(summaries: list[Summary]) -> dict:
    prompt = sum(s.num_prompt_tokens for s in summaries)
    completion = sum(s.num_completion_tokens for s in summaries)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in summaries)}}


async def collect(renderer: Renderer, events: Events, num_prompts: int, logprobs: bool) -> dict:
    """The whole (non-streamed) response body."""
    choices = [Choice() for _ in range(num_prompts * renderer.n)]
    summaries = []
    async for prompt_index, event in events:
        for sample in event.samples:
            index = renderer.choice_index(prompt_index, sample)
            renderer.observe(index, sample)
            choice = choices[index]
            choice.text += sample.text
            choice.logprobs += sample.logprobs or []
            choice.finish_reason = sample.finish_reason or choice.finish_reason
        if event.summary is not None:
            summaries.append(event.summary)
    return renderer.body(renderer.object, [renderer.choice(i, c, logprobs) for i, c in enumerate(choices)],
                         renderer.usage(summaries))


async def sse(renderer: Renderer, events: Events, num_prompts: int, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per sample event that carries something, then usage, then [DONE]."""
    def data(choices: list[dict], with_usage: dict | None = None) -> str:
        body = renderer.body(renderer.chunk_object, choices, with_usage)
        if not include_usage:
            del body["usage"]
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    if isinstance(renderer, ChatRenderer):
        for index in range(num_prompts * renderer.n):
            yield data([renderer.role_chunk(index)])
    offsets: dict[int, int] = {}
    summaries = []
    async for prompt_index, event in events:
        for sample in event.samples:
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
    yield "data: [DONE]\n\n"
