"""Async scheduling: a worker runs the announced continuation early and answers the next delta
from it (StepDelta.async_next_step). The tokens and logprobs must be those of plain steps."""
from __future__ import annotations

import dataclasses

from services.core.config import EngineArgs
from services.core.sampling_params import SamplingParams
from services.core.scheduler import Scheduler
from services.worker.async_scheduling import AsyncSteps
from services.worker.worker import Worker
from tests.conftest import make_llm, random_prompts


def params_for(i: int) -> SamplingParams:
    if i % 3 == 0:  # random sampling: seeded by position, so running early draws the same numbers
        return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=6 + i, ignore_eos=True, logprobs=2)
    return SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=1)  # they end at different steps


def run_async(folder, prompts, params, late: int = 0):
    """The core scheduler with async scheduling on, driving a real worker the way the worker service does:
    step, then run the announced continuation before the next delta arrives. The last `late`
    requests arrive one per step once the others are decoding."""
    args = EngineArgs.from_kwargs(str(folder), dtype="float32", seed=0)
    worker = Worker(args.worker_config(), args.cache_config())
    config = dataclasses.replace(args.scheduler_config(worker.info.max_model_len), async_scheduling=True)
    sched = Scheduler(config)
    sched.add_worker("w", worker.info)
    arrivals = [(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))]
    for request in arrivals[:len(arrivals) - late]:
        sched.add_request(*request)
    waiting = arrivals[len(arrivals) - late:]
    tokens: dict[str, list] = {}
    for step in range(1000):
        if step >= 3 and waiting:
            sched.add_request(*waiting.pop(0))
        if not sched.has_unfinished() and not waiting:
            break
        for worker_id, delta in sched.schedule().items():
            result = worker.step(delta)
            if delta.async_next_step:
                worker.run_async_step()
            for update in sched.update(worker_id, result):
                tokens.setdefault(update.request_id, []).append((update.token_ids, update.logprobs))
    return worker, [tokens[f"r{i}"] for i in range(len(prompts))]


def test_same_tokens_and_logprobs_as_plain_steps_and_most_steps_come_from_the_early_step(tiny_llama):
    prompts = random_prompts(6, 512, 3, 40, seed=5)
    params = [params_for(i) for i in range(6)]
    worker, got = run_async(tiny_llama, prompts, params)
    want = make_llm(tiny_llama, dtype="float32").generate(prompts, params, use_tqdm=False)
    for steps, out in zip(got, want):
        assert [t for ids, _ in steps for t in ids] == out.outputs[0].token_ids
        assert [lp for _, lps in steps for lp in lps] == out.outputs[0].logprobs
    runner = worker.runner
    assert runner.async_steps.num_used == runner.async_steps.num_run >= 8  # requests ending only shrink the batch: still used


def test_requests_admitted_during_an_early_step_run_beside_it(tiny_llama, monkeypatch):
    """A request that arrives while the continuation runs early joins the next step at once: the
    planned sequences are answered from the early step, the newcomer's prefill runs alone."""
    served_with_newcomers = []
    use = AsyncSteps._use

    def spy(self, delta, done):
        result = use(self, delta, done)
        served_with_newcomers.append(result is not None and bool(delta.new_seqs))
        return result

    monkeypatch.setattr(AsyncSteps, "_use", spy)
    prompts = random_prompts(5, 512, 3, 40, seed=6)
    params = [params_for(i) for i in range(5)]
    worker, got = run_async(tiny_llama, prompts, params, late=2)
    want = make_llm(tiny_llama, dtype="float32").generate(prompts, params, use_tqdm=False)
    for steps, out in zip(got, want):
        assert [t for ids, _ in steps for t in ids] == out.outputs[0].token_ids
        assert [lp for _, lps in steps for lp in lps] == out.outputs[0].logprobs
    assert worker.runner.async_steps.num_used == worker.runner.async_steps.num_run >= 8
    assert any(served_with_newcomers)


def test_a_delta_other_than_the_plan_runs_as_usual(tiny_llama):
    """A next delta other than the continuation (here: another token than the one sampled) is
    run from the mirrors as the scheduler knows them, as if nothing had run early."""
    args = EngineArgs.from_kwargs(str(tiny_llama), dtype="float32", seed=0)
    early, plain = (Worker(args.worker_config(), args.cache_config()) for _ in range(2))
    config = dataclasses.replace(args.scheduler_config(early.info.max_model_len), async_scheduling=True)
    sched = Scheduler(config)
    sched.add_worker("w", early.info)
    sched.add_request("a", random_prompts(1, 512, 20, 20, seed=9)[0], SamplingParams(temperature=0, max_tokens=6))
    for _ in range(3):  # prefill, then decode steps that announce their continuation
        delta = sched.schedule()["w"]
        result = early.step(delta)
        assert result.outputs == plain.step(delta).outputs
        sched.update("w", result)
    assert delta.async_next_step
    early.run_async_step()
    changed = sched.schedule()["w"]
    entry = changed.cached_seqs[0]
    changed.cached_seqs[0] = dataclasses.replace(entry, new_token_ids=[(entry.new_token_ids[0] + 1) % 512])
    assert early.step(changed).outputs == plain.step(changed).outputs
    assert early.runner.async_steps.num_used == 0
