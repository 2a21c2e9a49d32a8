"""The worker service's configuration: where it listens and whom it registers with (the model and
its kernels: WorkerConfig; its KV cache: CacheConfig, both in services/core/config.py)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from services.core.config import CacheConfig, LogConfig, WorkerConfig, setting
from services.core.errors import check


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class WorkerServiceConfig:
    scheduler_address: str = setting("127.0.0.1:50052", "HOST:PORT of the scheduler")
    worker_id: str = setting(help="unique worker name (default: HOSTNAME-PID)", default_factory=_default_worker_id)
    host: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(0, "port to listen on (0: pick a free one)")
    advertise_host: str = setting(
        "127.0.0.1", "host the scheduler dials to reach this worker (compose: the container's name)")
    reflection: bool = setting(False, "serve gRPC reflection")

    def __post_init__(self) -> None:
        check(":" in self.scheduler_address, "scheduler_address",
              f"must be HOST:PORT, got {self.scheduler_address!r}")
        check(bool(self.worker_id), "worker_id", "must not be empty")
        check(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")


# python -m services.worker's flags (services/cli.py)
CLI_CONFIGS = (WorkerConfig, CacheConfig, WorkerServiceConfig, LogConfig)
