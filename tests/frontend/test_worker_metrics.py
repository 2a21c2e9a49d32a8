"""/metrics carries each worker's queues and pace under a `worker` label, beside the totals the
Gateway API Inference Extension reads."""
from __future__ import annotations

from services.core.stats import SchedulerStats, WorkerStats
from services.frontend.metrics import FrontendMetrics


def worker(worker_id: str, **figures) -> WorkerStats:
    return WorkerStats(worker_id=worker_id, num_gpu_blocks=100, num_free_gpu_blocks=75, num_cpu_blocks=0,
                       num_free_cpu_blocks=0, prefix_cache_queries=0, prefix_cache_hits=0, **figures)


def test_each_workers_figures_have_their_own_series_and_the_totals_stay():
    stats = SchedulerStats(num_waiting=3, num_running=5, workers=(
        worker("w0", num_running=4, num_waiting=1, step_time_s=0.02, num_steps=300),
        worker("w1", num_running=1, num_waiting=2, num_swapped=1, step_time_s=6.5, num_steps=12)))
    text = FrontendMetrics("m").render(stats).decode()
    for line in ('pagedserve:worker_num_requests_running{model_name="m",worker="w0"} 4.0',
                 'pagedserve:worker_num_requests_waiting{model_name="m",worker="w1"} 2.0',
                 'pagedserve:worker_num_requests_swapped{model_name="m",worker="w1"} 1.0',
                 'pagedserve:worker_step_time_seconds{model_name="m",worker="w0"} 0.02',
                 'pagedserve:worker_step_time_seconds{model_name="m",worker="w1"} 6.5',
                 'pagedserve:worker_steps_total{model_name="m",worker="w0"} 300.0',
                 'pagedserve:kv_cache_usage_perc{model_name="m",worker="w1"} 0.25',
                 'vllm:num_requests_waiting{model_name="m"} 3.0',
                 'vllm:num_requests_running{model_name="m"} 5.0'):
        assert line in text.splitlines(), line
