"""One prompt, two runs: are they the same, and if not, where and why might they part?

The reference is the batch-1 baseline (or a variant's own batch-1 run). A run is compared on
the chosen tokens and their logprobs: `identical` means the same tokens with bit-equal logprobs,
the claim the engine makes for every variant that changes only how requests are batched or
stored. A divergence is the first position where the tokens differ (or where one run stops and
the other goes on); before it both runs saw the same context, so their logprobs of the same
tokens can be compared, and the reference's top-2 margin there says whether the flip was a
near-tie, which any rounding difference can flip.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.core.step import Logprobs

IDENTICAL, SAME_TOKENS, DIVERGED, NOT_RUN = "identical", "same tokens", "diverged", "not run"


@dataclass(kw_only=True)
class Sample:
    """What one run gave one sample of one prompt."""

    token_ids: list[int]
    logprobs: list[float]  # of the chosen tokens
    margins: list[float | None]  # top-1 minus top-2 logprob at each position (None: not known)
    seed: int | None = None  # the request's seed (the engine draws one for requests without)
    text: str = ""

    @classmethod
    def from_logprobs(cls, token_ids: list[int], logprobs: list[Logprobs] | None, seed: int | None,
                      text: str = "") -> Sample:
        entries = logprobs or []
        return cls(token_ids=list(token_ids), logprobs=[lp.logprob for lp in entries],
                   margins=[margin(lp.top) for lp in entries], seed=seed, text=text)


def margin(top: list[tuple[int, float]]) -> float | None:
    return float(top[0][1] - top[1][1]) if len(top) >= 2 else None


@dataclass(kw_only=True)
class Cell:
    """One prompt under one variant, against its reference."""

    status: str  # IDENTICAL, SAME_TOKENS, DIVERGED or NOT_RUN
    first_divergence: int | None = None  # token position (0 = the first generated token)
    sample_index: int = 0  # which of the request's n samples diverged first
    max_logprob_delta: float = 0.0  # largest |Δ logprob| of the chosen tokens before the divergence
    margin: float | None = None  # the reference's top-2 margin at the divergence
    variant_margin: float | None = None  # the variant's own margin there
    near_tie: bool = False  # either margin below the near-tie threshold: a flip any rounding can cause
    draws_same: bool | None = None  # sampled requests: the same seed, so the same random draws
    reference_tokens: list[int] = field(default_factory=list)  # from the divergence on (a few)
    variant_tokens: list[int] = field(default_factory=list)
    reason: str = ""  # why NOT_RUN


def compare(reference: list[Sample], got: list[Sample], sampled: bool, near_tie: float) -> Cell:
    """The earliest divergence over the request's samples; IDENTICAL when there is none and every
    logprob has the same bits."""
    cells = [_compare_sample(i, r, g, near_tie) for i, (r, g) in enumerate(zip(reference, got))]
    if len(reference) != len(got):
        cells.append(Cell(status=DIVERGED, first_divergence=0, sample_index=min(len(reference), len(got))))
    diverged = [c for c in cells if c.status == DIVERGED]
    cell = min(diverged, key=lambda c: c.first_divergence) if diverged else \
        Cell(status=SAME_TOKENS if any(c.status == SAME_TOKENS for c in cells) else IDENTICAL)
    cell.max_logprob_delta = max((c.max_logprob_delta for c in cells), default=0.0)
    if sampled:
        cell.draws_same = all(r.seed == g.seed for r, g in zip(reference, got))
    return cell


def _compare_sample(index: int, ref: Sample, got: Sample, near_tie: float) -> Cell:
    common = min(len(ref.token_ids), len(got.token_ids))
    at = next((i for i in range(common) if ref.token_ids[i] != got.token_ids[i]), None)
    if at is None and len(ref.token_ids) != len(got.token_ids):
        at = common  # one stopped (end of sequence, a stop string) where the other went on
    before = len(ref.token_ids) if at is None else at
    pairs = list(zip(ref.logprobs[:before], got.logprobs[:before]))
    delta = max((abs(a - b) for a, b in pairs), default=0.0)
    if at is None:
        return Cell(status=IDENTICAL if delta == 0.0 and len(ref.logprobs) == len(got.logprobs) else SAME_TOKENS,
                    sample_index=index, max_logprob_delta=delta)
    ref_margin, got_margin = _at(ref.margins, at), _at(got.margins, at)
    known = [m for m in (ref_margin, got_margin) if m is not None]
    return Cell(status=DIVERGED, first_divergence=at, sample_index=index, max_logprob_delta=delta, margin=ref_margin,
                variant_margin=got_margin, near_tie=bool(known) and min(known) < near_tie,
                reference_tokens=ref.token_ids[at:at + 4], variant_tokens=got.token_ids[at:at + 4])


def _at(values: list, index: int):
    return values[index] if index < len(values) else None
