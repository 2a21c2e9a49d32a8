"""The checks a prompt passes before it is admitted, written once: the frontend runs them where the
client's fields are known (services/frontend/core.py), the scheduler where a request enters without a
frontend (the in-process LLM, a SubmitMany message: services/core/scheduler.py)."""
from __future__ import annotations

from collections.abc import Sequence

from services.core.errors import InvalidArgument, check


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Every id in the model's vocabulary; `field`: the name the caller gave the ids."""
    for position, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(field, f"token id {token} at position {position} is outside the vocabulary "
                                         f"(vocab_size {vocab_size})")


def check_prompt(prompt_ids: Sequence[int], max_model_len: int, vocab_size: int | None,
                 vocab_field: str = "prompt", generates: bool = True) -> None:
    """Not empty, room to generate at least one token (a pooling request, generates=False: within
    max_model_len, named `input`), ids the model has (vocab_size None: not known yet)."""
    check(len(prompt_ids) > 0, "prompt", "must not be empty")
    if generates:
        check(len(prompt_ids) < max_model_len, "prompt",
              f"has {len(prompt_ids)} tokens; max_model_len {max_model_len} leaves no room for output")
    else:
        check(len(prompt_ids) <= max_model_len, "input",
              f"{len(prompt_ids)} tokens exceed max_model_len {max_model_len}")
    if vocab_size is not None:
        check_token_ids(vocab_field, prompt_ids, vocab_size)
