"""Async scheduling, the worker's side: run the next step before its delta arrives.

AsyncModelRunner is the ModelRunner with these steps; it overrides execute, run_async_step and
forget_all and uses the base class's hooks run_delta and apply_cached. When a delta says its
continuation comes next (StepDelta.async_next_step; the scheduler's side is
services/core/async_scheduling.py), the runner plans that continuation from the step's result
(`plan`), runs it between the result leaving and the next delta arriving (`run`), and answers
the next delta's planned sequences from it (`take`). With batch-invariant kernels the next delta
may differ from the plan: sequences that ended are left out, and requests admitted meanwhile run
then, on their own (a row's bits do not depend on its batch). The early step writes only each
continuing sequence's next K/V slot, in a block the sequence holds, with the values the real
step would write, so a delta that does not match loses nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from services.core.step import CachedSequence, SeqOutput, StepDelta, StepResult
from services.core.stop import finish_reason
from services.worker.model_runner import ModelRunner


@dataclass
class AsyncStep:
    """A continuation run before its delta: the cached-sequence entries it assumed, and its outputs."""

    expected: dict[int, CachedSequence]
    outputs: dict[int, SeqOutput]


def _as_planned(entry: CachedSequence, planned: CachedSequence | None) -> bool:
    """New blocks may come with it: they hold later tokens than the one run early."""
    return planned is not None and (entry.new_token_ids, entry.num_computed_tokens, entry.num_scheduled_tokens) == \
        (planned.new_token_ids, planned.num_computed_tokens, planned.num_scheduled_tokens)


class AsyncSteps:
    """One runner's planned continuation and the early step run from it."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.planned: list[CachedSequence] = []  # the continuation of the last step, not run yet
        self.done: AsyncStep | None = None  # run, waiting for its delta
        self.num_run = self.num_used = 0

    def plan(self, result: StepResult) -> None:
        """The entries the next delta will hold for the sequences that go on: each sampled token
        comes back as the one new token, computed from the position it takes."""
        self.planned = []
        for output in result.outputs:
            state = self.runner.seqs.get(output.seq_id)
            if state is None or len(output.token_ids) != 1:
                continue
            ends = finish_reason(state.params, output.token_ids[0], len(state.output_token_ids) + 1,
                                 self.runner.eos_token_ids)  # max_model_len is the scheduler's: a wasted row
            if ends is None:
                self.planned.append(CachedSequence(seq_id=output.seq_id, new_token_ids=list(output.token_ids),
                                                   new_block_ids=[], num_computed_tokens=state.num_computed_tokens,
                                                   num_scheduled_tokens=1))

    def run(self) -> None:
        """Run the planned continuation, if any, and keep its outputs for `take`."""
        continuation, self.planned = self.planned, []
        if not continuation:
            return
        runner = self.runner
        states = [runner.seqs[c.seq_id] for c in continuation]
        saved = [(len(s.output_token_ids), s.num_computed_tokens, s.num_samples) for s in states]
        try:
            result = runner.run_delta(StepDelta(step_id=-1, cached_seqs=continuation))
        finally:  # the mirrors stay as the scheduler knows them until a delta confirms the step
            for state, (num_outputs, num_computed, num_samples) in zip(states, saved):
                del state.output_token_ids[num_outputs:]
                state.num_computed_tokens, state.num_samples = num_computed, num_samples
        self.done = AsyncStep({c.seq_id: c for c in continuation}, {o.seq_id: o for o in result.outputs})
        self.num_run += 1

    def take(self, delta: StepDelta) -> StepResult | None:
        """The step, answered in part from the early one, or None: run it as usual."""
        done, self.done, self.planned = self.done, None, []
        return self._use(delta, done) if done is not None else None

    def clear(self) -> None:
        self.planned, self.done = [], None

    def _use(self, delta: StepDelta, done: AsyncStep) -> StepResult | None:
        """The step, with the sequences that are as planned answered from the early step and the
        rest of the delta (requests admitted meanwhile) run now; None when none is as planned.
        Answering part of a step needs batch-invariant kernels; without, only the exact plan."""
        if delta.blocks_to_swap_out or delta.blocks_to_swap_in or delta.blocks_to_copy:
            return None  # never after a planned step (every slot is held); were they there, they would go first
        runner, expected = self.runner, done.expected
        used = [entry for entry in delta.cached_seqs if _as_planned(entry, expected.get(entry.seq_id))]
        rest = [entry for entry in delta.cached_seqs if not _as_planned(entry, expected.get(entry.seq_id))]
        exact = not rest and not delta.new_seqs and len(used) == len(expected)
        if not used or not (runner.batch_invariant or exact):
            return None
        for seq_id in delta.finished_seq_ids:
            runner.seqs.pop(seq_id, None)
        for entry in used:
            state, num_new = runner.apply_cached(entry)
            state.num_computed_tokens += num_new
        result = runner.run_delta(dataclasses.replace(delta, cached_seqs=rest, finished_seq_ids=[]))
        result.outputs[:0] = [done.outputs[entry.seq_id] for entry in used]
        self.num_used += 1
        return result


class AsyncModelRunner(ModelRunner):
    """The model runner of a worker under async scheduling: a delta that announces its
    continuation gets it run early (`run_async_step`), and the next delta is answered from it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.async_steps = AsyncSteps(self)  # the next step, run before its delta

    def execute(self, delta: StepDelta) -> StepResult:
        result = self.async_steps.take(delta)
        if result is None:
            result = self.run_delta(delta)
        if delta.async_next_step:
            self.async_steps.plan(result)
        return result

    def run_async_step(self) -> None:
        self.async_steps.run()

    def forget_all(self) -> None:
        super().forget_all()
        self.async_steps.clear()
