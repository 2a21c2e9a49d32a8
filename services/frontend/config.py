"""The frontend's settings, validated when built (once, in main)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.core.config import LogConfig, model_cache_dir_setting, setting, tokenizer_setting
from services.core.errors import check
from services.core.lora import lora_modules_setting, parse_lora_modules
from services.core.structured import GrammarLimits
from services.frontend import reasoning
from services.frontend.response_store import ResponseStoreLimits


@dataclass(frozen=True, kw_only=True)
class FrontendConfig:
    model: str = setting("default", "the workers' --model (its tokenizer and chat template): a folder, a GGUF file, "
                                    "'default' or a hub id")
    model_cache_dir: str = model_cache_dir_setting()
    tokenizer: str = tokenizer_setting()
    served_model_name: str = setting("", "the model's id for clients (default: the --model value)")
    lora_modules: str = lora_modules_setting()
    lora_dir: str = setting("", "the folder POST /v1/load_lora_adapter may load adapters from (their paths must lie "
                                "under it); empty: none, unless --allow-any-lora-path")
    allow_any_lora_path: bool = setting(False, "let POST /v1/load_lora_adapter load an adapter from any path the "
                                               "workers can read (behind --api-key)")
    scheduler_address: str = setting("127.0.0.1:50052", "the scheduler's HOST:PORT; several, comma-separated: "
                                                        "one is active, the next takes over when it is lost")
    scheduler_failover_timeout_s: float = setting(
        30.0, "seconds the open requests wait for a scheduler after theirs was lost (it restarts, or another "
              "address takes over) before they fail with UNAVAILABLE; they are then carried over with the "
              "same tokens", flag="--scheduler-failover-timeout")
    host: str = setting("0.0.0.0", "address to listen on")
    grpc_port: int = setting(50051, "public gRPC port (0: any free port)")
    http_port: int = setting(0, "the OpenAI HTTP API, /health and /metrics port (0: off)")
    api_key: str = setting("", "HTTP clients must send 'Authorization: Bearer KEY' (empty: no key)", repr=False)
    max_body_bytes: int = setting(2 * 1024 * 1024, "larger HTTP request bodies get 413 before they are parsed")
    max_message_bytes: int = setting(4 * 1024 * 1024, "larger gRPC request messages get RESOURCE_EXHAUSTED")
    max_pending: int = setting(0, "requests in flight at this frontend before RESOURCE_EXHAUSTED (0: no limit)")
    reflection: bool = setting(True, "serve gRPC reflection of the public API (grpcurl, Postman)")
    health_poll_s: float = setting(1.0, "how often to ask the scheduler whether a worker is ready")
    drain_timeout_s: float = setting(60.0, "on SIGTERM, seconds the open requests get to finish before the "
                                           "process exits")
    reasoning_parser: str = setting(
        "", "read reasoning models' thinking apart from the answer (reasoning_content, reasoning items, thinking "
            "blocks): qwen3, deepseek_r1, gpt_oss, auto (by the chat template's markers), or empty for none")
    chat_template: str = setting("", "a chat template (a file, or the Jinja text itself) to use instead of the "
                                     "model's own (empty: the model's)")
    trust_request_chat_template: bool = setting(
        False, "take a request's own chat_template (a Jinja template runs on this server: off, such a request "
               "is a 400)")
    default_chat_template_kwargs: str = setting(
        "", "a JSON object of variables every chat template gets unless a request's chat_template_kwargs "
            "sets them, e.g. '{\"enable_thinking\": false}'")
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # structured outputs
    responses: ResponseStoreLimits = field(default_factory=ResponseStoreLimits)  # the Responses API's store

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model

    def __post_init__(self) -> None:
        check(bool(self.model), "model", "must not be empty")
        check(self.model_id not in parse_lora_modules(self.lora_modules), "lora_modules",
              f"an adapter may not be named as the base model {self.model_id!r}")
        for address in self.scheduler_address.split(","):
            check(":" in address, "scheduler_address", f"must be HOST:PORT[,HOST:PORT...], got {self.scheduler_address!r}")
        check(self.scheduler_failover_timeout_s >= 0, "scheduler_failover_timeout_s",
              f"must be >= 0, got {self.scheduler_failover_timeout_s}")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            check(0 <= port < 65536, name, f"must be in [0, 65535], got {port}")
        check(self.max_body_bytes > 0, "max_body_bytes", f"must be > 0, got {self.max_body_bytes}")
        check(self.max_message_bytes > 0, "max_message_bytes", f"must be > 0, got {self.max_message_bytes}")
        check(self.max_pending >= 0, "max_pending", f"must be >= 0, got {self.max_pending}")
        check(self.health_poll_s > 0, "health_poll_s", f"must be > 0, got {self.health_poll_s}")
        reasoning.choose(self.reasoning_parser, "")  # a known name
        self.template_kwargs()
        check(not self.chat_template or self.template_source(), "chat_template", "is an empty file")
        check(self.drain_timeout_s >= 0, "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")


    def template_kwargs(self) -> dict:
        if not self.default_chat_template_kwargs:
            return {}
        try:
            kwargs = json.loads(self.default_chat_template_kwargs)
        except ValueError:
            kwargs = None
        check(isinstance(kwargs, dict), "default_chat_template_kwargs", "must be a JSON object")
        return kwargs

    def template_source(self) -> str:
        """--chat-template's Jinja: the file's text when it names a file, else the value itself."""
        path = Path(self.chat_template)
        if "{" not in self.chat_template and path.is_file():
            return path.read_text(encoding="utf-8")
        check("{" in self.chat_template or not self.chat_template, "chat_template",
              f"is neither a file nor a Jinja template: {self.chat_template!r}")
        return self.chat_template


CLI_CONFIGS = (FrontendConfig, LogConfig)  # python -m services.frontend's flags (services/cli.py)
