"""Prometheus metrics of the frontend, named like vLLM's (`vllm:x` -> `pagedserve:x`).

Latencies and token counters are recorded by FrontendCore.generate, the path every
transport shares, so gRPC and HTTP requests both count. Queue, preemption, KV-cache and
prefix-cache figures are the scheduler's, read from its GetStats at scrape time; the
per-worker ones (label `worker`: running, waiting, swapped, step time, steps, KV usage, prefix
cache) show a worker that falls behind, since each worker steps at its own pace.

The same queue, running, KV-cache and prefix-cache figures are also exported, summed over the
workers, under the names the Gateway API Inference Extension's model-server protocol documents
(INFERENCE_EXTENSION_NAMES), which its endpoint picker and llm-d read without configuration.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.core.stats import SchedulerStats
from services.frontend.types import GenerateEvent, Summary


PREFIX = "pagedserve:"
# vLLM's buckets, so its dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class FrontendMetrics:
    """One registry per frontend (not the global one), so several can live in one test process."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerCollector(model_name)
        self.registry.register(self.scheduler)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token of a request.",
                              TOKEN_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two steps' tokens.", TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting in the scheduler's queue.",
                               REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached the scheduler.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = Counter(PREFIX + "request_success", "Finished samples by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self, stats: SchedulerStats | None) -> bytes:
        """The text exposition; the scheduler's figures are left out when it did not answer."""
        self.scheduler.stats = stats
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies, fed with each event the frontend produces for it."""

    def __init__(self, metrics: FrontendMetrics):
        self.metrics = metrics
        self.started = time.monotonic()
        self.first: float | None = None
        self.last = self.started
        self.num_steps = 0  # events that carried tokens
        self.queue_time_s: float | None = None

    def on_queue_time(self, seconds: float) -> None:
        if self.queue_time_s is None:
            self.queue_time_s = seconds
            self.metrics.queue.observe(seconds)

    def on_event(self, event: GenerateEvent) -> None:
        if not any(sample.token_ids for sample in event.samples):
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.started)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last, self.num_steps = now, self.num_steps + 1

    def finish(self, summary: Summary) -> None:
        metrics = self.metrics
        metrics.e2e.observe(time.monotonic() - self.started)
        if self.num_steps > 1:
            metrics.tpot.observe((self.last - self.first) / (self.num_steps - 1))
        metrics.prompt_tokens.inc(summary.num_prompt_tokens)
        metrics.generation_tokens.inc(summary.num_completion_tokens)
        for reason in summary.finish_reasons:
            metrics.success.labels(metrics.model_name, reason).inc()


# The model-server protocol of the Gateway API Inference Extension (kubernetes-sigs/gateway-api-inference-extension,
# docs/proposals/003-model-server-protocol/README.md at commit 25557e290ad41bec74d2313182df35d40b2c0cda) names
# the metrics its endpoint picker scrapes by their vLLM names: TotalQueuedRequests (a gauge)
# `vllm:num_requests_waiting`, TotalRunningRequests `vllm:num_requests_running`, KVCacheUtilization
# `vllm:kv_cache_usage_perc` (a fraction, 1 = full). It asks model servers to support prefix-cache reuse but
# names no metric for it; the prefix-cache counters are vLLM's own names. Each is one series per frontend
# (the scheduler's figure, all workers together), labelled model_name as vLLM's are.
INFERENCE_EXTENSION_NAMES = {  # protocol's / vLLM's name -> the pagedserve: name it repeats
    "vllm:num_requests_waiting": "pagedserve:num_requests_waiting",
    "vllm:num_requests_running": "pagedserve:num_requests_running",
    "vllm:kv_cache_usage_perc": "pagedserve:kv_cache_usage_perc",
    "vllm:prefix_cache_queries": "pagedserve:prefix_cache_queries",
    "vllm:prefix_cache_hits": "pagedserve:prefix_cache_hits",
}


class SchedulerCollector:
    """Gauges and counters from the scheduler's latest GetStats (set just before each scrape)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: SchedulerStats | None = None

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        for name, doc, value in (("num_requests_running", "Sequences running.", stats.num_running),
                                 ("num_requests_waiting", "Sequences waiting.", stats.num_waiting),
                                 ("num_requests_swapped", "Sequences swapped out.", stats.num_swapped)):
            yield self._family(GaugeMetricFamily, name, doc, [([], value)])
        yield self._family(CounterMetricFamily, "num_preemptions", "Preemptions since the scheduler started.",
                           [([], stats.num_preemptions)])
        workers = stats.workers
        yield self._family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of a worker's KV blocks in use.",
                           [([w.worker_id], (w.num_gpu_blocks - w.num_free_gpu_blocks) / max(w.num_gpu_blocks, 1))
                            for w in workers],
                           ["worker"])
        yield self._family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           [([w.worker_id], w.prefix_cache_queries) for w in workers], ["worker"])
        yield self._family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           [([w.worker_id], w.prefix_cache_hits) for w in workers], ["worker"])
        yield from self._per_worker(stats)
        yield from self._spec_decode(stats)
        yield from self._inference_extension(stats)
        yield from self._lora(stats)

    def _lora(self, stats: SchedulerStats):
        """vLLM's vllm:lora_requests_info (the adapters running and waiting as comma-separated labels, the
        Gateway API Inference Extension routes by it) and each adapter's sequences."""
        running = [n for n, k in zip(stats.lora_names, stats.lora_num_running) if k]
        waiting = [n for n, k in zip(stats.lora_names, stats.lora_num_waiting) if k]
        info = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters with requests running and waiting.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([",".join(running), ",".join(waiting)], time.time())
        yield info
        for name, doc, values in (("lora_num_requests_running", "Sequences running under the adapter.",
                                   stats.lora_num_running),
                                  ("lora_num_requests_waiting", "Sequences waiting under the adapter.",
                                   stats.lora_num_waiting)):
            yield self._family(GaugeMetricFamily, name, doc, [([n], k) for n, k in zip(stats.lora_names, values)],
                               ["lora_name"])

    def _per_worker(self, stats: SchedulerStats):
        """Each worker's queues and pace (label `worker`): the workers step independently, so one
        slow worker shows here, not in the totals."""
        workers = stats.workers
        for kind, name, doc, value in (
                (GaugeMetricFamily, "worker_num_requests_running", "Sequences running on the worker.",
                 lambda w: w.num_running),
                (GaugeMetricFamily, "worker_num_requests_waiting", "Sequences placed on the worker, waiting to start.",
                 lambda w: w.num_waiting),
                (GaugeMetricFamily, "worker_num_requests_swapped", "Sequences swapped out of the worker.",
                 lambda w: w.num_swapped),
                (GaugeMetricFamily, "worker_step_time_seconds", "The worker's step time, scheduled to applied "
                                                                "(moving average).", lambda w: w.step_time_s),
                (CounterMetricFamily, "worker_steps", "Steps the worker ran since it joined.", lambda w: w.num_steps)):
            yield self._family(kind, name, doc, [([w.worker_id], value(w)) for w in workers], ["worker"])

    def _spec_decode(self, stats: SchedulerStats):
        """Speculative decoding's counters, vLLM's names (services/core/spec_decode.py)."""
        for name, doc, value in (
                ("spec_decode_num_drafts", "Sequence-steps that verified drafted tokens.", stats.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Drafted tokens.", stats.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Drafted tokens accepted (equal to the sampler's own).",
                 stats.spec_decode_num_accepted_tokens)):
            yield self._family(CounterMetricFamily, name, doc, [([], value)])
        yield self._family(CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                           "Drafted tokens accepted, by their position in the draft.",
                           [([str(pos)], n) for pos, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)],
                           ["position"])

    def _inference_extension(self, stats: SchedulerStats):
        """The same figures under the protocol's names (INFERENCE_EXTENSION_NAMES), all workers together."""
        workers = stats.workers
        num_blocks = sum(w.num_gpu_blocks for w in workers)
        used = sum(w.num_gpu_blocks - w.num_free_gpu_blocks for w in workers)
        for kind, name, doc, value in (
                (GaugeMetricFamily, "num_requests_waiting", "TotalQueuedRequests: sequences waiting.", stats.num_waiting),
                (GaugeMetricFamily, "num_requests_running", "TotalRunningRequests: sequences running.",
                 stats.num_running),
                (GaugeMetricFamily, "kv_cache_usage_perc", "KVCacheUtilization: fraction of all workers' KV blocks "
                                                           "in use (1 = full).", used / max(num_blocks, 1)),
                (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache, all "
                                                             "workers.", sum(w.prefix_cache_queries for w in workers)),
                (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache, all workers.",
                 sum(w.prefix_cache_hits for w in workers))):
            family = kind("vllm:" + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family

    def _family(self, kind, name: str, doc: str, samples: list[tuple[list[str], float]], labels: tuple = ()):
        family = kind(PREFIX + name, doc, labels=["model_name", *labels])
        for label_values, value in samples:
            family.add_metric([self.model_name, *label_values], value)
        return family
