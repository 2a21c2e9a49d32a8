"""KV-cache events: what a worker's prefix cache gained and lost, as vLLM publishes them.

The scheduler owns every worker's block pool (docs/ARCHITECTURE.md rule 2), so it is the one
that knows when a block becomes cached under its hash, when allocation evicts a cached block,
and when a worker's whole cache is gone (the worker was lost or reset). With events on, each
worker's BlockManager appends these to a list (`BlockManager.record_events`), the service drains
them after each of that worker's steps and publishes them (services/scheduler/kv_publisher.py,
vLLM's ZMQ wire format). Pure Python: the wire encoding lives with the publisher.

Hashes here are the scheduler's own chained sha256 prefix hashes (services/core/block_pool.py);
on the wire each is `external_hash`: the last 8 bytes as an unsigned big-endian int, as vLLM
turns its own hashes into ints for routers.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.core.errors import check

MEDIUM_GPU = "GPU"  # vLLM's name for a worker's primary KV cache (the device blocks, on any device)
KV_EVENT_PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def external_hash(block_hash: bytes) -> int:
    """A block hash as published: its last 8 bytes, an unsigned big-endian int (vLLM's int hashes)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Full blocks became cached, in chain order: block_hashes[0]'s parent is parent_block_hash
    (None: the first block of a prompt), each next block's parent the one before it."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]  # every stored block's tokens, block after block
    block_size: int
    lora_id: int | None = None  # the id of the LoRA adapter they were computed under (Scheduler.register_lora)
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted (allocation took them for new tokens)."""

    block_hashes: list[bytes]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """Nothing of the worker's cache is known any more (the worker was lost, or reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config`, the same JSON keys and defaults. Publishing is per scheduler:
    one PUB socket for every worker, each batch naming its worker in data_parallel_rank
    (docs/guide/kv-events-and-priority.md says why)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # default: "zmq" when enabled, else "null" (vLLM's)
    endpoint: str = "tcp://*:5557"  # bound when it has "*", "::", ipc:// or inproc://, else connected
    replay_endpoint: str | None = None  # a ROUTER socket answering replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the sender thread; past it they are dropped, counted
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        check(self.publisher in KV_EVENT_PUBLISHERS, "publisher",
              f"must be one of {KV_EVENT_PUBLISHERS}, got {self.publisher!r}")
        check(isinstance(self.enable_kv_cache_events, bool), "enable_kv_cache_events", "must be true or false")
        for name in ("endpoint", "topic"):
            check(isinstance(getattr(self, name), str), name, "must be a string")
        check(self.replay_endpoint is None or isinstance(self.replay_endpoint, str), "replay_endpoint",
              "must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                  f"must be an integer >= 1, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            check(value is None or value.startswith(ENDPOINT_SCHEMES), name,
                  f"must be a ZMQ address starting with one of {ENDPOINT_SCHEMES}, got {value!r}")


class KVEventLog:
    """The events of one worker's cache since the service last drained them, in order. The worker's
    BlockManager and BlockPool append to it; it outlives a reset of the worker (a new BlockManager)."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def __len__(self) -> int:
        return len(self._events)

    def append(self, event: KVCacheEvent) -> None:
        self._events.append(event)

    def drain(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
