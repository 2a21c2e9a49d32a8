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


def parse_lora_modules(text: str) -> dict[str, str]:
    """--lora-modules "name=path name2=path2" (vLLM's name=path pairs; commas also separate them) as
    {name: path}; InvalidArgument naming the flag for a malformed or repeated pair."""
    modules: dict[str, str] = {}
    for pair in text.replace(",", " ").split():
        name, sep, path = pair.partition("=")
        check(bool(sep and name and path), "lora_modules", f"expected name=path, got {pair!r}")
        check(name not in modules, "lora_modules", f"adapter {name!r} is named twice")
        modules[name] = path
    return modules


def lora_modules_setting():
    # held by the worker (which loads them) and the frontend (which serves their names): one definition
    from services.core.config import setting

    return setting("", "LoRA adapters to serve, as name=path pairs separated by spaces (PEFT folders; needs "
                       "--enable-lora): a request names one as its model")
