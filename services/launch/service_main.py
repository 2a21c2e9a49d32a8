"""The start-up every service's `main` shares: parse the flags its config dataclasses generate
(services/cli.py), configure logging, watch the launcher (services/launch/orphan.py), then run
the service on uvloop until SIGTERM or SIGINT (`stop_requested`)."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

from services import cli
from services.launch import orphan
from services.launch.logs import configure_logging


class ServiceMain:
    """`python -m services.NAME`: its flags are those of `classes`, the last of them LogConfig."""

    def __init__(self, name: str, doc: str, classes: tuple[type, ...]):
        self.name, self.classes = name, classes
        self.prog = f"python -m services.{name}"
        self.description = doc.splitlines()[0]

    def parse_args(self, argv: list[str] | None = None) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        cli.add_config_flags(parser, *self.classes)
        return parser.parse_args(argv)

    def build_configs(self, args: argparse.Namespace) -> tuple:
        """One instance of each config dataclass; a refused setting exits 2 naming its flag."""
        return cli.build_configs(args, *self.classes, prog=self.prog)

    def start(self, argv: list[str] | None = None) -> tuple:
        """The configs (LogConfig applied and left out), with logging set up and the launcher watched."""
        *configs, log = self.build_configs(self.parse_args(argv))
        configure_logging(self.name, log.log_level)
        orphan.stop_with_launcher(os.environ.get(orphan.LAUNCHER_PID_ENV))  # main is where the environment is read
        return tuple(configs)

    def run(self, serve: Callable[..., Awaitable[Any]], argv: list[str] | None = None) -> Any:
        """start(), then serve(*configs) on uvloop; its result."""
        return self.serve(serve(*self.start(argv)))

    @staticmethod
    def serve(coroutine: Awaitable[Any]) -> Any:
        """The service's coroutine on uvloop (after start(), for a main that decides what to run)."""
        return uvloop.run(coroutine)


def stop_requested() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT (from inside the running loop): the graceful stop begins."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
