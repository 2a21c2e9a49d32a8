"""The three services on five "hosts" (network namespaces on a bridge, tests/netns.py), no containers.

The scheduler, two workers and the frontend each run in their own namespace, bound to that host's
address; each worker advertises its own. The workers are not alike: w1 runs one math thread, w2 two
(WORKER_THREADS), and each steps at its own pace (a step loop per worker in the scheduler). A client in a fifth namespace streams through the frontend.
Nothing is on a shared loopback: every call between the services crosses the bridge, as between
machines. The test process stands outside every host and reads the scheduler's GetStats over the bridge.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.internal.v1 import scheduler_pb2
from services.core.sampling_params import SamplingParams
from services.launch.deployment import Deployment, service_commands
from services.launch.healthcheck import health_status
from tests.conftest import make_llm, random_prompts
from tests.e2e.test_worker_pace_faults import assert_only_the_paused_streams_stalled, pause_once_under_way, resume, \
    stream_all
from tests.netns import Hosts, why_not
from tests.waits import poll, scheduler_stats

REASON = why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")]

ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("stream_client.py")
# Each host has its own ports, so the same ones serve on every host (none is this machine's).
SCHEDULER_PORT, WORKER_PORT, GRPC_PORT, HTTP_PORT = 7052, 7053, 7051, 7080
ENGINE_FLAGS = (("--dtype", "float32"), ("--num-gpu-blocks", "128"))
NUM_REQUESTS, MAX_NEW = 16, 48
WORKER_THREADS = {"w1": 1, "w2": 2}  # different machines, different workers: the tokens do not depend on it (rule 4)


class Service:
    """One service's process in a host, its stderr (structlog JSON lines) in a file."""

    def __init__(self, host, argv: list[str], log: Path, num_threads: int = 1):
        self.host, self.log = host, log
        with open(log, "w") as out:
            # few math threads each: five hosts share this machine's cores
            self.proc = host.popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PAGEDSERVE_NUM_THREADS": str(num_threads)})

    def events(self, name: str) -> list[dict]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == name:
                    found.append(record)
        return found


def command(service: str, model: Path, *, host: str, scheduler: str = "", advertise: str = "") -> list[str]:
    """`service`'s command line as `python -m services up` builds it, for one service on its own host."""
    deployment = Deployment(model=str(model), num_workers=1, host=host, internal_host=host,
                            grpc_port=GRPC_PORT, http_port=HTTP_PORT, scheduler_port=SCHEDULER_PORT,
                            scheduler_address=scheduler, worker_ports=(WORKER_PORT,),
                            advertise_host=advertise or host, python=sys.executable, engine_flags=ENGINE_FLAGS)
    return service_commands(deployment)["worker-0" if service == "worker" else service]


class Cluster:
    def __init__(self, hosts: Hosts, model: Path, logs: Path):
        self.hosts, self.model, self.logs = hosts, model, logs
        self.scheduler = f"{hosts['sched'].address}:{SCHEDULER_PORT}"
        self.frontend = f"{hosts['front'].address}:{GRPC_PORT}"
        self.services = {"scheduler": Service(hosts["sched"], command("scheduler", model, host=hosts["sched"].address),
                                              logs / "scheduler.log")}
        for name in ("w1", "w2"):
            self.start_worker(name)
        self.services["frontend"] = Service(hosts["front"], command("frontend", model, host=hosts["front"].address,
                                                                    scheduler=self.scheduler), logs / "frontend.log")

    def start_worker(self, name: str, advertise: str = "") -> Service:
        host = self.hosts[name]
        self.services[name] = Service(host, command("worker", self.model, host=host.address, scheduler=self.scheduler,
                                                    advertise=advertise), self.logs / f"{name}.log",
                                      WORKER_THREADS.get(name, 1))
        return self.services[name]

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        return scheduler_stats(self.scheduler)

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        poll(predicate, timeout, what, every=0.2, logs=self.log_tails)

    def log_tails(self) -> str:
        return "\n".join(f"--- {name}\n" + "\n".join(s.log.read_text(errors="replace").splitlines()[-15:])
                         for name, s in self.services.items())

    def stream(self, requests: list[dict], started_after: int = 1) -> subprocess.Popen:
        """The client in its own host, streaming `requests` at once (tests/e2e/stream_client.py)."""
        job = json.dumps({"requests": requests, "started_after": started_after})
        return self.hosts["client"].popen([sys.executable, str(CLIENT), self.frontend, job], cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    with Hosts(["sched", "w1", "w2", "front", "client", "w3"], prefix="ps25-", subnet="10.225.0.0/26") as hosts:
        cluster = Cluster(hosts, tiny_llama, tmp_path_factory.mktemp("multihost-logs"))
        cluster.wait_for(lambda: len(cluster.stats().workers) == 2, 180, "both workers to register")
        cluster.wait_for(lambda: health_status(cluster.frontend) == "SERVING", 120, "the frontend to serve")
        yield cluster


def requests() -> list[dict]:
    """Greedy and seeded sampling alike, every stream its full length (no EOS)."""
    prompts = random_prompts(NUM_REQUESTS, 512, 4, 60, seed=25)
    return [dict(prompt=p, max_tokens=MAX_NEW, ignore_eos=True,
                 **(dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.95, seed=700 + i)))
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def single_host(cluster):
    """The same requests on one machine, in this process (the engine the services wrap)."""
    wanted = requests()
    params = [SamplingParams(**{k: v for k, v in r.items() if k != "prompt"}) for r in wanted]
    outputs = make_llm(cluster.model, dtype="float32").generate([r["prompt"] for r in wanted], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def results(client: subprocess.Popen, timeout: float = 120) -> list[dict]:
    out, err = client.communicate(timeout=timeout)
    assert client.returncode == 0, err[-3000:]
    (final,) = [json.loads(line)["results"] for line in out.splitlines() if line.startswith('{"results"')]
    return final


def test_workers_advertise_their_own_hosts_and_streams_match_a_single_host_run(cluster, single_host):
    workers = {w.worker_id: w.address for w in cluster.stats().workers}
    assert sorted(workers.values()) == sorted(f"{cluster.hosts[n].address}:{WORKER_PORT}" for n in ("w1", "w2"))
    got = results(cluster.stream(requests()))
    assert [r["error"] for r in got] == [None] * NUM_REQUESTS
    assert [r["token_ids"] for r in got] == single_host
    assert {r["finish_reason"] for r in got} == {"length"}
    assert all(w.prefix_cache_queries > 0 for w in cluster.stats().workers)  # both hosts got work


def test_a_paused_worker_host_holds_back_only_its_own_streams(cluster, single_host):
    """Every process on w2's host is SIGSTOPped for 4 s once each stream is under way (a VM paused, a
    host swapping): the streams on w1's host never wait over a second, and w2's resume with the
    undisturbed tokens. The client is this process, outside every host."""
    w2 = f"{cluster.hosts['w2'].address}:{WORKER_PORT}"
    on_token, paused = pause_once_under_way(
        4, cluster.hosts["w2"].pids,
        lambda: next(w for w in cluster.stats().workers if w.address == w2), pause_s=4.0)
    try:
        got = asyncio.run(stream_all(cluster.frontend, requests(), on_token=on_token))
    finally:
        resume(paused)
    assert [ids for ids, _ in got] == single_host
    assert_only_the_paused_streams_stalled(got, paused, pause_s=4.0)
    assert len(cluster.stats().workers) == 2  # a pause is not a death


def test_a_worker_host_losing_power_mid_stream_fails_no_stream(cluster, single_host):
    """Every process on w2's host is SIGKILLed once each stream is under way: the scheduler drops that
    worker and recomputes its sequences on w1; every stream ends with the undisturbed tokens."""
    client = cluster.stream(requests(), started_after=NUM_REQUESTS * 4)
    line = client.stdout.readline()
    assert line.startswith('{"started"'), (line, client.stderr.read()[-3000:] if client.poll() is not None else "")
    victim = cluster.services["w2"]
    killed = cluster.hosts["w2"].kill_all()
    assert victim.proc.pid in killed or victim.proc.poll() is not None
    got = results(client)
    assert [r["error"] for r in got] == [None] * NUM_REQUESTS
    assert [r["token_ids"] for r in got] == single_host
    dropped = cluster.services["scheduler"].events("worker_dropped")
    assert len(dropped) == 1 and dropped[0]["num_recomputed"] > 0  # it held running sequences when it died
    assert [w.address for w in cluster.stats().workers] == [f"{cluster.hosts['w1'].address}:{WORKER_PORT}"]



def test_a_worker_advertising_an_address_the_scheduler_cannot_reach_is_refused_within_seconds(cluster):
    """The mistake a user makes first on several machines: the worker keeps the default
    --advertise-host 127.0.0.1, which on the scheduler's host is the scheduler's own loopback."""
    worker = cluster.start_worker("w3", advertise="127.0.0.1")
    cluster.wait_for(lambda: worker.events("worker_serving") or worker.proc.poll() is not None, 120, "w3 to load")
    serving = time.monotonic()
    assert worker.proc.wait(timeout=20) == 2  # refused: a final answer, not a retry loop
    refused_s = time.monotonic() - serving
    (event,) = worker.events("registration_refused")
    assert f"127.0.0.1:{WORKER_PORT}" in event["reason"] and "cannot reach" in event["reason"]
    assert "--advertise-host" in event["reason"]  # the fix is named
    assert refused_s < 10
    assert len(cluster.stats().workers) == 1  # never admitted
