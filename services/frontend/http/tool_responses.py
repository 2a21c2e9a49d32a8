"""Chat responses of a request with tools: `message.tool_calls` and finish_reason "tool_calls".

Non-streamed, the whole output is parsed (services/frontend/tools.py). Streamed, a sample's text
is held back while it may still be a tool call (with tool_choice auto: until it starts with
something other than `<tool_call>`, `{` or `[`; it is then streamed as content); a sample that
is a call is sent when it ends, as one delta with `tool_calls` entries carrying `index`, `id`,
`type` and the whole `function` (name and arguments), which the OpenAI SDK's stream helpers
accumulate like any other split.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.frontend.http.responses import ChatRenderer, Choice
from services.frontend.tools import ToolPlan
from services.frontend.types import SampleEvent


@dataclass
class ToolChatRenderer(ChatRenderer):
    plan: ToolPlan = None
    _held: dict[int, str] = field(default_factory=dict)  # choice index -> text held back
    _streaming: set[int] = field(default_factory=set)  # choices known to be plain content

    def choice(self, index: int, choice: Choice, logprobs: bool) -> dict:
        body = super().choice(index, choice, logprobs)
        content, calls = self.plan.parse(choice.text)
        if calls:
            body["message"] = {"role": "assistant", "content": content,
                               "tool_calls": [c.to_openai() for c in calls]}
            body["finish_reason"] = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
        return body

    def chunk_choice(self, index: int, sample: SampleEvent, offset: int) -> dict | None:
        if index in self._streaming:
            return super().chunk_choice(index, sample, offset)
        text = self._held.get(index, "") + sample.text
        if self.plan.mode == "auto" and _plainly_content(text):
            self._streaming.add(index)
            self._held.pop(index, None)
            return {**super().chunk_choice(index, sample, offset), "delta": {"content": text}}
        if sample.finish_reason is None:
            self._held[index] = text
            return None
        self._held.pop(index, None)
        content, calls = self.plan.parse(text)
        chunk = super().chunk_choice(index, sample, offset)
        if not calls:
            return {**chunk, "delta": {"content": text} if text else {}}
        delta = {"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]}
        if content:
            delta["content"] = content
        finish = "tool_calls" if sample.finish_reason == "stop" else sample.finish_reason
        return {**chunk, "delta": delta, "finish_reason": finish}


def _plainly_content(text: str) -> bool:
    head = text.lstrip()
    return bool(head) and not head.startswith(("{", "[")) and not "<tool_call>".startswith(head[:11]) \
        and not head.startswith("<tool_call>")
