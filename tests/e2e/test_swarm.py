"""deploy/swarm's stack on a real two-node Docker Swarm: two daemons, each in its own network
namespace host (tests/netns.py, tests/e2e/swarm.py), node A the manager and node B a worker.

The image is the one tests/e2e/test_docker.py builds (the same hash of its inputs, built only when
missing), loaded into each node once. The model is the converted default model on this machine's
disk, bind-mounted on both nodes: the two daemons share a disk, as nodes with a shared volume would.
The test process stands outside the swarm and reaches the frontend at node A's address (host-mode
ports), the scheduler through `docker exec` on node A (it publishes nothing).

One stack for the module, in order: deploy (2 workers, one per node), a rolling update of the
workers while streams run, scale to 4, a worker container on node B killed mid-stream, the
scheduler's container killed mid-stream, then node B drained while streams run. Every stream's
tokens are compared with the undisturbed ones.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from services.tools.default_model import ensure_default_model
from tests.e2e.docker_stack import IMAGE_REPO, Engine, Reference, Streams, Unavailable, chat, ensure_image, run
from tests.e2e.swarm import Node, form_swarm, load_image
from tests.netns import Hosts, why_not
from tests.waits import http_healthy, poll

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
STACK_FILE = ROOT / "deploy" / "swarm" / "pagedserve-stack.yml"
STACK = "ps25"
GRPC_PORT, HTTP_PORT = 7051, 7080  # published on node A's address (its namespace's own ports)
STARTUP_S = 600  # a node's first worker compiles the CPU kernels into that node's volume
PROMPTS = ("Once upon a time", "The three primary colors are", "def fibonacci(n):", "Paris is a city",
           "The best way to cook rice is", "import numpy as np", "Water boils at", "My favourite book")
# GetStats, from inside the scheduler's container (the image's /app): [worker_id, address, num_running]
STATS = ("import json, grpc\n"
         "from pagedserve.internal.v1 import scheduler_pb2 as pb, scheduler_pb2_grpc as rpc\n"
         "stats = rpc.SchedulerStub(grpc.insecure_channel('127.0.0.1:50052')).GetStats(pb.GetStatsRequest(), timeout=10)\n"
         "print(json.dumps([[w.worker_id, w.address, w.num_running] for w in stats.workers]))\n")


class Swarm:
    def __init__(self, hosts: Hosts, image: str, engine: Engine):
        self.a, self.b = Node(hosts["nodea"], engine.docker), Node(hosts["nodeb"], engine.docker)
        self.nodes = (self.a, self.b)
        self.frontend = f"{hosts['nodea'].address}:{GRPC_PORT}"
        self.http = f"http://{hosts['nodea'].address}:{HTTP_PORT}"
        for node in self.nodes:
            node.start()
        started = time.monotonic()
        loaded = load_image(list(self.nodes), engine.docker, image, IMAGE_REPO)
        print(f"\nimage {image} loaded into {len(loaded)} node(s) in {time.monotonic() - started:.0f}s")
        form_swarm(self.a, [self.b], address_pool="10.225.0.128/25")
        self.id_a, self.id_b = self.a.node_id(), self.b.node_id()
        self.a.docker("node", "update", "--label-add", "pagedserve.frontend=true", self.id_a)
        models = ensure_default_model().parent
        env = {**os.environ, "PAGEDSERVE_IMAGE": image, "PAGEDSERVE_MODELS": str(models),
               "PAGEDSERVE_GRPC_PORT": str(GRPC_PORT), "PAGEDSERVE_HTTP_PORT": str(HTTP_PORT),
               "PAGEDSERVE_WORKER_THREADS": "1"}  # up to 5 workers share 2 cores
        self.a.docker("stack", "deploy", "--resolve-image", "never", "-c", str(STACK_FILE), STACK, env=env)

    def stats(self) -> list[list]:
        """The scheduler's registered workers: [worker_id, address, num_running] each."""
        (scheduler,) = self.containers(self.a, "scheduler")
        return json.loads(self.a.docker("exec", scheduler, "python", "-c", STATS, timeout=60).stdout)

    def containers(self, node: Node, service: str) -> list[str]:
        """The running containers of `service` on `node` (short ids: the workers' host names)."""
        return node.docker("ps", "-q", "--filter", f"label=com.docker.swarm.service.name={STACK}_{service}").stdout.split()

    def registered_on(self) -> dict[str, list[str]]:
        """Registered worker ids by node ("a", "b"; "?" for none of the running containers)."""
        on_a, on_b = self.containers(self.a, "worker"), self.containers(self.b, "worker")
        found = {"a": [], "b": [], "?": []}
        for worker_id, _, _ in self.stats():
            container = container_of(worker_id)
            found["a" if container in on_a else "b" if container in on_b else "?"].append(worker_id)
        return found

    def service(self, *args: str, timeout: float = STARTUP_S) -> None:
        self.a.docker("service", *args, timeout=timeout)

    def running(self, service: str) -> list[tuple[Node, str]]:
        """(node, container) for each running container of `service`, on either node."""
        return [(node, container) for node in self.nodes for container in self.containers(node, service)]

    def events(self, name: str, service: str = "scheduler") -> list[dict]:
        """The `service`'s logged events called `name`, of every task it had (a killed one's too)."""
        logged = self.a.docker("service", "logs", "--raw", f"{STACK}_{service}", timeout=60)
        lines = (logged.stdout + logged.stderr).splitlines()  # the CLI keeps the container's two streams apart
        return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e.get("event") == name]

    def logs(self) -> str:
        """What a failed test prints: the services' last lines, the scheduler's membership events,
        every task's state and error."""
        out = [json.dumps(e) for name in ("worker_registered", "worker_dropped", "worker_refused")
               for e in self.events(name)]
        for service in ("scheduler", "worker", "frontend"):
            result = self.a.docker("service", "logs", "--tail", "15", f"{STACK}_{service}", timeout=60, check=False)
            out.append(f"--- {service}\n{result.stdout[-3000:]}{result.stderr[-1500:]}")
        out.append(self.a.docker("service", "ps", "--no-trunc", *(f"{STACK}_{s}" for s in ("scheduler", "worker", "frontend")),
                                 check=False).stdout[-5000:])
        return "\n".join(out)

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        # an exception is not yet: a container between states, a frontend not yet listening
        poll(predicate, timeout, what, every=1, retry_on=(RuntimeError, ValueError, OSError), logs=self.logs)

    def close(self) -> None:
        self.a.docker("stack", "rm", STACK, check=False)
        for node in self.nodes:
            node.stop()


def container_of(worker_id: str) -> str:
    """A worker's container (short id): its default worker id is HOSTNAME-PID, and a container's
    host name is its short id."""
    return worker_id.rsplit("-", 1)[0]


@pytest.fixture(scope="module")
def swarm():
    reason = why_not()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    try:
        engine = Engine()
    except Unavailable as reason:
        pytest.skip(f"no Docker engine can run here: {reason}")
    try:
        image, build_s = ensure_image(engine)
        print(f"\n{engine.versions()}; image {image}" + (f" built in {build_s:.0f}s" if build_s else " (cached)"))
        with Hosts(["nodea", "nodeb"], prefix="ps25-", subnet="10.225.0.64/26", bridge="sbr") as hosts:
            swarm = None
            try:
                swarm = Swarm(hosts, image, engine)
                swarm.wait_for(lambda: len(swarm.stats()) == 2, STARTUP_S, "2 registered workers")
                swarm.wait_for(lambda: http_healthy(swarm.http), 120, "the frontend to serve")
                yield swarm
            finally:
                if swarm is not None:
                    swarm.close()
                else:
                    for node in (Node(hosts["nodea"], engine.docker), Node(hosts["nodeb"], engine.docker)):
                        print(node.log_tail())
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(swarm):
    return Reference(swarm.frontend, PROMPTS)


class StreamsDuring:
    """Rounds of streams through the frontend, one after another, until `stop`: each must end with
    the undisturbed tokens. A round is a few seconds long, so one is open whenever the swarm acts."""

    def __init__(self, swarm: Swarm, reference: Reference, seconds: float):
        self.swarm, self.reference = swarm, reference
        self.length = reference.length_for(seconds, least=12)
        self.rounds: list[tuple[list[list[int]], list[str | None]]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._first.wait(300), "the first round got no token"

    def _run(self) -> None:
        while not self._stop.is_set():
            streams = Streams(self.swarm.frontend, self.length, PROMPTS)
            streams.wait_started()
            self._first.set()
            try:
                self.rounds.append(streams.join())
            except AssertionError as error:  # a stream failed: reported by `stop`
                self.errors.append(error)
                self._first.set()
                return

    def stop(self) -> int:
        """Once the round open now ends: how many rounds ran; fails if a stream failed or differed."""
        self._stop.set()
        self._thread.join(600)
        assert not self.errors, f"{self.errors}\n{self.swarm.logs()}"
        for tokens, finish in self.rounds:
            assert tokens == self.reference.prefix(self.length)
            assert finish == ["length"] * len(PROMPTS)
        return len(self.rounds)


def test_a_chat_from_outside_the_swarm_answers_paris(swarm):
    assert "Paris" in chat(swarm.http, "What is the capital of France?")
    on = swarm.registered_on()
    assert (len(on["a"]), len(on["b"]), on["?"]) == (1, 1, []), swarm.logs()  # spread: one worker per node


def test_a_rolling_update_of_the_workers_fails_no_stream(swarm, reference):
    """`docker service update --force`: one worker at a time, the new one healthy (registered)
    before the old one is stopped (the stack's start-first update order)."""
    before = {worker_id for worker_id, _, _ in swarm.stats()}
    during = StreamsDuring(swarm, reference, seconds=4.0)
    swarm.service("update", "--force", f"{STACK}_worker")
    rounds = during.stop()
    assert rounds >= 2
    swarm.wait_for(lambda: len(swarm.stats()) == 2, 120, "2 registered workers")
    assert not before & {worker_id for worker_id, _, _ in swarm.stats()}  # every worker was replaced
    # (where the new ones run is the scheduler's choice: start-first places each while the old runs)


def test_scaling_to_4_workers_registers_4_on_both_nodes(swarm, reference):
    swarm.service("scale", f"{STACK}_worker=4")
    swarm.wait_for(lambda: len(swarm.stats()) == 4, STARTUP_S, "4 registered workers")
    on = swarm.registered_on()
    assert on["a"] and on["b"] and not on["?"] and len(on["a"]) + len(on["b"]) == 4
    assert len({address for _, address, _ in swarm.stats()}) == 4


def test_a_worker_container_killed_on_node_b_mid_stream_loses_no_token_and_swarm_restarts_it(swarm, reference):
    length = reference.length_for(10.0, least=24)  # about 10 s: the kill lands mid-stream
    streams = Streams(swarm.frontend, length, PROMPTS)
    streams.wait_started()
    on_b = swarm.containers(swarm.b, "worker")
    running = {container_of(worker_id): (worker_id, n) for worker_id, _, n in swarm.stats()}
    victim = max(on_b, key=lambda c: running.get(c, ("", 0))[1])  # the busiest worker on node B
    victim_id, victim_running = running[victim]
    assert victim_running > 0  # 8 streams on 4 workers: node B's busiest holds some
    swarm.b.docker("kill", victim)  # SIGKILL
    tokens, finish = streams.join()
    assert tokens == reference.prefix(length) and finish == ["length"] * len(PROMPTS)
    dropped = [e for e in swarm.events("worker_dropped") if e["worker_id"] == victim_id]
    assert dropped and dropped[-1]["num_recomputed"] > 0  # its sequences were recomputed elsewhere
    swarm.wait_for(lambda: len(swarm.stats()) == 4 and victim_id not in {w for w, _, _ in swarm.stats()},
                   STARTUP_S, "Swarm to replace the killed worker")
    assert victim not in swarm.containers(swarm.a, "worker") + swarm.containers(swarm.b, "worker")


def test_the_scheduler_container_killed_mid_stream_fails_no_stream_and_swarm_restarts_it(swarm, reference):
    """SIGKILL of the scheduler task's container: Swarm starts a new one (the stack's restart
    policy), the workers register with it, and the frontend carries every open stream over to it
    as a continuation (docs/guide/reliability.md, "When the scheduler dies"): each ends with the undisturbed tokens."""
    workers = {worker_id for worker_id, _, _ in swarm.stats()}
    length = reference.length_for(10.0, least=24)  # about 10 s: the kill lands mid-stream
    streams = Streams(swarm.frontend, length, PROMPTS)
    streams.wait_started()
    ((node, victim),) = swarm.running("scheduler")  # on whichever node Swarm placed it
    node.docker("kill", victim)  # SIGKILL
    killed = time.monotonic()
    # every stream was open when its scheduler died: each is carried over to the new one
    assert streams.finish == [None] * len(PROMPTS)
    try:
        tokens, finish = streams.join()
    except AssertionError as error:  # a stream failed: what the services logged says why
        raise AssertionError(f"{error}\n{swarm.logs()}") from None
    print(f"\nthe streams ended {time.monotonic() - killed:.1f}s after the scheduler was killed")
    assert tokens == reference.prefix(length) and finish == ["length"] * len(PROMPTS)
    (restarted,) = [container for _, container in swarm.running("scheduler")]
    assert restarted != victim
    swarm.wait_for(lambda: {worker_id for worker_id, _, _ in swarm.stats()} == workers, 120,
                   "the same workers to register with the restarted scheduler")


def test_draining_node_b_mid_stream_moves_its_workers_to_node_a_and_fails_no_stream(swarm, reference):
    assert swarm.containers(swarm.b, "worker")
    during = StreamsDuring(swarm, reference, seconds=4.0)
    swarm.a.docker("node", "update", "--availability", "drain", swarm.id_b)
    swarm.wait_for(lambda: not swarm.containers(swarm.b, "worker") and len(swarm.registered_on()["a"]) == 4,
                   STARTUP_S, "node B's workers to move to node A")
    rounds = during.stop()
    assert rounds >= 2
    assert len(swarm.stats()) == 4
