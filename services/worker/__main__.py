"""python -m services.worker: load the model, allocate the KV cache, serve Step, register.

    python -m services.worker --model PATH --scheduler-address HOST:PORT --host 0.0.0.0 --port 0 \\
        --advertise-host HOST --worker-id ID --dtype auto --device auto --block-size 16 \\
        --num-gpu-blocks N --kv-cache-memory-bytes N --swap-space-bytes N --kernel-backend auto \\
        --cpu-isa auto --seed 0 --quantization auto --batch-invariant/--no-batch-invariant [--reflection] \\
        --log-level info

Every flag also reads PAGEDSERVE_<FLAG> from the environment. SIGTERM/SIGINT: health turns
NOT_SERVING, heartbeats stop, in-flight steps get a grace period, then the process exits.
A refusal by the scheduler (block size or model mismatch) exits with status 2.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys

import structlog
import uvloop

from services.cli import add_flag, add_switch
from services.core.config import CacheConfig, WorkerConfig
from services.launch.logs import configure_logging
from services.worker.registrar import Refused
from services.worker.server import WorkerServiceConfig, start_worker

log = structlog.get_logger("worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__.split("\n")[0])
    add_flag(parser, "--model", "default", help="model folder (or 'default')")
    add_flag(parser, "--scheduler-address", "127.0.0.1:50052", help="HOST:PORT of the scheduler")
    add_flag(parser, "--host", "0.0.0.0", help="address to listen on")
    add_flag(parser, "--port", 0, int, help="port to listen on (0: pick a free one)")
    add_flag(parser, "--advertise-host", "127.0.0.1", help="host the scheduler dials to reach this worker")
    add_flag(parser, "--worker-id", f"{socket.gethostname()}-{os.getpid()}", help="unique worker name")
    add_flag(parser, "--dtype", "auto", help="float32, bfloat16, float16 or auto")
    add_flag(parser, "--device", "auto", help="cpu, cuda or auto")
    add_flag(parser, "--block-size", 16, int, help="tokens per KV block; must equal the scheduler's")
    add_flag(parser, "--num-gpu-blocks", None, int, help="KV cache size in blocks (default: from the budget)")
    add_flag(parser, "--kv-cache-memory-bytes", None, int, help="KV cache memory budget")
    add_flag(parser, "--swap-space-bytes", 64 << 20, int, help="CPU swap pool")
    add_flag(parser, "--kernel-backend", "auto", help="auto, torch, cpu or triton")
    add_flag(parser, "--cpu-isa", "auto", help="CPU kernel tier: auto, avx512, avx2 or generic")
    add_flag(parser, "--seed", 0, int, help="weights-independent torch seed")
    add_flag(parser, "--num-threads", 0, int, help="CPU threads for the math (0: the library default)")
    add_flag(parser, "--quantization", "auto",
             help="weights: auto (the folder's GGUF if it has one), none, gguf or int8 (per channel, at load)")
    add_switch(parser, "--batch-invariant", True, help="the deterministic mode (DESIGN rule 4)")
    add_switch(parser, "--reflection", False, help="serve gRPC reflection")
    add_flag(parser, "--log-level", "info", help="debug, info, warning or error")
    return parser.parse_args(argv)


def build_configs(args: argparse.Namespace) -> tuple[WorkerConfig, CacheConfig, WorkerServiceConfig]:
    worker = WorkerConfig(args.model, args.dtype, args.device, args.seed, args.kernel_backend, args.batch_invariant,
                          num_threads=args.num_threads, quantization=args.quantization, cpu_isa=args.cpu_isa)
    cache = CacheConfig(args.block_size, args.num_gpu_blocks, args.kv_cache_memory_bytes, args.swap_space_bytes)
    service = WorkerServiceConfig(args.scheduler_address, args.worker_id, args.host, args.port, args.advertise_host,
                                  args.reflection)
    return worker, cache, service


async def serve(worker_config: WorkerConfig, cache: CacheConfig, service: WorkerServiceConfig) -> int:
    server = await start_worker(worker_config, cache, service)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, server.registration], return_when=asyncio.FIRST_COMPLETED)
    error = server.registration.exception() if server.registration.done() else None
    if error is not None:
        log.error("registration_failed", reason=str(error), refused=isinstance(error, Refused))
    code = 0 if error is None else 2 if isinstance(error, Refused) else 1
    waiter.cancel()
    await server.stop(grace=5.0)
    return code


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("worker", args.log_level)
    sys.exit(uvloop.run(serve(*build_configs(args))))


if __name__ == "__main__":
    main()
