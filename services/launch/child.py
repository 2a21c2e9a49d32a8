"""One service process of the launcher: started, its output pumped to a sink, asked whether it serves.

"Serving" means its grpc.health.v1 answers SERVING *and* the process itself listens on its
ports: another deployment's server on the same port can answer the health check, but it is not
this child (a child that failed to bind exits, and meanwhile it is not listening).
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

import psutil

from services.launch.healthcheck import health_status
from services.launch.orphan import LAUNCHER_PID_ENV

TAIL_LINES = 20


class LaunchError(RuntimeError):
    """A service did not come up, or exited for good; `child` names it."""

    def __init__(self, child: "Child", reason: str):
        self.child, self.reason = child, f"{child.name} {reason}"
        tail = "\n".join(f"    {line}" for line in child.tail) or "    (no output)"
        super().__init__(f"{self.reason}; its last log lines:\n{tail}")


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (empty when it is gone)."""
    try:
        connections = psutil.Process(pid).net_connections(kind="inet")
    except psutil.Error:
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


@dataclass(kw_only=True)
class Child:
    name: str
    argv: list[str]
    address: str  # its health check's HOST:PORT
    ports: tuple[int, ...]  # what it listens on once it serves
    proc: subprocess.Popen | None = None
    pump: threading.Thread | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    started_at: float = 0.0
    ready: bool = False  # seen serving since its last start
    ready_by: float = 0.0  # a restarted child not serving by then is killed (and restarted)
    restarts: int = 0  # in a row: reset once it ran RestartPolicy.reset_after_s
    restart_at: float | None = None  # exited, to be started again at this time

    def start(self, sink: TextIO, lock: threading.Lock, prefix: str, ready_by: float) -> None:
        self.join_pump()  # the last run's output is all written first
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", bufsize=1, start_new_session=True,
                                     env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())})  # see orphan.py
        self.started_at, self.ready, self.ready_by = time.monotonic(), False, ready_by
        self.pump = threading.Thread(target=self._pump, args=(self.proc, sink, lock, prefix), daemon=True)
        self.pump.start()

    def _pump(self, proc: subprocess.Popen, sink: TextIO, lock: threading.Lock, prefix: str) -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            with lock:
                sink.write(f"{prefix}{line}\n")
                sink.flush()

    def join_pump(self, timeout: float = 2.0) -> None:
        if self.pump is not None:
            self.pump.join(timeout)

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def serving(self) -> bool:
        if self.exit_code() is not None or health_status(self.address, timeout=1.0) != "SERVING":
            return False
        return set(self.ports) <= listening_ports(self.proc.pid)

    def describe_health(self) -> str:
        status = health_status(self.address, timeout=1.0)
        missing = sorted(set(self.ports) - listening_ports(self.proc.pid)) if self.proc else list(self.ports)
        if status == "SERVING" and missing:
            return f"SERVING, but from another process: pid {self.proc.pid} does not listen on {missing}"
        return status

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_until(self, deadline: float) -> bool:
        """Whether it exited by `deadline`."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True
