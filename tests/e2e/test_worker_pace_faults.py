"""`python -m services up --workers 2` with one worker paused (SIGSTOP, as a GC pause, a noisy
neighbour or a swapping host would): the other worker's streams go on without a gap, and the
paused worker's streams resume with the tokens an undisturbed run gives."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedserve import AsyncClient
from services.launch.deployment import free_ports
from tests.conftest import random_prompts
from tests.e2e.test_launcher import REAL_SERVICES, launch, up_args  # noqa: F401 (a fixture)
from tests.waits import scheduler_stats

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]

NUM_STREAMS, MAX_TOKENS, PAUSE_S, GAP_S = 8, 64, 5.0, 1.0


async def stream_all(address: str, prompts, on_token=None) -> list[tuple[list[int], list[float]]]:
    """Each greedy stream's token ids and the times its deltas arrived; `on_token(total)` after each delta."""
    client = AsyncClient(address)
    total = 0

    async def one(prompt):
        nonlocal total
        ids, times = [], []
        async for delta in client.generate(prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True):
            ids += delta.token_ids
            times.append(time.monotonic())
            total += len(delta.token_ids)
            if on_token is not None:
                on_token(total)
        return ids, times

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def longest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def test_a_paused_worker_holds_back_only_its_own_streams(launch, tiny_llama):
    ports = free_ports(3)
    up = launch(up_args(tiny_llama, ports) + ["--dtype", "float32", "--num-gpu-blocks", "128", "--num-threads", "1",
                                              "--startup-timeout", "240"])
    up.wait_ready(timeout=300)
    address, victim, victim_port = f"127.0.0.1:{ports[0]}", up.pids()["worker-1"], up.worker_ports()[1]
    prompts = random_prompts(NUM_STREAMS, 512, 4, 40, seed=40)
    want = [ids for ids, _ in asyncio.run(stream_all(address, prompts))]  # undisturbed
    paused: dict[str, float | int] = {}

    def pause_once(total: int) -> None:
        if total >= NUM_STREAMS * 4 and not paused:  # every stream under way
            paused["num_on_victim"] = next(w.num_running for w in scheduler_stats(ports[2]).workers
                                           if w.address.endswith(f":{victim_port}"))
            os.kill(victim, signal.SIGSTOP)
            paused["at"] = time.monotonic()
            asyncio.get_running_loop().call_later(PAUSE_S, os.kill, victim, signal.SIGCONT)

    try:
        got = asyncio.run(stream_all(address, prompts, on_token=pause_once))
    finally:
        os.kill(victim, signal.SIGCONT)
    assert [ids for ids, _ in got] == want  # every stream whole, the paused worker's too
    gaps = sorted(longest_gap(times) for _, times in got)
    num_held = paused["num_on_victim"]
    assert 0 < num_held < NUM_STREAMS, "the streams run on both workers"
    assert all(gap < GAP_S for gap in gaps[:NUM_STREAMS - num_held]), f"the other worker's streams stalled: {gaps}"
    assert all(gap > PAUSE_S - 1 for gap in gaps[NUM_STREAMS - num_held:]), f"the pause missed its streams: {gaps}"
