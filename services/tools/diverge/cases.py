"""The requests `diverge` compares: the user's prompts (a JSONL file) and the random neighbours
that fill the batches around them.

One JSON object a line: exactly one of `prompt` (text), `messages` (chat, rendered with the
model's chat template) or `prompt_token_ids`; optionally `id` and any SamplingParams field
(`temperature`, `seed`, `max_tokens`, ...), which override the command's sampling flags.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from services.core.errors import InvalidArgument, check
from services.core.sampling_params import SamplingParams
from services.core.tokenizer import Tokenizer

MIN_LOGPROBS = 2  # the chosen token's logprob and the top two, for the margin at a divergence
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
NEIGHBOUR_MAX_PROMPT = 48  # tokens; a neighbour generates up to twice the batch's max_tokens


@dataclass(frozen=True, kw_only=True)
class Case:
    """One request of the user's file, tokenized once so every variant runs the same ids."""

    id: str
    label: str  # the prompt as the report shows it
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # with logprobs >= MIN_LOGPROBS


def with_logprobs(params: SamplingParams) -> SamplingParams:
    return replace(params, logprobs=max(params.logprobs or 0, MIN_LOGPROBS))


def load_cases(path: Path, tokenizer: Tokenizer, defaults: dict) -> list[Case]:
    """Parse the JSONL file; a bad line is an InvalidArgument naming its line and field."""
    cases = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            cases.append(_case(number, line, tokenizer, defaults))
    check(bool(cases), "prompts", f"{path} holds no prompt")
    ids = [c.id for c in cases]
    check(len(set(ids)) == len(ids), "prompts", f"duplicate ids in {path}")
    return cases


def _case(number: int, line: str, tokenizer: Tokenizer, defaults: dict) -> Case:
    where = f"prompts line {number}"
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(where, f"not JSON: {exc}") from exc
    check(isinstance(entry, dict), where, "must be a JSON object")
    given = [k for k in PROMPT_KEYS if k in entry]
    check(len(given) == 1, where, f"needs exactly one of {', '.join(PROMPT_KEYS)}")
    key = given[0]
    if key == "prompt":
        check(isinstance(entry[key], str) and entry[key] != "", f"{where}: prompt", "must be a non-empty string")
        ids, label = tokenizer.encode(entry[key]), entry[key]
    elif key == "messages":
        text = tokenizer.apply_chat_template(entry[key])  # a chat template brings its own special tokens
        ids, label = tokenizer.encode(text, add_special_tokens=False), entry[key][-1].get("content", "")
    else:
        value = entry[key]
        check(isinstance(value, list) and value and all(isinstance(t, int) for t in value),
              f"{where}: prompt_token_ids", "must be a non-empty list of token ids")
        ids, label = value, f"{len(value)} token ids"
    fields = set(SamplingParams.field_names())
    unknown = [k for k in entry if k not in fields and k not in PROMPT_KEYS and k != "id"]
    check(not unknown, where, f"unknown keys {unknown}")
    try:
        params = SamplingParams(**{**defaults, **{k: v for k, v in entry.items() if k in fields}})
    except (InvalidArgument, TypeError) as exc:
        raise InvalidArgument(where, str(exc)) from exc
    case_id = str(entry.get("id", f"p{number}"))
    return Case(id=case_id, label=label, prompt_token_ids=tuple(ids), params=with_logprobs(params))


def neighbours(num: int, vocab_size: int, max_tokens: int, rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Random requests to share a batch with: random token ids (clear of the usual special ids
    0..2), random lengths, greedy and seeded sampling mixed, running to their max_tokens."""
    out = []
    for _ in range(num):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, NEIGHBOUR_MAX_PROMPT))]
        sampled = rng.random() < 0.5
        params = SamplingParams(temperature=rng.uniform(0.5, 1.2) if sampled else 0.0, top_p=0.95 if sampled else 1.0,
                                seed=rng.getrandbits(32) if sampled else None, ignore_eos=True,
                                max_tokens=rng.randint(max(1, max_tokens // 2), max_tokens * 2))
        out.append((prompt, params))
    return out
