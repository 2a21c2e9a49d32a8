"""What names a LoRA adapter: vLLM's LoRARequest, for `LLM.generate(..., lora_request=...)`."""
from __future__ import annotations

from dataclasses import dataclass

from services.core.errors import check


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and PEFT folder (adapter_config.json + adapter_model.safetensors); lora_int_id is
    vLLM's id, kept for its callers (the name is what pagedserve keys adapters and their cached blocks by)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        check(bool(self.lora_name), "lora_name", "must not be empty")
        check(bool(self.lora_path), "lora_path", f"adapter {self.lora_name!r} needs the folder it is loaded from")
