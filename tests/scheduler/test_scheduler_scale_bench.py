"""bench/scheduler_scale.py's stand-in workers keep the Worker contract with the real scheduler
service: they register, every one of them is stepped, and the requests stream tokens."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.scheduler_scale import measure  # noqa: E402


@pytest.mark.slow
def test_the_real_scheduler_drives_every_stand_in_worker():
    row = uvloop.run(measure(num_workers=2, seqs_per_worker=3, seconds=0.5))
    assert row["workers"] == 2
    assert row["worker_steps_per_s"] == pytest.approx(2 * row["steps_per_s"], rel=0.2)  # both step every round
    assert row["tokens_per_s"] == pytest.approx(3 * row["worker_steps_per_s"], rel=0.2)  # a token per sequence
    assert row["scheduler_cpu_ms_per_worker_step"] > 0 and row["added_latency_ms_p99"] > 0
