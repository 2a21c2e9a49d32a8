"""python -m services.worker: load the model, allocate the KV cache, serve Step, register.

    python -m services.worker --model PATH --scheduler-address HOST:PORT --host 0.0.0.0 --port 0 \\
        --advertise-host HOST --worker-id ID --dtype auto --device auto --block-size 16 \\
        --num-gpu-blocks N --kv-cache-memory-bytes N --swap-space-bytes N --kernel-backend auto \\
        --cpu-isa auto --torch-seed 0 --quantization auto --batch-invariant/--no-batch-invariant [--reflection] \\
        --log-level info

The flags are those of WorkerConfig, CacheConfig, WorkerServiceConfig and LogConfig
(services/cli.py); every flag also reads PAGEDSERVE_<FLAG> from the environment. SIGTERM/SIGINT:
health turns NOT_SERVING, heartbeats stop, in-flight steps get a grace period, then the process
exits. A refusal by the scheduler (block size or model mismatch, or the scheduler cannot reach the
worker at its advertised address: fix --advertise-host) is logged with its reason and exits with status 2.
"""
from __future__ import annotations

import asyncio
import sys

import structlog

from services.core.config import CacheConfig, WorkerConfig
from services.launch.service_main import ServiceMain, stop_requested
from services.worker.config import CLI_CONFIGS, WorkerServiceConfig
from services.worker.registrar import Refused
from services.worker.server import start_worker

log = structlog.get_logger("worker")
MAIN = ServiceMain("worker", __doc__, CLI_CONFIGS)
PROG, parse_args, build_configs = MAIN.prog, MAIN.parse_args, MAIN.build_configs
STOP_GRACE_S = 5.0  # on SIGTERM, what an in-flight step gets (deploy/kubernetes sizes the pod's grace period on it)


async def serve(worker_config: WorkerConfig, cache: CacheConfig, service: WorkerServiceConfig) -> int:
    server = await start_worker(worker_config, cache, service)
    waiter = asyncio.create_task(stop_requested().wait())
    broken = asyncio.create_task(server.broken.wait())
    await asyncio.wait([waiter, server.registration, broken], return_when=asyncio.FIRST_COMPLETED)
    error = server.registration.exception() if server.registration.done() else None
    if error is not None:
        log.error("registration_refused" if isinstance(error, Refused) else "registration_failed",
                  worker_id=service.worker_id, reason=str(error))
    code = 0 if error is None else 2 if isinstance(error, Refused) else 1
    if broken.done():
        log.error("worker_group_broken", reason="a rank of this worker's group failed; exiting so that the "
                                                "whole group restarts")
        code = 1
    waiter.cancel()
    broken.cancel()
    await server.stop(grace=STOP_GRACE_S)
    return code


def main(argv: list[str] | None = None) -> None:
    worker, cache, service = MAIN.start(argv)
    if worker.group_rank > 0:  # a follower of a worker group: no gRPC and no event loop, it runs rank 0's steps
        from services.worker.worker_group import follow

        follow(worker, cache)
        sys.exit(0)
    sys.exit(MAIN.serve(serve(worker, cache, service)))


if __name__ == "__main__":
    main()
