"""`python -m services.frontend`: the public gRPC and OpenAI HTTP APIs in front of the scheduler.

The flags are those of FrontendConfig, GrammarLimits and LogConfig (services/cli.py); every flag
also reads PAGEDSERVE_<FLAG> from the environment.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal

import uvloop

from services import cli
from services.core.config import LogConfig
from services.core.model_path import resolve_model_path
from services.frontend.config import CLI_CONFIGS, FrontendConfig
from services.frontend.server import FrontendServer
from services.launch import orphan
from services.launch.logs import configure_logging

PROG = "python -m services.frontend"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    cli.add_config_flags(parser, *CLI_CONFIGS)
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> tuple[FrontendConfig, LogConfig]:
    return cli.build_configs(args, *CLI_CONFIGS, prog=PROG)


async def serve(config: FrontendConfig) -> None:
    server = FrontendServer(config, resolve_model_path(config.model, config.model_cache_dir))
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await server.drain()


def main(argv: list[str] | None = None) -> None:
    config, log = build_config(parse_args(argv))
    configure_logging("frontend", log.log_level)
    orphan.stop_with_launcher(os.environ.get(orphan.LAUNCHER_PID_ENV))
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
