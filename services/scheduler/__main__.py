"""python -m services.scheduler: the scheduler service (queues, block tables, step loop).

    python -m services.scheduler --host 0.0.0.0 --port 50052 --block-size 16 --max-num-seqs 64 \\
        --max-num-batched-tokens 2048 --max-model-len 0 --scheduling-policy fcfs \\
        --preemption-mode recompute --enable-prefix-caching --enable-chunked-prefill \\
        --max-waiting-requests 4096 --heartbeat-timeout-s 10 --step-timeout-s 300 --worker-probe-timeout-s 3 \\
        --async-scheduling [--reflection] --log-level info

The flags are those of SchedulerServiceConfig, SchedulerConfig and LogConfig (services/cli.py);
every flag also reads PAGEDSERVE_<FLAG> from the environment. SIGTERM/SIGINT: health turns
NOT_SERVING, new Submits get UNAVAILABLE, running requests finish, then the process exits.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal

import uvloop

from services import cli
from services.core.config import LogConfig
from services.launch import orphan
from services.launch.logs import configure_logging
from services.scheduler.config import CLI_CONFIGS, SchedulerServiceConfig
from services.scheduler.server import SchedulerServer

PROG = "python -m services.scheduler"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    cli.add_config_flags(parser, *CLI_CONFIGS)
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> tuple[SchedulerServiceConfig, LogConfig]:
    return cli.build_configs(args, *CLI_CONFIGS, prog=PROG)


async def serve(config: SchedulerServiceConfig) -> None:
    server = SchedulerServer(config)
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.shutdown()


def main(argv: list[str] | None = None) -> None:
    config, log = build_config(parse_args(argv))
    configure_logging("scheduler", log.log_level)
    orphan.stop_with_launcher(os.environ.get(orphan.LAUNCHER_PID_ENV))
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
