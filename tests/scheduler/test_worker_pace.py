"""The step loop with stand-in workers: each worker steps at its own pace. A worker whose Step
does not answer holds back only its own sequences; the other worker's keep getting tokens, and
the held ones go on with the same tokens once it answers."""
from __future__ import annotations

import asyncio
import time

from services.core.config import SchedulerConfig
from services.core.sampling_params import SamplingParams
from services.core.step import SeqOutput, StepDelta, StepResult, WorkerInfo
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.loop import StepLoop

INFO = WorkerInfo(model="stand-in", dtype="float32", block_size=8, num_gpu_blocks=64, num_cpu_blocks=0,
                  vocab_size=100, max_model_len=256, eos_token_ids=(1,), device="cpu", batch_invariant=True)
MAX_TOKENS = 24


def token_at(length: int) -> int:
    """What a stand-in samples after `length` tokens: a function of the position only, as a seeded
    greedy sample is of the tokens before it (never 1, the eos)."""
    return 3 + (length * 7) % 50


class StandIn:
    """The RemoteWorker interface without a wire: mirrors sequences and samples token_at. Its Step
    waits on `gate` (set: answers at once) from its `gate_from`-th step on."""

    def __init__(self, worker_id: str, gate_from: int | None = None):
        self.worker_id, self.address, self.info = worker_id, f"stand-in/{worker_id}", INFO
        self.last_seen, self.forgot = time.monotonic(), False
        self.lengths: dict[int, int] = {}
        self.num_steps, self.gate_from, self.gate = 0, gate_from, asyncio.Event()
        self.gate.set()
        self.seq_ids: set[int] = set()  # every sequence it ran

    async def step(self, delta: StepDelta) -> StepResult:
        self.num_steps += 1
        if self.gate_from is not None and self.num_steps >= self.gate_from:
            await self.gate.wait()
        await asyncio.sleep(0.002)  # a step takes a moment
        for seq_id in delta.finished_seq_ids:
            self.lengths.pop(seq_id, None)
        result = StepResult(delta.step_id)
        for new in delta.new_seqs:
            self.lengths[new.seq_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        for cached in delta.cached_seqs:
            self.lengths[cached.seq_id] += len(cached.new_token_ids)
        for seq in delta.new_seqs + delta.cached_seqs:
            self.seq_ids.add(seq.seq_id)
            if seq.num_computed_tokens + seq.num_scheduled_tokens == self.lengths[seq.seq_id]:
                result.outputs.append(SeqOutput(seq_id=seq.seq_id, token_ids=[token_at(self.lengths[seq.seq_id])]))
        self.last_seen = time.monotonic()
        return result

    async def idle(self) -> None:
        pass

    async def close(self) -> None:
        pass


class Client:
    """Each request's tokens as delivered, and when the last one came."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, asyncio.Event] = {}

    async def all_started(self) -> None:
        while not all(self.tokens.values()):
            await asyncio.sleep(0.01)

    def deliver(self, request_id: str):
        self.tokens[request_id], self.done[request_id] = [], asyncio.Event()

        def take(item) -> None:
            if item is None or isinstance(item, Exception):
                self.done[request_id].set()
            else:
                self.tokens[request_id] += [t for update in item for t in update.token_ids]
        return take


def test_a_worker_whose_step_hangs_holds_back_only_its_own_sequences():
    prompts = {f"r{i}": [10 + i] * (5 + 3 * i) for i in range(4)}

    async def main():
        loop = StepLoop(SchedulerServiceConfig(scheduler=SchedulerConfig(block_size=8, async_scheduling=False)))
        workers = {"w0": StandIn("w0"), "w1": StandIn("w1", gate_from=3)}
        for worker_id, handle in workers.items():
            loop._admit(worker_id, INFO)
            loop.workers[worker_id] = handle
        running = asyncio.create_task(loop.run())
        client = Client()
        try:
            workers["w1"].gate.clear()  # w1 answers its first two steps, then hangs
            for request_id, prompt in prompts.items():
                loop.submit(request_id, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            0, (), client.deliver(request_id))
            await asyncio.wait_for(client.all_started(), 5)  # w1 answers its first steps
            on_w1 = {loop.core.seqs[seq_id].request.request_id for seq_id in workers["w1"].seq_ids}
            on_w0 = set(prompts) - on_w1
            assert on_w0 and on_w1, "the requests are spread over both workers"
            # while w1 hangs, w0's requests run to their end
            await asyncio.wait_for(asyncio.gather(*(client.done[r].wait() for r in on_w0)), 5)
            assert all(len(client.tokens[r]) < MAX_TOKENS for r in on_w1), "w1's requests waited for it"
            workers["w1"].gate.set()
            await asyncio.wait_for(asyncio.gather(*(client.done[r].wait() for r in on_w1)), 5)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        for request_id, prompt in prompts.items():
            assert client.tokens[request_id] == [token_at(len(prompt) + i) for i in range(MAX_TOKENS)]
        assert loop.core.stats().num_running == 0 and not loop.core.requests

    asyncio.run(main())



def test_a_request_placed_on_a_worker_that_stalls_is_taken_by_an_idle_one_without_another_event():
    """A request waits for the worker its prefix is cached on, whose step hangs. The other worker
    is idle and nothing else happens (no request, abort or finished step): it must still notice the
    stall and take the request, not sleep until the hung worker answers."""
    shared = [20] * 16  # two whole blocks, cached on w1 by the first request

    async def main():
        loop = StepLoop(SchedulerServiceConfig(scheduler=SchedulerConfig(block_size=8, async_scheduling=False)))
        w1, w0 = StandIn("w1"), StandIn("w0")
        loop._admit("w1", INFO)
        loop.workers["w1"] = w1
        running = asyncio.create_task(loop.run())
        client = Client()
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        try:
            loop.submit("first", shared + [5], greedy, 0, (), client.deliver("first"))
            await asyncio.wait_for(client.done["first"].wait(), 5)  # its blocks stay cached on w1
            long = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            loop.submit("long", [30] * 5, long, 0, (), client.deliver("long"))  # w1 is the only worker
            await asyncio.wait_for(client.all_started(), 5)
            w1.gate_from, w1.gate = w1.num_steps + 1, asyncio.Event()  # w1's next step hangs
            loop._admit("w0", INFO)
            loop.workers["w0"] = w0
            loop._wake_all()
            await asyncio.sleep(0.05)  # w1's step is out; w0's loop runs and finds nothing
            loop.submit("follow-up", shared + [6], greedy, 0, (), client.deliver("follow-up"))
            # placed on w1 (its prefix is there, and w1 is not stalled yet); w0 sleeps
            await asyncio.wait_for(client.done["follow-up"].wait(), 5)
            assert not w1.gate.is_set() and w1.num_steps == w1.gate_from, "w1 hung all along"
            assert len(client.tokens["long"]) < MAX_TOKENS
            w1.gate.set()
            await asyncio.wait_for(client.done["long"].wait(), 5)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        assert client.tokens["follow-up"] == [token_at(len(shared) + 1 + i) for i in range(4)]
        assert client.tokens["long"] == [token_at(5 + i) for i in range(MAX_TOKENS)]

    asyncio.run(main())
