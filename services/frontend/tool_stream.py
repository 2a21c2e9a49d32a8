"""Tool calls read from a model's output as it is generated: content, call starts and argument pieces.

One reader for every API and for streamed and whole answers alike: a whole answer is the stream fed
at once (`ToolPlan.parse`), so the arguments a client joins from the deltas are, byte for byte, the
arguments of the non-streamed call. The arguments are the model's own text of the arguments value
(never re-serialized); under a required or named tool choice the grammar keeps that text valid JSON.

What is read, by tool choice:
- named: the whole output is the arguments object of the one named call;
- required: a JSON list of `{"name": ..., "arguments": {...}}` objects (the grammar's shape);
- auto: content, with Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, or an output that is only such an object (or a list of them). `parameters` is taken for
  `arguments` (Llama 3.1), and arguments given as JSON text are decoded. A call starts once its
  name is read and is one of the tools; text held while it may still be a call is content if it
  turns out not to be one. A call cut short (max_tokens) keeps the arguments generated so far.
"""
from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
WHITESPACE = " \t\r\n"
SCALAR_CHARS = set("-+0123456789.eEtruefalsn")


@dataclass(kw_only=True)
class Piece:
    """content (text), call (index, name: a call starts), or arguments (index, text: more of them)."""

    kind: str
    text: str = ""
    index: int = 0
    name: str = ""


class NotACall(Exception):
    pass


class ToolCallStream:
    def __init__(self, mode: str, names: set[str], named: str = "", new_call=None):
        self.mode, self.names, self.named = mode, names, named
        self.new_call = new_call  # (name) -> ToolCall: the calls, with their ids
        self.calls: list = []  # the ToolCalls started so far; their arguments grow
        self._pieces: list[Piece] = []
        self._pushed: str | None = None
        self._ended = False
        self._raw: list[str] = []  # the text of a candidate call, given back as content if it is not one
        self._parser = self._parse()
        next(self._parser)

    def feed(self, text: str) -> list[Piece]:
        for char in text:
            self._parser.send(char)
        return self._take()

    def finish(self) -> list[Piece]:
        if not self._ended:
            try:
                self._parser.send(None)
            except StopIteration:
                pass
        return self._take()

    def _take(self) -> list[Piece]:
        merged: list[Piece] = []
        for piece in self._pieces:
            last = merged[-1] if merged else None
            if last and piece.kind == last.kind != "call" and piece.index == last.index:
                last.text += piece.text
            else:
                merged.append(piece)
        self._pieces = []
        return merged

    # the output
    def _content(self, text: str) -> None:
        if text:
            self._pieces.append(Piece(kind="content", text=text))

    def _start(self, name: str) -> int:
        self.calls.append(self.new_call(name))
        index = len(self.calls) - 1
        self._pieces.append(Piece(kind="call", index=index, name=name))
        return index

    def _arguments(self, index: int, text: str) -> None:
        if text:
            self.calls[index].arguments += text
            self._pieces.append(Piece(kind="arguments", text=text, index=index))

    # the parser: a generator fed one character at a time (None at the end)
    def _char(self) -> Generator[None, str | None, str | None]:
        if self._pushed is not None:
            char, self._pushed = self._pushed, None
        elif self._ended:
            return None
        else:
            char = yield
            if char is None:
                self._ended = True
                return None
        self._raw.append(char)
        return char

    def _push(self, char: str | None) -> None:
        if char is not None:
            self._pushed = char
            self._raw.pop()

    def _after_space(self):
        char = yield from self._char()
        while char is not None and char in WHITESPACE:
            char = yield from self._char()
        return char

    def _parse(self):
        if self.mode == "named":
            index = self._start(self.named)
            while (char := (yield from self._char())) is not None:
                self._arguments(index, char)
        elif self.mode == "required":
            try:
                yield from self._json_calls((yield from self._after_space()))
            except NotACall:
                pass
        elif self.mode == "auto":
            yield from self._auto()
        else:
            while (char := (yield from self._char())) is not None:
                self._content(char)
        while not self._ended:  # the grammar's end: anything more is ignored
            yield from self._char()

    def _auto(self):
        space, first = "", (yield from self._char())
        while first is not None and first in WHITESPACE:
            space, first = space + first, (yield from self._char())
        if first in ("{", "["):
            self._raw = [first]
            num_calls = len(self.calls)
            try:
                yield from self._json_calls(first)
                return (yield from self._content_with_blocks())
            except NotACall:
                if len(self.calls) == num_calls:
                    self._content(space + "".join(self._raw))
        else:
            self._push(first)
            self._content(space)
        yield from self._content_with_blocks()

    def _content_with_blocks(self):
        held = ""  # a tail that may begin <tool_call>
        while (char := (yield from self._char())) is not None:
            held += char
            if held == TOOL_CALL_OPEN:
                held = ""
                yield from self._block()
            elif not TOOL_CALL_OPEN.startswith(held):
                cut = next((i for i in range(1, len(held)) if TOOL_CALL_OPEN.startswith(held[i:])), len(held))
                self._content(held[:cut])
                held = held[cut:]
        self._content(held)

    def _block(self):
        """After <tool_call>: a call object, then </tool_call>. Not a call: the block is content."""
        self._raw = list(TOOL_CALL_OPEN)
        num_calls = len(self.calls)
        try:
            char = yield from self._after_space()
            if char != "{":
                raise NotACall
            yield from self._call_object()
        except NotACall:
            if len(self.calls) == num_calls:
                self._content("".join(self._raw))
            return
        char = yield from self._after_space()
        for expected in TOOL_CALL_CLOSE:  # a missing or odd close tag is dropped
            if char != expected:
                self._push(char)
                return
            char = yield from self._char()
        self._push(char)

    def _json_calls(self, first: str | None):
        """A call object or a list of them; `first` is the first character."""
        if first == "{":
            return (yield from self._call_object())
        if first != "[":
            raise NotACall
        char = yield from self._after_space()
        while char == "{":
            yield from self._call_object()
            char = yield from self._after_space()
            if char == ",":
                char = yield from self._after_space()
        if char != "]":
            raise NotACall

    def _call_object(self):
        """After `{`: keys name and arguments (or parameters), in either order, others skipped."""
        name, index, held = None, None, []
        char = yield from self._after_space()
        while char == '"':
            key = yield from self._string()
            if (yield from self._after_space()) != ":":
                raise NotACall
            char = yield from self._after_space()
            if key == "name" and name is None:
                if char != '"':
                    raise NotACall
                name = yield from self._string()
                if name not in self.names:
                    raise NotACall
                index = self._start(name)
                self._arguments(index, "".join(held))
            elif key in ("arguments", "parameters") and not held and (index is None or not self.calls[index].arguments):
                sink = (lambda text: self._arguments(index, text)) if index is not None else held.append
                if char == '"':  # arguments as JSON text
                    text = yield from self._string()
                    sink(text)
                else:
                    yield from self._value(char, sink)
            else:
                yield from self._value(char, lambda text: None)
            char = yield from self._after_space()
            if char == ",":
                char = yield from self._after_space()
        if char != "}" or index is None:
            raise NotACall

    def _string(self):
        """After the opening quote: the string's value."""
        raw = ['"']
        while (char := (yield from self._char())) is not None:
            raw.append(char)
            if char == "\\":
                raw.append((yield from self._char()) or "")
            elif char == '"':
                try:
                    return json.loads("".join(raw))
                except ValueError:
                    raise NotACall from None
        raise NotACall

    def _value(self, char: str | None, sink):
        """A JSON value starting with `char`, each character given to sink as it is read."""
        if char is None:
            raise NotACall
        if char not in '{["':
            while char is not None and char in SCALAR_CHARS:
                sink(char)
                char = yield from self._char()
            return self._push(char)
        depth, in_string = 0, False
        while char is not None:
            sink(char)
            if in_string:
                if char == "\\":
                    char = yield from self._char()
                    if char is None:
                        break
                    sink(char)
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
            if depth == 0 and not in_string:
                return
            char = yield from self._char()
        raise NotACall
