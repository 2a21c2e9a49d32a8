"""python -m services <command>

    up    start the scheduler, N workers and the frontend as local processes (no Docker)
    diverge  why did my output change? each cause of drift against a batch-1 baseline

`up`'s own flags (UpConfig) also read PAGEDSERVE_<FLAG> from the environment; it takes every
flag of the services too (services.launch.deployment.routes) and passes each one given to the services
that hold it; one not given is left to the services, which read their own PAGEDSERVE_* variables.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from services import cli
from services.launch.deployment import DEFAULT_STOP_TIMEOUT_S, Deployment, UpConfig, free_ports, routes
from services.launch.supervisor import Launcher, frontend_drain_timeout
from services.tools.diverge.cli import add_diverge_parser

PROG = "python -m services up"
__all__ = ["DEFAULT_STOP_TIMEOUT_S", "main"]


def add_up_parser(commands) -> None:
    up = commands.add_parser("up", help="start all three services locally and wait for Ctrl-C",
                             description="Start the scheduler, N workers and the frontend as separate "
                                         "processes (the commands the containers run), wait until each is "
                                         "SERVING, print the addresses; restart a service that exits (a worker "
                                         "always, the scheduler and the frontend 3 times in a row); on Ctrl-C "
                                         "or SIGTERM drain the frontend, then stop the scheduler, then the workers.")
    cli.add_config_flags(up, UpConfig)
    engine = up.add_argument_group("service flags", "passed to the services that take them (default: theirs)")
    for name, route in routes().items():
        flag = route.flag
        if flag.is_switch:
            engine.add_argument(name, *flag.aliases, dest=flag.dest, default=None,
                                action=argparse.BooleanOptionalAction, help=route.help)
        else:
            engine.add_argument(name, *flag.aliases, dest=flag.dest, default=None, help=route.help,
                                metavar=flag.metavar)
    up.set_defaults(run=run_up)


def default_worker_threads(num_workers: int) -> int:
    """Share the cores among the workers; the frontend and scheduler are mostly idle (~8% of a core
    each under load). Measured on 2 cores, offline bench through the services, one worker: fp32 220 tok/s
    with 1 thread, 300 with 2; bf16 339 and 405."""
    return max(1, (os.cpu_count() or 1) // num_workers)


def engine_flags(args: argparse.Namespace) -> tuple[tuple[str, str | bool], ...]:
    values = ((name, getattr(args, route.flag.dest)) for name, route in routes().items())
    chosen = tuple((name, value) for name, value in values if value is not None)
    if args.num_threads is None:
        chosen += (("--num-threads", str(default_worker_threads(args.workers))),)
    return chosen


def run_up(args: argparse.Namespace) -> int:
    from services.core.errors import InvalidArgument
    from services.core.model_path import resolve_model_path

    (up,) = cli.build_configs(args, UpConfig, prog=PROG)  # exits 2 on a setting it refuses
    try:
        model = resolve_model_path(up.model)  # once: every service gets the same file or folder
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    deployment = Deployment(
        model=str(model), served_model_name=up.model or "default", num_workers=up.workers,
        host=up.host, grpc_port=up.grpc_port,
        http_port=up.http_port, scheduler_port=up.scheduler_port,
        worker_ports=free_ports(up.workers, avoid=(up.grpc_port, up.http_port, up.scheduler_port)),
        engine_flags=engine_flags(args), python=up.python,
        drain_timeout_s=frontend_drain_timeout(up.stop_timeout),
    )
    launcher = Launcher(deployment, log_dir=up.log_dir)
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    return launcher.run(up.startup_timeout, up.stop_timeout)


def main(argv: list[str] | None = None) -> int:
    # the name the user typed: the `pagedserve` console command or `python -m services`
    prog = "pagedserve" if os.path.basename(sys.argv[0]) == "pagedserve" else "python -m services"
    parser = argparse.ArgumentParser(prog=prog, description="pagedserve, a paged-attention "
                                     "LLM server as three gRPC services")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    add_up_parser(commands)
    add_diverge_parser(commands)
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
