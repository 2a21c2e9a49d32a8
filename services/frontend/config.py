"""The frontend's settings, validated when built (once, in main)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.core.errors import check
from services.core.structured import GrammarLimits


@dataclass(frozen=True)
class FrontendConfig:
    model: str = "default"  # the tokenizer's folder (the workers' --model), "default" or a hub id
    served_model_name: str = ""  # the model's id for clients; empty: the --model value
    scheduler_address: str = "127.0.0.1:50052"
    host: str = "0.0.0.0"
    grpc_port: int = 50051  # 0: any free port
    http_port: int = 0  # the OpenAI HTTP API, /health and /metrics; 0: off
    api_key: str = field(default="", repr=False)  # HTTP: required as "Authorization: Bearer KEY"; empty: none
    max_body_bytes: int = 2 * 1024 * 1024  # HTTP: larger request bodies get 413 before they are parsed
    max_message_bytes: int = 4 * 1024 * 1024  # gRPC: a larger request message gets RESOURCE_EXHAUSTED
    max_pending: int = 0  # requests in flight at this frontend before RESOURCE_EXHAUSTED; 0: no limit
    reflection: bool = True  # gRPC server reflection of the public API (grpcurl, Postman)
    health_poll_s: float = 1.0  # how often to ask the scheduler whether a worker is ready
    drain_timeout_s: float = 60.0  # on SIGTERM, how long running requests may take to finish
    grammar: GrammarLimits = GrammarLimits()  # structured outputs: compile limits and cache size

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model

    def __post_init__(self) -> None:
        check(bool(self.model), "model", "must not be empty")
        check(":" in self.scheduler_address, "scheduler_address", f"must be HOST:PORT, got {self.scheduler_address!r}")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            check(0 <= port < 65536, name, f"must be in [0, 65535], got {port}")
        check(self.max_body_bytes > 0, "max_body_bytes", f"must be > 0, got {self.max_body_bytes}")
        check(self.max_message_bytes > 0, "max_message_bytes", f"must be > 0, got {self.max_message_bytes}")
        check(self.max_pending >= 0, "max_pending", f"must be >= 0, got {self.max_pending}")
        check(self.health_poll_s > 0, "health_poll_s", f"must be > 0, got {self.health_poll_s}")
        check(self.drain_timeout_s >= 0, "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
