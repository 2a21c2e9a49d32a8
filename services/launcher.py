"""`python -m services up`: the scheduler, N workers and the frontend as local processes.

`service_commands` is the single source of the services' command lines: the launcher runs
them, and the compose file's commands are checked against them (tests/e2e/test_compose.py).
Startup goes scheduler, then workers, then frontend, each waited for until its
grpc.health.v1 says SERVING. Ctrl-C or SIGTERM stops all of them (SIGTERM, a grace period,
then SIGKILL); so does any one of them exiting, which makes the launcher exit with 1.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from services.healthcheck import health_status

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
    "--overlap-steps": ("scheduler",),
    "--batch-invariant": ("worker",),
}
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
TAIL_LINES = 20


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
    ] + (["--served-model-name", d.served_model_name] if d.served_model_name else [])
    return commands


def dial_host(host: str) -> str:
    """An address to connect to for a server bound to `host`."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


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


class LaunchError(RuntimeError):
    """A service did not come up, or exited; `child` names it."""

    def __init__(self, child: "Child", message: str):
        tail = "\n".join(f"    {line}" for line in child.tail) or "    (no output)"
        super().__init__(f"{child.name} {message}; its last log lines:\n{tail}")


@dataclass
class Child:
    """One service process, its output pumped to a sink by a thread, the last lines kept."""

    name: str
    argv: list[str]
    address: str
    proc: subprocess.Popen | None = None
    pump: threading.Thread | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))

    def start(self, sink: TextIO, lock: threading.Lock, prefix: str) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", bufsize=1, start_new_session=True)
        self.pump = threading.Thread(target=self._pump, args=(sink, lock, prefix), daemon=True)
        self.pump.start()

    def _pump(self, sink: TextIO, lock: threading.Lock, prefix: str) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            with lock:
                sink.write(f"{prefix}{line}\n")
                sink.flush()

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)


class Launcher:
    """Starts the children in order, watches them, stops them all once."""

    def __init__(self, deployment: Deployment, log_dir: Path | None = None, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr):
        addresses = health_addresses(deployment)
        self.deployment = deployment
        self.children = [Child(name, argv, addresses[name]) for name, argv in service_commands(deployment).items()]
        self.log_dir, self.out, self.err = log_dir, out, err
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self._log_files: list[TextIO] = []

    def run(self, startup_timeout: float, stop_timeout: float) -> int:
        """Until Ctrl-C/SIGTERM (exit 0) or a failure (exit 1); every child is stopped on return."""
        try:
            self._start_all(time.monotonic() + startup_timeout)
            if not self.stopping.is_set():
                self._print_ready()
                self._watch()
            return 0
        except LaunchError as exc:
            self._say(f"error: {exc}")
            return 1
        finally:
            self.stop(stop_timeout)

    def request_stop(self, signum=None, frame=None) -> None:
        self.stopping.set()

    def _start_all(self, deadline: float) -> None:
        workers = [c for c in self.children if c.name.startswith("worker-")]
        for group in ([self.children[0]], workers, [self.children[-1]]):
            if self.stopping.is_set():  # Ctrl-C while an earlier group was starting
                return
            for child in group:
                child.start(*self._sink(child))
                self._say(f"started {child.name} (pid {child.proc.pid}): {' '.join(child.argv)}")
            self._wait_serving(group, deadline)

    def _sink(self, child: Child) -> tuple[TextIO, threading.Lock, str]:
        if self.log_dir is None:
            return self.err, self.lock, f"{child.name:<10}| "
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{child.name}.log", "a", encoding="utf-8")
        self._log_files.append(log)
        return log, threading.Lock(), ""

    def _wait_serving(self, group: list[Child], deadline: float) -> None:
        pending = list(group)
        while pending and not self.stopping.is_set():
            for child in list(pending):
                if child.exit_code() is not None:
                    raise LaunchError(child, f"exited with code {child.exit_code()} before it was serving")
                if health_status(child.address, timeout=1.0) == "SERVING":
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                status = health_status(pending[0].address, timeout=1.0)
                raise LaunchError(pending[0], f"was not SERVING at {pending[0].address} in time (last: {status})")
            self.stopping.wait(0.2 if pending else 0)

    def _watch(self) -> None:
        while not self.stopping.wait(0.2):
            for child in self.children:
                if child.exit_code() is not None:
                    raise LaunchError(child, f"exited with code {child.exit_code()}")

    def _print_ready(self) -> None:
        d, pids = self.deployment, {c.name: c.proc.pid for c in self.children}
        public = dial_host(d.host)
        lines = [f"ready: pagedserve serving {d.model} with {d.num_workers} worker(s)",
                 f"  gRPC API   {public}:{d.grpc_port}",
                 f"  HTTP API   http://{public}:{d.http_port}/v1",
                 f"  frontend   pid {pids['frontend']}"]
        lines += [f"  {c.name:<10} {c.address} pid {pids[c.name]} (internal)" for c in self.children[:-1]]
        lines.append(f"  logs       {self.log_dir if self.log_dir else 'below, prefixed by service'}")
        lines.append("Press Ctrl-C to stop.")
        print("\n".join(lines), file=self.out, flush=True)

    def stop(self, timeout: float) -> None:
        """SIGTERM every child (frontend first), wait up to `timeout` in all, SIGKILL the rest."""
        running = [c for c in reversed(self.children) if c.exit_code() is None and c.proc]
        if running:
            self._say(f"stopping {', '.join(c.name for c in running)}")
        for child in running:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in running:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"{child.name} did not stop in {timeout:g}s: killing it")
                child.signal(signal.SIGKILL)
                child.proc.wait()
        for child in self.children:
            if child.pump:
                child.pump.join(timeout=2.0)  # its last lines, before the log files close
        for log in self._log_files:
            log.close()
        self._log_files.clear()

    def _say(self, message: str) -> None:
        with self.lock:
            print(f"launcher  | {message}", file=self.err, flush=True)
