"""WorkerGroup without a model: what rank 0 broadcasts and when, what breaks the group, what the
followers do with each message, and the start-up watch (tests/e2e/test_parallel*.py run real groups)."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from services.core.errors import InvalidArgument
from services.core.step import StepDelta
from services.rpc.internal_codec import delta_from_bytes, delta_to_bytes
from services.worker.group import FORGET, STEP, STOP, TIMERS
from services.worker.worker_group import GroupBroken, WorkerGroup, follow_steps, wait_started


class FakeComm:
    def __init__(self, inbox=(), fail_broadcast=False):
        self.sent, self.inbox, self.fail_broadcast, self.closed = [], list(inbox), fail_broadcast, False
        self.timers_gathered = 0

    def broadcast(self, kind, payload=b""):
        if self.fail_broadcast:
            raise RuntimeError("Connection closed by peer")
        self.sent.append((kind, payload))

    def receive(self):
        return self.inbox.pop(0)

    def gather_timers(self):
        self.timers_gathered += 1
        return [{"busy_seconds": 1.0}]

    def close(self):
        self.closed = True


class FakeRank:
    def __init__(self, comm, refuse=None):
        self.comm, self.refuse, self.steps, self.forgets, self.closed = comm, refuse, [], 0, False
        self.shard = type("Shard", (), {"rank": 1})()

    def step(self, delta):
        self.steps.append((delta, list(self.comm.sent)))  # what had been broadcast when it ran
        if self.refuse is not None:
            raise self.refuse
        return f"result of {delta.step_id}"

    def forget_all(self):
        self.forgets += 1

    def close(self):
        self.closed = True
        self.comm.close()


def test_rank_0_broadcasts_each_step_before_running_it_and_never_runs_ahead():
    rank = FakeRank(FakeComm())
    group = WorkerGroup(rank)
    assert group.step(StepDelta(step_id=7, finished_seq_ids=[3], async_next_step=True)) == "result of 7"
    ran, sent_before = rank.steps[0]
    assert not ran.async_next_step and sent_before == [(STEP, delta_to_bytes(ran))]
    assert delta_from_bytes(sent_before[0][1]).finished_seq_ids == [3]


def test_a_refusal_every_rank_shares_leaves_the_group_whole():
    group = WorkerGroup(FakeRank(FakeComm(), refuse=InvalidArgument("seq_id", "unknown")))
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            group.step(StepDelta(step_id=1))
    assert not group.broken


def test_a_failed_collective_breaks_the_group_for_good():
    comm = FakeComm(fail_broadcast=True)
    group = WorkerGroup(FakeRank(comm))
    with pytest.raises(GroupBroken, match="lost a rank: RuntimeError: Connection closed"):
        group.step(StepDelta(step_id=1))
    comm.fail_broadcast = False
    with pytest.raises(GroupBroken, match="restarting"):
        group.step(StepDelta(step_id=2))
    assert comm.sent == []  # a broken group sends nothing more


def test_forget_timers_and_close_reach_the_followers_and_close_survives_them_gone():
    comm = FakeComm()
    rank = FakeRank(comm)
    group = WorkerGroup(rank)
    group.forget_all()
    assert group.group_timers() == [{"busy_seconds": 1.0}]
    assert [kind for kind, _ in comm.sent] == [FORGET, TIMERS] and rank.forgets == 1
    comm.fail_broadcast = True  # STOP cannot go out: close still leaves the group
    group.close()
    assert rank.closed and comm.closed


def test_a_follower_runs_each_message_until_stop_and_survives_a_refused_step():
    inbox = [(FORGET, b""), (TIMERS, b""), (STEP, delta_to_bytes(StepDelta(step_id=4))), (STOP, b""),
             (STEP, b"never read")]
    rank = FakeRank(FakeComm(inbox))
    follow_steps(rank)
    assert (rank.forgets, rank.comm.timers_gathered, [d.step_id for d, _ in rank.steps]) == (1, 1, [4])
    assert len(rank.comm.inbox) == 1  # it stopped at STOP
    refusing = FakeRank(FakeComm([(STEP, delta_to_bytes(StepDelta(step_id=5))), (STOP, b"")]),
                        refuse=InvalidArgument("seq_id", "unknown"))
    follow_steps(refusing)  # rank 0 answers the refusal; the follower goes on
    assert [d.step_id for d, _ in refusing.steps] == [5]


def _exit_at_once(sender):
    os._exit(3)


def _start_and_wait(sender):
    sender.send(True)
    time.sleep(30)


def _spawn(target):
    context = multiprocessing.get_context("fork")  # fast; wait_started does not care how they started
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(sender,), daemon=True, name="pagedserve-rank-1")
    process.start()
    sender.close()
    return receiver, process


def test_a_rank_that_exits_while_starting_is_reported_at_once_with_the_fix():
    receiver, process = _spawn(_exit_at_once)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match='exited with status 3 while starting.*if __name__ == "__main__":'):
        wait_started([(receiver, process)], 2, timeout_s=60)
    assert time.monotonic() - start < 30


def test_ranks_that_start_are_waited_for_and_then_left_running():
    receiver, process = _spawn(_start_and_wait)
    try:
        wait_started([(receiver, process)], 2, timeout_s=60)
        assert process.is_alive()
    finally:
        process.kill()
        process.join()
