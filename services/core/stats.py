"""The scheduler's stats, typed, from the block pools to the frontend's /metrics.

One name per field, the same as the internal proto's (scheduler.proto WorkerStats and
GetStatsResponse): the block manager fills BlockStats, the core scheduler adds what it knows per
worker and overall, the step loop what only the service knows (addresses, steps, the model);
services.rpc.internal_codec carries them over GetStats field by field, and the frontend reads the
same dataclasses back.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class BlockStats:
    """One worker's KV block pool (BlockManager.stats)."""

    num_gpu_blocks: int  # device blocks
    num_free_gpu_blocks: int  # free (cached-but-free count as free)
    num_cpu_blocks: int  # swap pool size
    num_free_cpu_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up, since the worker joined
    prefix_cache_hits: int  # prompt tokens found


@dataclass(frozen=True, kw_only=True)
class WorkerStats(BlockStats):
    worker_id: str
    num_running: int = 0  # sequences running on it
    num_waiting: int = 0  # sequences placed on it, waiting to start
    num_swapped: int = 0  # sequences swapped out of it
    num_steps: int = 0  # steps it ran since it joined
    step_time_s: float = 0.0  # its steps' moving average, scheduled to applied (the round trip)
    address: str = ""  # host:port the scheduler steps it at (the service's; empty in process)


@dataclass(frozen=True, kw_only=True)
class SchedulerStats:
    num_waiting: int = 0  # sequences
    num_running: int = 0
    num_swapped: int = 0
    num_preemptions: int = 0  # since the scheduler started
    workers: tuple[WorkerStats, ...] = field(default_factory=tuple)  # sorted by worker_id
    num_steps: int = 0  # worker-steps run since start, all workers together (the service's step loops)
    max_model_len: int = 0  # prompt + output limit (0 until a worker registered)
    vocab_size: int = 0  # of the served model (0 until a worker registered)
    model: str = ""  # the model folder the workers loaded
    batch_invariant: bool = False  # the workers' deterministic mode
    # speculative decoding (services/core/spec_decode.py), vLLM's counters, since the scheduler started
    spec_decode_num_drafts: int = 0  # sequence-steps that verified drafts
    spec_decode_num_draft_tokens: int = 0  # tokens drafted
    spec_decode_num_accepted_tokens: int = 0  # drafted tokens kept
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: kept at draft position i
    # LoRA adapters with sequences running or waiting (sorted), and how many of each, side by side
    lora_names: tuple[str, ...] = ()
    lora_num_running: tuple[int, ...] = ()
    lora_num_waiting: tuple[int, ...] = ()

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def worker(self, worker_id: str) -> WorkerStats:
        return next(w for w in self.workers if w.worker_id == worker_id)
