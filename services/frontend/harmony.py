"""gpt-oss's harmony format, read as it is generated (the `gpt_oss` reasoning parser).

A reply is messages, each a header and a body: `<|channel|>analysis<|message|>...<|end|>`, then
`<|start|>assistant<|channel|>final<|message|>...<|return|>`; a tool call is a commentary message
to a function, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
(the recipient may also stand before the channel). The analysis channel is the thinking, the final
channel (and commentary to no one) the answer, and a call goes to the tool-call reader as the
Hermes block `<tool_call>{"name": NAME, "arguments": ...}</tool_call>`, so its arguments stream the
same way as every other model's. The text must keep the special tokens (the request is decoded with
skip_special_tokens false). Written from the format's published description: the `openai-harmony`
package needs to download its encoding's vocabulary file, which an offline server cannot.
"""
from __future__ import annotations

import re

from services.frontend.tool_stream import Piece, ToolCallStream

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.-]+)")
# a call as the tool-call reader of each tool choice reads one (named: the arguments alone)
CALL_OPEN = {"auto": '<tool_call>{{"name": "{name}", "arguments": ', "required": '[{{"name": "{name}", "arguments": '}
CALL_CLOSE = {"auto": "}</tool_call>", "required": "}]"}
MAX_HEADER_CHARS = 256  # a longer "header" is not one: the model is not writing harmony


class HarmonyReader:
    """Same interface as ToolCallStream (feed, finish, calls); pieces of kind "reasoning" for the
    analysis channel, then the answer reader's."""

    def __init__(self, answer: ToolCallStream):
        self.answer = answer
        self.state, self.kind = "header", ""  # kind of the body: reasoning, content or call
        self._held = ""
        self._header = ""

    @property
    def calls(self) -> list:
        return self.answer.calls

    @property
    def thinking(self) -> bool:
        """Inside the analysis channel: the tokens fed now are reasoning tokens (usage)."""
        return self.state == "body" and self.kind == "reasoning"

    def feed(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        self._held += text
        while self._held:
            if self.state == "header" and not self._read_header(pieces):
                break
            if self.state == "body" and not self._read_body(pieces):
                break
        return pieces

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        held, self._held = self._held, ""
        if self.state == "header":
            self._emit("content", _without_markers(self._header + held), pieces)
        else:
            self._emit(self.kind, held, pieces)
            self._end_body(pieces)
        return pieces + self.answer.finish()

    def _read_header(self, pieces: list[Piece]) -> bool:
        at = self._held.find(MESSAGE)
        if at < 0:
            if len(self._header) + len(self._held) > MAX_HEADER_CHARS:  # plain text: the answer
                self._emit("content", self._header + self._held, pieces)
                self._header, self._held, self.state, self.kind = "", "", "body", "content"
            return False
        header, self._held = self._header + self._held[:at], self._held[at + len(MESSAGE):]
        self._header, self.state = "", "body"
        words = header.split(CHANNEL, 1)[1].split() if CHANNEL in header else []
        channel = words[0] if words else ""
        recipient = RECIPIENT.search(header)
        self.kind = "reasoning" if channel == "analysis" else "call" if recipient else "content"
        if self.kind == "call":
            self._to_answer(CALL_OPEN.get(self.answer.mode, "").format(name=recipient.group(1)), pieces)
        return True

    def _read_body(self, pieces: list[Piece]) -> bool:
        ends = [(i, m) for m in ENDS if (i := self._held.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(self.kind, self._held[:at], pieces)
            self._held = self._held[at + len(marker):]
            self._end_body(pieces)
            self.state = "header"
            return True
        keep = next((i for i in range(len(self._held)) if any(m.startswith(self._held[i:]) for m in ENDS)),
                    len(self._held))  # a tail that may begin an end marker
        self._emit(self.kind, self._held[:keep], pieces)
        self._held = self._held[keep:]
        return False

    def _end_body(self, pieces: list[Piece]) -> None:
        if self.kind == "call":
            self._to_answer(CALL_CLOSE.get(self.answer.mode, ""), pieces)
        self.kind = ""

    def _emit(self, kind: str, text: str, pieces: list[Piece]) -> None:
        if not text:
            return
        if kind == "reasoning":
            if pieces and pieces[-1].kind == "reasoning":
                pieces[-1].text += text
            else:
                pieces.append(Piece(kind="reasoning", text=text))
        else:
            self._to_answer(text, pieces)

    def _to_answer(self, text: str, pieces: list[Piece]) -> None:
        pieces += self.answer.feed(text)


def _without_markers(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text
