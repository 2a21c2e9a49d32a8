"""`pagedserve up --tensor-parallel-size 2`: each worker is a group of two ranks, and a rank killed
mid-stream takes its group down cleanly; the scheduler recomputes the group's sequences on the other
worker, the launcher restarts the whole group, and no stream fails or changes a token."""
from __future__ import annotations

import asyncio

import psutil
import pytest

from services.launch.deployment import free_ports
from tests.e2e.test_launcher import REAL_SERVICES, launch  # noqa: F401 (a fixture)
from tests.e2e.test_launcher_faults import start, stream_all, streams_survive_a_kill
from tests.waits import poll, scheduler_stats, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]


def followers(pid: int) -> list[psutil.Process]:
    """The follower ranks a worker started (multiprocessing's spawned children, not its resource tracker)."""
    return [c for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())]


def test_up_tp2_serves_and_a_rank_killed_mid_stream_loses_no_stream(launch, model_dir):
    folder = model_dir("llama", "tiny", num_layers=4)
    ports = free_ports(3)
    up = start(launch, folder, ports, "--tensor-parallel-size", "2", "--num-threads", "1")
    poll(lambda: len(scheduler_stats(ports[2]).workers) == 2, 30, "2 workers")
    ranks = {name: followers(pid) for name, pid in up.pids().items() if name.startswith("worker-")}
    assert [len(children) for children in ranks.values()] == [1, 1]  # each worker: rank 0 and one follower
    leader = up.pids()["worker-0"]
    prompts, kwargs, want = streams_survive_a_kill(f"127.0.0.1:{ports[0]}", 12, 32, seed=21, victim=ranks["worker-0"][0].pid,
                                  kill_after=12 * 6)
    exited = up.wait_event("service_exited", timeout=60, service_name="worker-0")
    assert exited["pid"] == leader and exited["exit_code"] == 1  # rank 0 left when its group broke
    ready = up.wait_event("service_ready", timeout=180, service_name="worker-0")
    assert ready["pid"] != leader
    wait_idle(ports[2], 60, num_workers=2)
    again = asyncio.run(stream_all(f"127.0.0.1:{ports[0]}", prompts[:2], kwargs[:2]))
    assert again == want[:2]  # the restarted group serves the same bits
