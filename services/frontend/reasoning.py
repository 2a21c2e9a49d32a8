"""Reasoning models: their thinking kept apart from the answer, and constraints applied after it.

A reasoning parser (`--reasoning-parser`, vLLM's names) knows the markers a model thinks between:
`qwen3` and `deepseek_r1` both write `<think> ... </think>` and then the answer; `gpt_oss` writes
harmony channels (services/frontend/harmony.py: analysis is the thinking, final the answer). Whether an output
starts inside the thinking is read from the rendered prompt: a template that opens the thinking
itself (DeepSeek-R1's `<｜Assistant｜><think>\\n`, Qwen3-Thinking-2507) leaves the start marker
open at the prompt's end, and one that closes it (Qwen3 with `enable_thinking: false`) leaves an
empty `<think>\\n\\n</think>` block, so the output is all answer. `deepseek_r1` also treats an
output as thinking from its first token when the prompt does not say (its older templates).

`ReasoningReader` splits an output as it is generated, in front of the tool-call reader
(services/frontend/tool_stream.py), which then sees the answer only; a whole answer is the same
reader fed at once, so streamed reasoning pieces join into exactly the non-streamed reasoning. The
whitespace around the markers is dropped (the thinking's leading and trailing, the answer's leading).

`thinking_constraint` turns a request's constraint (JSON schema, regex, choice, a forced tool call)
and its reasoning budget into one Lark grammar for llguidance: free text for the thinking, at most
`max_tokens` of it (`think[max_tokens=N]`, which llguidance enforces: after N tokens the only token
allowed is the end marker), then the end marker as its token, then the constrained answer. It is
compiled and replayed like any other constraint (docs/ARCHITECTURE.md, rule 4): the worker needs no
state of its own for it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from services.core.errors import check
from services.core.structured import Constraint
from services.frontend.harmony import HarmonyReader
from services.frontend.tool_stream import Piece, ToolCallStream

WHITESPACE = " \t\r\n"
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # structured.py's


@dataclass(frozen=True, kw_only=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_thinks: bool = False  # the output is thinking from its first token unless the prompt closed it
    harmony: bool = False  # gpt-oss: channels, not markers (services/frontend/harmony.py)


PARSERS = {"qwen3": ReasoningParser(name="qwen3"),
           "deepseek_r1": ReasoningParser(name="deepseek_r1", always_thinks=True),
           "gpt_oss": ReasoningParser(name="gpt_oss", start="<|channel|>analysis<|message|>", end="<|end|>",
                                      harmony=True)}
CHOICES = ("", "auto", *PARSERS)  # "": no parser


def choose(name: str, template: str) -> ReasoningParser | None:
    """The parser named by --reasoning-parser; under `auto`, the one the chat template's markers say."""
    check(name in CHOICES, "reasoning_parser", f"must be one of {', '.join(repr(c) for c in CHOICES)}, got {name!r}")
    if name != "auto":
        return PARSERS.get(name)
    if "<|channel|>" in template:
        return PARSERS["gpt_oss"]
    if "<think>" not in template:
        return None
    return PARSERS["deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"]


@dataclass(frozen=True)
class Thinking:
    """One request's reasoning: its parser, and whether the output starts inside the thinking."""

    parser: ReasoningParser
    starts_inside: bool

    @classmethod
    def of(cls, parser: ReasoningParser, prompt_tail: str) -> Thinking | None:
        """`prompt_tail`: the rendered prompt's last characters (special tokens kept). None when
        the prompt ends with the thinking closed: the output is all answer."""
        tail = prompt_tail.rstrip(WHITESPACE)
        if parser.harmony:
            return cls(parser, False)  # the reply's headers say which channel each part is
        if tail.endswith(parser.end):
            return None
        return cls(parser, tail.endswith(parser.start) or parser.always_thinks)

    def reader(self, answer: ToolCallStream) -> ReasoningReader | HarmonyReader:
        return HarmonyReader(answer) if self.parser.harmony else ReasoningReader(self, answer)


class ReasoningReader:
    """Pieces of kind "reasoning" for the thinking, then the answer reader's pieces (content,
    calls, arguments). Same interface as ToolCallStream: feed, finish, calls."""

    def __init__(self, thinking: Thinking, answer: ToolCallStream):
        self.parser, self.answer = thinking.parser, answer
        self.state = "before"  # until the start marker is read, or known not to come
        self._otherwise = "reasoning" if thinking.starts_inside else "answer"  # without a start marker
        self._held = ""  # text that may still be (part of) a marker, or trailing whitespace of the thinking
        self._thought = False  # some reasoning text was given (its leading whitespace is dropped)
        self._after_end = False  # the answer follows an end marker (its leading whitespace is dropped)
        self.num_reasoning_chars = 0

    @property
    def calls(self) -> list:
        return self.answer.calls

    @property
    def thinking(self) -> bool:
        """Inside the thinking: the tokens fed now are reasoning tokens (usage)."""
        return self.state == "reasoning" or (self.state == "before" and self._otherwise == "reasoning")

    def feed(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        self._held += text
        while self._held:
            if self.state == "before" and not self._before():
                break
            if self.state == "reasoning" and not self._reasoning(pieces):
                break
            if self.state == "answer":
                pieces += self._answer(self._held)
                self._held = ""
        return pieces

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        held, self._held = self._held, ""
        if self.state == "before":
            self.state = self._otherwise
        if self.state == "answer":
            pieces += self.answer.feed(held)
        else:
            self._reason(held.rstrip(WHITESPACE), pieces)
        return pieces + self.answer.finish()

    def _before(self) -> bool:
        """Whether the text held is decided: the start marker (then thinking) or not (then answer)."""
        stripped = self._held.lstrip(WHITESPACE)
        if stripped.startswith(self.parser.start):
            self._held, self.state = stripped[len(self.parser.start):], "reasoning"
            return True
        if self.parser.start.startswith(stripped):
            return False  # empty or a prefix of the marker: wait
        self.state = self._otherwise
        return True

    def _reasoning(self, pieces: list[Piece]) -> bool:
        end = self._held.find(self.parser.end)
        if end >= 0:
            self._reason(self._held[:end].rstrip(WHITESPACE), pieces)
            self._held, self.state, self._after_end = self._held[end + len(self.parser.end):], "answer", True
            return True
        keep = next((i for i in range(len(self._held)) if self.parser.end.startswith(self._held[i:])),
                    len(self._held))  # a tail that may begin the end marker
        text = self._held[:keep]
        sure = len(text.rstrip(WHITESPACE))  # trailing whitespace waits: it is dropped before the end marker
        self._reason(text[:sure], pieces)
        self._held = self._held[sure:]
        return False

    def _reason(self, text: str, pieces: list[Piece]) -> None:
        if not self._thought:
            text = text.lstrip(WHITESPACE)
        if text:
            self._thought = True
            self.num_reasoning_chars += len(text)
            if pieces and pieces[-1].kind == "reasoning":
                pieces[-1].text += text
            else:
                pieces.append(Piece(kind="reasoning", text=text))

    def _answer(self, text: str) -> list[Piece]:
        if self._after_end:
            text = text.lstrip(WHITESPACE)
            self._after_end = not text
        return self.answer.feed(text) if text else []


def num_reasoning_tokens(reader, token_ids: list[int]) -> int:
    """How many of a sample's new tokens are thinking, for usage's reasoning_tokens (chat completions'
    and the Responses API's): all of them when the reader is inside the thinking before they are fed
    (the end marker's token counts, a start marker's does not), else none. `reader`: the sample's
    reader (a ToolCallStream, without a reasoning parser, never thinks)."""
    return len(token_ids) if getattr(reader, "thinking", False) else 0


def split(pieces: list[Piece]) -> tuple[str, list[Piece]]:
    """(the reasoning text, the other pieces) of a reader's pieces."""
    return "".join(p.text for p in pieces if p.kind == "reasoning"), [p for p in pieces if p.kind != "reasoning"]


def thinking_constraint(thinking: Thinking, constraint: Constraint | None, max_reasoning_tokens: int | None,
                        marker_token) -> Constraint | None:
    """One grammar: thinking (free, at most max_reasoning_tokens tokens), the end marker, then the
    answer under `constraint` (anything when None). `marker_token(text)`: the marker's token id, or
    None when the vocabulary has no single token for it. A user's own Lark grammar is kept as it is
    (it constrains the whole output; it may spell out the thinking itself)."""
    if constraint is None and max_reasoning_tokens is None:
        return None
    if constraint is not None and constraint.kind == "grammar":
        check(max_reasoning_tokens is None, constraint.field, "a Lark grammar cannot be combined with a "
                                                              "reasoning budget (it constrains the thinking too)")
        return constraint
    parser = thinking.parser
    think = "think" if max_reasoning_tokens is None else f"think[max_tokens={max_reasoning_tokens}]"
    if parser.harmony:  # (the analysis message, then the final channel's header) and the answer
        channel, message, end, start = (_marker(m, marker_token) for m in ("<|channel|>", "<|message|>",
                                                                              "<|end|>", "<|start|>"))
        prefix = f'({channel} "analysis" {message} think {end} {start} "assistant")? {channel} "final" {message}'
    else:
        end = _marker(parser.end, marker_token)
        body = f"think {end} /[ \\t\\r\\n]*/"
        prefix = body if thinking.starts_inside else \
            f"({_marker(parser.start, marker_token)} /[ \\t\\r\\n]*/ {body})?"
    lark = f"start: {prefix} answer\n{think}: /(.|\\n)*/\nanswer: {_answer(constraint)}\n"
    return Constraint("grammar", lark, constraint.field if constraint is not None else "max_reasoning_tokens")


def _marker(text: str, marker_token) -> str:
    token = marker_token(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def _answer(constraint: Constraint | None) -> str:
    if constraint is None:
        return "<[*]>*"  # any tokens, special ones too (a tool call's marker may be one)
    if constraint.kind in ("json", "json_object"):
        schema = json.loads(constraint.spec) if constraint.kind == "json" else {"type": "object"}
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        return "%json " + json.dumps({**schema, "x-guidance": JSON_DEFAULTS})
    if constraint.kind == "regex":
        return "/" + _lark_regex(constraint.spec) + "/"
    return " | ".join(json.dumps(c) for c in json.loads(constraint.spec))  # choice


def _lark_regex(pattern: str) -> str:
    """The pattern inside a Lark /.../ literal: its unescaped slashes and its line breaks escaped."""
    out, chars = [], iter(pattern)
    for char in chars:
        if char == "\\":
            out.append(char + next(chars, "\\"))
        else:
            out.append({"/": "\\/", "\n": "\\n", "\r": "\\r"}.get(char, char))
    return "".join(out)
