"""`python -m services up`: what the deployment is (Deployment) and the command line of each service.

`service_commands` is the single source of the services' command lines: the launcher
(services.supervisor) runs them, and the compose file's commands are checked against them
(tests/e2e/test_compose.py). Every flag `up` takes for the services is in VALUE_FLAGS or
SWITCH_FLAGS with the services it reaches (tests/e2e/test_launcher.py checks each one arrives
and each service's parser knows it).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

# Engine flags `up` passes through, and the services that take each.
VALUE_FLAGS = {
    "--log-level": ("scheduler", "worker", "frontend"),
    "--block-size": ("scheduler", "worker"),
    "--swap-space-bytes": ("worker",),
    "--max-num-seqs": ("scheduler",),
    "--max-num-batched-tokens": ("scheduler",),
    "--max-model-len": ("scheduler",),
    "--scheduling-policy": ("scheduler",),
    "--preemption-mode": ("scheduler",),
    "--max-waiting-requests": ("scheduler",),
    "--heartbeat-timeout-s": ("scheduler",),
    "--step-timeout-s": ("scheduler",),
    "--dtype": ("worker",),
    "--device": ("worker",),
    "--num-gpu-blocks": ("worker",),
    "--kv-cache-memory-bytes": ("worker",),
    "--kernel-backend": ("worker",),
    "--cpu-isa": ("worker",),
    "--seed": ("scheduler", "worker"),
    "--num-threads": ("worker",),
    "--quantization": ("worker",),
    "--max-pending": ("frontend",),
}
SWITCH_FLAGS = {
    "--reflection": ("scheduler", "worker", "frontend"),
    "--enable-prefix-caching": ("scheduler",),
    "--enable-chunked-prefill": ("scheduler",),
    "--async-scheduling": ("scheduler",),
    "--batch-invariant": ("worker",),
}
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
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
        unknown = [f for f, _ in self.engine_flags if f not in VALUE_FLAGS and f not in SWITCH_FLAGS]
        if unknown:
            raise ValueError(f"unknown engine flags {unknown}")

    @property
    def scheduler_target(self) -> str:
        return self.scheduler_address or f"{self.internal_host}:{self.scheduler_port}"


def _engine_args(deployment: Deployment, service: str) -> list[str]:
    args: list[str] = []
    for flag, value in deployment.engine_flags:
        if service not in VALUE_FLAGS.get(flag, SWITCH_FLAGS.get(flag, ())):
            continue
        if flag in SWITCH_FLAGS:
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


def free_ports(num: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """`num` distinct ports free now (all held open while choosing, so none repeats)."""
    sockets = [socket.socket() for _ in range(num)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return tuple(s.getsockname()[1] for s in sockets)
    finally:
        for s in sockets:
            s.close()
