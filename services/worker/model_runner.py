"""Runs one step on a worker: apply the delta, flatten the batch, forward, sample.

The steps of async scheduling (the next step run before its delta arrives) are a subclass,
AsyncModelRunner (services/worker/async_scheduling.py), over the hooks `run_delta` and
`apply_cached`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.core.errors import InvalidArgument, UnknownSequence, check
from services.core.sampling_params import SamplingParams
from services.core.step import NewSequence, SeqOutput, StepDelta, StepResult
from services.worker.grammar import Grammars, SequenceGrammar
from services.worker.kv_cache import KVCache
from services.worker.lora import LoraAdapter, LoraBatch, LoraRegistry
from services.worker.models.llama import AttentionMetadata, LlamaForCausalLM
from services.worker.sampler import SamplingRow, prompt_logprobs, sample


@dataclass(kw_only=True)
class SeqState:
    """The worker's mirror of one running sequence (the scheduler owns the truth)."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams  # its seed always set
    sample_index: int
    num_samples: int = 1
    grammar: SequenceGrammar | None = None  # structured outputs: the matcher of its output tokens
    draft_token_ids: list[int] = field(default_factory=list)  # this step's drafts to verify (speculation)
    lora: LoraAdapter | None = None  # the adapter it runs under (services/worker/lora.py)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:end] if start < num_prompt else []) + \
            self.output_token_ids[max(start - num_prompt, 0):max(end - num_prompt, 0)]


@dataclass(kw_only=True)
class _Batch:
    """Host-side lists for one step, turned into tensors by `_tensors`."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_seqs: list[int] = field(default_factory=list)  # each token's sequence: a row of `tables`
    slots: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    tables: list[list[int]] = field(default_factory=list)
    sample_seqs: list[tuple[SeqState, int]] = field(default_factory=list)  # (seq, row in hidden)
    prompt_rows: list[tuple[SeqState, int, int]] = field(default_factory=list)  # (seq, first row, first pos)
    pool_spans: list[tuple[SeqState, int, int, int]] = field(default_factory=list)  # (seq, first, last row, first pos)
    lora_rows: dict[str, tuple[LoraAdapter, list[int]]] = field(default_factory=dict)  # name -> (adapter, rows)


@dataclass(kw_only=True)
class _Sampling:
    """What a step samples, one logits row each: a sequence's next token, a fork's first tokens
    (a row per child), or a verify pass (a row per drafted position and one after the last)."""

    rows: list[SamplingRow] = field(default_factory=list)
    hidden_rows: list[int] = field(default_factory=list)  # each logits row's row in hidden
    constrained: list[tuple[int, SequenceGrammar, list[int]]] = field(default_factory=list)  # (row, grammar, tokens)
    spans: list[tuple[SeqState, int, int, list[int]]] = field(default_factory=list)  # (seq, first, rows, drafts)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 batch_invariant: bool = False, grammars: Grammars | None = None, pooler=None,
                 loras: LoraRegistry | None = None):
        """pooler: a pooling worker's (services/worker/pooler.py): its sequences are pooled, not sampled.
        loras: the worker's adapters where --enable-lora (the model's LoRA sites enabled)."""
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.pooler, self.loras = pooler, loras
        self.block_size = kv_cache.block_size
        self.eos_token_ids = model.cfg.eos_token_ids
        self.batch_invariant = batch_invariant  # a row's bits do not depend on its batch: subsets may be served
        self.grammars = grammars  # compiles and applies structured-outputs constraints
        self.seqs: dict[int, SeqState] = {}

    def execute(self, delta: StepDelta) -> StepResult:
        return self.run_delta(delta)

    def run_async_step(self) -> None:
        """Run the continuation the last delta announced (async scheduling): none here."""

    def forget_all(self) -> None:
        """The scheduler dropped this worker: no sequence it holds will be named again."""
        self.seqs.clear()

    def run_delta(self, delta: StepDelta) -> StepResult:
        """Hook: apply the delta to the mirrors, run the forward pass, sample."""
        for seq_id in delta.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        self.kv_cache.copy(delta.blocks_to_copy)  # first: a forked block may be swapped out in the same step
        self.kv_cache.swap_out(delta.blocks_to_swap_out)
        self.kv_cache.swap_in(delta.blocks_to_swap_in)
        in_use = self.loras_in_use(delta.new_seqs)
        scheduled = [self._add(new, in_use) for new in delta.new_seqs] + \
            [self.apply_cached(c) for c in delta.cached_seqs]
        result = StepResult(delta.step_id)
        if not scheduled:
            return result
        batch = self._prepare(scheduled)
        sampling = self._sampling(batch)
        masks = self.grammars.start_masks(sampling.constrained) if sampling.constrained else None  # beside the forward
        hidden = self._forward(batch)
        if hidden is None:  # a later pipeline stage of a worker group: stage 0 samples
            return result
        if self.pooler is not None:
            for state, first_row, last_row, start in batch.pool_spans:
                pooled = self.pooler.pool(hidden, first_row, last_row, start)
                result.outputs.append(SeqOutput(seq_id=state.seq_id, token_ids=[], pooled=pooled))
            return result
        self._sample(sampling, hidden, result, masks)
        self._prompt_logprobs(batch, hidden, result)
        return result

    def _forward(self, batch: _Batch) -> torch.Tensor | None:
        if not batch.lora_rows:
            return self.model(*self._tensors(batch))
        groups = [(adapter, torch.tensor(rows, dtype=torch.int64, device=self.device))
                  for adapter, rows in batch.lora_rows.values()]
        self.model.lora.batch = LoraBatch(groups)
        try:
            return self.model(*self._tensors(batch))
        finally:
            self.model.lora.batch = None

    # ---- delta -> mirror -------------------------------------------------------
    def loras_in_use(self, new_seqs: list[NewSequence]) -> set[str]:
        """The adapters of the sequences held and those this step sends: none of them is dropped for another."""
        return {s.lora.name for s in self.seqs.values() if s.lora is not None} | \
            {new.lora_name for new in new_seqs if new.lora_name}

    def _add(self, new: NewSequence, in_use: set[str] = frozenset()) -> tuple[SeqState, int]:
        self._check_blocks(new.seq_id, new.block_ids)
        check(new.params.seed is not None, "seed", f"sequence {new.seq_id} came without its request's seed")
        state = SeqState(seq_id=new.seq_id, prompt_token_ids=list(new.prompt_token_ids),
                         output_token_ids=list(new.output_token_ids), block_ids=list(new.block_ids),
                         num_computed_tokens=new.num_computed_tokens, params=new.params,
                         sample_index=new.sample_index, num_samples=new.num_samples)
        if new.lora_name:
            if self.loras is None:
                raise InvalidArgument("lora_name", f"adapter {new.lora_name!r}: this worker runs without --enable-lora")
            state.lora = self.loras.acquire(new.lora_name, new.lora_path, in_use)  # loaded on demand
        if new.params.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidArgument("structured_outputs", "this worker has no grammar compiler")
            state.grammar = self.grammars.start(new.params.structured_outputs, new.seq_id)
        self.seqs[new.seq_id] = state
        return state, new.num_scheduled_tokens

    def apply_cached(self, cached) -> tuple[SeqState, int]:
        """Hook: a held sequence's mirror brought up to the scheduler's (what changed since its last step)."""
        state = self.seqs.get(cached.seq_id)
        if state is None:
            raise UnknownSequence(f"worker does not hold sequence {cached.seq_id}; re-send it in full")
        self._check_blocks(cached.seq_id, cached.new_block_ids)
        state.output_token_ids.extend(cached.new_token_ids)
        if cached.num_kept_blocks is not None:  # blocks of rejected drafts given back
            del state.block_ids[cached.num_kept_blocks:]
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens
        state.draft_token_ids = list(cached.draft_token_ids)
        return state, cached.num_scheduled_tokens

    def _check_blocks(self, seq_id: int, block_ids: list[int]) -> None:
        """The kernels index the cache with these ids unchecked (the compiled CPU ones too)."""
        num_blocks = self.kv_cache.num_blocks
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        if bad:
            raise InvalidArgument("block_ids", f"sequence {seq_id}: block ids {bad[:5]} outside this worker's "
                                               f"cache of {num_blocks} blocks")

    # ---- batch preparation -----------------------------------------------------
    def _prepare(self, scheduled: list[tuple[SeqState, int]]) -> _Batch:
        batch, bs = _Batch(), self.block_size
        for state, num_new in scheduled:
            drafts = state.draft_token_ids  # run after the sequence's tokens, in the same pass
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            real_end = end - len(drafts)
            if real_end <= start or real_end > state.num_tokens or (drafts and real_end != state.num_tokens) \
                    or -(-end // bs) > len(state.block_ids):
                raise InvalidArgument("step", f"sequence {state.seq_id}: cannot run tokens {start}..{end} "
                                              f"({len(drafts)} drafted) of {state.num_tokens} with "
                                              f"{len(state.block_ids)} blocks")
            first_row = len(batch.input_ids)
            batch.input_ids += state.token_ids(start, real_end) + drafts
            batch.positions += range(start, end)
            batch.token_seqs += [len(batch.tables)] * num_new
            if state.lora is not None:
                batch.lora_rows.setdefault(state.lora.name, (state.lora, []))[1].extend(
                    range(first_row, first_row + num_new))
            batch.slots += [state.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            batch.seq_lens.append(end)
            batch.query_start_loc.append(len(batch.input_ids))
            batch.tables.append(state.block_ids)
            if state.params.prompt_logprobs is not None and start < len(state.prompt_token_ids):
                batch.prompt_rows.append((state, first_row, start))
            state.num_computed_tokens = real_end
            if real_end == state.num_tokens and self.pooler is not None:
                batch.pool_spans.append((state, first_row, len(batch.input_ids) - 1, start))
            elif real_end == state.num_tokens:
                batch.sample_seqs.append((state, len(batch.input_ids) - 1 - len(drafts)))
        return batch

    def _tensors(self, batch: _Batch):
        dev = self.device
        width = max(len(t) for t in batch.tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in batch.tables], dtype=torch.int64, device=dev)
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=dev)
        query_start_loc = torch.tensor(batch.query_start_loc, dtype=torch.int64, device=dev)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=dev)
        # kernels.attention.token_layout, from the lists: a token's position is its place in the sequence
        layout = (torch.tensor(batch.token_seqs, dtype=torch.int64, device=dev), positions)
        meta = AttentionMetadata(
            positions=positions, slot_mapping=torch.tensor(batch.slots, dtype=torch.int64, device=dev),
            block_tables=tables, seq_lens=seq_lens, query_start_loc=query_start_loc, layout=layout)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=dev)
        return input_ids, self.kv_cache.layers, meta

    # ---- sampling --------------------------------------------------------------
    def _sampling(self, batch: _Batch) -> _Sampling:
        """The logits rows to sample, planned before the forward pass (the grammar masks are built
        beside it). A verify row samples as a decode step at its position would: the same position
        (so the same uniform), and the drafts before it as output tokens (penalties, min_tokens,
        the grammar's state). Drafts the grammar refuses are cut first: they could not be accepted."""
        plan = _Sampling()
        for state, row in batch.sample_seqs:
            first, drafts = len(plan.rows), state.draft_token_ids
            if drafts and state.grammar is not None:
                drafts = drafts[:state.grammar.num_valid(state.output_token_ids, drafts)]
            if drafts:
                rows = [(state.sample_index, row + i, state.output_token_ids + drafts[:i], state.num_tokens + i)
                        for i in range(len(drafts) + 1)]
            else:  # a fork samples each child's first token here
                rows = [(state.sample_index + k, row, state.output_token_ids, state.num_tokens)
                        for k in range(state.num_samples)]
            for sample_index, hidden_row, tokens, position in rows:
                if state.grammar is not None:
                    plan.constrained.append((len(plan.rows), state.grammar, tokens))
                plan.rows.append(SamplingRow(params=state.params, sample_index=sample_index,
                                             position=position, prompt_token_ids=state.prompt_token_ids,
                                             output_token_ids=tokens))
                plan.hidden_rows.append(hidden_row)
            plan.spans.append((state, first, len(rows), drafts))
        return plan

    def _sample(self, plan: _Sampling, hidden: torch.Tensor, result: StepResult, masks=None) -> None:
        if not plan.rows:
            return
        distinct = list(dict.fromkeys(plan.hidden_rows))  # ascending; a fork repeats its row
        if distinct != list(range(hidden.shape[0])):  # decode: every row samples, no gather
            hidden = hidden[torch.tensor(distinct, device=self.device)]
        logits = self.model.compute_logits(hidden)
        if len(distinct) != len(plan.hidden_rows):  # forks: a row's logits once per child (a [R, V] copy)
            at = {row: i for i, row in enumerate(distinct)}
            logits = logits[torch.tensor([at[row] for row in plan.hidden_rows], device=self.device)]
        if masks is not None:
            self.grammars.apply(logits, masks)  # structured outputs
        sampled = sample(logits, plan.rows, self.eos_token_ids)
        for state, first, num_rows, drafts in plan.spans:
            picks = sampled[first:first + num_rows]
            if drafts:  # keep the drafts the sampler drew too, then its own token
                num_accepted = 0
                while num_accepted < len(drafts) and picks[num_accepted][0] == drafts[num_accepted]:
                    num_accepted += 1
                picks = picks[:num_accepted + 1]
            state.num_samples = 1  # the fork (if any) happened: from now on one token a step
            state.draft_token_ids = []
            logprobs = [lp for _, lp in picks] if state.params.logprobs is not None else None
            result.outputs.append(SeqOutput(seq_id=state.seq_id, token_ids=[tok for tok, _ in picks], logprobs=logprobs))

    def _prompt_logprobs(self, batch: _Batch, hidden: torch.Tensor, result: StepResult) -> None:
        for state, first_row, start in batch.prompt_rows:
            num_prompt = len(state.prompt_token_ids)
            stop = min(state.num_computed_tokens, num_prompt - 1)  # position p predicts prompt token p + 1
            entries = [None] if start == 0 else []  # the first prompt token has no logprob
            if stop > start:
                logits = self.model.compute_logits(hidden[first_row:first_row + stop - start])
                targets = state.prompt_token_ids[start + 1:stop + 1]
                entries += prompt_logprobs(logits, targets, state.params.prompt_logprobs)
            result.prompt_logprobs[state.seq_id] = entries
