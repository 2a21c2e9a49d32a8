"""The `--against` variants: the prompts through a running cluster's public API, and through a
worker of our own that joins that cluster and is killed mid-request (its sequences are then
recomputed on the cluster's other workers, docs/ARCHITECTURE.md rule 5).

The cluster must serve the same model with the baseline's dtype, block size and kernels, or
every cell differs for that reason alone.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from pagedserve.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve import AsyncClient, Client, GenerationError
from services.core.sampling_params import SamplingParams
from services.launch.deployment import free_ports
from services.tools.diverge.cases import Case
from services.tools.diverge.compare import Sample, margin
from services.tools.diverge.engine_runs import Run
from services.tools.diverge.variants import CLUSTER, Variant

REGISTER_TIMEOUT_S = 300.0


def run_on_cluster(variant: Variant, cases: list[Case], frontend: str, scheduler: str | None, model: Path,
                   engine_args: dict) -> Run:
    if variant.where == CLUSTER:
        with Client(frontend) as client:
            return _run_of(cases, client.complete_batch(_requests(cases)))
    with OwnWorker(scheduler, model, engine_args) as worker:
        return asyncio.run(_killed_mid_request(frontend, cases, worker))


def _requests(cases: list[Case]) -> list[dict]:
    return [{"prompt": list(c.prompt_token_ids), **_sampling(c.params)}
            for c in cases]


def _sampling(params: SamplingParams) -> dict:
    """The public API's sampling fields, from the engine's (the same names)."""
    out = {k: v for k, v in asdict(params).items() if v is not None and v != () and v != ""}  # "": unset (pooling)
    out["logit_bias"] = dict(params.logit_bias)
    return out


def _run_of(cases: list[Case], results: list, note: str = "", exercised: bool = True) -> Run:
    run, errors = Run(note=note, exercised=exercised), []
    for case, result in zip(cases, results):
        if isinstance(result, GenerationError):
            errors.append(f"{case.id}: {result}")
            continue
        run.samples[case.id] = [Sample(token_ids=s.token_ids, logprobs=[lp.logprob for lp in s.logprobs or []],
                                       margins=[margin(lp.top) for lp in s.logprobs or []], seed=result.seed,
                                       text=s.text)
                                for s in result.samples]
    if errors:
        run.note = "; ".join(filter(None, [run.note, *errors]))
    return run


class OwnWorker:
    """A worker process of ours, registered with the cluster's scheduler with more KV blocks than
    any other worker, so the scheduler (which places a request on the worker with the most free
    blocks) sends it the next requests."""

    def __init__(self, scheduler: str, model: Path, engine_args: dict):
        self.scheduler, self.worker_id = scheduler, f"diverge-{os.getpid()}"
        stats = self.stats()
        blocks = 2 * max((w.num_gpu_blocks for w in stats.workers), default=256)
        port = free_ports(1)[0]
        flags = {"--model": str(model), "--scheduler-address": scheduler, "--host": "127.0.0.1",
                 "--port": port, "--advertise-host": "127.0.0.1", "--worker-id": self.worker_id,
                 "--dtype": engine_args["dtype"], "--block-size": engine_args["block_size"],
                 "--num-gpu-blocks": blocks, "--kernel-backend": engine_args["kernel_backend"],
                 "--cpu-isa": engine_args["cpu_isa"],
                 "--num-threads": engine_args["num_threads"], "--log-level": "warning"}
        command = [sys.executable, "-m", "services.worker", *(str(x) for kv in flags.items() for x in kv)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stats(self) -> scheduler_pb2.GetStatsResponse:
        with grpc.insecure_channel(self.scheduler) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def mine(self, stats: scheduler_pb2.GetStatsResponse):
        return next((w for w in stats.workers if w.worker_id == self.worker_id), None)

    def __enter__(self) -> OwnWorker:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while self.mine(self.stats()) is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"our worker exited ({self.process.returncode}): "
                                   f"{self.process.stderr.read().decode(errors='replace')[-500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"our worker did not register within {REGISTER_TIMEOUT_S:g}s")
            time.sleep(0.2)
        return self

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def __exit__(self, *exc) -> None:
        self.kill()
        if self.process.stderr is not None:
            self.process.stderr.close()


async def _killed_mid_request(frontend: str, cases: list[Case], worker: OwnWorker) -> Run:
    """Kill our worker once the requests have streamed about a token each: stopped first, so
    that the sequences it holds can be counted before it dies."""
    client = AsyncClient(frontend)
    try:
        stream = client.generate_batch(_requests(cases))
        seen, held = 0, None
        async for _, delta in stream:
            seen += len(delta.token_ids)
            if held is None and seen >= len(cases):
                worker.process.send_signal(signal.SIGSTOP)  # frozen mid-step: what it holds stays put
                mine = worker.mine(await asyncio.to_thread(worker.stats))
                held = mine.num_running if mine is not None else 0
                worker.kill()
        results = stream.results
    finally:
        await client.close()
    held = held or 0
    return _run_of(cases, results, f"killed our worker holding {held} sequences", exercised=held > 0)
