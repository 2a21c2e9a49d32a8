"""A service that `pagedserve up` started stops when the launcher is gone.

The launcher starts each service in a session of its own, so that a Ctrl-C in the terminal
reaches the launcher alone and it stops the services in order (frontend, scheduler, workers).
The price: a launcher killed outright (SIGKILL, the OOM killer) left its services running,
holding their ports, and the next `up` could not bind them. So the launcher names its pid in
the children's environment (LAUNCHER_PID_ENV), and each service watches its parent: once it
is no longer the launcher (the service was reparented), the service SIGTERMs itself and takes
its usual graceful stop. A service started by hand or by docker compose has no such variable
and is left alone.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil
import structlog

LAUNCHER_PID_ENV = "PAGEDSERVE_LAUNCHER_PID"
POLL_S = 0.5

log = structlog.get_logger("launch")


def stop_with_launcher(launcher_pid: str | None) -> None:
    """From a service's main: SIGTERM this process once the launcher `launcher_pid` (its value of
    LAUNCHER_PID_ENV; None or empty: not started by the launcher) is no longer its parent."""
    if not launcher_pid:
        return
    pid = int(launcher_pid)
    if os.getppid() != pid and psutil.pid_exists(pid):
        log.warning("launcher_not_parent", launcher_pid=pid, parent_pid=os.getppid())  # not ours to watch
        return
    threading.Thread(target=_watch, args=(pid,), name="launcher-watch", daemon=True).start()


def _watch(pid: int) -> None:
    while os.getppid() == pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    with contextlib.suppress(OSError):  # the launcher read our output: the pipe is likely broken now
        log.warning("launcher_gone", launcher_pid=pid, action="stopping")
