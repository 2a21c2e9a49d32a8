"""The launcher's processes: start the services in order, keep them running, stop them in order.

Start: the scheduler, then the workers, then the frontend, each waited for until its
grpc.health.v1 says SERVING and the process itself listens on its ports (a health answer from
another deployment on the same port does not count).

Running: a service that exits is logged (one JSON line: service, pid, exit code, how long it
ran) and started again after a backoff that doubles from 0.5 s up to 30 s and starts over
once the service has run 60 s. A worker is restarted without limit: while it is away the
scheduler recomputes its sequences on the other workers, and the new process registers
itself. The scheduler and the frontend are restarted at most 3 times in a row (the frontends
carry their open requests over to a restarted scheduler; a restarted frontend has lost its open
streams); one more exit stops
the deployment and `up` exits with 1. So does a service exiting with status 2 (its flags are
wrong, or the scheduler refused the worker): a restart cannot help.

Stop (Ctrl-C or SIGTERM), within the grace period in all: the frontend first (it turns
NOT_SERVING, refuses new requests and lets the open streams finish for its drain timeout,
FRONTEND_DRAIN_SHARE of the grace period), then the scheduler, then the workers. A group still
running at its share of the deadline gets SIGKILL. Exit status 0.
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from services.launch.child import Child, LaunchError
from services.launch.deployment import Deployment, dial_host, health_addresses, listen_ports, service_commands

CORE_SERVICES = ("scheduler", "frontend")
FINAL_EXIT_CODE = 2  # a service's "restarting cannot help" (bad flags, refused by the scheduler)
FRONTEND_DRAIN_SHARE = 2 / 3  # of the grace period, for the open streams
STOP_SHARES = {"frontend": 5 / 6, "scheduler": 11 / 12, "workers": 1.0}  # each group's deadline
TICK_S = 0.2


class StopFlag:
    """The launcher's stop request, set from a signal handler. A threading.Event is not safe there: the
    handler runs in the main thread between two of its bytecodes, and where those were inside the Event's
    own wait (its lock held), set() waited on that lock forever and `up` never stopped (a CI run's SIGTERM
    hung it). Here set() takes no lock: a flag and a byte into a pipe, which wait()'s select wakes on."""

    def __init__(self) -> None:
        self._set = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._write, b"x")
        except BlockingIOError:  # the pipe is full: wait() is awake already
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Whether it is set, once it is or after `timeout` seconds."""
        if not self._set:
            select.select([self._read], [], [], timeout)
        return self._set


def frontend_drain_timeout(stop_timeout: float) -> float:
    return round(stop_timeout * FRONTEND_DRAIN_SHARE, 1)


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0  # a service that ran this long starts its backoff over
    max_core_restarts: int = 3  # the scheduler's and the frontend's, in a row

    def backoff(self, num_restarts: int) -> float:
        return min(self.initial_backoff_s * 2 ** num_restarts, self.max_backoff_s)


class Launcher:
    """Starts the children in order, restarts the ones that exit, stops them all once."""

    def __init__(self, deployment: Deployment, log_dir: Path | None = None, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr, policy: RestartPolicy = RestartPolicy()):
        addresses, ports = health_addresses(deployment), listen_ports(deployment)
        self.deployment, self.policy = deployment, policy
        self.children = [Child(name=name, argv=argv, address=addresses[name], ports=ports[name])
                         for name, argv in service_commands(deployment).items()]
        self.log_dir, self.out, self.err = log_dir, out, err
        self.stopping = StopFlag()  # set by request_stop, a signal handler
        self.lock = threading.Lock()
        self._sinks: dict[str, TextIO] = {}
        self.startup_timeout = 600.0

    def run(self, startup_timeout: float, stop_timeout: float) -> int:
        """Until Ctrl-C/SIGTERM (exit 0) or a failure (exit 1); every child is stopped on return."""
        self.startup_timeout = startup_timeout
        try:
            self._start_all(time.monotonic() + startup_timeout)
            if not self.stopping.is_set():
                self._print_ready()
                self._supervise()
            return 0
        except LaunchError as exc:
            self.event("deployment_failed", level="error", service_name=exc.child.name, reason=exc.reason,
                       last_lines=list(exc.child.tail))
            return 1
        finally:
            self.stop(stop_timeout)

    def request_stop(self, signum=None, frame=None) -> None:
        self.stopping.set()

    # ---- start ----------------------------------------------------------------------------
    def _start_all(self, deadline: float) -> None:
        workers = [c for c in self.children if c.name.startswith("worker-")]
        for group in ([self.children[0]], workers, [self.children[-1]]):
            if self.stopping.is_set():  # Ctrl-C while an earlier group was starting
                return
            for child in group:
                self._start(child)
            self._wait_serving(group, deadline)

    def _start(self, child: Child) -> None:
        child.start(*self._sink(child), ready_by=time.monotonic() + self.startup_timeout)
        self.event("service_started", service_name=child.name, pid=child.proc.pid, argv=child.argv)

    def _sink(self, child: Child) -> tuple[TextIO, threading.Lock, str]:
        if self.log_dir is None:
            return self.err, self.lock, f"{child.name:<10}| "
        if child.name not in self._sinks:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._sinks[child.name] = open(self.log_dir / f"{child.name}.log", "a", encoding="utf-8")
        return self._sinks[child.name], threading.Lock(), ""

    def _wait_serving(self, group: list[Child], deadline: float) -> None:
        pending = list(group)
        while pending and not self.stopping.is_set():
            for child in list(pending):
                if child.exit_code() is not None:
                    raise LaunchError(child, f"exited with code {child.exit_code()} before it was serving")
                if child.serving():
                    child.ready = True
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                raise LaunchError(pending[0], f"was not SERVING at {pending[0].address} in time "
                                              f"(last: {pending[0].describe_health()})")
            self.stopping.wait(TICK_S if pending else 0)

    # ---- keep running ---------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self.stopping.wait(TICK_S):
            for child in self.children:
                if not self.stopping.is_set():
                    self._check(child, time.monotonic())

    def _check(self, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.restart_at = None
                self._start(child)
            return
        code = child.exit_code()
        if code is not None:
            self._exited(child, code, now)
        elif not child.ready and child.serving():
            child.ready = True
            self.event("service_ready", service_name=child.name, pid=child.proc.pid, restarts=child.restarts)
        elif not child.ready and now > child.ready_by:
            self.event("service_not_ready", level="warning", service_name=child.name, pid=child.proc.pid,
                       health=child.describe_health())
            child.signal(signal.SIGKILL)  # the next tick sees it exit and restarts it

    def _exited(self, child: Child, code: int, now: float) -> None:
        ran_s = now - child.started_at
        if ran_s >= self.policy.reset_after_s:
            child.restarts = 0
        if code == FINAL_EXIT_CODE:
            raise LaunchError(child, f"exited with code {code} (a setting it refuses; not restarted)")
        if child.name in CORE_SERVICES and child.restarts >= self.policy.max_core_restarts:
            raise LaunchError(child, f"exited with code {code} after {child.restarts} restarts in a row; giving up")
        delay = self.policy.backoff(child.restarts)
        child.restarts += 1
        child.restart_at = now + delay
        self.event("service_exited", level="warning", service_name=child.name, pid=child.proc.pid,
                   exit_code=code, ran_s=round(ran_s, 1), restart_in_s=delay, restarts=child.restarts)

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

    # ---- stop -----------------------------------------------------------------------------
    def stop(self, timeout: float) -> None:
        """SIGTERM the frontend, then the scheduler, then the workers, each group waited for until
        its share of `timeout`; SIGKILL what is left of a group at its deadline."""
        start = time.monotonic()
        groups = {"frontend": [self.children[-1]], "scheduler": [self.children[0]],
                  "workers": self.children[1:-1]}
        for group, children in groups.items():
            running = [c for c in children if c.exit_code() is None and c.proc]
            if running:
                self.event("stopping", services=[c.name for c in running])
            for child in running:
                child.signal(signal.SIGTERM)
            for child in running:
                if not child.wait_until(start + timeout * STOP_SHARES[group]):
                    self.event("stop_timeout", level="warning", service_name=child.name, pid=child.proc.pid,
                               grace_s=timeout)
                    child.signal(signal.SIGKILL)
                    child.proc.wait()
        for child in self.children:
            child.join_pump()  # its last lines, before the log files close
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()

    def event(self, event: str, level: str = "info", **fields) -> None:
        """One JSON line on stderr, shaped like the services' own (services.launch.logs)."""
        record = {"service": "launcher", "event": event, "level": level,
                  "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"), **fields}
        prefix = "launcher  | " if self.log_dir is None else ""
        with self.lock:
            print(prefix + json.dumps(record), file=self.err, flush=True)
