"""python -m services.scheduler: the scheduler service (queues, block tables, step loop).

    python -m services.scheduler --host 0.0.0.0 --port 50052 --block-size 16 --max-num-seqs 64 \\
        --max-num-batched-tokens 2048 --max-model-len 0 --scheduling-policy fcfs \\
        --preemption-mode recompute --enable-prefix-caching --enable-chunked-prefill \\
        --max-waiting-requests 4096 --heartbeat-timeout-s 10 --step-timeout-s 300 --async-scheduling \\
        [--reflection] --log-level info

Every flag also reads PAGEDSERVE_<FLAG> from the environment. SIGTERM/SIGINT: health turns
NOT_SERVING, new Submits get UNAVAILABLE, running requests finish, then the process exits.
"""
from __future__ import annotations

import argparse
import asyncio
import signal

import uvloop

from services.cli import add_flag, add_switch
from services.logs import configure_logging
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.server import SchedulerServer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__.split("\n")[0])
    add_flag(parser, "--host", "0.0.0.0", help="address to listen on")
    add_flag(parser, "--port", 50052, int, help="port to listen on (0: pick a free one)")
    add_flag(parser, "--block-size", 16, int, help="tokens per KV block; workers must match")
    add_flag(parser, "--max-num-seqs", 64, int, help="running sequences per worker")
    add_flag(parser, "--max-num-batched-tokens", 2048, int, help="token budget per worker step")
    add_flag(parser, "--max-model-len", 0, int, help="prompt + output limit (0: min(model max, 4096))")
    add_flag(parser, "--scheduling-policy", "fcfs", help="fcfs, priority or sjf")
    add_flag(parser, "--preemption-mode", "recompute", help="recompute or swap")
    add_switch(parser, "--enable-prefix-caching", True, help="reuse cached prompt blocks")
    add_switch(parser, "--enable-chunked-prefill", True, help="split long prompts across steps")
    add_flag(parser, "--max-waiting-requests", 4096, int, help="beyond this, Submit gets RESOURCE_EXHAUSTED")
    add_flag(parser, "--heartbeat-timeout-s", 10.0, float, help="drop a worker silent this long")
    add_flag(parser, "--step-timeout-s", 300.0, float,
             help="drop a worker whose step takes this long (its sequences are recomputed elsewhere; "
                  "raise it for big models on slow machines, where one long prefill step can take minutes)")
    add_flag(parser, "--seed", None, int, help="draw the seeds of requests that bring none from this (default: random)")
    add_switch(parser, "--async-scheduling", True,
               help="plan each worker's next decode step while it runs this one, so it can run it while the result "
                    "travels (--overlap-steps: the old name, still taken)")
    parser.add_argument("--overlap-steps", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_switch(parser, "--reflection", False, help="serve gRPC reflection")
    add_flag(parser, "--log-level", "info", help="debug, info, warning or error")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> SchedulerServiceConfig:
    return SchedulerServiceConfig(
        host=args.host, port=args.port, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy, preemption_mode=args.preemption_mode,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        max_waiting_requests=args.max_waiting_requests,
        heartbeat_timeout_s=args.heartbeat_timeout_s, step_timeout_s=args.step_timeout_s,
        reflection=args.reflection, seed=args.seed,
        async_scheduling=args.async_scheduling)


async def serve(config: SchedulerServiceConfig) -> None:
    server = SchedulerServer(config)
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging("scheduler", args.log_level)
    uvloop.run(serve(build_config(args)))


if __name__ == "__main__":
    main()
