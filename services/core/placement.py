"""Placement: which worker a waiting sequence goes to.

The scheduler holds every worker's block hashes (each WorkerScheduler's block manager), so it
can place a sequence where the longest run of its prompt's full blocks is cached, as llm-d's
precise prefix-cache scorer does from outside. The order (`best_worker`): a worker that is not
stalled (its step out far longer than its steps take), then one with room (a seat and the free
blocks the sequence needs beyond its cached prefix), then one that holds the sequence's LoRA adapter
(another loads it first), then the longest cached prefix, then the
lightest load (sequences running, swapped and waiting there), the most free KV blocks, the
shortest measured step time, and the worker id. Pure Python.
"""
from __future__ import annotations

from services.core.block_pool import hash_full_blocks
from services.core.config import SchedulerConfig
from services.core.sequence import Sequence
from services.core.worker_scheduler import WorkerScheduler


def best_worker(candidates: list[WorkerScheduler], seq: Sequence, config: SchedulerConfig,
                now: float) -> WorkerScheduler:
    """The first of `candidates` (non-empty, each serving seq's model) in the placement order."""
    if len(candidates) == 1:
        return candidates[0]
    hashes = prefix_hashes(seq, config)

    def key(ws: WorkerScheduler) -> tuple:
        cached = ws.blocks.num_cached_blocks(hashes)
        no_room = ws.load() >= config.max_num_seqs or not has_room(ws, seq, cached)
        loads_lora = bool(seq.request.lora_name) and seq.request.lora_name not in ws.lora_names
        return (ws.is_stalled(now), no_room, loads_lora, -cached, ws.load(), -ws.blocks.num_free_blocks, ws.step_time_s,
                ws.worker_id)
    return min(candidates, key=key)


def has_room(ws: WorkerScheduler, seq: Sequence, num_cached_blocks: int = 0) -> bool:
    """A seat on ws, and the free blocks seq's tokens need beyond its cached prefix."""
    needed = ws.blocks.num_blocks_needed(seq.num_tokens) - num_cached_blocks
    return ws.has_seat() and ws.blocks.num_free_blocks >= needed


def prefix_hashes(seq: Sequence, config: SchedulerConfig) -> list[bytes]:
    """The chained hashes of the blocks a prefix hit could cover (as BlockManager.match_prefix)."""
    if not config.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
        return []
    token_ids, block_size = seq.token_ids, config.block_size
    return hash_full_blocks(token_ids, block_size, (len(token_ids) - 1) // block_size, [], seq.request.cache_root)
