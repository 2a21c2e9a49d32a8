"""The scheduler service's configuration, built once in `main` and validated when built."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.core.config import LogConfig, SchedulerConfig, setting
from services.core.errors import check

REGISTER_TIMEOUT_S = 10.0  # how long a worker waits for RegisterWorker's answer (services/worker/registrar.py)
MAX_PROBE_TIMEOUT_S = REGISTER_TIMEOUT_S - 2  # the probe, and the rest of the registration, fit in it


@dataclass(frozen=True, kw_only=True)
class SchedulerServiceConfig:
    """Where the scheduler listens and how it watches its workers; the policy: `scheduler`."""

    host: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(50052, "port to listen on (0: pick a free one)")
    heartbeat_timeout_s: float = setting(10.0, "drop a worker silent this long")
    step_timeout_s: float = setting(
        300.0, "drop a worker whose step takes this long (hung, not dead: it still beats; its sequences are "
               "recomputed elsewhere; raise it for big models on slow machines, where one long prefill step "
               "can take minutes)")
    worker_probe_timeout_s: float = setting(
        3.0, "before accepting a worker, try this long to reach it at the address it advertised; refuse it "
             "when that fails (services/scheduler/worker_client.py probe_worker)")
    reflection: bool = setting(False, "serve gRPC reflection")
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        check(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        check(self.heartbeat_timeout_s > 0, "heartbeat_timeout_s", f"must be > 0, got {self.heartbeat_timeout_s}")
        check(self.step_timeout_s > 0, "step_timeout_s", f"must be > 0, got {self.step_timeout_s}")
        check(0 < self.worker_probe_timeout_s <= MAX_PROBE_TIMEOUT_S, "worker_probe_timeout_s",
              f"must be in (0, {MAX_PROBE_TIMEOUT_S:g}] (a worker waits {REGISTER_TIMEOUT_S:g} s for the answer), "
              f"got {self.worker_probe_timeout_s}")

    @property
    def heartbeat_interval_s(self) -> float:
        """What workers are told: several beats fit in one timeout."""
        return self.heartbeat_timeout_s / 4


CLI_CONFIGS = (SchedulerServiceConfig, LogConfig)  # python -m services.scheduler's flags (services/cli.py)
