"""The HTTP API in front of a real scheduler and worker (tiny random model, in process):
seeded sampling reproduces, streamed equals whole, logprobs are real, metrics follow GetStats."""
from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import openai
import pytest
import yaml

from services.frontend.config import FrontendConfig
from services.frontend.metrics import INFERENCE_EXTENSION_NAMES
from services.frontend.server import FrontendServer
from services.launch.deployment import free_ports
from test_http_api import metric, raw
from tests.cluster import Cluster
from tests.waits import http_healthy, poll

PROMPT = "The quick brown fox"


class HttpCluster:
    """Scheduler, one worker and a frontend with HTTP, on one loop in a background thread."""

    def __init__(self, model, frontend_config: dict | None = None, worker_config: dict | None = None,
                 **scheduler_config):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.model = str(model)
        self.frontend_config = frontend_config or {}
        self.run(self._start(model, worker_config, scheduler_config))  # grpc.aio objects belong to the loop they are made in
        self.url = f"http://127.0.0.1:{self.frontend.http.port}"

    async def _start(self, model, worker_config: dict | None, scheduler_config: dict) -> None:
        self.cluster = await Cluster(model, worker_config, **scheduler_config).start(1)
        self.frontend = FrontendServer(FrontendConfig(
            model=self.model, scheduler_address=f"127.0.0.1:{self.cluster.scheduler.port}", host="127.0.0.1",
            grpc_port=0, http_port=free_ports(1)[0], health_poll_s=0.02, **self.frontend_config), model)
        await self.frontend.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.frontend.drain())
        self.run(self.cluster.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def serve(model, frontend_config: dict | None = None, worker_config: dict | None = None, **scheduler_config):
    """A module fixture's body: an HttpCluster once its frontend has seen the registered worker
    (/health 200), closed after the module."""
    served = HttpCluster(model, frontend_config, worker_config, **scheduler_config)
    poll(lambda: http_healthy(served.url), 10, "/health 200", every=0.02)
    yield served
    served.close()


@pytest.fixture(scope="module")
def served(tiny_llama):
    yield from serve(tiny_llama)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def test_seeded_sampling_reproduces_and_streaming_equals_the_whole(served, client):
    kwargs = dict(model=served.model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=42, n=2,
                  extra_body={"ignore_eos": True})
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text  # the two samples draw differently
    assert first.system_fingerprint == "pagedserve-batch-invariant"
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]
    other = client.completions.create(**{**kwargs, "seed": 43})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_chat_with_real_logprobs(served, client):
    chat = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hello!"}],
                                          max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    [choice] = chat.choices
    entries = choice.logprobs.content
    assert chat.usage.completion_tokens == len(entries) == 5 and choice.finish_reason == "length"
    assert "".join(e.token for e in entries) == choice.message.content
    for entry in entries:  # greedy: the sampled token is the most likely one
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_metrics_follow_the_requests_and_the_scheduler(served, client):
    before = raw(served.url + "/metrics")[1].decode()
    for _ in range(2):
        client.completions.create(model=served.model, prompt=[[5, 6, 7, 8] * 8], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = raw(served.url + "/metrics")[1].decode()

    def moved(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("pagedserve:prompt_tokens_total") == 64 and moved("pagedserve:generation_tokens_total") == 6
    assert moved("pagedserve:prefix_cache_queries_total", worker="w0") >= 32
    assert moved("pagedserve:prefix_cache_hits_total", worker="w0") >= 16  # the second run reuses full blocks
    assert moved("pagedserve:request_queue_time_seconds_count") == 2
    assert 0 <= metric(after, "pagedserve:kv_cache_usage_perc", worker="w0") < 1
    assert metric(after, "pagedserve:num_requests_running") == 0


def exported_names(text: str) -> set[str]:
    """Every sample name on a /metrics page (counters with their _total)."""
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


PER_WORKER = {"pagedserve:kv_cache_usage_perc", "pagedserve:prefix_cache_queries", "pagedserve:prefix_cache_hits"}


def test_the_inference_extension_names_repeat_the_pagedserve_figures(served, client):
    """The Gateway API Inference Extension's model-server protocol names (services/frontend/metrics.py)
    carry the scheduler's figures, all workers together, beside the pagedserve: ones."""
    for _ in range(2):  # the second run hits the prefix cache
        client.completions.create(model=served.model, prompt=[[9, 10, 11, 12] * 8], max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = raw(served.url + "/metrics")[1].decode()
    exported = exported_names(text)
    for alias, name in INFERENCE_EXTENSION_NAMES.items():
        suffix = "_total" if "prefix_cache" in name else ""  # counters
        assert alias + suffix in exported, alias
        per_worker = {"worker": "w0"} if name in PER_WORKER else {}  # one worker: its figure is the whole
        assert metric(text, alias + suffix, model_name=served.model) == metric(text, name + suffix, **per_worker)
    assert metric(text, "vllm:prefix_cache_hits_total") >= 16
    assert 0 <= metric(text, "vllm:kv_cache_usage_perc") < 1


def test_the_autoscalers_metric_names_are_exported(served):
    """The HPA (through prometheus-adapter) and KEDA scale the workers on names a frontend exports."""
    kube = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
    hpa = yaml.safe_load((kube / "base" / "worker-autoscaler.yaml").read_text())
    [rule] = yaml.safe_load((kube / "prometheus-adapter" / "values.yaml").read_text())["rules"]["external"]
    scaled = yaml.safe_load((kube / "components" / "keda" / "scaledobject.yaml").read_text())
    [metric_spec] = hpa["spec"]["metrics"]
    assert re.sub(rule["name"]["matches"], rule["name"]["as"], "pagedserve:num_requests_waiting") == \
        metric_spec["external"]["metric"]["name"]
    used = set(re.findall(r"[a-z_]+:[a-z_]+", rule["seriesQuery"]))
    for trigger in scaled["spec"]["triggers"]:
        used |= set(re.findall(r"[a-z_]+:[a-z_]+", trigger["metadata"]["query"]))
    assert used == {"pagedserve:num_requests_waiting"}
    assert used <= exported_names(raw(served.url + "/metrics")[1].decode())


def test_a_stop_string_ends_its_sample_with_the_text_before_it_and_frees_the_blocks(served, client):
    """The frontend matches the stop string and ends that sample at the real scheduler (a
    StopSample on its SubmitMany call): the text stops before it, the other sample goes on, and
    every block is free once the request is over."""
    kwargs = dict(model=served.model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5, n=2,
                  extra_body={"ignore_eos": True})
    full = [c.text for c in client.completions.create(**kwargs).choices]
    stop = full[0][len(full[0]) // 2:][:3]
    assert stop.strip(), full[0]
    cut = client.completions.create(**kwargs, stop=[stop])
    for choice, text in zip(cut.choices, full):
        ended = stop in text
        assert choice.text == (text[:text.index(stop)] if ended else text)
        assert choice.finish_reason == ("stop" if ended else "length")
    assert cut.usage.completion_tokens < 2 * 16
    served.run(served.cluster.wait_idle())
