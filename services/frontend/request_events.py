"""RequestEvents: one request's samples as the frontend follows them, turned into GenerateEvents
(text deltas, stop strings, counts).

The core OutputCollector (the one LLM.generate uses) does the detokenizing and the stop
strings; this turns what each scheduler message added into a GenerateEvent.
"""
from __future__ import annotations

from services.core.outputs import OutputCollector
from services.core.sampling_params import SamplingParams
from services.core.sequence import SeqUpdate
from services.core.tokenizer import Tokenizer
from services.frontend.types import GenerateEvent, SampleEvent, Summary


class RequestEvents:
    """After `apply`, `stopped` names the samples a stop string just ended: the caller ends
    them at the scheduler; their later tokens are dropped."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer):
        self.collector = OutputCollector(request_id, None, prompt_token_ids, params, tokenizer)
        self.stopped: list[int] = []

    @property
    def finished(self) -> bool:
        return self.collector.output.finished

    def apply(self, updates: list[SeqUpdate]) -> GenerateEvent:
        output = self.collector.output
        event, self.stopped = GenerateEvent(request_id=output.request_id), []
        for update in updates:
            if update.prompt_logprobs is not None:
                event.prompt_logprobs = update.prompt_logprobs
            sample = output.outputs[update.sample_index]
            if sample.finish_reason is not None:
                continue
            num_chars, num_tokens = len(sample.text), len(sample.token_ids)
            if self.collector.apply(update):
                self.stopped.append(update.sample_index)
            logprobs = sample.logprobs[num_tokens:] if sample.logprobs is not None else None
            event.samples.append(SampleEvent(index=sample.index, text=sample.text[num_chars:],
                                             token_ids=sample.token_ids[num_tokens:], logprobs=logprobs,
                                             finish_reason=sample.finish_reason, stop_reason=sample.stop_reason))
        return event

    def summary(self) -> Summary:
        output = self.collector.output
        return Summary(finish_reasons=[s.finish_reason or "abort" for s in output.outputs],
                       num_prompt_tokens=len(output.prompt_token_ids),
                       num_completion_tokens=sum(len(s.token_ids) for s in output.outputs),
                       num_cached_tokens=output.num_cached_tokens, seed=output.seed)
