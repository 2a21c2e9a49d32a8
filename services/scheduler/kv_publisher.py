"""KV-cache events on the wire, as vLLM publishes them (vllm/distributed/kv_events.py).

A ZMQ PUB socket sends each batch as three frames: [topic, sequence number (8 bytes, big-endian,
from 0, one per batch), msgpack payload]. The payload is an array-like KVEventBatch
[ts, events, data_parallel_rank], each event a tagged array:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Hashes are ints (services/core/kv_events.py external_hash). An optional ROUTER socket answers a
replay request [b"", start sequence number (8 bytes, big-endian)] with every buffered batch from
that number on, each [b"", seq, payload], then [b"", -1 (8 bytes, signed), b""].

The step loop only enqueues (`publish`: no encoding, no I/O); a sender thread encodes and sends.
A full queue drops the batch and counts it (`num_dropped`): publishing never blocks a step.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque

import msgpack
import structlog
import zmq

from services.core.errors import InvalidArgument
from services.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventsConfig,
                                     external_hash)

log = structlog.get_logger("scheduler")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05  # how often the sender looks at the replay socket while no batch comes


def wire_event(event: KVCacheEvent) -> list:
    """One event as vLLM's tagged array."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash)
        return ["BlockStored", [external_hash(h) for h in event.block_hashes], parent, list(event.token_ids),
                event.block_size, event.lora_id, event.medium, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [external_hash(h) for h in event.block_hashes], event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(ts: float, events: list[KVCacheEvent], rank: int) -> bytes:
    return msgpack.packb([ts, [wire_event(e) for e in events], rank])


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a stable address (a wildcard, ipc, inproc), connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes each worker's KV-cache events (`publish`), from a sender thread."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context | None = None):
        self.config = config
        self.num_published = 0
        self.num_dropped = 0  # batches the full queue turned away
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._pub = self._replay = None
        if config.publisher == "zmq":
            self._open_sockets(context or zmq.Context.instance())
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("kv_events_publishing", publisher=config.publisher, endpoint=config.endpoint,
                 replay_endpoint=config.replay_endpoint, topic=config.topic)

    def _open_sockets(self, context: zmq.Context) -> None:
        """The PUB socket, and the ROUTER replay socket if asked; an address that cannot be bound (taken,
        not this host's) is refused naming the key."""
        config, key = self.config, "endpoint"
        try:
            self._pub = context.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                key = "replay_endpoint"
                self._replay = context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            for socket in (self._pub, self._replay):
                if socket is not None:
                    socket.close(linger=0)
            raise InvalidArgument("kv_events_config", f"{key} {getattr(config, key)!r}: {error}") from None

    def publish(self, batches: list[tuple[int, list[KVCacheEvent]]]) -> None:
        """Enqueue one batch per worker (rank, its events); never blocks. The null publisher drops them."""
        if self._pub is None:
            return
        now = time.time()
        for rank, events in batches:
            try:
                self._queue.put_nowait((now, events, rank))
            except queue.Full:
                self.num_dropped += 1
                if self.num_dropped & (self.num_dropped - 1) == 0:  # 1, 2, 4, ...: not a line per step
                    log.warning("kv_events_dropped", num_dropped=self.num_dropped,
                                max_queue_size=self.config.max_queue_size)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to timeout_s), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    # ---- the sender thread ------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send(encode_batch(*item))
        except Exception:  # a bug here must not go unseen; the step loop carries on without events
            log.exception("kv_events_sender_failed")
        finally:
            for socket in (self._pub, self._replay):
                if socket is not None:
                    socket.close(linger=0)

    def _send(self, payload: bytes) -> None:
        seq = self.num_published
        self.num_published += 1
        if self._pub is not None:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", num_frames=len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
