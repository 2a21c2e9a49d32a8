"""Structured outputs: the constraint a request's tokens must follow, and its compilation.

A `Constraint` is plain data (a kind and its text) that travels with the sampling parameters,
frontend -> scheduler -> worker, as protobuf. The compiler is llguidance (bench/grammar_choice.py
says why): `GrammarCache` turns a constraint into a pristine matcher for one tokenizer, once, and
keeps at most `max_entries` of them in memory (never on disk); a sequence gets a `deep_copy`.

Hostile constraints are bounded three ways (`GrammarLimits`): the constraint's size in bytes is
checked before anything is compiled; llguidance's own fuel limits bound the work of building the
grammar and of every mask; and the frontend refuses a compile that runs past a wall-clock limit
(llguidance drops the GIL while it builds, so the event loop keeps running meanwhile).
Everything here is pure Python over llguidance: no torch, no grpc.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from services.core.config import setting
from services.core.errors import InvalidArgument, check

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `spec` by kind: json, a JSON schema as JSON text; json_object,
    empty (any JSON object); regex, the pattern (Rust regex syntax, whole output); choice, a JSON
    list of the allowed strings; grammar, a Lark grammar (llguidance's dialect; rule `start`)."""

    kind: str
    spec: str = ""
    field: str = field(default="structured_outputs", compare=False)  # the request field, for errors

    def __post_init__(self) -> None:
        check(self.kind in KINDS, self.field, f"unknown constraint kind {self.kind!r}; expected one of {KINDS}")
        check(isinstance(self.spec, str), self.field, "must be text")
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            check(isinstance(choices, list) and 0 < len(choices) <= MAX_CHOICES
                  and all(isinstance(c, str) and c for c in choices), self.field,
                  f"choice must be 1 to {MAX_CHOICES} non-empty strings")

    @classmethod
    def json_schema(cls, schema: dict | str | bool, field: str = "structured_outputs.json") -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "structured_outputs.choice") -> Constraint:
        return cls("choice", json.dumps(list(choices)), field)

    @classmethod
    def from_options(cls, options: dict, field: str = "structured_outputs") -> Constraint:
        """vLLM's structured_outputs: exactly one of json (a schema, dict or text), json_object
        (true), regex, choice (a list of strings) or grammar (Lark text)."""
        check(isinstance(options, dict), field, "must be an object")
        given = {k: v for k, v in options.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(KINDS))
        check(not unknown, f"{field}.{unknown[0] if unknown else ''}",
              f"unknown option; expected one of {', '.join(KINDS)}")
        check(len(given) == 1, field, f"exactly one of {', '.join(KINDS)} is required, got {len(given)}")
        (kind, value), = given.items()
        where = f"{field}.{kind}"
        if kind == "json":
            check(isinstance(value, (dict, str, bool)), where, "must be a JSON schema")
            return cls.json_schema(value, where)
        if kind == "json_object":
            return cls("json_object", "", where)
        if kind == "choice":
            check(isinstance(value, list), where, "must be a list of strings")
            return cls.choice(value, where)
        check(isinstance(value, str) and value, where, "must be non-empty text")
        return cls(kind, value, where)

    def grammar(self) -> str:
        """The llguidance grammar (JSON text) for this constraint. Raises InvalidArgument."""
        import llguidance

        defaults = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        try:
            if self.kind == "json":
                schema = json.loads(self.spec)
                check(isinstance(schema, (dict, bool)), self.field, "a JSON schema must be an object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=defaults)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in json.loads(self.spec))
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            return llguidance.LLMatcher.grammar_from_lark(self.spec)
        except (ValueError, TypeError, RecursionError) as error:
            raise InvalidArgument(self.field, f"invalid {self.kind}: {str(error)[:300]}") from None


@dataclass(frozen=True, kw_only=True)
class GrammarLimits:
    """Bounds on one constraint's compilation (the frontend's flags; llguidance's fuel is not one)."""

    max_bytes: int = setting(64 << 10, "structured outputs: larger constraints are refused (400)",
                             flag="--max-grammar-bytes")
    compile_timeout_s: float = setting(
        5.0, "structured outputs: constraints that take longer to compile are refused (400)",
        flag="--grammar-compile-timeout-s")  # wall clock, enforced by the frontend
    max_grammar_size: int = setting(200_000, "llguidance: symbols in the grammar's productions", cli=False)
    initial_lexer_fuel: int = setting(1_000_000, "llguidance: work building the lexer (~50k/ms)", cli=False)
    step_lexer_fuel: int = setting(200_000, "llguidance: work per mask (~14k/ms)", cli=False)
    max_entries: int = setting(256, "structured outputs: compiled grammars kept in memory (per process)",
                               flag="--grammar-cache-size")

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_grammar_size", "initial_lexer_fuel", "step_lexer_fuel", "max_entries"):
            check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        check(self.compile_timeout_s > 0, "compile_timeout_s", f"must be > 0, got {self.compile_timeout_s}")

    def parser_limits(self):
        import llguidance

        return llguidance.LLParserLimits(max_grammar_size=self.max_grammar_size,
                                         initial_lexer_fuel=self.initial_lexer_fuel,
                                         step_lexer_fuel=self.step_lexer_fuel, verbose_errors=False)


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's view of a tokenizer (from its tokenizer.json text); about 1 s, build once."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GrammarCache:
    """Compiled grammars of one tokenizer: constraint -> pristine matcher, LRU, bounded in memory."""

    def __init__(self, tokenizer, limits: GrammarLimits = GrammarLimits()):
        self.tokenizer, self.limits = tokenizer, limits
        self._entries: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()  # the frontend compiles in threads
        self.num_compiled = 0

    def matcher(self, constraint: Constraint):
        """A fresh matcher for the constraint (a copy of the cached one). Raises InvalidArgument."""
        with self._lock:
            cached = self._entries.get(constraint)
            if cached is not None:
                self._entries.move_to_end(constraint)
                return cached.deep_copy()
        compiled = self._compile(constraint)
        with self._lock:
            self._entries[constraint] = compiled
            while len(self._entries) > self.limits.max_entries:
                self._entries.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, constraint: Constraint):
        import llguidance

        size = len(constraint.spec.encode("utf-8", "surrogatepass"))
        check(size <= self.limits.max_bytes, constraint.field,
              f"the constraint is {size} bytes; the limit is {self.limits.max_bytes}")
        matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar(), log_level=0,
                                       limits=self.limits.parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask: some limits (lexer size) only show here
        if matcher.is_error():
            raise InvalidArgument(constraint.field, f"cannot compile the {constraint.kind}: "
                                                    f"{matcher.get_error().replace('<non-verbose/>', '').strip()[:300]}")
        self.num_compiled += 1
        return matcher

    def __len__(self) -> int:
        return len(self._entries)
