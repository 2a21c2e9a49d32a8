"""KV-cache events as a cluster router reads them: a subscriber with its own msgpack schema (not the
publisher's classes) rebuilds each worker's cached blocks from the ZMQ stream, and they must equal
the scheduler's own prefix caches after hits, evictions, swaps and a worker reset; the replay
socket serves the same history again."""
from __future__ import annotations

import argparse
import re
import shlex
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from services.core.config import SchedulerConfig
from services.core.errors import InvalidArgument
from services.core.kv_events import AllBlocksCleared, KVEventsConfig
from services.launch.deployment import free_ports
from services.scheduler.kv_publisher import KVEventPublisher
from tests.core.test_scheduler import make_scheduler, params

TOPIC = b"kv@test"
BLOCK_SIZE = 8
END_SEQ = -1


# ---- the subscriber's own schema (vLLM's array-like KVEventBatch of tagged events) ------------------
def decode_batch(payload: bytes) -> tuple[float, list, int]:
    batch = msgpack.unpackb(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, rank = batch
    assert isinstance(ts, float) and isinstance(events, list) and isinstance(rank, int)
    return ts, events, rank


def apply_event(cache: set[int], event: list) -> None:
    tag = event[0]
    if tag == "BlockStored":
        _, hashes, parent, token_ids, block_size, lora_id, medium, *_ = event
        assert block_size in (8, 16, 32) and len(token_ids) == block_size * len(hashes), event
        assert lora_id is None and medium == "GPU"
        assert parent is None or isinstance(parent, int)
        assert all(isinstance(h, int) and 0 <= h < 2 ** 64 for h in hashes)
        cache.update(hashes)
    elif tag == "BlockRemoved":
        _, hashes, medium = event
        assert medium == "GPU" and set(hashes) <= cache, "a block removed that was never stored"
        cache.difference_update(hashes)
    elif tag == "AllBlocksCleared":
        assert len(event) == 1
        cache.clear()
    else:
        raise AssertionError(f"unknown event {event!r}")


def rebuild(batches: list[tuple[int, bytes]]) -> tuple[dict[int, set[int]], dict[str, int]]:
    """Each rank's cached hashes from the batches in sequence order, and how many of each event."""
    caches: dict[int, set[int]] = {}
    counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    for _, payload in sorted(batches):
        _, events, rank = decode_batch(payload)
        for event in events:
            apply_event(caches.setdefault(rank, set()), event)
            counts[event[0]] += 1
    return caches, counts


def replay(context: zmq.Context, endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
    batches = []
    try:
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def scheduler_caches(sched) -> dict[int, set[int]]:
    return {sched.worker_ranks[w]: {int.from_bytes(h[-8:], "big") for h in ws.blocks.cached_block_hashes()}
            for w, ws in sched.workers.items()}


# ---- the workload ----------------------------------------------------------------------------------
def run_workload(sched, fakes, publisher: KVEventPublisher) -> int:
    """Shared prefixes (hits), more prompts than the caches hold (evictions), a cache too small for
    everything running (swaps), and worker w1 reset halfway. Returns how many batches it published."""
    num_batches = 0
    for i in range(24):
        prefix = [10 + i % 3] * 16  # three families of prompts sharing two blocks
        sched.add_request(f"r{i}", prefix + [20 + i] * (5 + i % 11), params(6 + i % 5))
    for step in range(400):
        if not sched.has_unfinished():
            break
        if step == 12:
            sched.reset_worker("w1")
            fakes["w1"].seqs.clear()
        for worker_id, delta in sched.schedule().items():
            sched.update(worker_id, fakes[worker_id].step(delta))
        drained = sched.drain_kv_events()
        publisher.publish(drained)
        num_batches += len(drained)
    assert not sched.has_unfinished()
    return num_batches


@pytest.fixture(scope="module")
def published():
    pub_port, replay_port = free_ports(2)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub_port}",
                            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic=TOPIC.decode())
    # an address without a wildcard is connected to (vLLM's rule): the subscriber binds it, on loopback
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.bind(config.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    publisher = KVEventPublisher(config, context)
    sched, fakes = make_scheduler(num_blocks=10, workers=("w0", "w1"), block_size=BLOCK_SIZE,
                                  preemption_mode="swap", kv_events_config=config)
    num_probes = 0  # empty batches until the subscription has reached the publisher (ZMQ's slow joiner)
    while not sub.poll(50):
        publisher.publish([(0, [])])
        num_probes += 1
        assert num_probes < 200, "the subscriber never connected"
    num_batches = num_probes + run_workload(sched, fakes, publisher)
    live = []
    while (not live or live[-1][0] < num_batches - 1) and sub.poll(5000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC
        live.append((int.from_bytes(seq, "big"), payload))
    yield dict(sched=sched, live=live, num_batches=num_batches, context=context,
               replay_endpoint=config.replay_endpoint, publisher=publisher)
    publisher.close()
    sub.close(linger=0)
    context.term()


def test_subscriber_rebuilds_each_workers_prefix_cache(published):
    sched, live = published["sched"], published["live"]
    # a late joiner's gap (batches sent before its subscription) is filled by replay, as a router does
    seqs = [seq for seq, _ in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "live batches out of order or lost"
    missed = replay(published["context"], published["replay_endpoint"], 0)[:seqs[0]] if seqs[0] else []
    caches, counts = rebuild(missed + live)
    assert len(missed) + len(live) == published["num_batches"]
    assert caches == scheduler_caches(sched)
    assert all(caches.values()), "every worker ends with cached blocks"
    assert counts["BlockStored"] and counts["BlockRemoved"] and counts["AllBlocksCleared"] == 1, counts
    assert sched.num_preemptions > 0 and sched.stats().workers[0].prefix_cache_hits > 0


def test_replay_serves_the_whole_history_from_any_sequence_number(published):
    history = replay(published["context"], published["replay_endpoint"], 0)
    assert [seq for seq, _ in history] == list(range(published["num_batches"]))
    caches, _ = rebuild(history)
    assert caches == scheduler_caches(published["sched"])
    tail = replay(published["context"], published["replay_endpoint"], 5)
    assert tail == history[5:]


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "kv-events-and-priority.md"


def test_the_guides_subscriber_rebuilds_the_caches_and_its_commands_parse(published):
    """docs/guide/kv-events-and-priority.md: its subscriber's `replay` and `apply`, on the published
    history, give the scheduler's caches; its `pagedserve up` commands are ones `up` takes."""
    text = GUIDE.read_text()
    [example] = re.findall(r"```python\n(.*?)```", text, re.S)
    namespace = {"__name__": "guide"}
    exec(compile(example, str(GUIDE), "exec"), namespace)
    caches: dict[int, set[int]] = {}
    for _, payload in namespace["replay"](published["context"], published["replay_endpoint"], 0):
        namespace["apply"](caches, payload)
    assert caches == scheduler_caches(published["sched"])
    from services.__main__ import add_up_parser
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_up_parser(parser.add_subparsers())
    commands = re.findall(r"^\.venv/bin/pagedserve up (.+)$", text, re.M)
    assert len(commands) == 2, "the guide's commands were not found: the pattern is wrong"
    for command in commands:
        args = parser.parse_args(["up", *shlex.split(command)])
        given = {name: getattr(args, name) for name in ("kv_events_config", "scheduling_policy")}
        SchedulerConfig(**{name: value for name, value in given.items() if value is not None})


def test_blocks_stored_under_an_adapter_carry_its_id():
    """One prompt under the base and under adapter "sql" (lora_int_id 7): the wire's BlockStored events carry
    lora_id 7 for the adapter's blocks (other hashes) and None for the base's."""
    from services.core.kv_events import BlockStored
    from services.scheduler.kv_publisher import wire_event
    from tests.core.test_scheduler import run_to_end

    sched, fakes = make_scheduler(max_cpu_loras=2, kv_events_config=KVEventsConfig(enable_kv_cache_events=True))
    sched.register_lora("sql", "/adapters/sql", lora_id=7)
    prompt = list(range(10, 30))  # two full blocks of 8
    sched.add_request("base", prompt, params(2))
    sched.add_request("sql", prompt, params(2), lora_name="sql")
    run_to_end(sched, fakes)
    by_lora: dict = {}
    for _, events in sched.drain_kv_events():
        for event in (wire_event(e) for e in events if isinstance(e, BlockStored)):
            by_lora.setdefault(event[5], set()).update(event[1])
    assert set(by_lora) == {None, 7} and len(by_lora[7]) == 2 and not by_lora[None] & by_lora[7]


def test_a_full_queue_drops_and_counts_instead_of_blocking_the_step(monkeypatch):
    monkeypatch.setattr(KVEventPublisher, "_run", lambda self: None)  # a sender that never catches up
    publisher = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-full",
                                                max_queue_size=2))
    publisher.publish([(0, [AllBlocksCleared()])] * 5)
    assert (publisher._queue.qsize(), publisher.num_dropped) == (2, 3)
    publisher._pub.close(linger=0)


def test_a_replay_address_already_taken_is_refused_naming_it(published):
    taken = published["replay_endpoint"]
    with pytest.raises(InvalidArgument, match=f"kv_events_config.*replay_endpoint '{taken}'"):
        KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-taken",
                                        replay_endpoint=taken))


def test_events_off_by_default_and_bad_config_names_the_key():
    sched, _ = make_scheduler()
    assert sched.kv_events is None and sched.workers["w0"].blocks.kv_events is None
    config = SchedulerConfig(kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.kv_events_config.publisher == "zmq" and config.kv_events_config.topic == "kv"
    with pytest.raises(InvalidArgument, match="kv_events_config.*publisher"):
        SchedulerConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "nats"}')
    with pytest.raises(InvalidArgument, match="kv_events_config.*endpoint"):
        SchedulerConfig(kv_events_config='{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}')
    with pytest.raises(InvalidArgument, match="kv_events_config.*buffer_stepz"):
        SchedulerConfig(kv_events_config='{"buffer_stepz": 3}')


# ---- the scheduler service ---------------------------------------------------------------------------
@pytest.mark.slow
def test_the_scheduler_service_publishes_its_workers_caches_and_clears_a_lost_one(model_dir):
    """`--kv-events-config` on the real service with two workers: the replayed history rebuilds both
    workers' prefix caches; a worker lost is announced with AllBlocksCleared for its rank."""
    import asyncio
    import json

    from tests.cluster import VOCAB, Cluster, run
    from tests.conftest import greedy, random_prompts

    replay_port, pub_port = free_ports(2)
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub_port}",
                         "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})
    context = zmq.Context()

    async def history_matches(loop, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while True:
            caches, counts = rebuild(await asyncio.to_thread(replay, context, f"tcp://127.0.0.1:{replay_port}", 0))
            expected = scheduler_caches(loop.core)
            expected.update({rank: set() for rank in loop.core.worker_ranks.values() if rank not in expected})
            if {rank: caches.get(rank, set()) for rank in expected} == expected:
                return counts
            assert time.monotonic() < deadline, f"the events never matched: {counts}"
            await asyncio.sleep(0.05)

    async def main():
        async with Cluster(model_dir("llama", "tiny"), kv_events_config=config, num_workers=2) as cluster:
            loop = cluster.scheduler.loop
            shared = random_prompts(1, VOCAB, 40, 40, seed=5)[0]
            prompts = [shared + p for p in random_prompts(6, VOCAB, 5, 30, seed=6)]
            await asyncio.gather(*(cluster.generate(f"r{i}", p, greedy(3)) for i, p in enumerate(prompts)))
            counts = await history_matches(loop)
            assert counts["BlockStored"] > 0 and all(scheduler_caches(loop.core).values())
            await loop.drop("w1", "lost")  # what a failed step or missed heartbeats do
            counts = await history_matches(loop)
            assert counts["AllBlocksCleared"] == 1

    try:
        run(main())
    finally:
        context.term()
