"""Async scheduling, the scheduler's side: plan step N+1 while a worker still runs step N.

vLLM's name for the idea. After a pure decode step, the scheduler already knows what the next
step of that worker will be, up to the sequences that end: the same sequences, one token each
(the one this step samples), in the blocks they hold. So it marks the delta
(`StepDelta.async_next_step`), and the worker may run that continuation while the result
travels back and the scheduler decides. The next delta then holds the continuation minus the
sequences that ended (the stop rule, services/core/stop.py, which the worker applies too) plus
any request admitted meanwhile. Rows do not depend on their batch (docs/ARCHITECTURE.md, rule 4), so the
sequences the worker ran early get the bits the real step would have given them; a delta that
does not match is simply run. The worker's side: services/worker/async_scheduling.py.

Worth it across processes, where the result's trip is a good share of a step; the in-process
engine steps synchronously and leaves it off.
"""
from __future__ import annotations

from services.core.scheduler import Scheduler, StepPlan


class AsyncScheduler(Scheduler):
    """The scheduler with async scheduling on (`Scheduler(config)` is one when
    config.async_scheduling is): the same steps, and a pure decode step's continuation announced."""

    def plan_next_step(self, plan: StepPlan) -> bool:
        """Whether the worker may run this step's continuation early: nothing waits to be admitted there,
        and the step is a pure decode step over every sequence the worker runs. Each sequence that
        goes on then gets the slot of its next token now (at most one block ahead of time), so the
        continuation needs nothing new, and the next step can neither preempt nor swap it; a
        request that arrives meanwhile joins that step. Called before the delta is filled: it may
        add blocks."""
        ws = self.workers[plan.worker_id]
        delta, blocks = plan.delta, ws.blocks
        if self.waits_for(ws) or ws.swapped or not plan.scheduled:
            return False
        if delta.blocks_to_swap_in or delta.blocks_to_swap_out or delta.blocks_to_copy:
            return False
        if len(plan.scheduled) != len(ws.running):
            return False
        for seq, num_new in plan.scheduled:
            if seq.num_tokens_on_worker == 0 or num_new != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
                return False  # new to the worker, or not one token sampled this step
            if seq.request.params.n > 1 and not seq.request.forked:  # a fork comes with its first token
                return False
        going_on = [seq for seq, _ in plan.scheduled  # a sequence that ends on this token needs no slot
                    if len(seq.output_token_ids) + 1 < seq.request.params.max_tokens]
        needed = sum(max(0, blocks.num_blocks_needed(seq.num_tokens + 1) - len(blocks.block_table(seq.seq_id)))
                     for seq in going_on)
        if needed > blocks.num_free_blocks:
            return False
        for seq in going_on:
            if blocks.allocate_slots(seq.seq_id, seq.num_tokens + 1) is None:
                raise AssertionError("allocate_slots failed with enough free blocks")
        return True
