"""A scheduler killed (kill -9) under `pagedserve up` while streams are open: the frontends carry
every open request over to the restarted scheduler as a continuation, and each stream (gRPC and
HTTP; greedy, seeded, stop strings, logprobs, a JSON schema, n=2, penalties, min_tokens) finishes
with the text, tokens, logprobs and usage of an undisturbed run. Then two frontends, the scheduler
killed twice in a row. The fast tests of the frontend's side: tests/frontend/test_failover.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pagedserve import Client
from services.launch.deployment import free_ports
from tests.conftest import random_prompts
from tests.e2e.test_launcher import ROOT, REAL_SERVICES, Up, up_args
from tests.waits import http_healthy, poll, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not REAL_SERVICES, reason="services not there")]

NUM_STREAMS = 32
MAX_TOKENS = 48
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def kind(i: int) -> dict:
    """The sampling of stream i: eight kinds, each over gRPC and over HTTP (i // 8 odd)."""
    seed = 700 + i
    return [dict(temperature=0.0, ignore_eos=True),
            dict(temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, logprobs=2),
            dict(temperature=1.0, seed=seed, ignore_eos=True),  # + stop strings, found by stop_strings()
            dict(temperature=0.0, ignore_eos=True, logprobs=3),
            dict(n=2, temperature=1.0, seed=seed, ignore_eos=True, logprobs=1),
            dict(temperature=1.0, seed=seed, logprobs=1, json_schema=SCHEMA),
            dict(temperature=0.8, seed=seed, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5,
                 frequency_penalty=0.5),
            dict(temperature=1.2, seed=seed, min_tokens=40, logprobs=0)][i % 8] | dict(max_tokens=MAX_TOKENS)


def grpc_stream(address: str, prompt: list[int], kw: dict, counter: list[int]) -> tuple:
    kw = dict(kw)
    if "json_schema" in kw:
        kw["json_schema"] = json.dumps(kw["json_schema"])
    with Client(address) as client:
        stream = client.stream(prompt, **kw)
        for delta in stream:
            counter[0] += len(delta.token_ids)
        r = stream.result
        return ("grpc", [(s.text, s.token_ids, s.logprobs, s.finish_reason) for s in r.samples],
                r.num_prompt_tokens, r.num_completion_tokens, r.seed if "seed" in kw else None)


def http_stream(url: str, model: str, prompt: list[int], kw: dict, counter: list[int]) -> tuple:
    kw = dict(kw)
    extra = {k: kw.pop(k) for k in ("ignore_eos", "top_k", "repetition_penalty", "min_tokens") if k in kw}
    if "json_schema" in kw:
        extra["structured_outputs"] = {"json": kw.pop("json_schema")}
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    choices: dict[int, list] = {}
    usage = None
    for chunk in client.completions.create(model=model, prompt=prompt, stream=True, extra_body=extra,
                                           stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text, logprobs, reason = choices.setdefault(choice.index, ["", [], None])
            choices[choice.index][0] += choice.text
            if choice.logprobs is not None:
                logprobs += list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                     choice.logprobs.top_logprobs or [None] * len(choice.logprobs.tokens)))
            choices[choice.index][2] = choice.finish_reason or reason
            counter[0] += 1
    client.close()
    return ("http", sorted((i, *c) for i, c in choices.items()), usage.prompt_tokens, usage.completion_tokens)


class Deployment:
    """`pagedserve up` (2 workers, the tiny model) and a second frontend before the same scheduler."""

    def __init__(self, model, ports, up: Up, second: subprocess.Popen, second_ports):
        self.model, self.ports, self.up, self.second, self.second_ports = str(model), ports, up, second, second_ports

    def frontends(self) -> list[tuple[str, str]]:
        """(gRPC address, HTTP url) of each frontend."""
        return [(f"127.0.0.1:{g}", f"http://127.0.0.1:{h}") for g, h in (self.ports[:2], self.second_ports)]

    def run(self, prompts, kwargs, frontend_of, counter=None) -> list[tuple]:
        counter = counter if counter is not None else [0]
        frontends = self.frontends()
        with ThreadPoolExecutor(len(prompts)) as pool:
            jobs = []
            for i, (prompt, kw) in enumerate(zip(prompts, kwargs)):
                address, url = frontends[frontend_of(i)]
                if (i // 8) % 2 == 0:
                    jobs.append(pool.submit(grpc_stream, address, prompt, kw, counter))
                else:
                    jobs.append(pool.submit(http_stream, url, self.model, prompt, kw, counter))
            return [job.result(timeout=300) for job in jobs]


@pytest.fixture(scope="module")
def deployment(tiny_llama):
    ports, second_ports = free_ports(3), free_ports(2)
    up = Up(up_args(tiny_llama, ports) + ["--dtype", "float32", "--num-gpu-blocks", "256", "--startup-timeout",
                                          "240", "--scheduler-failover-timeout", "60"])
    second = None
    try:
        up.wait_ready(timeout=300)
        second = subprocess.Popen(
            [sys.executable, "-m", "services.frontend", "--model", str(tiny_llama), "--host", "127.0.0.1",
             "--scheduler-address", f"127.0.0.1:{ports[2]}", "--grpc-port", str(second_ports[0]),
             "--http-port", str(second_ports[1]), "--health-poll-s", "0.2", "--scheduler-failover-timeout", "60"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        poll(lambda: http_healthy(second_ports[1]), 120, "the second frontend healthy")
        yield Deployment(tiny_llama, ports, up, second, second_ports)
    finally:
        if second is not None:
            second.kill()
            second.wait()
        up.kill_all()


def workload(deployment: Deployment, seed: int) -> tuple[list, list]:
    """32 prompts and their sampling; the stop strings of kind 2 are picked from an undisturbed run
    without them, late in its text, so that they match after the kill."""
    prompts = random_prompts(NUM_STREAMS, 512, 4, 40, seed=seed)
    kwargs = [kind(i) for i in range(NUM_STREAMS)]
    stops = [i for i in range(NUM_STREAMS) if i % 8 == 2]
    free = deployment.run([prompts[i] for i in stops], [kwargs[i] for i in stops], lambda i: 0)
    for i, got in zip(stops, free):
        text = got[1][0][0] if got[0] == "grpc" else got[1][0][1]
        kwargs[i] = kwargs[i] | dict(stop=[late_substring(text)])
    return prompts, kwargs


def late_substring(text: str) -> str:
    """A piece of `text` whose first occurrence starts past its middle."""
    for size in range(2, 12):
        for start in range(len(text) * 2 // 3, len(text) - size):
            piece = text[start:start + size]
            if text.find(piece) > len(text) // 2 and piece.strip():
                return piece
    return text[-3:]


class Killer(threading.Thread):
    """Kills the scheduler (kill -9) each time the streams have produced `at[k]` tokens since the last
    restart (the first: since the start), waiting between kills for the launcher's new scheduler."""

    def __init__(self, up: Up, counter: list[int], at: list[int]):
        super().__init__(daemon=True)
        self.up, self.counter, self.at = up, counter, at
        self.killed: list[tuple[int, int]] = []  # (pid, tokens when killed)

    def run(self) -> None:
        base = 0
        for threshold in self.at:
            while self.counter[0] - base < threshold:
                time.sleep(0.005)
            pid = self.up.pids()["scheduler"]
            os.kill(pid, signal.SIGKILL)
            self.killed.append((pid, self.counter[0]))
            deadline = time.monotonic() + 60
            while self.up.wait_event("service_ready", timeout=60, service_name="scheduler")["pid"] == pid:
                assert time.monotonic() < deadline, "the launcher did not restart the scheduler"
                time.sleep(0.05)
            base = self.counter[0]


def check_after(deployment: Deployment, killer: Killer, num_kills: int) -> None:
    assert len(killer.killed) == num_kills
    wait_idle(deployment.ports[2], 30, num_workers=2)  # both workers re-registered, nothing left allocated
    for _, port in deployment.frontends():
        poll(lambda: http_healthy(int(port.rsplit(":", 1)[1])), 30, "/health 200")
    assert deployment.up.proc.poll() is None and deployment.second.poll() is None


def test_32_streams_finish_identical_across_a_scheduler_kill(deployment):
    prompts, kwargs = workload(deployment, seed=32)
    want = deployment.run(prompts, kwargs, lambda i: 0)
    counter = [0]
    killer = Killer(deployment.up, counter, [NUM_STREAMS * 6])
    killer.start()
    got = deployment.run(prompts, kwargs, lambda i: 0, counter)
    killer.join(60)
    assert killer.killed and killer.killed[0][1] < NUM_STREAMS * MAX_TOKENS / 2  # mid-stream
    assert killer.killed[-1][1] < counter[0]  # the streams went on after the kill
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"stream {i} ({kwargs[i]})"
    check_after(deployment, killer, 1)


def test_two_frontends_survive_the_scheduler_killed_twice_in_a_row(deployment):
    prompts, kwargs = workload(deployment, seed=33)
    want = deployment.run(prompts, kwargs, lambda i: i % 2)
    counter = [0]
    killer = Killer(deployment.up, counter, [NUM_STREAMS * 4, NUM_STREAMS * 3])
    killer.start()
    got = deployment.run(prompts, kwargs, lambda i: i % 2, counter)
    killer.join(120)
    assert len(killer.killed) == 2 and killer.killed[-1][1] < counter[0]  # the streams went on after both
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"stream {i} ({kwargs[i]})"
    check_after(deployment, killer, 2)
