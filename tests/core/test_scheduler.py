"""The scheduler driven on the CPU with a fake worker: policies, budgets, preemption, deltas."""
from __future__ import annotations

import pytest

from services.core.config import SchedulerConfig
from services.core.sampling_params import SamplingParams
from services.core.scheduler import Scheduler
from services.core.step import SeqOutput, StepDelta, StepResult, WorkerInfo


class FakeWorker:
    """Mirrors sequences like the real runner and 'samples' a token derived from the length."""

    def __init__(self):
        self.seqs: dict[int, dict] = {}
        self.deltas: list[StepDelta] = []

    def step(self, delta: StepDelta) -> StepResult:
        self.deltas.append(delta)
        for seq_id in delta.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        result = StepResult(delta.step_id)
        for new in delta.new_seqs:
            self.seqs[new.seq_id] = dict(n=len(new.prompt_token_ids) + len(new.output_token_ids),
                                         computed=new.num_computed_tokens + new.num_scheduled_tokens,
                                         samples=new.num_samples)
        for cached in delta.cached_seqs:
            state = self.seqs[cached.seq_id]  # KeyError = a delta for an unknown sequence
            state["n"] += len(cached.new_token_ids)
            assert cached.num_computed_tokens == state["computed"]
            state["computed"] += cached.num_scheduled_tokens
            state["samples"] = 1
        for seq_id, state in self.seqs.items():
            touched = any(s.seq_id == seq_id for s in delta.new_seqs + delta.cached_seqs)
            if touched and state["computed"] == state["n"]:
                result.outputs.append(SeqOutput(seq_id=seq_id, token_ids=[3 + (state["n"] * 7 + k) % 50 for k in range(state["samples"])]))
        return result


def make_scheduler(num_blocks=64, workers=("w0",), block_size=8, max_cpu_loras=0, **config):
    """max_cpu_loras: each worker's (> 0: it runs with --enable-lora)."""
    config.setdefault("max_model_len", 256)
    config.setdefault("async_scheduling", False)
    sched = Scheduler(SchedulerConfig(block_size=block_size, enable_prefix_caching=True, **config))
    fakes = {}
    for w in workers:
        sched.add_worker(w, WorkerInfo(model="fake", dtype="float32", block_size=block_size, num_gpu_blocks=num_blocks,
                                       num_cpu_blocks=32, vocab_size=100, max_model_len=256, eos_token_ids=(1,),
                                       device="cpu", batch_invariant=True, max_cpu_loras=max_cpu_loras))
        fakes[w] = FakeWorker()
    return sched, fakes


def run_to_end(sched, fakes, max_steps=500):
    finished, order = {}, []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        for worker_id, delta in sched.schedule().items():
            for update in sched.update(worker_id, fakes[worker_id].step(delta)):
                if update.finish_reason:
                    finished[(update.request_id, update.sample_index)] = update.finish_reason
                    order.append(update.request_id)
    return finished, order


def params(max_tokens=4, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def all_free(sched):
    return all(s.num_free_gpu_blocks == s.num_gpu_blocks and s.num_free_cpu_blocks == s.num_cpu_blocks
               for s in sched.stats().workers)


def test_first_step_sends_sequences_in_full_then_deltas():
    sched, fakes = make_scheduler()
    sched.add_request("a", list(range(10, 20)), params(3))
    run_to_end(sched, fakes)
    deltas = fakes["w0"].deltas
    assert [len(d.new_seqs) for d in deltas[:1]] == [1] and deltas[0].new_seqs[0].num_scheduled_tokens == 10
    assert all(not d.new_seqs for d in deltas[1:-1])
    assert [c.num_scheduled_tokens for d in deltas[1:] for c in d.cached_seqs] == [1, 1]
    assert all(len(c.new_token_ids) == 1 for d in deltas[1:] for c in d.cached_seqs)
    assert all_free(sched)


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", ["a", "b", "c"]),
    ("priority", ["c", "a", "b"]),
    ("sjf", ["b", "c", "a"]),
])
def test_policies_pick_the_order(policy, expected):
    sched, fakes = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    sched.add_request("a", [5] * 30, params(8), priority=2)
    sched.add_request("b", [5] * 3, params(2), priority=3)
    sched.add_request("c", [5] * 10, params(2), priority=1)
    _, order = run_to_end(sched, fakes)
    assert order == expected


def steps_to_first_token(sched, fakes, request_id, max_steps=500):
    """Steps (rounds over every worker) until request_id has its first token; runs the rest to the end."""
    first = None
    for step in range(1, max_steps):
        for worker_id, delta in sched.schedule().items():
            for update in sched.update(worker_id, fakes[worker_id].step(delta)):
                if update.request_id == request_id and update.token_ids and first is None:
                    first = step
        if not sched.has_unfinished():
            return first
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("load", [0, 16])
def test_a_high_priority_request_gets_its_first_token_in_one_step_past_long_low_priority_prefills(load):
    """16 prompts of 240 tokens each want 15 steps each of a 16-token budget; a 12-token
    high-priority request arriving among them still gets its first token in its first step, as alone."""
    sched, fakes = make_scheduler(num_blocks=512, scheduling_policy="priority", max_num_batched_tokens=16)
    for i in range(load):
        sched.add_request(f"low{i}", [7 + i] * 240, params(4), priority=5)
    for _ in range(2):  # they run
        for worker_id, delta in sched.schedule().items():
            sched.update(worker_id, fakes["w0"].step(delta))
    sched.add_request("high", [3] * 12, params(4), priority=0)
    assert steps_to_first_token(sched, fakes, "high") == 1
    assert all_free(sched) and sched.num_preemptions == 0


def test_a_high_priority_request_preempts_low_priority_ones_when_the_cache_is_full():
    sched, fakes = make_scheduler(num_blocks=24, scheduling_policy="priority", preemption_mode="recompute")
    for i in range(4):
        sched.add_request(f"low{i}", [7 + i] * 40, params(8), priority=5)  # 6 blocks each at the end
    for _ in range(3):
        for worker_id, delta in sched.schedule().items():
            sched.update(worker_id, fakes["w0"].step(delta))
    assert sched.stats().workers[0].num_free_gpu_blocks < 3
    sched.add_request("high", [3] * 20, params(4), priority=0)
    assert steps_to_first_token(sched, fakes, "high") == 1
    assert sched.num_preemptions > 0 and all_free(sched)


def test_chunked_prefill_respects_the_token_budget():
    sched, fakes = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=True)
    sched.add_request("a", list(range(3, 23)), params(2))
    run_to_end(sched, fakes)
    sizes = [d.num_scheduled_tokens for d in fakes["w0"].deltas]
    assert sizes[:3] == [8, 8, 4] and max(sizes) <= 8


def test_preemption_by_recompute_resends_in_full_and_frees_everything():
    sched, fakes = make_scheduler(num_blocks=12, preemption_mode="recompute")
    for i in range(4):
        sched.add_request(str(i), [5 + i] * 17, params(12))
    finished, _ = run_to_end(sched, fakes)
    assert sched.num_preemptions > 0
    assert set(finished.values()) == {"length"} and len(finished) == 4
    resent = [n for d in fakes["w0"].deltas for n in d.new_seqs if n.output_token_ids]
    assert resent and all(n.num_computed_tokens % 8 == 0 for n in resent)
    assert all_free(sched)


def test_preemption_by_swap_moves_blocks_out_and_back():
    sched, fakes = make_scheduler(num_blocks=12, preemption_mode="swap")
    for i in range(4):
        sched.add_request(str(i), [5 + i] * 17, params(12))
    finished, _ = run_to_end(sched, fakes)
    deltas = fakes["w0"].deltas
    assert any(d.blocks_to_swap_out for d in deltas) and any(d.blocks_to_swap_in for d in deltas)
    assert len(finished) == 4 and all_free(sched)


def test_abort_frees_blocks_and_worker_forgets_next_step():
    sched, fakes = make_scheduler()
    sched.add_request("a", [5] * 10, params(50))
    sched.add_request("b", [6] * 10, params(3))
    for worker_id, delta in sched.schedule().items():
        sched.update(worker_id, fakes[worker_id].step(delta))
    updates = sched.abort("a")
    assert updates and updates[0].finish_reason == "abort"
    run_to_end(sched, fakes)
    assert any(0 in d.finished_seq_ids for d in fakes["w0"].deltas)
    assert all_free(sched)


def test_requests_spread_over_workers_and_survive_a_dead_worker():
    sched, fakes = make_scheduler(workers=("w0", "w1"))
    for i in range(6):
        sched.add_request(str(i), [5 + i] * 6, params(10))
    for _ in range(3):
        for worker_id, delta in sched.schedule().items():
            sched.update(worker_id, fakes[worker_id].step(delta))
    assert fakes["w0"].deltas and fakes["w1"].deltas
    moved = sched.remove_worker("w1")
    assert moved > 0
    finished, _ = run_to_end(sched, {"w0": fakes["w0"]})
    assert len(finished) == 6 and set(finished.values()) == {"length"}
    resent = [n for d in fakes["w0"].deltas for n in d.new_seqs if n.output_token_ids]
    assert len(resent) == moved


def test_parallel_samples_fork_with_copy_of_partial_block():
    sched, fakes = make_scheduler()
    sched.add_request("a", [5] * 10, params(4, n=3))
    finished, _ = run_to_end(sched, fakes)
    assert len(finished) == 3
    assert any(d.blocks_to_copy for d in fakes["w0"].deltas)  # 10 tokens: the second block is partial
    assert all_free(sched)


def test_queue_limit_refuses_with_resource_exhausted():
    from services.core.errors import ResourceExhausted

    sched, fakes = make_scheduler(max_waiting_requests=2, max_num_seqs=3)
    for request_id in "abcde":  # a burst before any step: the 3 free seats are not the waiting room
        sched.add_request(request_id, [5], params())
    with pytest.raises(ResourceExhausted):
        sched.add_request("f", [5], params())
    sched.update("w0", fakes["w0"].step(sched.schedule()["w0"]))  # a, b, c run; d, e wait
    with pytest.raises(ResourceExhausted):
        sched.add_request("f", [5], params())


def test_async_scheduling_plans_pure_decode_steps_with_the_next_slot_allocated():
    sched, fakes = make_scheduler(async_scheduling=True)
    sched.add_request("a", list(range(10, 17)), params(12))  # 7 prompt tokens: decode crosses block edges
    sched.add_request("b", list(range(20, 35)), params(12))
    deltas = []
    while sched.has_unfinished():
        for worker_id, delta in sched.schedule().items():
            deltas.append(delta)
            for seq, _ in sched._inflight[worker_id].scheduled:  # the planned next step needs no new slot
                if delta.async_next_step:
                    table = sched.workers[worker_id].blocks.block_table(seq.seq_id)
                    assert len(table) * 8 >= seq.num_tokens + 1
            sched.update(worker_id, fakes[worker_id].step(delta))
    assert not deltas[0].async_next_step  # a prefill step
    planned = [d for d in deltas[:-1] if d.async_next_step]
    assert len(planned) >= 9  # every decode step but the last, whatever block edges they cross
    for before, after in zip(deltas, deltas[1:]):
        if before.async_next_step:  # the continuation: the same sequences, one token each, nothing new
            assert not after.new_seqs and {c.seq_id for c in after.cached_seqs} <= {c.seq_id for c in before.cached_seqs}
            assert all(c.num_scheduled_tokens == 1 for c in after.cached_seqs)
    assert all_free(sched)


def test_async_scheduling_admits_a_new_request_at_once_and_tokens_do_not_change():
    def run(async_scheduling):
        sched, fakes = make_scheduler(async_scheduling=async_scheduling)
        sched.add_request("a", list(range(10, 30)), params(8))
        steps, tokens = [], {}
        for step in range(40):
            if step == 3:
                sched.add_request("late", list(range(40, 50)), params(5))
            if not sched.has_unfinished():
                break
            for worker_id, delta in sched.schedule().items():
                steps.append(delta)
                for u in sched.update(worker_id, fakes[worker_id].step(delta)):
                    tokens.setdefault(u.request_id, []).extend(u.token_ids)
        return steps, tokens, all_free(sched)

    plain_steps, plain_tokens, plain_free = run(False)
    steps, tokens, free = run(True)
    assert tokens == plain_tokens and free and plain_free
    admitted = next(i for i, d in enumerate(steps) if any(len(n.prompt_token_ids) == 10 for n in d.new_seqs))
    assert admitted == next(i for i, d in enumerate(plain_steps) if any(len(n.prompt_token_ids) == 10
                                                                        for n in d.new_seqs))
    assert steps[admitted - 1].async_next_step  # it joins the planned continuation
    assert not steps[admitted].async_next_step  # a step with a prefill plans nothing
