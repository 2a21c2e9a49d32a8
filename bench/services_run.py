"""Start the three services for a benchmark (`python -m services up`) or use running ones, and
send a batch of requests through the public gRPC API with pagedserve.client.

Loopback only: the launcher binds 127.0.0.1 and picks free ports.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common import REPO


def missing_services() -> str | None:
    """Why the gRPC mode cannot run, or None when the client and the launcher are there."""
    for module in ("pagedserve.client", "services.launch.deployment", "services.frontend.server", "services.scheduler.server",
                   "services.worker.server"):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} does not exist yet"
        except ImportError as exc:
            return f"{module} cannot be imported: {exc}"
    return None


def require_services() -> None:
    reason = missing_services()
    if reason:
        raise SystemExit(f"the three-services mode needs the gRPC services and pagedserve/client.py: {reason}")


@contextlib.contextmanager
def launched(model: str, dtype: str, batch_invariant: bool = True, max_num_seqs: int = 64,
             max_num_batched_tokens: int = 2048, workers: int = 1, timeout: float = 300.0,
             backend: str = "grpc", quantization: str = "auto") -> Iterator[str]:
    """`python -m services up` on free loopback ports; yields the frontend's gRPC address, or its
    HTTP address (host:port) when backend is "http"."""
    require_services()
    from services.launch.healthcheck import is_serving
    from services.launch.deployment import free_ports
    port, http_port, scheduler_port = free_ports(3)
    log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))
    command = [sys.executable, "-m", "services", "up", "--model", model, "--workers", str(workers),
               "--grpc-port", str(port), "--http-port", str(http_port), "--scheduler-port", str(scheduler_port),
               "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens), "--log-level", "warning",
               "--quantization", quantization,
               "--batch-invariant" if batch_invariant else "--no-batch-invariant", "--log-dir", str(log_dir)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not is_serving(address, timeout=1.0):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"services did not start (exit {process.poll()}); logs in {log_dir}")
            time.sleep(0.5)
        yield f"127.0.0.1:{http_port}" if backend == "http" else address
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)  # the launcher stops its children in order
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def request_kwargs(output_len: int) -> dict:
    return {"max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True, "temperature": 0.0}


async def run_batch(address: str, requests, one_call: bool = False) -> list[int]:
    """All requests at once, streamed; returns the number of tokens each produced. one_call: all
    of them over one GenerateBatch call, else one Generate call each."""
    import asyncio
    from pagedserve import AsyncClient, GenerationError

    async with AsyncClient(address) as client:
        if one_call:
            results = await client.complete_batch([dict(prompt=list(r.prompt_ids), **request_kwargs(r.output_len))
                                                   for r in requests])
            failed = [r for r in results if isinstance(r, GenerationError)]
            if failed:
                raise failed[0]
            return [len(r.token_ids) for r in results]

        async def one(request) -> int:
            result = await client.complete(list(request.prompt_ids), **request_kwargs(request.output_len))
            return len(result.token_ids)
        return await asyncio.gather(*(one(r) for r in requests))
