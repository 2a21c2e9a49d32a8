"""Incremental detokenization with stop strings: one per sample, used by every transport.

Text is only emitted once it cannot change: a piece that ends in a broken multi-byte
character (U+FFFD) waits for the next token, and while stop strings are set the last
(longest stop - 1) characters are held back so a stop string is never streamed and
then cut. `finish()` flushes the rest so the streamed text always equals the decoded ids.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.core.sampling_params import SamplingParams
from services.core.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the output, for tokenizers that merge spaces


@dataclass
class TextDelta:
    text: str
    stop: str | None = None  # the stop string that matched (the sample is finished)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer, self.params = tokenizer, params
        self.context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.output_ids: list[int] = []
        self.text = ""  # the output's text so far (stop string cut off)
        self.emitted = 0  # characters of self.text already returned
        self.stopped: str | None = None
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    def add(self, token_ids: list[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", self.stopped)
        self.output_ids += token_ids
        full = self._decode_output()
        if full.endswith("\ufffd"):
            return TextDelta("")
        search_from = max(len(self.text) - self._holdback, 0)
        self.text = full
        for stop in self.params.stop:
            at = self.text.find(stop, max(search_from - len(stop), 0))
            if at >= 0:
                self.stopped = stop
                self.text = self.text[:at + (len(stop) if self.params.include_stop_str_in_output else 0)]
                return TextDelta(self._take(len(self.text)), stop)
        return TextDelta(self._take(len(self.text) - self._holdback))

    def finish(self) -> str:
        """The text not yet returned, once the sample ended."""
        if not self.stopped:
            self.text = self._decode_output()
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:upto], upto
        return piece

    def _decode_output(self) -> str:
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self.context, skip)
        whole = self.tokenizer.decode(self.context + self.output_ids, skip)
        return whole[len(prefix):] if whole.startswith(prefix) else self.tokenizer.decode(self.output_ids, skip)
