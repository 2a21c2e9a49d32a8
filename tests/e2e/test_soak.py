"""bench/soak.py for half a minute through `python -m services up`: mixed gRPC and HTTP traffic, 15% client
disconnects, 15% deadlines, a worker (at 9 s) and then the scheduler (at 18 s) killed with SIGKILL and
restarted by the launcher (the frontend carries its open requests over to the new scheduler), with traffic
before, during and after each restart. Half a minute holds every event a minute did: the minute's second
half only repeated the traffic (1,500 requests completed in a minute at load 38), for 30 s more of the suite."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_launcher import REAL_SERVICES

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]


def test_a_half_minute_soak_with_disconnects_deadlines_a_killed_worker_and_scheduler_loses_nothing(tmp_path):
    summary_path = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "bench/soak.py", "--duration", "30", "--kill-at", "0.3",
                          "--scheduler-kill-at", "0.6", "--json", str(summary_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert summary_path.is_file(), run.stdout + run.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["num_failures"] == 0, json.dumps(summary["failures"], indent=1)
    outcomes = summary["by_fate_and_outcome"]
    assert outcomes["normal/completed"] > 100
    assert outcomes["disconnect/cancelled"] > 0 and outcomes["deadline/timed_out"] > 0  # the faults happened
    assert set(outcomes) <= {"normal/completed", "disconnect/cancelled", "disconnect/completed",
                             "deadline/timed_out", "deadline/timed_out_as_internal", "deadline/completed"}
    kill = summary["worker_kill"]
    assert kill["new_pid"] not in (None, kill["pid"])  # restarted by the launcher
    scheduler_kill = summary["scheduler_kill"]
    assert scheduler_kill["new_pid"] not in (None, scheduler_kill["pid"])
    after = summary["after_the_run"]
    assert after["num_workers"] == 2 and after["idle"], after  # it re-registered; every KV block is free
    assert summary["launcher_exit"] == 0
    assert set(summary["resident_mb_growth"]) == {"scheduler", "worker-0", "worker-1", "frontend"}
    assert summary["passed"] and run.returncode == 0, run.stdout
