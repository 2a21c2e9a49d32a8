"""`python -m services up` with the real services on a tiny random model, under faults a user meets:
a worker killed mid-stream, a SIGTERM while streams are open, a scheduler that crashed and came back."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve import AsyncClient
from services.launch.healthcheck import health_status
from services.launch.deployment import Deployment, free_ports, service_commands
from tests.conftest import random_prompts
from tests.e2e.test_launcher import REAL_SERVICES, assert_all_stopped, launch, up_args  # noqa: F401 (a fixture)
from tests.waits import http_healthy, poll, scheduler_stats, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]


def params(i: int, max_tokens: int) -> dict:
    """Greedy and seeded sampling, alternately."""
    if i % 2 == 0:
        return dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return dict(temperature=0.9, top_p=0.95, seed=500 + i, max_tokens=max_tokens, ignore_eos=True)


async def stream_all(address: str, prompts, kwargs, on_token=None) -> list[tuple[list[int], str]]:
    """(token ids, finish reason) of each stream; `on_token(total tokens so far, streams that have had a token)` after
    each delta."""
    client = AsyncClient(address)
    total, started = 0, 0

    async def one(prompt, kw):
        nonlocal total, started
        ids, reason = [], None
        async for delta in client.generate(prompt, **kw):
            started += not ids and bool(delta.token_ids)
            ids += delta.token_ids
            reason = delta.finish_reason or reason
            total += len(delta.token_ids)
            if on_token is not None:
                on_token(total, started)
        return ids, reason

    try:
        return await asyncio.gather(*(one(p, kw) for p, kw in zip(prompts, kwargs)))
    finally:
        await client.close()


def streams_survive_a_kill(address: str, num: int, max_tokens: int, seed: int, victim: int, kill_after: int) -> tuple:
    """`num` streams of `max_tokens` (params(i)) fault-free, then again with `victim` SIGKILLed once
    `kill_after` tokens of them all have streamed: every stream completes with the same tokens, and the
    kill fell in the first half of the output. Returns the prompts, their sampling keywords and the
    fault-free (token ids, finish reason)s."""
    prompts = random_prompts(num, 512, 4, 60, seed=seed)
    kwargs = [params(i, max_tokens) for i in range(num)]
    want = asyncio.run(stream_all(address, prompts, kwargs))  # fault-free
    assert all(len(ids) == max_tokens and reason == "length" for ids, reason in want)
    killed = []

    def kill_once(total: int, started: int) -> None:
        if total >= kill_after and not killed:  # every stream is under way
            os.kill(victim, signal.SIGKILL)
            killed.append(total)

    got = asyncio.run(stream_all(address, prompts, kwargs, on_token=kill_once))
    assert killed and killed[0] < num * max_tokens / 2  # mid-stream
    assert got == want  # every stream complete, the same tokens
    return prompts, kwargs, want


def start(launch, model, ports, *extra: str):
    up = launch(up_args(model, ports) + ["--dtype", "float32", "--num-gpu-blocks", "128",
                                         "--startup-timeout", "240", *extra])
    up.wait_ready(timeout=300)
    return up


def test_a_worker_killed_mid_stream_loses_no_stream_and_comes_back(launch, tiny_llama):
    ports = free_ports(3)
    up = start(launch, tiny_llama, ports)
    victim = up.pids()["worker-0"]
    streams_survive_a_kill(f"127.0.0.1:{ports[0]}", 24, 48, seed=12, victim=victim, kill_after=24 * 8)
    exited = up.wait_event("service_exited", timeout=10, service_name="worker-0")
    assert exited["pid"] == victim and exited["exit_code"] == -signal.SIGKILL
    ready = up.wait_event("service_ready", timeout=120, service_name="worker-0")
    assert ready["pid"] != victim
    wait_idle(ports[2], 30, num_workers=2)
    assert up.proc.poll() is None


def test_sigterm_lets_20_open_streams_finish_and_exits_0_within_the_grace_period(launch, tiny_llama):
    ports = free_ports(3)
    grace = 40.0
    up = start(launch, tiny_llama, ports, "--stop-timeout", f"{grace:g}")
    pids = up.pids()
    prompts = random_prompts(20, 512, 4, 40, seed=13)
    kwargs = [params(i, 200) for i in range(20)]
    signalled: list[float] = []

    def sigterm_once(total: int, started: int) -> None:
        # every stream open first: under load 80 tokens of some streams came before another's request reached the
        # frontend, which then (rightly) refused it as shutting down
        if total >= 20 * 4 and started == 20 and not signalled:
            signalled.append(time.monotonic())
            up.proc.send_signal(signal.SIGTERM)

    got = asyncio.run(stream_all(f"127.0.0.1:{ports[0]}", prompts, kwargs, on_token=sigterm_once))
    assert signalled
    assert [(len(ids), reason) for ids, reason in got] == [(200, "length")] * 20
    assert up.finish(timeout=grace + 10) == 0, up.log()
    assert time.monotonic() - signalled[0] < grace + 2
    assert_all_stopped(up, ports + up.worker_ports(), pids, within=1)


def test_up_restarts_a_killed_scheduler_and_serves_again(launch, tiny_llama):
    ports = free_ports(3)
    up = start(launch, tiny_llama, ports)
    scheduler = up.pids()["scheduler"]
    os.kill(scheduler, signal.SIGKILL)
    assert up.wait_event("service_ready", timeout=60, service_name="scheduler")["pid"] != scheduler
    poll(lambda: len(scheduler_stats(ports[2]).workers) == 2, 30, "2 workers re-registered")
    poll(lambda: http_healthy(ports[1]), 30, "/health 200")
    got = asyncio.run(stream_all(f"127.0.0.1:{ports[0]}", [[5, 6, 7]], [params(0, 8)]))
    assert got[0][1] == "length" and len(got[0][0]) == 8


def test_health_is_200_soon_after_a_scheduler_comes_back_from_a_long_outage(tiny_llama):
    """The services one by one (the launcher would restart the scheduler sooner). While the scheduler
    was away, the workers' and the frontend's channels backed off towards gRPC's 120 s maximum and
    the workers beat every 2.5 s: /health stayed 503 for ~5 s after the scheduler was back."""
    grpc_port, http_port, scheduler_port, worker_port = free_ports(4)
    commands = service_commands(Deployment(
        model=str(tiny_llama), num_workers=1, grpc_port=grpc_port, http_port=http_port,
        scheduler_port=scheduler_port, worker_ports=(worker_port,), python=sys.executable,
        engine_flags=(("--dtype", "float32"), ("--num-gpu-blocks", "64"))))
    procs = {name: subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, argv in commands.items()}
    try:
        poll(lambda: http_healthy(http_port), 240, "/health 200")
        procs["scheduler"].kill()
        procs["scheduler"].wait()
        time.sleep(10)
        procs["scheduler"] = subprocess.Popen(commands["scheduler"], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)
        poll(lambda: health_status(f"127.0.0.1:{scheduler_port}", timeout=1) == "SERVING", 60, "scheduler")
        back = time.monotonic()
        poll(lambda: http_healthy(http_port), 30, "/health 200")
        assert time.monotonic() - back < 3.5
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
