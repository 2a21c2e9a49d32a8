"""`docker compose up`, for real: the image built from this tree, the three services in containers
on the host network (docker-compose.hostnet.yml, ports free on loopback), the default model.

One stack for the module, in order: up (model-init converts the model into a fresh volume), scale
to 3 workers, a worker crash mid-stream, then `stop` draining open streams. The engine is
started when none runs (dockerd --bridge=none --iptables=false, as root) and the image is built
only when no image for the hash of its inputs exists (a scratch build takes about 6 min here,
a code change about 1 min, a cached run none); the tests skip only when no engine can run.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from pagedserve.internal.v1 import scheduler_pb2
from services.launch.deployment import free_ports
from tests.e2e.docker_stack import (PROMPTS, Engine, Reference, Stack, Streams, Unavailable, chat, compose_command,
                                    ensure_image, listening_ports, run)
from tests.waits import http_healthy, poll, scheduler_stats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

MODEL_DIR = "/models/SmolLM2-135M-Instruct"
STARTUP_S = 900  # model-init's conversion and the first kernel build, on a loaded 2-core machine
GRACE_S = 15  # the compose files' stop_grace_period


@pytest.fixture(scope="module")
def engine():
    try:
        engine = Engine()
    except Unavailable as reason:
        pytest.skip(f"no Docker engine can run here: {reason}")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def stack(engine):
    compose = compose_command(engine.docker)
    assert compose, "no Compose installed (apt-get install docker-compose)"
    image, build_s = ensure_image(engine)
    print(f"\n{engine.versions()}; {' '.join(compose)}; image {image}"
          + (f" built in {build_s:.0f}s" if build_s else " (cached)"))
    stack = Stack(engine, compose, image, free_ports(3))
    try:
        stack.compose("up", "-d", "--no-build", timeout=STARTUP_S)
        wait_for(lambda: len(stats(stack).workers) == 1, STARTUP_S, stack, "the worker to register")
        wait_for(lambda: http_healthy(stack.http_port), 120, stack, "the frontend to serve")
        yield stack
    finally:
        stack.down()


def stats(stack: Stack) -> scheduler_pb2.GetStatsResponse:
    return scheduler_stats(stack.scheduler)


def wait_for(predicate, timeout: float, stack: Stack, what: str) -> None:
    poll(predicate, timeout, what, every=1, logs=stack.logs)


@pytest.fixture(scope="module")
def reference(stack):
    return Reference(stack.frontend)


def log_events(stack: Stack, service: str) -> list[dict]:
    """The service's JSON log lines (compose prefixes each with "NAME_1  | ")."""
    lines = stack.logs(service, tail=2000).splitlines()
    return [json.loads(line.split("| ", 1)[1]) for line in lines if "| {" in line]


def test_up_converts_the_default_model_into_the_volume_and_answers_paris(stack):
    (init,) = stack.containers("model-init")
    assert stack.inspect(init, "{{.State.ExitCode}}") == "0"
    listed = run([stack.engine.docker, "run", "--rm", "--network", "none", "-v", f"{stack.project}_models:/models:ro",
                  stack.image, "ls", MODEL_DIR]).stdout.split()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(listed)
    assert "Paris" in chat(f"http://127.0.0.1:{stack.http_port}", "What is the capital of France?")
    (worker,) = stack.containers("worker")
    assert run([stack.engine.docker, "exec", worker, "id", "-u"]).stdout.strip() == "1000"  # not root
    kernels = run([stack.engine.docker, "exec", worker, "ls", "/home/pagedserve/.cache/pagedserve-kernels"]).stdout
    assert ".so" in kernels  # compiled in the container, for its CPU, into the writable cache


def test_scale_to_three_workers_registers_three(stack, reference):
    stack.compose("up", "-d", "--no-build", "--scale", "worker=3", timeout=STARTUP_S)
    wait_for(lambda: len(stats(stack).workers) == 3, STARTUP_S, stack, "3 registered workers")
    workers = stats(stack).workers
    assert len({w.worker_id for w in workers}) == len({w.address for w in workers}) == 3
    assert len(stack.containers("worker")) == 3


def test_a_worker_crash_mid_stream_loses_no_token_and_the_worker_comes_back(stack, reference):
    """The streams finish with the undisturbed tokens; the engine restarts the container, which
    registers again. The crash is a SIGKILL of the container's process (what an OOM kill does):
    `docker kill` counts as a manual stop for the engine, which then restarts nothing."""
    wait_for(lambda: len(stats(stack).workers) == 3, STARTUP_S, stack, "3 registered workers")
    before = {w.worker_id: w for w in stats(stack).workers}
    length = reference.length_for(10.0, least=24)  # about 10 s: the crash lands mid-stream
    streams = Streams(stack.frontend, length)
    streams.wait_started()
    busy = next(w for w in stats(stack).workers if w.num_running > 0)
    port = int(busy.address.rsplit(":", 1)[1])
    pids = {c: int(stack.inspect(c, "{{.State.Pid}}")) for c in stack.containers("worker")}
    (victim,) = [c for c, pid in pids.items() if port in listening_ports(pid)]
    os.kill(pids[victim], signal.SIGKILL)
    tokens, finish = streams.join()
    assert tokens == reference.prefix(length)
    assert finish == ["length"] * len(PROMPTS)
    dropped = [e for e in log_events(stack, "scheduler") if e.get("event") == "worker_dropped"]
    assert [e["worker_id"] for e in dropped] == [busy.worker_id] and dropped[0]["num_recomputed"] > 0
    wait_for(lambda: stack.inspect(victim, "{{.RestartCount}}") == "1", 120, stack, "the restart")
    wait_for(lambda: len(stats(stack).workers) == 3 and busy.worker_id not in {w.worker_id for w in stats(stack).workers},
             STARTUP_S, stack, "the restarted worker to register")
    assert len(set(before) & {w.worker_id for w in stats(stack).workers}) == 2  # the other two never left


def test_stop_drains_open_streams_within_the_grace_period(stack, reference):
    length = reference.length_for(GRACE_S / 4, least=8)  # open at SIGTERM, done well within the grace period
    streams = Streams(stack.frontend, length)
    streams.wait_started()
    started = time.monotonic()
    stack.compose("stop", timeout=300)
    stopped_s = time.monotonic() - started
    tokens, finish = streams.join()
    assert tokens == reference.prefix(length) and finish == ["length"] * len(PROMPTS)  # every open stream ran to its end
    (frontend,) = stack.containers("frontend-host")
    assert stack.inspect(frontend, "{{.State.ExitCode}}") == "0"  # exited by itself: not killed at the grace period
    draining = [e for e in log_events(stack, "frontend-host") if e.get("event") == "draining"]
    assert draining and draining[-1]["num_pending"] == len(PROMPTS)  # they were still open at SIGTERM
    for service in ("scheduler", "worker"):
        assert {stack.inspect(c, "{{.State.Status}}") for c in stack.containers(service)} == {"exited"}
    print(f"compose stop took {stopped_s:.1f}s for {length}-token streams at {reference.step_s:.3f}s a step")
