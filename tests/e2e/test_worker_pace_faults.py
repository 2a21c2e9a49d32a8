"""Workers at their own pace, as processes: one worker paused (SIGSTOP, as a GC pause, a noisy
neighbour or a swapping host would) holds back only its own streams, which resume with the tokens an
undisturbed run gives; workers of different layouts (a TP=2 group beside a single worker) serve side
by side with the tokens of one worker alone. The same helpers pause a worker's whole host in
tests/e2e/test_multihost.py."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psutil
import pytest

from pagedserve import AsyncClient
from services.launch.deployment import free_ports
from tests.conftest import random_prompts
from tests.e2e.test_launcher import REAL_SERVICES, ROOT, launch, up_args  # noqa: F401 (a fixture)
from tests.waits import poll, scheduler_stats

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]

NUM_STREAMS, MAX_TOKENS, PAUSE_S, GAP_S = 8, 64, 5.0, 1.0


def greedy_requests(prompts, max_tokens: int = MAX_TOKENS) -> list[dict]:
    return [dict(prompt=p, temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for p in prompts]


async def stream_all(address: str, requests: list[dict], on_token=None) -> list[tuple[list[int], list[float]]]:
    """Each stream's token ids and the times its deltas arrived; `on_token(counts)` after each delta, with
    every stream's number of tokens so far. A request is a prompt and AsyncClient.generate's keyword
    arguments (as tests/e2e/stream_client.py takes)."""
    client = AsyncClient(address)
    counts = [0] * len(requests)

    async def one(index: int, request: dict):
        request = dict(request)
        prompt = request.pop("prompt")
        ids, times = [], []
        async for delta in client.generate(prompt, **request):
            ids += delta.token_ids
            times.append(time.monotonic())
            counts[index] += len(delta.token_ids)
            if on_token is not None:
                on_token(counts)
        return ids, times

    try:
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        await client.close()


def longest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def pause_once_under_way(num_tokens: int, pids: Callable[[], list[int]], victim: Callable[[], object],
                         pause_s: float = PAUSE_S) -> tuple[Callable[[list[int]], None], dict]:
    """An on_token for stream_all that, once every stream has had `num_tokens` (so that each stream's
    pause falls between two of its deltas, not before its first), takes the victim worker's
    WorkerStats (`victim()`: what it holds), SIGSTOPs `pids()` and SIGCONTs them `pause_s` later; and
    the dict it fills ("pids", "victim"). The caller `resume`s it in a finally."""
    paused: dict = {}

    def on_token(counts: list[int]) -> None:
        if min(counts) >= num_tokens and not paused:
            paused["victim"] = victim()
            paused["pids"] = pids()
            for pid in paused["pids"]:
                os.kill(pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(pause_s, resume, paused)

    return on_token, paused


def resume(paused: dict) -> None:
    for pid in paused.get("pids", ()):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def on_both_workers(victim, num_streams: int) -> bool:
    """The paused worker ran some of the streams, and not all of them."""
    return 0 < victim.num_running and victim.num_running + victim.num_waiting + victim.num_swapped < num_streams


def assert_only_the_paused_streams_stalled(got: list[tuple[list[int], list[float]]], paused: dict,
                                           pause_s: float = PAUSE_S) -> None:
    """Each stream either never waited over GAP_S or waited about the pause; as many waited as the paused
    worker held (running at the pause, up to those also waiting or swapped there), so every stream on
    the other worker went on. Told apart by their longest gap: the test need not know which ran where."""
    gaps = sorted(longest_gap(times) for _, times in got)
    victim = paused["victim"]
    num_stalled = sum(gap > pause_s - 1 for gap in gaps)
    num_placed = victim.num_running + victim.num_waiting + victim.num_swapped
    assert on_both_workers(victim, len(got)), f"the streams run on both workers: {victim}"
    assert all(gap < GAP_S or gap > pause_s - 1 for gap in gaps), f"a stream waited, not for the pause: {gaps}"
    assert victim.num_running <= num_stalled <= num_placed, \
        f"{num_stalled} streams stalled, the paused worker held {victim.num_running} to {num_placed}: {gaps}"


def victim_stats(scheduler: str, port: int):
    return next(w for w in scheduler_stats(scheduler).workers if w.address.endswith(f":{port}"))


def test_a_paused_worker_holds_back_only_its_own_streams(launch, tiny_llama):
    ports = free_ports(3)
    up = launch(up_args(tiny_llama, ports) + ["--dtype", "float32", "--num-gpu-blocks", "128", "--num-threads", "1",
                                              "--startup-timeout", "240"])
    up.wait_ready(timeout=300)
    address, victim_port = f"127.0.0.1:{ports[0]}", up.worker_ports()[1]
    requests = greedy_requests(random_prompts(NUM_STREAMS, 512, 4, 40, seed=40))
    want = [ids for ids, _ in asyncio.run(stream_all(address, requests))]  # undisturbed
    for _ in range(3):  # on a loaded host the streams may all land on one worker: pause again on a new run
        on_token, paused = pause_once_under_way(4, lambda: [up.pids()["worker-1"]],
                                                lambda: victim_stats(ports[2], victim_port))
        try:
            got = asyncio.run(stream_all(address, requests, on_token=on_token))
        finally:
            resume(paused)
        assert [ids for ids, _ in got] == want  # every stream whole, the paused worker's too
        if on_both_workers(paused["victim"], len(got)):
            break
    assert_only_the_paused_streams_stalled(got, paused)


def test_a_tp2_group_beside_a_single_worker_gives_the_tokens_of_one_worker_alone(launch, tiny_llama, tmp_path):
    """`up` starts one single-process worker; a TP=2 group (rank 0 starts rank 1) joins by hand, as an
    operator adds a worker of another layout. With greedy and seeded streams on both, every stream
    equals what the single worker alone gave, and pausing the group holds back only its own streams."""
    ports = free_ports(4)
    engine = ["--dtype", "float32", "--num-gpu-blocks", "128", "--num-threads", "1"]
    up = launch(up_args(tiny_llama, ports[:3], workers=1) + engine + ["--startup-timeout", "240"])
    up.wait_ready(timeout=300)
    address, scheduler = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[2]}"
    requests = [dict(prompt=p, max_tokens=40, ignore_eos=True,
                     **(dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_p=0.95, seed=400 + i)))
                for i, p in enumerate(random_prompts(NUM_STREAMS, 512, 4, 16, seed=41))]  # no full block: placed by load
    alone = [ids for ids, _ in asyncio.run(stream_all(address, requests))]
    log = tmp_path / "tp2-worker.log"
    with open(log, "w") as out:
        group = subprocess.Popen([sys.executable, "-m", "services.worker", "--model", str(tiny_llama),
                                  "--scheduler-address", scheduler, "--host", "127.0.0.1", "--port", str(ports[3]),
                                  *engine, "--tensor-parallel-size", "2"], cwd=ROOT, stdout=out,
                                 stderr=subprocess.STDOUT)
    paused: dict = {}
    try:
        poll(lambda: len(scheduler_stats(scheduler).workers) == 2, 240, "the TP=2 group to register",
             logs=lambda: log.read_text()[-3000:])
        group_pids = [group.pid, *(c.pid for c in psutil.Process(group.pid).children(recursive=True))]
        on_token, paused = pause_once_under_way(4, lambda: group_pids,
                                                lambda: victim_stats(scheduler, ports[3]), pause_s=3.0)
        got = asyncio.run(stream_all(address, requests, on_token=on_token))
    finally:
        resume(paused)
        for process in [psutil.Process(group.pid), *psutil.Process(group.pid).children(recursive=True)]:
            process.kill()
        group.wait(30)
    assert [ids for ids, _ in got] == alone
    assert_only_the_paused_streams_stalled(got, paused, pause_s=3.0)
