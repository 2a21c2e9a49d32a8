"""Incremental detokenization with stop strings: one per sample, used by every transport.

Text is only emitted once it cannot change: a piece that ends in a broken multi-byte
character (U+FFFD) waits for the next token, and while stop strings are set the last
(longest stop - 1) characters are held back so a stop string is never streamed and
then cut. `finish()` flushes the rest so the streamed text always equals the decoded ids.

Each token costs a decode of a short window, not of the whole output: tokens
[prefix_offset, read_offset) are the ones decoded last time, and the new text is what
decoding from prefix_offset to the end adds to them (vLLM's scheme).
"""
from __future__ import annotations

from dataclasses import dataclass

from services.core.sampling_params import SamplingParams
from services.core.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the output, for tokenizers that merge spaces
BROKEN = "\ufffd"  # what decoding makes of an incomplete multi-byte character


@dataclass
class TextDelta:
    text: str
    stop: str | None = None  # the stop string that matched (the sample is finished)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer, self.params = tokenizer, params
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if self._decode_ids(context).endswith(BROKEN):
            context = []  # a prompt ending inside a character: decode the output on its own
        self.tokens = context
        self.prefix_offset, self.read_offset = 0, len(context)
        self.text = ""  # the output's complete text so far (stop string cut off)
        self.pending = ""  # decoded after `text` but ending in a broken character: not final yet
        self.emitted = 0  # characters of self.text already returned
        self.checked = 0  # characters already searched for stop strings
        self.stopped: str | None = None
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    def add(self, token_ids: list[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", self.stopped)
        self.tokens += token_ids
        self.text += self._read()
        stop = self._find_stop()
        if stop is not None:
            return TextDelta(self._take(len(self.text)), stop)
        return TextDelta(self._take(len(self.text) - self._holdback))

    def finish(self) -> str:
        """The text not yet returned, once the sample ended."""
        if not self.stopped:
            self.text += self.pending  # a trailing broken character is final now
            self.pending = ""
        return self._take(len(self.text))

    def _read(self) -> str:
        """The complete text the new tokens add; an incomplete end waits in self.pending."""
        prefix = self._decode_ids(self.tokens[self.prefix_offset:self.read_offset])
        new = self._decode_ids(self.tokens[self.prefix_offset:])[len(prefix):]
        if new.endswith(BROKEN):
            self.pending = new
            return ""
        self.prefix_offset, self.read_offset, self.pending = self.read_offset, len(self.tokens), ""
        return new

    def _find_stop(self) -> str | None:
        """Search the text that is final (a pending broken character cannot start a stop string,
        but what precedes it can end one); on a match, cut the text there."""
        final = self.text + self.pending.rstrip(BROKEN)
        for stop in self.params.stop:
            at = final.find(stop, max(self.checked - len(stop) + 1, 0))
            if at >= 0:
                self.stopped, self.pending = stop, ""
                self.text = final[:at + (len(stop) if self.params.include_stop_str_in_output else 0)]
                return stop
        self.checked = len(final)
        return None

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:upto], upto
        return piece

    def _decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.params.skip_special_tokens)
