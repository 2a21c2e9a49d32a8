"""Speculative decoding, the scheduler's side: drafts, acceptance, and when not to draft. Pure Python.

Exact verification (docs/ARCHITECTURE.md, "Speculative decoding"): a sequence in decode is
scheduled with its k drafted tokens after its last token; the worker runs the k + 1 positions in
the same forward pass as everyone else's prefill and decode, samples every position with the one
sampler exactly as a decode step would there (the same processed logits, the same uniform keyed by
(seed, sample index, position), the grammar's mask after the tokens before it), keeps the drafts
up to the first one that differs from its sample, and returns the kept drafts followed by the
sampler's own token. The tokens and logprobs are therefore those of decoding without drafts, by
construction; kernels that give a token the same bits in a prefill chunk as in a decode step
(rule 4) make the logits equal too.

Drafting lives here, in the scheduler, because the scheduler owns the tokens (rule 1) and the
block tables (rule 2): it needs the drafts to size the step (token budget, KV slots, preemption)
before the worker sees it, and a drafter needs nothing but token ids. The worker stays what it
was: it computes what it is sent.

`Speculator` keeps one drafter per sequence, each request's draft length (adaptive: it doubles after a
verify that kept every draft and falls back after a miss), each request's acceptance (a request whose drafts
keep failing pauses drafting, for longer each time), the batch size above which nothing is drafted, and the counters
/metrics shows under vLLM's names (pagedserve:spec_decode_*).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.core.config import SpeculativeConfig
from services.core.drafters import GlobalSuffixTree, NgramDrafter, SuffixDrafter


@dataclass(kw_only=True)
class SpecStats:
    """Since the scheduler started: vLLM's spec_decode counters."""

    num_drafts: int = 0  # sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def as_stats(self) -> dict:
        """SchedulerStats' fields (services/core/stats.py)."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": tuple(self.accepted_per_pos)}


@dataclass(kw_only=True)
class _SeqSpec:
    drafter: NgramDrafter | SuffixDrafter
    num_fed: int = 0  # tokens of the sequence given to the drafter
    window_drafted: int = 0  # drafted and accepted tokens since its acceptance was last judged
    window_accepted: int = 0
    pauses: int = 0  # times its acceptance fell below the threshold
    resume_at: int = 0  # no drafts while the sequence is shorter than this
    draft_len: int = 0  # tokens the next draft may have (adaptive length; fixed: num_speculative_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._seqs: dict[int, _SeqSpec] = {}
        self._global = GlobalSuffixTree(config.suffix_max_depth, config.suffix_global_max_tokens) \
            if config.method == "suffix" and config.suffix_global_max_tokens > 0 else None

    def pays_at(self, num_running: int) -> bool:
        """Whether a worker running this many sequences drafts at all (measured: bench/spec.py)."""
        limit = self.config.disable_by_batch_size
        return limit == 0 or num_running < limit

    def propose(self, seq_id: int, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(its draft length, max_drafts) tokens that may follow token_ids (prompt + output)."""
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _SeqSpec(drafter=self._new_drafter(seq_id),
                                                  draft_len=self.config.shortest_draft)
        k = min(state.draft_len, max_drafts)
        if len(token_ids) < state.resume_at or k < 1:
            return []
        state.drafter.extend(token_ids[state.num_fed:])
        state.num_fed = len(token_ids)
        return state.drafter.propose(k)

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A verify pass kept num_accepted of num_drafts drafts."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.accepted_per_pos[pos] += 1
        state = self._seqs.get(seq_id)
        if state is None:
            return
        if num_drafts:
            # adaptive length (min_speculative_tokens): a copy that ran through the whole draft likely runs on;
            # a miss starts over short, or as long as what was kept
            state.draft_len = min(state.draft_len * 2, self.config.num_speculative_tokens) \
                if num_accepted == num_drafts else max(self.config.shortest_draft, num_accepted + 1)
        state.window_drafted += num_drafts
        state.window_accepted += num_accepted
        if state.window_drafted < self.config.min_draft_tokens:
            return
        if state.window_accepted < self.config.min_acceptance_rate * state.window_drafted:
            # a pause, not an end: an answer that opens with prose and then copies code would
            # otherwise lose its drafts for good on the prose (bench/spec.py's copy workload at
            # k = 4 lost a quarter of its accepted tokens that way)
            # the sequence now ends after the num_fed tokens drafted from, the kept drafts and the sampler's token
            pause = self.config.min_draft_tokens << min(state.pauses, 16)
            state.resume_at = state.num_fed + num_accepted + 1 + pause
            state.pauses += 1
        state.window_drafted = state.window_accepted = 0

    def forget(self, seq_id: int, output_token_ids: list[int] | None = None) -> None:
        """The sequence ended; a finished one's output joins the global tree (suffix, when kept)."""
        self._seqs.pop(seq_id, None)
        if self._global is not None and output_token_ids:
            self._global.add(output_token_ids)

    def _new_drafter(self, seq_id: int) -> NgramDrafter | SuffixDrafter:
        c = self.config
        if c.method == "ngram":
            return NgramDrafter(c.prompt_lookup_min, c.prompt_lookup_max)
        return SuffixDrafter(c.suffix_max_depth, c.suffix_min_count, self._global)
