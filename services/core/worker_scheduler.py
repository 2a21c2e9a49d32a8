"""One worker's scheduling: its running and swapped sequences, its block manager, its step.

The shared part (services/core/scheduler.py's Scheduler: admission, seeds, the waiting queue,
placement, continuations) hands a WorkerScheduler the sequences placed on it; the
WorkerScheduler builds that worker's next step (`schedule`: running first, then swapped, then
what waits for it, preempting when blocks run out), applies its result (`update`: tokens under
the stop rule, prefix-cache registration, a parallel-sampling fork, verified drafts), and knows
nothing of the other workers. Each worker steps on its own cadence (the service's step loop,
services/scheduler/loop.py, runs one task per worker), so a slow worker only delays its own
sequences. Pure Python.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.core.block_manager import BlockManager
from services.core.config import SchedulerConfig
from services.core.kv_events import KVEventLog
from services.core.policy import policy_key
from services.core.sequence import Sequence, SeqStatus, SeqUpdate
from services.core.step import CachedSequence, NewSequence, StepDelta, StepResult, WorkerInfo
from services.core.stop import finish_reason

if TYPE_CHECKING:
    from services.core.scheduler import Scheduler

STEP_TIME_WEIGHT = 0.2  # of the newest step in the worker's moving average of step time
STALL_FACTOR, STALL_MIN_S = 4.0, 1.0  # a step this many times its average, and this long, is a stall


@dataclass(kw_only=True)
class StepPlan:
    """One worker's step being built."""

    worker_id: str
    delta: StepDelta
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens run, drafts included)
    num_tokens: int = 0
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> its drafted tokens (speculation)


class WorkerScheduler:
    """The scheduler's state for one worker, and that worker's steps."""

    def __init__(self, worker_id: str, info: WorkerInfo, config: SchedulerConfig, shared: Scheduler):
        self.worker_id, self.info, self.config, self.shared = worker_id, info, config, shared
        # the LoRA adapters it holds, least recently used first: its own registry's order, mirrored (it loads
        # one on demand and drops the least recently used one no sequence it runs uses, as _hold_lora does)
        self.lora_names: dict[str, None] = dict.fromkeys(info.lora_names[-info.max_cpu_loras:] if self.serves_loras
                                                         else ())
        self.blocks = BlockManager(info.num_gpu_blocks, info.block_size, info.num_cpu_blocks,
                                   config.enable_prefix_caching)
        if shared.kv_events is not None:
            self.blocks.record_events(shared.kv_events.setdefault(worker_id, KVEventLog()))
        self.running: dict[int, Sequence] = {}
        self.swapped: dict[int, Sequence] = {}
        self.num_waiting = 0  # sequences placed on it that wait to be admitted (the shared queue holds them)
        self.pending_forget: list[int] = []
        self.pending_swap_out: list[tuple[int, int]] = []
        self.pending_copy: list[tuple[int, int]] = []
        self.inflight: StepPlan | None = None
        self.num_steps = 0
        self.step_time_s = 0.0  # moving average, from schedule to update
        self.step_started: float | None = None  # while a step is out

    # ---- load, for placement ---------------------------------------------------
    def has_seat(self) -> bool:
        return len(self.running) < self.config.max_num_seqs

    def is_stalled(self, now: float) -> bool:
        """Its step has been out far longer than its steps take (paused, hung, or much slower now)."""
        if self.step_started is None:
            return False
        return now - self.step_started > max(STALL_MIN_S, STALL_FACTOR * self.step_time_s)

    def load(self) -> int:
        return len(self.running) + len(self.swapped) + self.num_waiting

    def serves(self, request) -> bool:
        """Hook: whether this worker serves the request's model and its LoRA adapter. Every worker serves the
        one model (the scheduler refuses one that does not fit); an adapter the scheduler serves, every worker
        with --enable-lora (it loads the adapter if it does not hold it: placement prefers one that does)."""
        return not request.lora_name or (self.serves_loras and request.lora_name in self.shared.loras)

    @property
    def serves_loras(self) -> bool:
        return self.info.max_cpu_loras > 0

    # ---- one step --------------------------------------------------------------
    def schedule(self, step_id: int) -> StepDelta | None:
        """This worker's next step: running first, then swapped, then what waits for it; None
        when it has nothing to do."""
        plan = StepPlan(worker_id=self.worker_id, delta=StepDelta(step_id=step_id))
        if not self._schedule_running(plan):  # a preemption: nothing new joins this step
            self._schedule_swapped(plan)
            self.shared.admit_waiting(self, plan)
        delta = plan.delta
        delta.finished_seq_ids = self.pending_forget + delta.finished_seq_ids
        delta.blocks_to_swap_out = self.pending_swap_out + delta.blocks_to_swap_out
        delta.blocks_to_copy = self.pending_copy + delta.blocks_to_copy
        self.pending_forget, self.pending_swap_out, self.pending_copy = [], [], []
        async_next_step = self.shared.plan_next_step(plan)  # before the delta is filled: it may add blocks
        self._fill_delta(plan)
        delta.async_next_step = async_next_step
        if delta.is_empty:
            return None
        self.inflight, self.step_started = plan, time.monotonic()
        return delta

    def _key(self, seq: Sequence) -> tuple:
        return policy_key(self.config.scheduling_policy, seq)

    def num_new_tokens(self, seq: Sequence, plan: StepPlan) -> int:
        """Tokens to run for seq this step under the token budget (0: none fit)."""
        budget = self.config.max_num_batched_tokens - plan.num_tokens
        wanted = seq.num_tokens - seq.num_computed_tokens
        if wanted <= budget:
            return wanted
        return budget if self.config.enable_chunked_prefill and not self._runs_whole(seq) else 0

    def _runs_whole(self, seq: Sequence) -> bool:
        """A pooling sequence this worker pools over its whole prompt at once (an encoder, mean or CLS)."""
        return self.info.pooling_whole and bool(seq.request.params.pooling)

    def _schedule_running(self, plan: StepPlan) -> bool:
        preempted = False
        queue = sorted(self.running.values(), key=self._key)
        speculator = self.shared.speculator
        speculate = speculator is not None and speculator.pays_at(len(queue))
        by_priority = self.config.scheduling_policy == "priority"
        while queue:
            seq = queue.pop(0)
            if by_priority and self.shared.waiting and plan.num_tokens < self.config.max_num_batched_tokens:
                preempted |= self._admit_outranking(seq, queue, plan)
            num_new = self.num_new_tokens(seq, plan)
            if num_new == 0:
                continue
            drafts = self._drafts(seq, num_new, plan) if speculate else []
            if drafts and not self.blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new + len(drafts)):
                drafts = []  # drafts never preempt anyone
            while not self.blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                victim = queue.pop() if queue else seq  # lowest priority goes first
                self._preempt(victim, plan)
                preempted = True
                if victim is seq:
                    break
            else:
                self.allocate(seq, num_new, plan, drafts)
        return preempted

    def _admit_outranking(self, seq: Sequence, queue: list[Sequence], plan: StepPlan) -> bool:
        """Priority policy: before running seq gets its share of the step, start what waits and
        outranks it, so a long low-priority prefill never holds back a short high-priority request; one
        that does not fit preempts the lowest-priority running sequences not yet scheduled (queue's
        tail) while they rank below it. Returns whether it preempted any."""
        def make_room(waiting: Sequence) -> bool:
            if plan.num_tokens >= self.config.max_num_batched_tokens or not queue or \
                    self._key(queue[-1]) <= self._key(waiting):
                return False
            self._preempt(queue.pop(), plan)
            return True

        num_preemptions = self.shared.num_preemptions
        self.shared.admit_waiting(self, plan, below=self._key(seq), make_room=make_room)
        return self.shared.num_preemptions != num_preemptions

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
        return self.shared.speculator.propose(seq.seq_id, seq.token_ids, room) if room > 0 else []

    def _schedule_swapped(self, plan: StepPlan) -> None:
        for seq in sorted(self.swapped.values(), key=self._key):
            if not self.has_seat() or not self.blocks.can_swap_in(seq.seq_id) or \
                    not self.has_lora_slot(seq.request.lora_name):
                continue
            num_new = self.num_new_tokens(seq, plan)
            needed = self.blocks.num_blocks_needed(seq.num_computed_tokens + num_new)
            if num_new == 0 or self.blocks.num_free_blocks < needed:
                continue
            plan.delta.blocks_to_swap_in += self.blocks.swap_in(seq.seq_id, seq.token_ids, seq.request.lora_id)
            del self.swapped[seq.seq_id]
            seq.status = SeqStatus.RUNNING
            self.running[seq.seq_id] = seq
            self.allocate(seq, num_new, plan)

    def admit(self, seq: Sequence, plan: StepPlan) -> bool:
        """Start a waiting sequence here this step (its cached prefix attached); False when it does
        not fit now (no seat, no budget or no blocks)."""
        if not self.has_seat() or plan.num_tokens >= self.config.max_num_batched_tokens:
            return False
        if seq.request.params.prompt_logprobs is None and not self._runs_whole(seq):  # every position run
            seq.num_computed_tokens = self.blocks.match_prefix(seq.seq_id, seq.token_ids, seq.request.cache_root)
        num_new = self.num_new_tokens(seq, plan)
        if num_new == 0 or not self.blocks.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
            self.blocks.free(seq.seq_id)
            seq.num_computed_tokens = 0
            return False
        if seq.request.num_cached_tokens == 0 and not seq.output_token_ids:
            seq.request.num_cached_tokens = seq.num_computed_tokens
        seq.status, seq.worker_id = SeqStatus.RUNNING, self.worker_id
        self.running[seq.seq_id] = seq
        self.allocate(seq, num_new, plan)
        return True

    def has_lora_slot(self, lora_name: str) -> bool:
        """Whether a sequence under this LoRA adapter may start here: the adapters of the running
        sequences, with it, stay within max_loras and within the adapters the worker holds at once (so it
        always has one no running sequence uses to drop for it); the base needs no slot."""
        if not lora_name:
            return True
        running = self._loras_running()
        return lora_name in running or len(running) < min(self.config.max_loras, self.info.max_cpu_loras)

    def _loras_running(self) -> set[str]:
        return {s.request.lora_name for s in self.running.values() if s.request.lora_name}

    def _hold_lora(self, lora_name: str) -> None:
        """A new sequence under this adapter is sent: the worker holds it after (loading it, past
        max_cpu_loras dropping the least recently used adapter that no running sequence uses). Mirrors
        services/worker/lora.py LoraRegistry.acquire, for placement: a miss costs a load, never a request."""
        held = self.lora_names
        held.pop(lora_name, None)
        running = self._loras_running()
        while len(held) >= self.info.max_cpu_loras:
            victim = next((name for name in held if name not in running), None)
            if victim is None:
                break
            del held[victim]
        held[lora_name] = None

    def allocate(self, seq: Sequence, num_new: int, plan: StepPlan, drafts: list[int] = ()) -> None:
        """Slots for num_new tokens and the drafts after them (given back on rejection: _apply_verified)."""
        num_new += len(drafts)
        if self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new) is None:
            raise AssertionError("allocate_slots failed after can_allocate")
        plan.scheduled.append((seq, num_new))
        plan.num_tokens += num_new
        if drafts:
            plan.drafts[seq.seq_id] = list(drafts)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.shared.num_preemptions += 1
        seq.num_preemptions += 1
        del self.running[seq.seq_id]
        if seq.num_tokens_on_worker:
            plan.delta.finished_seq_ids.append(seq.seq_id)
        seq.forget_on_worker()
        if self.config.preemption_mode == "swap" and self.blocks.can_swap_out(seq.seq_id):
            plan.delta.blocks_to_swap_out += self.blocks.swap_out(seq.seq_id)
            seq.status = SeqStatus.SWAPPED
            self.swapped[seq.seq_id] = seq
            return
        self.blocks.free(seq.seq_id)
        seq.worker_id, seq.num_computed_tokens = None, 0
        self.shared.enqueue(seq)  # placed again: where its prefix is cached, likely here

    def _fill_delta(self, plan: StepPlan) -> None:
        for seq, num_new in plan.scheduled:
            table = self.blocks.block_table(seq.seq_id)
            if seq.num_tokens_on_worker == 0:
                request = seq.request
                plan.delta.new_seqs.append(NewSequence(
                    seq_id=seq.seq_id, prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(seq.output_token_ids), block_ids=list(table),
                    num_computed_tokens=seq.num_computed_tokens, num_scheduled_tokens=num_new, params=request.params,
                    sample_index=seq.sample_index,
                    num_samples=request.params.n if not request.forked and seq.sample_index == 0 else 1,
                    lora_name=request.lora_name, lora_path=self.shared.loras.get(request.lora_name, "")))
                if request.lora_name:
                    self._hold_lora(request.lora_name)
            else:
                num_prompt = len(seq.prompt_token_ids)
                plan.delta.cached_seqs.append(CachedSequence(
                    seq_id=seq.seq_id, new_token_ids=seq.output_token_ids[seq.num_tokens_on_worker - num_prompt:],
                    new_block_ids=table[seq.num_blocks_on_worker:], num_computed_tokens=seq.num_computed_tokens,
                    num_scheduled_tokens=num_new, draft_token_ids=plan.drafts.get(seq.seq_id, []),
                    num_kept_blocks=seq.num_blocks_on_worker))
            seq.num_tokens_on_worker, seq.num_blocks_on_worker = seq.num_tokens, len(table)

    # ---- results ---------------------------------------------------------------
    def update(self, result: StepResult) -> list[SeqUpdate]:
        """Apply this worker's step result; returns what changed for each sample."""
        plan, self.inflight = self.inflight, None
        self._time_step()
        updates = []
        drafts, block_size, seqs = plan.drafts, self.blocks.block_size, self.shared.seqs
        prompt_logprobs = result.prompt_logprobs
        for seq, num_new in plan.scheduled:
            if seq.status is not SeqStatus.RUNNING or seq.worker_id != self.worker_id:  # finished, moved
                continue
            if prompt_logprobs:
                _add_prompt_logprobs(seq, prompt_logprobs.get(seq.seq_id))
            before = seq.num_computed_tokens
            seq.num_computed_tokens = after = before + num_new - len(drafts.get(seq.seq_id, ()))
            # A block is full, so cacheable, only once computed tokens cross its end: most decode steps
            # cross none, and then neither the prompt + output copy (token_ids) nor the call is made.
            if after // block_size > before // block_size:
                self.blocks.cache_full_blocks(seq.seq_id, seq.token_ids, after, seq.request.cache_root,
                                              seq.request.lora_id)
        for output in result.outputs:
            seq = seqs.get(output.seq_id)
            if seq is None or seq.status is SeqStatus.FINISHED:
                continue
            if drafts and seq.seq_id in drafts:
                updates.append(self._apply_verified(seq, drafts[seq.seq_id], output))
                continue
            if output.pooled is not None:  # a pooling request: its prompt is done, and so is it
                updates.append(self.shared.pooled_update(seq, output.pooled))
                continue
            tokens, logprobs = output.token_ids, output.logprobs
            first = [logprobs[0] if logprobs else None]
            if seq.request.forked or seq.sample_index != 0:  # nothing to fork (every step after a request's first)
                updates.append(self._append_tokens(seq, tokens[:1], first))
                continue
            children = self._fork(seq, tokens[1:], logprobs)  # before the parent's token is appended
            updates.append(self._append_tokens(seq, tokens[:1], first))
            for child, token, lp in children:
                updates.append(self._append_tokens(child, [token], [lp]))
        return updates

    def _time_step(self) -> None:
        if self.step_started is not None:
            elapsed = time.monotonic() - self.step_started
            self.step_time_s = elapsed if self.num_steps == 0 else \
                (1 - STEP_TIME_WEIGHT) * self.step_time_s + STEP_TIME_WEIGHT * elapsed
        self.step_started = None
        self.num_steps += 1

    def _fork(self, parent: Sequence, tokens: list[int], logprobs):
        request = parent.request
        if request.forked or parent.sample_index != 0:
            return []
        request.forked = True
        children = []
        for i, token in enumerate(tokens, start=1):
            child = self.shared.new_seq(request, i)
            copies = self.blocks.fork(parent.seq_id, child.seq_id, parent.num_tokens)
            if copies is None:  # no block for the copy: the child starts over from the prompt
                self.shared.enqueue(child)
                continue
            child.output_token_ids = list(parent.output_token_ids)
            child.num_computed_tokens, child.status, child.worker_id = \
                parent.num_computed_tokens, SeqStatus.RUNNING, self.worker_id
            self.pending_copy += copies
            self.running[child.seq_id] = child
            children.append((child, token, logprobs[i] if logprobs else None))
        return children

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list) -> SeqUpdate:
        """Append tokens in order under the stop rule; those after the one that ends seq are dropped."""
        params, appended = seq.request.params, 0
        for token, logprob in zip(tokens, logprobs):
            seq.output_token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            appended += 1
            finish = finish_reason(params, token, len(seq.output_token_ids), self.info.eos_token_ids, seq.num_tokens,
                                   self.config.max_model_len)
            if finish is not None:
                seq.stop_reason = finish.stop_token_id
                self.shared.finish(seq, finish.reason)
                break
        kept_logprobs = [lp for lp in logprobs[:appended] if lp is not None]
        return self.shared.update_of(seq, tokens[:appended], kept_logprobs or None)

    def _apply_verified(self, seq: Sequence, drafts: list[int], output) -> SeqUpdate:
        """A verify pass's result: the drafts it kept, then the sampler's own token. The kept drafts'
        K/V are computed; the slots of the rejected ones are given back (whole blocks past the
        sequence's tokens), and the worker told so by the next delta (num_kept_blocks)."""
        tokens = output.token_ids
        num_accepted = len(tokens) - 1
        if not 0 <= num_accepted <= len(drafts) or tokens[:num_accepted] != drafts[:num_accepted]:
            raise AssertionError(f"sequence {seq.seq_id}: the worker kept {tokens[:-1]} of the drafts {drafts}")
        self.shared.speculator.record(seq.seq_id, len(drafts), num_accepted)
        seq.num_computed_tokens += num_accepted
        self.blocks.cache_full_blocks(seq.seq_id, seq.token_ids + tokens[:num_accepted], seq.num_computed_tokens,
                                      seq.request.cache_root, seq.request.lora_id)
        update = self._append_tokens(seq, tokens, output.logprobs or [None] * len(tokens))
        if not seq.is_finished:
            self.blocks.trim(seq.seq_id, seq.num_tokens)
            seq.num_blocks_on_worker = min(seq.num_blocks_on_worker, len(self.blocks.block_table(seq.seq_id)))
        return update

    # ---- leaving ---------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """seq finished: its blocks back, and the worker told to forget it if it mirrors it."""
        self.running.pop(seq.seq_id, None)
        self.swapped.pop(seq.seq_id, None)
        self.blocks.free(seq.seq_id)
        if seq.num_tokens_on_worker:
            self.pending_forget.append(seq.seq_id)

    def evict(self) -> list[Sequence]:
        """The worker is gone: every sequence it ran or held swapped, each reset to be recomputed."""
        moved = list(self.running.values()) + list(self.swapped.values())
        self.running, self.swapped, self.inflight = {}, {}, None
        for seq in moved:
            seq.worker_id, seq.num_computed_tokens = None, 0
            seq.forget_on_worker()
        return moved


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
