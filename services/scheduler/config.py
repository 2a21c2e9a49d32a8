"""The scheduler service's configuration, built once in `main` and validated when built."""
from __future__ import annotations

from dataclasses import dataclass

from services.core.config import CacheConfig, SchedulerConfig
from services.core.errors import check

DEFAULT_MAX_MODEL_LEN = 4096  # the cap when max_model_len comes from the model


@dataclass(frozen=True)
class SchedulerServiceConfig:
    host: str = "0.0.0.0"
    port: int = 50052  # 0: pick a free port
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: from the first worker, min(model max, 4096)
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 4096
    heartbeat_timeout_s: float = 10.0  # a worker silent this long is dropped
    step_timeout_s: float = 300.0  # a step that takes longer drops its worker (hung, not dead: it still beats)
    seed: int | None = None  # seeds requests that bring none from this; None: fresh random seeds
    async_scheduling: bool = True  # plan each worker's next step while it runs this one (services/core/async_scheduling.py)
    reflection: bool = False

    def __post_init__(self) -> None:
        check(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        check(self.max_model_len == 0 or self.max_model_len >= 2, "max_model_len",
              f"must be 0 (from the model) or >= 2, got {self.max_model_len}")
        check(self.heartbeat_timeout_s > 0, "heartbeat_timeout_s", f"must be > 0, got {self.heartbeat_timeout_s}")
        check(self.step_timeout_s > 0, "step_timeout_s", f"must be > 0, got {self.step_timeout_s}")
        self.cache_config()
        self.scheduler_config(self.max_model_len or DEFAULT_MAX_MODEL_LEN)

    @property
    def heartbeat_interval_s(self) -> float:
        """What workers are told: several beats fit in one timeout."""
        return self.heartbeat_timeout_s / 4

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, enable_prefix_caching=self.enable_prefix_caching)

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        """The core config once the model's own limit is known (from the first worker)."""
        max_len = self.max_model_len or min(model_max_len, DEFAULT_MAX_MODEL_LEN)
        check(max_len <= model_max_len, "max_model_len",
              f"{max_len} exceeds the model's max_position_embeddings {model_max_len}")
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_len, self.enable_chunked_prefill,
                               self.preemption_mode, self.scheduling_policy, self.max_waiting_requests, self.seed,
                               self.async_scheduling)
