"""Placement and per-worker steps in the core: a request goes where its prefix is cached; a worker
whose step is stalled gets no new request and what waited for it runs elsewhere; the workers'
steps interleave in any order with the same tokens."""
from __future__ import annotations

import time

import pytest

from tests.core.test_scheduler import FakeWorker, make_scheduler, params, run_to_end


def updates_of(sched, fakes, worker_id):
    delta = sched.schedule_worker(worker_id)
    return [] if delta is None else sched.update(worker_id, fakes[worker_id].step(delta))


def test_a_follow_up_turn_goes_to_the_worker_that_caches_its_conversation():
    sched, fakes = make_scheduler(workers=("w0", "w1"))
    first = {"a": list(range(10, 50)), "b": list(range(60, 100))}
    for request_id, prompt in first.items():
        sched.add_request(request_id, prompt, params(4))
    ran_on = {}
    for worker_id in ("w0", "w1"):
        delta = sched.schedule_worker(worker_id)
        for new in delta.new_seqs:
            ran_on[sched.seqs[new.seq_id].request.request_id] = worker_id
        sched.update(worker_id, fakes[worker_id].step(delta))
    run_to_end(sched, fakes)
    assert sorted(ran_on.values()) == ["w0", "w1"]
    # the follow-ups, the one whose conversation w0 holds first (a placement by free blocks alone,
    # ties to the higher id, put it on w1 and the other on w0: no hit at all)
    order = sorted(first, key=lambda r: ran_on[r])
    cached = {}
    for request_id in order:
        sched.add_request(f"{request_id}2", first[request_id] + [7, 8, 9], params(2))
    for _ in range(20):
        for worker_id in ("w0", "w1"):
            for update in updates_of(sched, fakes, worker_id):
                cached[update.request_id] = update.num_cached_tokens
    assert cached == {"a2": 40, "b2": 40}  # every full block of the earlier prompt came from the cache


def test_a_stalled_worker_gets_no_new_request_and_what_waited_for_it_runs_elsewhere(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    sched, fakes = make_scheduler(workers=("w0", "w1"))
    sched.add_request("slow", list(range(10, 30)), params(30))
    sched.add_request("queued", list(range(30, 50)), params(3))  # placed on the other worker, idle
    holder = sched.seqs[0].placed
    other = "w1" if holder == "w0" else "w0"
    assert sched.seqs[1].placed == other
    stuck = sched.schedule_worker(holder)  # its step goes out and does not come back
    clock[0] += 0.02
    sched.update(other, fakes[other].step(sched.schedule_worker(other)))  # a 20 ms step on the other
    clock[0] += 5.0  # the stuck step is stalled now
    sched.add_request("new", list(range(50, 70)), params(3))
    assert sched.seqs[2].placed == other, "a stalled worker is placed on last"
    finished = {}
    for _ in range(10):
        for update in updates_of(sched, fakes, other):
            finished[update.request_id] = update.finish_reason
    assert finished == {"queued": "length", "new": "length"}  # ran to the end while the stalled step was out
    sched.update(holder, fakes[holder].step(stuck))  # it answers at last; its own request goes on
    got, _ = run_to_end(sched, fakes)
    assert got == {("slow", 0): "length"}
    assert sched.stats().num_running == 0


def test_workers_stepping_in_any_interleaving_give_the_same_tokens():
    prompts = {f"r{i}": list(range(10 + i, 30 + 3 * i)) for i in range(6)}

    def run(pattern):
        sched, fakes = make_scheduler(workers=("w0", "w1"), num_blocks=24)
        tokens = {r: [] for r in prompts}
        for request_id, prompt in prompts.items():
            sched.add_request(request_id, prompt, params(12))
        for step in range(400):
            worker_id = pattern[step % len(pattern)]
            for update in updates_of(sched, fakes, worker_id):
                tokens[update.request_id] += update.token_ids
            if not sched.has_unfinished():
                break
        assert sched.stats().num_running == 0 and not sched.has_unfinished()
        return tokens

    lockstep = run(["w0", "w1"])
    assert all(len(t) == 12 for t in lockstep.values())
    assert run(["w0", "w0", "w0", "w1"]) == lockstep  # w1 at a quarter of w0's pace
    assert run(["w1"] * 5 + ["w0"]) == lockstep


def test_an_adapters_requests_go_only_to_workers_with_lora_and_name_its_folder():
    """w1 runs with --enable-lora, w0 without; the base requests spread, the adapter's all run on w1 (even
    while w1 has no seat and w0 does), each sent with the folder w1 loads it from; an adapter the scheduler
    does not serve is refused naming the model."""
    from dataclasses import replace

    from services.core.errors import InvalidArgument

    sched, fakes = make_scheduler(workers=("w0", "w1"), max_num_seqs=3)
    sched.add_worker("w1", replace(sched.workers["w1"].info, max_cpu_loras=2))
    sched.register_lora("sql", "/adapters/sql")
    for i in range(4):
        sched.add_request(f"sql{i}", list(range(10 + i, 30 + i)), params(3), lora_name="sql")
    for i in range(2):
        sched.add_request(f"base{i}", list(range(50 + i, 70 + i)), params(3))
    ran_on = {}
    for _ in range(50):
        for worker_id, delta in sched.schedule().items():
            for new in delta.new_seqs:
                ran_on[sched.seqs[new.seq_id].request.request_id] = (worker_id, new.lora_name, new.lora_path)
            sched.update(worker_id, fakes[worker_id].step(delta))
    assert {ran_on[f"sql{i}"] for i in range(4)} == {("w1", "sql", "/adapters/sql")}
    assert {ran_on[f"base{i}"][1] for i in range(2)} == {""} and {ran_on[f"base{i}"][0] for i in range(2)} >= {"w0"}
    assert not sched.has_unfinished()
    with pytest.raises(InvalidArgument) as error:
        sched.add_request("x", [5, 6], params(2), lora_name="nope")
    assert error.value.field == "model"


def test_max_loras_bounds_the_adapters_running_together_on_a_worker():
    """max_loras 2: of three adapters' requests, the third adapter's waits until one of the first two has
    none running, and the base request queued behind it does not wait for it; every request finishes."""
    sched, fakes = make_scheduler(max_loras=2, max_cpu_loras=4)
    for name in "abc":
        sched.register_lora(name, f"/adapters/{name}")
    for i, name in enumerate(["a", "b", "c", "", "a"]):
        sched.add_request(f"r{i}", list(range(10 + i, 20 + i)), params(3 + 2 * (name == "a")), lora_name=name)
    seen = []
    for step in range(50):
        delta = sched.schedule_worker("w0")
        if delta is None:
            break
        if step == 0:
            assert {sched.seqs[new.seq_id].request.request_id for new in delta.new_seqs} == {"r0", "r1", "r3", "r4"}
        running = {seq.request.lora_name for seq in sched.workers["w0"].running.values()} - {""}
        seen.append(running)
        sched.update("w0", fakes["w0"].step(delta))
    assert max(len(s) for s in seen) == 2 and any("c" in s for s in seen)
    assert not sched.has_unfinished()


def test_max_cpu_loras_also_bounds_the_adapters_running_together():
    """A worker that holds 2 adapters at once runs at most 2 adapters' sequences together (max_loras 8), so
    it always has an idle one to drop for the next: the third adapter's requests wait, then run."""
    sched, fakes = make_scheduler(max_cpu_loras=2)
    for name in "abc":
        sched.register_lora(name, f"/adapters/{name}")
    for i, name in enumerate("abcabc"):
        sched.add_request(f"r{i}", list(range(10 + i, 20 + i)), params(4), lora_name=name)
    most = 0
    while sched.has_unfinished():
        delta = sched.schedule_worker("w0")
        most = max(most, len({seq.request.lora_name for seq in sched.workers["w0"].running.values()}))
        assert len(sched.workers["w0"].lora_names) <= 2
        sched.update("w0", fakes["w0"].step(delta))
    assert most == 2


def test_placement_prefers_the_worker_that_holds_the_adapter():
    """Two workers holding one adapter each: each adapter's requests go to its holder, though the other is
    idle; an adapter neither holds goes by load, and the worker it went to holds it after (its least
    recently used idle one dropped)."""
    sched, fakes = make_scheduler(workers=("w0", "w1"), max_cpu_loras=1)
    for name in "abc":
        sched.register_lora(name, f"/adapters/{name}")
    sched.set_worker_loras("w0", ["a"])
    sched.set_worker_loras("w1", ["b"])
    for i in range(3):
        sched.add_request(f"a{i}", list(range(10 + i, 20 + i)), params(3), lora_name="a")
    assert {sched.seqs[i].placed for i in range(3)} == {"w0"}
    sched.add_request("b0", list(range(40, 50)), params(3), lora_name="b")
    assert sched.seqs[3].placed == "w1"
    sched.add_request("c0", list(range(60, 70)), params(3), lora_name="c")
    assert sched.seqs[4].placed == "w1"  # the lighter load; w0 has three waiting
    run_to_end(sched, fakes)
    assert list(sched.workers["w0"].lora_names) == ["a"]
    assert list(sched.workers["w1"].lora_names) == ["c"]  # b ran first (max_loras: one at a time there), then c


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_completed_by_generated_tokens_are_cached_for_the_next_turn(async_scheduling):
    """A decode step registers a block in the prefix cache once its computed tokens complete it (most
    decode steps complete none, and `update` skips the registration then): a follow-up turn whose
    prompt is the first turn's prompt and answer finds every full block of both cached."""
    sched, fakes = make_scheduler(async_scheduling=async_scheduling)
    prompt = list(range(10, 20))  # 10 tokens: one full block of 8
    sched.add_request("a", prompt, params(20))
    answer = []
    while sched.has_unfinished():
        for update in updates_of(sched, fakes, "w0"):
            answer += update.token_ids
    assert len(answer) == 20
    sched.add_request("a2", prompt + answer + [7, 8, 9], params(1))
    cached = [u.num_cached_tokens for _ in range(5) for u in updates_of(sched, fakes, "w0")]
    # 30 tokens, 29 computed (the last one sampled is never run): 3 full blocks, 24 tokens
    assert cached == [24]
