"""The stop rule: whether a sample ends on the token it just got, and why. Pure Python.

One function for both sides: the scheduler ends sequences with it (Scheduler._append), and a
worker predicts with it which sequences the scheduler will end, to leave them out of the step it
runs early under async scheduling (services/worker/async_scheduling.py). Were the two rules
copies, a difference would make the worker run rows for nothing or, worse, expect a sequence
the scheduler ended.

Stop *strings* are not here: only the frontend sees text. Its detokenizer
(services/core/detokenizer.py) matches them on the text and asks the scheduler to stop the
sample (Scheduler.stop_sample), so a stop string ends a sample a step or so after its last
token was sampled, and the tokens past the match are never streamed. The rules here see only
token ids, in this order: a stop token id, then EOS (unless ignore_eos, and not before
min_tokens; the sampler also masks both until then), then length (max_tokens, max_model_len).
"""
from __future__ import annotations

from typing import NamedTuple

from services.core.sampling_params import SamplingParams

STOP, LENGTH = "stop", "length"  # the finish reasons this rule gives ("abort" is the client's)


class Finish(NamedTuple):
    reason: str  # STOP or LENGTH
    stop_token_id: int | None = None  # the stop token id that ended it (None for EOS and length)


def finish_reason(params: SamplingParams, token: int, num_output_tokens: int, eos_token_ids: tuple[int, ...],
                  num_tokens: int = 0, max_model_len: int | None = None) -> Finish | None:
    """Whether a sample ends on `token`, its `num_output_tokens`-th output token (counting it);
    `num_tokens` is prompt + output. `max_model_len` None: not checked (a worker does not know
    the scheduler's limit; it only wastes a row of its early step)."""
    if token in params.stop_token_ids:
        return Finish(STOP, token)
    if not params.ignore_eos and token in eos_token_ids and num_output_tokens >= params.min_tokens:
        return Finish(STOP)
    if num_output_tokens >= params.max_tokens or (max_model_len is not None and num_tokens >= max_model_len):
        return Finish(LENGTH)
    return None
