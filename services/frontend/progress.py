"""What a request's stream has delivered so far, and the continuation that carries it to another
scheduler (scheduler.proto SubmitRequest.continued_samples). Pure Python.

The frontend holds everything a continuation needs: the prompt, the parameters, the seed the
scheduler reported, and every token it streamed. Resubmitted with them, each open sample goes on
from its own tokens at its original positions, so the client gets the tokens and logprobs of an
undisturbed run (docs/ARCHITECTURE.md rule 4).
"""
from __future__ import annotations

from dataclasses import replace

from services.core.sampling_params import SamplingParams
from services.core.sequence import ContinuedSample, SeqUpdate


class Progress:
    """One request's delivered tokens per sample, which samples ended, its seed and cache hits."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.token_ids: list[list[int]] = [[] for _ in range(params.n)]
        self.finished = [False] * params.n
        self.seed: int | None = params.seed
        self.num_cached_tokens = 0
        self.reported = False  # a scheduler reported the seed and cache hits

    @property
    def started(self) -> bool:
        """Some token was delivered: a resubmission must continue, not start over."""
        return any(self.token_ids)

    @property
    def done(self) -> bool:
        return all(self.finished)

    def apply(self, updates: list[SeqUpdate]) -> None:
        """Fold in one step's updates; a continuation's keep the first admission's seed and cache hits
        (what an undisturbed run reports)."""
        for update in updates:
            if not self.reported:
                self.seed, self.num_cached_tokens, self.reported = update.seed, update.num_cached_tokens, True
            else:
                update.num_cached_tokens = self.num_cached_tokens
            self.token_ids[update.sample_index] += update.token_ids
            if update.finish_reason:
                self.finished[update.sample_index] = True

    def end_sample(self, sample_index: int) -> None:
        """The frontend ended the sample (a stop string matched): a continuation leaves it out."""
        self.finished[sample_index] = True

    def resubmission(self) -> tuple[SamplingParams, tuple[ContinuedSample, ...]]:
        """The parameters and continued samples to submit again: the original request when nothing
        was delivered (with the seed, once known), else a continuation of the open samples, without
        the prompt logprobs (delivered with the first token)."""
        params = self.params if self.seed is None else self.params.with_seed(self.seed)
        if not self.started:
            return params, ()
        continued = tuple(ContinuedSample(i, tuple(tokens)) for i, tokens in enumerate(self.token_ids)
                          if not self.finished[i])
        return replace(params, prompt_logprobs=None), continued
