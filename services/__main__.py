"""python -m services <command>

    up    start the scheduler, N workers and the frontend as local processes (no Docker)
    diverge  why did my output change? each cause of drift against a batch-1 baseline

Each flag of `up` also reads PAGEDSERVE_<FLAG> from the environment; engine flags not given
are left to the services, which read their own PAGEDSERVE_* variables.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from services.cli import add_flag
from services.launch.deployment import SWITCH_FLAGS, VALUE_FLAGS, Deployment, free_ports
from services.launch.supervisor import Launcher, frontend_drain_timeout
from services.tools.diverge.cli import add_diverge_parser

DEFAULT_STOP_TIMEOUT_S = 15.0  # docker-compose.yml's stop_grace_period is the same (a test checks)


def add_up_parser(commands) -> None:
    up = commands.add_parser("up", help="start all three services locally and wait for Ctrl-C",
                             description="Start the scheduler, N workers and the frontend as separate "
                                         "processes (the commands the containers run), wait until each is "
                                         "SERVING, print the addresses; restart a service that exits (a worker "
                                         "always, the scheduler and the frontend 3 times in a row); on Ctrl-C "
                                         "or SIGTERM drain the frontend, then stop the scheduler, then the workers.")
    add_flag(up, "--model", default="default", help='a model folder, a hub id, or "default" (SmolLM2-135M-Instruct)')
    add_flag(up, "--workers", default=1, type=int, help="number of worker processes")
    add_flag(up, "--host", default="127.0.0.1", help="the frontend's bind address (0.0.0.0: all interfaces)")
    add_flag(up, "--grpc-port", default=50051, type=int, help="the frontend's public gRPC port")
    add_flag(up, "--http-port", default=8000, type=int, help="the frontend's OpenAI-compatible HTTP port")
    add_flag(up, "--scheduler-port", default=50052, type=int, help="the scheduler's port (loopback only)")
    add_flag(up, "--log-dir", default=None, type=Path,
             help="write each service's log to DIR/<service>.log (default: the terminal, prefixed)")
    add_flag(up, "--startup-timeout", default=600.0, type=float, help="seconds for all services to be SERVING")
    add_flag(up, "--stop-timeout", default=DEFAULT_STOP_TIMEOUT_S, type=float,
             help="the whole grace period of a stop: open streams get 2/3 of it to finish, then the scheduler "
                  "and the workers stop; what is left at the end gets SIGKILL (docker-compose.yml's "
                  "stop_grace_period is the same)")
    add_flag(up, "--python", default=sys.executable, help="the interpreter the services run with")
    engine = up.add_argument_group("engine flags", "passed through to the services that take them")
    for flag, services in VALUE_FLAGS.items():
        engine.add_argument(flag, default=None, help=f"passed to the {' and '.join(services)}")
    for flag, services in SWITCH_FLAGS.items():
        engine.add_argument(flag, default=None, action=argparse.BooleanOptionalAction,
                            help=f"passed to the {' and '.join(services)}")
    up.set_defaults(run=run_up)


def default_worker_threads(num_workers: int) -> int:
    """Share the cores among the workers; the frontend and scheduler are mostly idle (~8% of a core
    each under load). Measured on 2 cores, offline bench through the services, one worker: fp32 220 tok/s
    with 1 thread, 300 with 2; bf16 339 and 405."""
    return max(1, (os.cpu_count() or 1) // num_workers)


def engine_flags(args: argparse.Namespace) -> tuple[tuple[str, str | bool], ...]:
    flags = list(VALUE_FLAGS) + list(SWITCH_FLAGS)
    values = ((flag, getattr(args, flag[2:].replace("-", "_"))) for flag in flags)
    chosen = tuple((flag, value) for flag, value in values if value is not None)
    if args.num_threads is None:
        chosen += (("--num-threads", str(default_worker_threads(args.workers))),)
    return chosen


def run_up(args: argparse.Namespace) -> int:
    from services.core.errors import InvalidArgument
    from services.core.model_path import resolve_model_path

    if args.workers < 1:
        print("error: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.stop_timeout <= 0:
        print("error: --stop-timeout must be > 0", file=sys.stderr)
        return 2
    try:
        model = resolve_model_path(args.model)  # once, so "default" is converted before anything starts
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    deployment = Deployment(
        model=str(model), served_model_name=args.model or "default", num_workers=args.workers,
        host=args.host, grpc_port=args.grpc_port,
        http_port=args.http_port, scheduler_port=args.scheduler_port,
        worker_ports=free_ports(args.workers),
        engine_flags=engine_flags(args), python=args.python,
        drain_timeout_s=frontend_drain_timeout(args.stop_timeout),
    )
    launcher = Launcher(deployment, log_dir=args.log_dir)
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    return launcher.run(args.startup_timeout, args.stop_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services", description="pagedserve, a paged-attention "
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
