"""Per-request sampling parameters, validated once where they enter a process.

A caller's SamplingParams(...) is checked when built (the frontend, LLM(...)), and the in-process
scheduler takes them as they are. A SubmitMany message is input too: the scheduler service checks
its params as it decodes them (internal_codec.submit_from_proto). Anything else that crosses the
internal wire is decoded with `unchecked`, so a worker (each NewSequence, every resend) checks nothing.
One implementation of the checks: `validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from services.core.errors import check
from services.core.structured import Constraint
from services.core.widths import INT32_MAX, SEED_END, UINT32_MAX, check_int

MAX_LOGPROBS = 20
MAX_N = 64  # samples per request
MAX_STOP_STRINGS = 16

# Each float setting's range, held once: SamplingParams.validate checks it where params enter, and
# the HTTP schema states it (http/models.py, float_bounds). (low, high, low_open): low < x when
# low_open, else low <= x; and x <= high.
FLOAT_RANGES = {"temperature": (0, 100, False), "top_p": (0, 1, True), "min_p": (0, 1, False),
                "repetition_penalty": (0, 10, True), "presence_penalty": (-2, 2, False),
                "frequency_penalty": (-2, 2, False)}
LOGIT_BIAS_RANGE = (-100, 100)


def float_bounds(name: str) -> dict[str, float]:
    """A float setting's range as pydantic's Field bounds (gt/ge, le)."""
    low, high, low_open = FLOAT_RANGES[name]
    return {"gt" if low_open else "ge": low, "le": high}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What a request asks of the sampler. Names follow vLLM / OpenAI.

    temperature 0 means greedy. `seed` None means the engine assigns one at admission
    and reports it back; the random draw for the token at position p of sample i is a
    pure function of (seed, i, p).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's and the top k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # the output must match this (services/core/structured.py); a dict is vLLM's form, e.g. {"json": schema}
    structured_outputs: Constraint | None = None
    # "embed" or "score": prefill only, the worker returns the prompt's pooled output (an embedding,
    # or scores) instead of a token, and the request ends (services/core/pooling.py); "": generate
    pooling: str = ""

    def __post_init__(self) -> None:
        # Accept lists and dicts from callers; store hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", Constraint.from_options(self.structured_outputs))
        self.validate()

    @classmethod
    def unchecked(cls, **values) -> SamplingParams:
        """Built from decoded wire values (already tuples) without the checks: see the module's doc."""
        params = object.__new__(cls)
        for f in fields(cls):
            object.__setattr__(params, f.name, values.get(f.name, f.default))
        return params

    def validate(self) -> None:
        """Raise InvalidArgument naming the first field out of range."""
        check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n}")
        for name, (low, high, low_open) in FLOAT_RANGES.items():
            value = getattr(self, name)
            check((low < value if low_open else low <= value) and value <= high, name,
                  f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
        check_int("top_k", self.top_k, -1, INT32_MAX)  # -1: off
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias:
            check(0 <= token <= UINT32_MAX, "logit_bias", f"token id must be in [0, {UINT32_MAX}], got {token}")
            check(low <= bias <= high, "logit_bias", f"bias must be in [{low}, {high}], got {bias}")
        check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < SEED_END),
              "seed", f"must be in [0, 2**63), got {self.seed}")
        check_int("max_tokens", self.max_tokens, 1, UINT32_MAX)
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be in [0, max_tokens], got {self.min_tokens}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        check(all(0 <= t <= UINT32_MAX for t in self.stop_token_ids), "stop_token_ids",
              f"token ids must be in [0, {UINT32_MAX}]")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, Constraint),
              "structured_outputs", "must be a Constraint or a dict of vLLM's options")
        check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
              "cannot be combined with structured outputs (the grammar decides where the output may end)")
        check(self.pooling in ("", "embed", "score"), "pooling", f"one of embed, score or \"\", got {self.pooling!r}")
        check(not self.pooling or (self.n == 1 and self.logprobs is None and self.prompt_logprobs is None
                                   and self.structured_outputs is None), "pooling",
              "a pooling request takes no sampling options (n, logprobs, structured outputs)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), name,
                  f"must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, seed: int) -> SamplingParams:
        """This request's params with the seed it was assigned (checked params stay checked)."""
        check(isinstance(seed, int) and 0 <= seed < SEED_END, "seed", f"must be in [0, 2**63), got {seed}")
        return SamplingParams.unchecked(**{**{f.name: getattr(self, f.name) for f in fields(self)}, "seed": seed})

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the params name must exist in the model's vocabulary."""
        for token, _ in self.logit_bias:
            check(token < vocab_size, "logit_bias", f"token id {token} >= vocab size {vocab_size}")
        for token in self.stop_token_ids:
            check(token < vocab_size, "stop_token_ids", f"token id {token} >= vocab size {vocab_size}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
