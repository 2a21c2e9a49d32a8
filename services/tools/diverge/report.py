"""The results of a `diverge` run: which cells count as failures, and the JSON form."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from services.tools.diverge.cases import Case
from services.tools.diverge.compare import DIVERGED, IDENTICAL, NOT_RUN, Cell, Sample
from services.tools.diverge.variants import Variant


@dataclass(kw_only=True)
class VariantResult:
    variant: Variant
    cells: dict[str, Cell] = field(default_factory=dict)  # case id -> cell
    note: str = ""
    exercised: bool = True
    error: str = ""  # the variant could not run
    seconds: float = 0.0


@dataclass(kw_only=True)
class Report:
    model: str
    settings: dict  # the baseline's engine arguments and the command's options
    cases: list[Case]
    baseline: dict[str, list[Sample]]
    results: list[VariantResult] = field(default_factory=list)
    fail_on: tuple[str, ...] = ()  # names of the variants whose differences fail the command
    near_tie: float = 0.0

    def failures(self) -> list[tuple[str, str]]:
        """(variant, case id) pairs that break a promise: a variant in fail_on that did not run, or
        gave a prompt other bits, except where the request's seed differed (its draws, not the
        variant, explain the difference)."""
        out = []
        for result in self.results:
            if result.variant.name not in self.fail_on:
                continue
            if result.error:
                out.append((result.variant.name, "*"))
            out += [(result.variant.name, case_id) for case_id, cell in result.cells.items()
                    if cell.status not in (IDENTICAL, NOT_RUN) and cell.draws_same is not False]
        return out

    def summary(self, result: VariantResult) -> str:
        if result.error:
            return f"error: {result.error}"
        cells = [c for c in result.cells.values() if c.status != NOT_RUN]
        if not cells:
            return "not run"
        same = sum(c.status == IDENTICAL for c in cells)
        seeds = sum(c.status != IDENTICAL and c.draws_same is False for c in cells)
        diverged = [c for c in cells if c.status == DIVERGED and c.draws_same is not False]
        parts = [f"{same}/{len(cells)} identical"]
        if diverged:
            ties = sum(c.near_tie for c in diverged)
            parts.append(f"{len(diverged)} diverged (first at token {min(c.first_divergence for c in diverged)}"
                         + (f", {ties} at a near-tie)" if ties else ")"))
        drift = len(cells) - same - seeds - len(diverged)
        if drift:
            parts.append(f"{drift} same tokens with other logprobs")
        if seeds:
            parts.append(f"{seeds} with another seed (no seed given)")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return {
            "model": self.model, "settings": self.settings, "near_tie": self.near_tie,
            "fail_on": list(self.fail_on), "failures": [list(f) for f in self.failures()],
            "prompts": [{"id": c.id, "label": c.label, "prompt_token_ids": list(c.prompt_token_ids),
                         "params": _params(c), "baseline": [asdict(s) for s in self.baseline.get(c.id, [])]}
                        for c in self.cases],
            "variants": [{"name": r.variant.name, "group": r.variant.group, "changes": r.variant.changes,
                          "expect": r.variant.expect, "fails_on_difference": r.variant.name in self.fail_on,
                          "note": r.note, "exercised": r.exercised, "error": r.error, "seconds": round(r.seconds, 2),
                          "summary": self.summary(r), "cells": {k: asdict(c) for k, c in r.cells.items()}}
                         for r in self.results],
        }


def _params(case: Case) -> dict:
    return {k: v for k, v in asdict(case.params).items() if k in
            ("n", "temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "ignore_eos", "repetition_penalty")}
