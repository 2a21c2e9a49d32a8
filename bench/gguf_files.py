"""The GGUF files a benchmark runs on: where a --model's file is, and what type it is.

A model argument is a GGUF file, or a folder (config.json + tokenizer + one *.gguf, or one *.gguf
alone): `gguf_path` finds the file the way the engine does. `type_label` names the file as llama.cpp
does (`general.file_type`: Q4_K_M, Q6_K, ...; a mix keeps its own name); `tensor_mix` counts each
block type among the file's tensors (a Q4_K_M file is Q4_K and Q6_K, its embedding Q6_K).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

# llama.cpp's llama_ftype (general.file_type): the name llama-quantize takes for each
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16"}


def model_path(model: str | None) -> Path:
    """The engine's own resolution of a --model argument (a folder, a GGUF file, or the default model)."""
    from services.core.model_path import resolve_model_path
    return Path(resolve_model_path(model or "default"))


def gguf_path(model: Path) -> Path:
    """The GGUF file of a resolved model (itself, or its folder's one *.gguf)."""
    from services.worker.gguf_weights import find_gguf_file
    path = find_gguf_file(model)
    if path is None:
        raise SystemExit(f"{model} is no GGUF file and holds none")
    return path


def type_label(path: Path) -> str:
    """llama.cpp's name of the file's type (general.file_type), else its most common block type."""
    from services.core.gguf_file import read_metadata
    code = read_metadata(path).get("general.file_type")
    if code in FILE_TYPES:
        return FILE_TYPES[code]
    return tensor_mix(path).most_common(1)[0][0]


def tensor_mix(path: Path) -> Counter:
    """Block type name -> number of tensors of that type (the norms' F32 left out)."""
    from gguf import GGUFReader
    return Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors
                   if not (t.tensor_type.name == "F32" and len(t.shape) == 1))


def mix_text(path: Path) -> str:
    return ", ".join(f"{name} x {count}" for name, count in tensor_mix(path).most_common())
