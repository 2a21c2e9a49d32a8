"""vLLM's run-time LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key,
as every route but /health and /metrics). The scheduler loads or unloads the adapter on every worker, each
checking it (a bad one is a 400 naming the problem); an adapter with requests running or waiting is not
unloaded (400: they finish first). A load's path must lie under --lora-dir unless --allow-any-lora-path.
Operator routes: left out of /openapi.json, which documents the generation API."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from services.core.errors import check
from services.frontend.core import FrontendCore


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what identifies an adapter here


def allowed_path(path: str, lora_dir: str, allow_any: bool) -> Path:
    """The adapter's folder, resolved (relative to --lora-dir where one is set); InvalidArgument naming
    lora_path where it lies outside --lora-dir and the operator did not allow any path."""
    check(bool(path), "lora_path", "must not be empty")
    base = Path(lora_dir).expanduser().resolve() if lora_dir else None
    resolved = ((base / path) if base is not None else Path(path)).expanduser().resolve()
    if not allow_any:
        check(base is not None, "lora_path", "loading adapters at run time needs --lora-dir (or --allow-any-lora-path)")
        check(resolved.is_relative_to(base), "lora_path", f"{path} is outside --lora-dir {lora_dir}")
    return resolved


def add_routes(app: FastAPI, core: FrontendCore) -> None:
    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, include_in_schema=False)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> str:
        check(bool(body.lora_name), "lora_name", "must not be empty")
        check(body.lora_name != core.model_id, "lora_name", f"{body.lora_name!r} is the base model's id")
        path = str(allowed_path(body.lora_path, core.lora_dir, core.allow_any_lora_path))
        await core.scheduler.lora(True, body.lora_name, path)
        core.loras[body.lora_name] = path
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, include_in_schema=False)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> str:
        core.check_model(body.lora_name)
        check(body.lora_name in core.loras, "lora_name", f"{body.lora_name!r} is the base model, not an adapter")
        await core.scheduler.lora(False, body.lora_name)
        del core.loras[body.lora_name]
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
