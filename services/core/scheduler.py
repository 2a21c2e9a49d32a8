"""The scheduler: queues, block tables per worker, policy, preemption, and step bookkeeping.

One idea covers prefill, chunked prefill and decode: each sequence has
`num_computed_tokens` catching up with its token count. A step gives every worker a
delta (services.core.step); `update` applies what the worker sampled. Pure Python.
"""
from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

from services.core.block_manager import BlockManager
from services.core.config import SchedulerConfig
from services.core.errors import ResourceExhausted, check
from services.core.policy import WaitingQueue, policy_key
from services.core.sampling_params import SamplingParams
from services.core.seeding import new_request_seed
from services.core.sequence import ContinuedSample, Request, Sequence, SeqStatus, SeqUpdate
from services.core.spec_decode import Speculator
from services.core.stats import SchedulerStats, WorkerStats
from services.core.stop import finish_reason
from services.core.step import CachedSequence, NewSequence, StepDelta, StepResult, WorkerInfo


@dataclass(kw_only=True)
class WorkerSlot:
    """The scheduler's state for one worker."""

    info: WorkerInfo
    blocks: BlockManager
    pending_forget: list[int] = field(default_factory=list)
    pending_swap_out: list[tuple[int, int]] = field(default_factory=list)
    pending_copy: list[tuple[int, int]] = field(default_factory=list)


@dataclass(kw_only=True)
class StepPlan:
    """One worker's step being built."""

    worker_id: str
    delta: StepDelta
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens run, drafts included)
    num_tokens: int = 0
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> its drafted tokens (speculation)


class Scheduler:
    """Queues, block tables and policy; each step, one StepDelta per worker (`schedule`) and the
    workers' results applied (`update`). Subclasses change a step through named hooks:
    `plan_next_step` (services/core/async_scheduling.py's AsyncScheduler overrides it)."""

    def __new__(cls, config: SchedulerConfig | None = None, *args, **kwargs):
        if cls is Scheduler and config is not None and config.async_scheduling:  # as vLLM picks its AsyncScheduler: by the setting
            from services.core.async_scheduling import AsyncScheduler

            cls = AsyncScheduler
        return super().__new__(cls)

    def __init__(self, config: SchedulerConfig):
        check(config.max_model_len is not None, "max_model_len", "settle it first (SchedulerConfig.for_model)")
        self.config = config
        self.workers: dict[str, WorkerSlot] = {}
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: dict[int, Sequence] = {}
        self.swapped: dict[int, Sequence] = {}
        self.seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.step_id = 0
        self.num_preemptions = 0
        self._inflight: dict[str, StepPlan] = {}
        # seeds for requests that bring none: reproducible from the engine seed, like vLLM's
        self._seeds = random.Random(config.seed) if config.seed is not None else None
        # speculative decoding: drafts verified exactly (services/core/spec_decode.py)
        self.speculator = Speculator(config.speculative_config) if config.speculative_config else None

    # ---- workers ---------------------------------------------------------------
    def add_worker(self, worker_id: str, info: WorkerInfo) -> None:
        """Take a worker, or refuse it (InvalidArgument) when it does not fit the others."""
        check(info.block_size == self.config.block_size, "block_size",
              f"worker {worker_id} has block size {info.block_size}, the scheduler {self.config.block_size}")
        for slot in self.workers.values():  # the first worker's, as every worker is like the others
            check(info.vocab_size == slot.info.vocab_size, "vocab_size",
                  f"worker {worker_id} has vocab size {info.vocab_size}, the others {slot.info.vocab_size}")
            break
        check(info.max_model_len >= self.config.max_model_len, "max_model_len",
              f"worker {worker_id} supports {info.max_model_len} tokens, the scheduler serves "
              f"{self.config.max_model_len}")
        self.workers[worker_id] = WorkerSlot(info=info, blocks=BlockManager(
            info.num_gpu_blocks, info.block_size, info.num_cpu_blocks, self.config.enable_prefix_caching))

    def remove_worker(self, worker_id: str) -> int:
        """Drop a dead worker; its sequences go back to waiting and are recomputed elsewhere.
        Their streamed tokens stay: recompute continues after them. Returns how many moved."""
        self.workers.pop(worker_id, None)
        self._inflight.pop(worker_id, None)
        moved = [s for s in itertools.chain(self.running.values(), self.swapped.values()) if s.worker_id == worker_id]
        for seq in moved:
            self.running.pop(seq.seq_id, None)
            self.swapped.pop(seq.seq_id, None)
            seq.worker_id, seq.num_computed_tokens = None, 0
            seq.forget_on_worker()
            self._enqueue(seq)
        return len(moved)

    def reset_worker(self, worker_id: str) -> int:
        """The worker answered that it does not hold a sequence it was sent (it lost its state, as a
        worker restarted at the same address before the scheduler noticed): re-send in full. Its
        sequences go back to waiting and are recomputed, their streamed tokens kept (on it or on
        another worker); its block pool starts empty, since none of its cached blocks can be trusted;
        and its next step first tells it to forget every sequence it may still mirror. Returns how
        many sequences are re-sent."""
        info = self.workers[worker_id].info
        held = [s.seq_id for s in itertools.chain(self.running.values(), self.swapped.values())
                if s.worker_id == worker_id]
        moved = self.remove_worker(worker_id)
        self.add_worker(worker_id, info)
        self.workers[worker_id].pending_forget = held
        return moved

    # ---- requests --------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, continued: tuple[ContinuedSample, ...] = ()) -> Request:
        """Admit a request; `continued` non-empty: a continuation (ContinuedSample), which runs
        just the samples it names, each from its own tokens."""
        params.validate()  # admission: the one check after the edge's (the wire's decoding checks nothing)
        check(request_id not in self.requests, "request_id", f"{request_id!r} is already running")
        check(len(prompt_token_ids) > 0, "prompt", "must not be empty")
        check(len(prompt_token_ids) < self.config.max_model_len, "prompt",
              f"{len(prompt_token_ids)} tokens leave no room to generate within max_model_len "
              f"{self.config.max_model_len}")
        self._check_against_workers(prompt_token_ids, params)
        # A burst arrives before any step runs: the requests that free seats will take are not waiting
        free_seats = max(0, len(self.workers) * self.config.max_num_seqs - len(self.running))
        if len(self.waiting) >= self.config.max_waiting_requests + free_seats:
            raise ResourceExhausted(f"{len(self.waiting)} requests are waiting and no seat is free; try again later")
        check(params.seed is not None or not continued, "seed", "a continuation must carry the request's seed")
        if params.seed is None:
            params = params.with_seed(self._seeds.getrandbits(63) if self._seeds else new_request_seed())
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                          arrival=next(self._arrivals), priority=priority)
        if continued:
            self._continue(request, continued)
        else:
            self._enqueue(self._new_seq(request, 0))
        self.requests[request_id] = request
        return request

    def _continue(self, request: Request, continued: tuple[ContinuedSample, ...]) -> None:
        """A continuation's samples, each waiting to be recomputed from prompt + its own tokens
        (as after a preemption); none is forked: each sample index is named at most once."""
        params, num_prompt = request.params, len(request.prompt_token_ids)
        indices = [sample.sample_index for sample in continued]
        check(len(set(indices)) == len(indices) and all(0 <= i < params.n for i in indices), "continued_samples",
              f"sample indices must be distinct and in [0, n={params.n}), got {indices}")
        for sample in continued:
            check(len(sample.token_ids) < params.max_tokens and num_prompt + len(sample.token_ids) <
                  self.config.max_model_len, "continued_samples",
                  f"sample {sample.sample_index} has {len(sample.token_ids)} tokens: no room left under "
                  f"max_tokens {params.max_tokens} or max_model_len {self.config.max_model_len}")
            if self.workers:
                vocab_size = next(iter(self.workers.values())).info.vocab_size
                check(all(0 <= t < vocab_size for t in sample.token_ids), "continued_samples",
                      f"token id outside the vocabulary ({vocab_size})")
        request.forked = True
        for sample in continued:
            seq = self._new_seq(request, sample.sample_index)
            seq.output_token_ids = list(sample.token_ids)
            self._enqueue(seq)

    def _check_against_workers(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Token ids the model has, and a request some worker's KV cache can hold (one that none
        can hold would wait forever)."""
        if not self.workers:
            return  # nothing registered yet: the transport answers UNAVAILABLE
        vocab_size = next(iter(self.workers.values())).info.vocab_size  # equal on every worker
        check(all(0 <= t < vocab_size for t in prompt_token_ids), "prompt_token_ids",
              f"token id outside the vocabulary ({vocab_size})")
        params.check_vocab(vocab_size)
        num_prompt, max_tokens = len(prompt_token_ids), params.max_tokens
        capacity = max(slot.info.num_gpu_blocks for slot in self.workers.values()) * self.config.block_size
        check(num_prompt < capacity, "prompt",
              f"{num_prompt} tokens do not fit in the largest worker's KV cache ({capacity} tokens)")
        total = min(num_prompt + max_tokens, self.config.max_model_len)
        check(total <= capacity, "max_tokens",
              f"prompt ({num_prompt}) + max_tokens ({max_tokens}) need {total} tokens of KV cache; "
              f"the largest worker holds {capacity}")

    def abort(self, request_id: str) -> list[SeqUpdate]:
        request = self.requests.get(request_id)
        if request is None:
            return []
        updates = []
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
                updates.append(self._update_of(seq, [], None))
        self.requests.pop(request_id, None)
        return updates

    def stop_sample(self, request_id: str, sample_index: int) -> None:
        """End one sample early because the frontend matched a stop string."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.sample_index == sample_index and not seq.is_finished:
                self._finish(seq, "stop")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ------------------------------------------------------------
    def schedule(self) -> dict[str, StepDelta]:
        """Choose every worker's batch for the next step."""
        self.step_id += 1
        plans = {w: StepPlan(worker_id=w, delta=StepDelta(step_id=self.step_id)) for w in self.workers}
        preempted = self._schedule_running(plans)
        if not preempted:
            self._schedule_swapped(plans)
            self._schedule_waiting(plans)
        deltas = {}
        for worker_id, plan in plans.items():
            slot = self.workers[worker_id]
            plan.delta.finished_seq_ids = slot.pending_forget + plan.delta.finished_seq_ids
            plan.delta.blocks_to_swap_out = slot.pending_swap_out + plan.delta.blocks_to_swap_out
            plan.delta.blocks_to_copy = slot.pending_copy + plan.delta.blocks_to_copy
            slot.pending_forget, slot.pending_swap_out, slot.pending_copy = [], [], []
            async_next_step = self.plan_next_step(plan)  # before the delta is filled: it may add blocks
            self._fill_delta(plan)
            plan.delta.async_next_step = async_next_step
            if not plan.delta.is_empty:
                deltas[worker_id] = plan.delta
                self._inflight[worker_id] = plan
        return deltas

    def plan_next_step(self, plan: StepPlan) -> bool:
        """Hook: whether the worker may run this step's continuation before its next delta arrives
        (StepDelta.async_next_step). Called before the delta is filled. Here never: each step
        runs to its end before the next is planned."""
        return False

    def _key(self, seq: Sequence) -> tuple:
        return policy_key(self.config.scheduling_policy, seq)

    def _num_new_tokens(self, seq: Sequence, plan: StepPlan) -> int:
        """Tokens to run for seq this step under the token budget (0: none fit)."""
        budget = self.config.max_num_batched_tokens - plan.num_tokens
        wanted = seq.num_tokens - seq.num_computed_tokens
        if wanted <= budget:
            return wanted
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule_running(self, plans: dict[str, StepPlan]) -> bool:
        preempted = False
        for worker_id, plan in plans.items():
            queue = sorted((s for s in self.running.values() if s.worker_id == worker_id), key=self._key)
            blocks = self.workers[worker_id].blocks
            speculate = self.speculator is not None and self.speculator.pays_at(len(queue))
            while queue:
                seq = queue.pop(0)
                num_new = self._num_new_tokens(seq, plan)
                if num_new == 0:
                    continue
                drafts = self._drafts(seq, num_new, plan) if speculate else []
                if drafts and not blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new + len(drafts)):
                    drafts = []  # drafts never preempt anyone
                while not blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                    victim = queue.pop() if queue else seq  # lowest priority goes first
                    self._preempt(victim, plan)
                    preempted = True
                    if victim is seq:
                        break
                else:
                    self._allocate(seq, num_new, plan, drafts)
        return preempted

    def _drafts(self, seq: Sequence, num_new: int, plan: StepPlan) -> list[int]:
        """Tokens drafted to verify after seq's last one: only for a sequence in decode that the
        worker holds (and whose parallel samples are forked), within the token budget and what the
        sequence may still generate."""
        request = seq.request
        if num_new != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or seq.num_tokens_on_worker == 0:
            return []
        if request.params.n > 1 and not request.forked:
            return []
        room = min(request.params.max_tokens - len(seq.output_token_ids),
                   self.config.max_model_len - seq.num_tokens,
                   self.config.max_num_batched_tokens - plan.num_tokens) - 1  # the sampler's own token
        return self.speculator.propose(seq.seq_id, seq.token_ids, room) if room > 0 else []

    def _schedule_swapped(self, plans: dict[str, StepPlan]) -> None:
        for seq in sorted(self.swapped.values(), key=self._key):
            plan = plans.get(seq.worker_id)
            blocks = self.workers[seq.worker_id].blocks
            if plan is None or not self._has_seat(plan) or not blocks.can_swap_in(seq.seq_id):
                continue
            num_new = self._num_new_tokens(seq, plan)
            needed = blocks.num_blocks_needed(seq.num_computed_tokens + num_new)
            if num_new == 0 or blocks.num_free_blocks < needed:
                continue
            plan.delta.blocks_to_swap_in += blocks.swap_in(seq.seq_id)
            del self.swapped[seq.seq_id]
            seq.status = SeqStatus.RUNNING
            self.running[seq.seq_id] = seq
            self._allocate(seq, num_new, plan)

    def _schedule_waiting(self, plans: dict[str, StepPlan]) -> None:
        while self.waiting:
            seq = self.seqs[self.waiting.peek()]
            worker_id = self._place(seq, plans)
            if worker_id is None:
                return
            plan, blocks = plans[worker_id], self.workers[worker_id].blocks
            if seq.request.params.prompt_logprobs is None:  # prompt logprobs need every position run
                seq.num_computed_tokens = blocks.match_prefix(seq.seq_id, seq.token_ids)
            num_new = self._num_new_tokens(seq, plan)
            if num_new == 0 or not blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                blocks.free(seq.seq_id)
                seq.num_computed_tokens = 0
                return
            self.waiting.pop()
            if seq.request.num_cached_tokens == 0 and not seq.output_token_ids:
                seq.request.num_cached_tokens = seq.num_computed_tokens
            seq.status, seq.worker_id = SeqStatus.RUNNING, worker_id
            self.running[seq.seq_id] = seq
            self._allocate(seq, num_new, plan)

    def _place(self, seq: Sequence, plans: dict[str, StepPlan]) -> str | None:
        """The worker with the most free blocks that still has a seat this step."""
        seats = [w for w, plan in plans.items() if self._has_seat(plan)
                 and plan.num_tokens < self.config.max_num_batched_tokens]
        if not seats:
            return None
        return max(seats, key=lambda w: (self.workers[w].blocks.num_free_blocks, w))

    def _has_seat(self, plan: StepPlan) -> bool:
        num_running = sum(1 for s in self.running.values() if s.worker_id == plan.worker_id)
        return num_running < self.config.max_num_seqs

    def _allocate(self, seq: Sequence, num_new: int, plan: StepPlan, drafts: list[int] = ()) -> None:
        """Slots for num_new tokens and the drafts after them (given back on rejection: _apply_verified)."""
        num_new += len(drafts)
        blocks = self.workers[seq.worker_id].blocks
        if blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new) is None:
            raise AssertionError("allocate_slots failed after can_allocate")
        plan.scheduled.append((seq, num_new))
        plan.num_tokens += num_new
        if drafts:
            plan.drafts[seq.seq_id] = list(drafts)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.num_preemptions += 1
        seq.num_preemptions += 1
        slot = self.workers[seq.worker_id]
        del self.running[seq.seq_id]
        if seq.num_tokens_on_worker:
            plan.delta.finished_seq_ids.append(seq.seq_id)
        seq.forget_on_worker()
        if self.config.preemption_mode == "swap" and slot.blocks.can_swap_out(seq.seq_id):
            plan.delta.blocks_to_swap_out += slot.blocks.swap_out(seq.seq_id)
            seq.status = SeqStatus.SWAPPED
            self.swapped[seq.seq_id] = seq
            return
        slot.blocks.free(seq.seq_id)
        seq.worker_id, seq.num_computed_tokens = None, 0
        self._enqueue(seq)

    def _fill_delta(self, plan: StepPlan) -> None:
        for seq, num_new in plan.scheduled:
            table = self.workers[seq.worker_id].blocks.block_table(seq.seq_id)
            if seq.num_tokens_on_worker == 0:
                request = seq.request
                plan.delta.new_seqs.append(NewSequence(
                    seq_id=seq.seq_id, prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(seq.output_token_ids), block_ids=list(table),
                    num_computed_tokens=seq.num_computed_tokens, num_scheduled_tokens=num_new, params=request.params,
                    sample_index=seq.sample_index,
                    num_samples=request.params.n if not request.forked and seq.sample_index == 0 else 1))
            else:
                num_prompt = len(seq.prompt_token_ids)
                plan.delta.cached_seqs.append(CachedSequence(
                    seq_id=seq.seq_id, new_token_ids=seq.output_token_ids[seq.num_tokens_on_worker - num_prompt:],
                    new_block_ids=table[seq.num_blocks_on_worker:], num_computed_tokens=seq.num_computed_tokens,
                    num_scheduled_tokens=num_new, draft_token_ids=plan.drafts.get(seq.seq_id, []),
                    num_kept_blocks=seq.num_blocks_on_worker))
            seq.num_tokens_on_worker, seq.num_blocks_on_worker = seq.num_tokens, len(table)

    # ---- results ---------------------------------------------------------------
    def update(self, worker_id: str, result: StepResult) -> list[SeqUpdate]:
        """Apply a worker's step result; returns what changed for each sample."""
        plan = self._inflight.pop(worker_id)
        blocks = self.workers[worker_id].blocks
        updates = []
        for seq, num_new in plan.scheduled:
            if seq.is_finished or seq.worker_id != worker_id or seq.status is not SeqStatus.RUNNING:
                continue
            self._add_prompt_logprobs(seq, result.prompt_logprobs.get(seq.seq_id))
            seq.num_computed_tokens += num_new - len(plan.drafts.get(seq.seq_id, ()))
            blocks.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        for output in result.outputs:
            seq = self.seqs.get(output.seq_id)
            if seq is None or seq.is_finished:
                continue
            if seq.seq_id in plan.drafts:
                updates.append(self._apply_verified(seq, plan.drafts[seq.seq_id], output, blocks))
                continue
            children = self._fork(seq, output.token_ids[1:], output.logprobs, worker_id)
            for s, token, lp in [(seq, output.token_ids[0], output.logprobs[0] if output.logprobs else None)] + children:
                updates.append(self._append(s, token, lp))
        return updates

    @staticmethod
    def _add_prompt_logprobs(seq: Sequence, entries) -> None:
        """Entries cover prompt tokens from num_computed_tokens (+1 after the first chunk); a
        recomputed prompt returns ones already held, which are skipped: a chunk of a recompute may
        end past what was held when the sequence was preempted, and only its new tail is kept."""
        if entries is None:
            return
        start, held = seq.num_computed_tokens, seq.request.prompt_logprobs
        first = 0 if start == 0 else start + 1  # the prompt position of entries[0]
        if first <= len(held):
            held += entries[len(held) - first:]

    def _fork(self, parent: Sequence, tokens: list[int], logprobs, worker_id: str):
        request = parent.request
        if request.forked or parent.sample_index != 0:
            return []
        request.forked = True
        blocks = self.workers[worker_id].blocks
        children = []
        for i, token in enumerate(tokens, start=1):
            child = self._new_seq(request, i)
            copies = blocks.fork(parent.seq_id, child.seq_id, parent.num_tokens)
            if copies is None:  # no block for the copy: the child starts over from the prompt
                self._enqueue(child)
                continue
            child.output_token_ids = list(parent.output_token_ids)
            child.num_computed_tokens, child.status, child.worker_id = parent.num_computed_tokens, SeqStatus.RUNNING, worker_id
            self.workers[worker_id].pending_copy += copies
            self.running[child.seq_id] = child
            children.append((child, token, logprobs[i] if logprobs else None))
        return children

    def _append(self, seq: Sequence, token: int, logprob) -> SeqUpdate:
        return self._append_tokens(seq, [token], [logprob])

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list) -> SeqUpdate:
        """Append tokens in order under the stop rule; those after the one that ends seq are dropped."""
        params, appended = seq.request.params, 0
        for token, logprob in zip(tokens, logprobs):
            seq.output_token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            appended += 1
            finish = finish_reason(params, token, len(seq.output_token_ids), self._eos(seq), seq.num_tokens,
                                   self.config.max_model_len)
            if finish is not None:
                seq.stop_reason = finish.stop_token_id
                self._finish(seq, finish.reason)
                break
        kept_logprobs = [lp for lp in logprobs[:appended] if lp is not None]
        return self._update_of(seq, tokens[:appended], kept_logprobs or None)

    def _apply_verified(self, seq: Sequence, drafts: list[int], output, blocks: BlockManager) -> SeqUpdate:
        """A verify pass's result: the drafts it kept, then the sampler's own token. The kept drafts'
        K/V are computed; the slots of the rejected ones are given back (whole blocks past the
        sequence's tokens), and the worker told so by the next delta (num_kept_blocks)."""
        tokens = output.token_ids
        num_accepted = len(tokens) - 1
        if not 0 <= num_accepted <= len(drafts) or tokens[:num_accepted] != drafts[:num_accepted]:
            raise AssertionError(f"sequence {seq.seq_id}: the worker kept {tokens[:-1]} of the drafts {drafts}")
        self.speculator.record(seq.seq_id, len(drafts), num_accepted)
        seq.num_computed_tokens += num_accepted
        blocks.cache_full_blocks(seq.seq_id, seq.token_ids + tokens[:num_accepted], seq.num_computed_tokens)
        update = self._append_tokens(seq, tokens, output.logprobs or [None] * len(tokens))
        if not seq.is_finished:
            blocks.trim(seq.seq_id, seq.num_tokens)
            seq.num_blocks_on_worker = min(seq.num_blocks_on_worker, len(blocks.block_table(seq.seq_id)))
        return update

    def _eos(self, seq: Sequence) -> tuple[int, ...]:
        slot = self.workers.get(seq.worker_id)
        return slot.info.eos_token_ids if slot else ()

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id, seq.output_token_ids if reason != "abort" else None)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.running.pop(seq.seq_id, None)
        self.swapped.pop(seq.seq_id, None)
        self._dequeue(seq)
        slot = self.workers.get(seq.worker_id)
        if slot is not None:
            slot.blocks.free(seq.seq_id)
            if seq.num_tokens_on_worker:
                slot.pending_forget.append(seq.seq_id)
        seq.forget_on_worker()
        request = seq.request
        if all(s.is_finished for s in request.seqs) and (request.forked or request.params.n == 1):
            self.requests.pop(request.request_id, None)
            for s in request.seqs:
                self.seqs.pop(s.seq_id, None)

    def _update_of(self, seq: Sequence, tokens: list[int], logprobs) -> SeqUpdate:
        request = seq.request
        done_prompt = seq.sample_index == 0 and len(seq.output_token_ids) == 1 and tokens
        prompt_logprobs = request.prompt_logprobs if done_prompt and request.params.prompt_logprobs is not None else None
        return SeqUpdate(request_id=request.request_id, sample_index=seq.sample_index, token_ids=tokens,
                         logprobs=logprobs, finish_reason=seq.finish_reason, stop_token_id=seq.stop_reason,
                         prompt_logprobs=prompt_logprobs, num_prompt_tokens=len(request.prompt_token_ids),
                         num_cached_tokens=request.num_cached_tokens, seed=request.seed)

    # ---- queues ----------------------------------------------------------------
    def _new_seq(self, request: Request, sample_index: int) -> Sequence:
        seq = Sequence(seq_id=next(self._seq_ids), request=request, sample_index=sample_index)
        request.seqs.append(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def _dequeue(self, seq: Sequence) -> None:
        self.waiting.remove(seq.seq_id)

    # ---- stats -----------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        running = Counter(seq.worker_id for seq in self.running.values())
        workers = tuple(WorkerStats(worker_id=worker_id, num_running=running[worker_id], **vars(slot.blocks.stats))
                        for worker_id, slot in sorted(self.workers.items()))
        spec = self.speculator.stats if self.speculator is not None else None
        return SchedulerStats(num_waiting=len(self.waiting), num_running=len(self.running),
                              num_swapped=len(self.swapped), num_preemptions=self.num_preemptions, workers=workers,
                              max_model_len=self.config.max_model_len,
                              **(spec.as_stats() if spec is not None else {}))
