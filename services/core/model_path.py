"""Turning the `model` argument into a local Hugging Face folder."""
from __future__ import annotations

from pathlib import Path

from services.core.errors import InvalidArgument

DEFAULT_MODEL = "default"


def resolve_model_path(model: str | None, cache_dir: str | Path | None = None) -> Path:
    """A folder as is; "default" (or None) the converted SmolLM2-135M-Instruct, in `cache_dir`
    (the model_cache_dir setting; None: its default); else a hub id, downloaded by huggingface_hub
    where a network exists."""
    if not model or model == DEFAULT_MODEL:
        from services.tools.default_model import ensure_default_model

        return ensure_default_model(cache_dir)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidArgument("model", f"{path} has no config.json")
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as exc:  # no network, unknown repo, ...
            raise InvalidArgument("model", f"cannot download {model!r}: {exc}") from exc
    raise InvalidArgument("model", f"{model!r} is neither a folder nor a hub id")
