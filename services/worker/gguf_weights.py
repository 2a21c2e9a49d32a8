"""A GGUF file's tensors under Hugging Face names, read with the `gguf` package.

One place for what both the default model's conversion (services/tools/default_model.py,
which dequantizes) and the worker (services/worker/loader.py: `--quantization gguf` keeps the
blocks, `none` dequantizes them) need: the tensors under HF names (services/worker/gguf_arch.py,
per architecture), llama.cpp's q/k row permutation undone where it permuted, what it stores fused
(Phi-3's attn_qkv and ffn_up) or stacked (a mixture's experts) as the per-projection, per-expert tensors
of a Hugging Face checkpoint (whole rows, so blocks are kept as they are), and which file is the model's GGUF.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from services.core.errors import InvalidArgument
from services.worker.checkpoint_names import FUSED
from services.worker.gguf_arch import GLOBAL_NAMES, LAYER_NAMES, architecture, encoder_hf_name, hf_name  # noqa: F401

# what an encoder's tensors may be: read as float32 (an encoder is served dense, models/bert.py)
ENCODER_TYPES = ("F32", "F16", "BF16", "Q8_0")


@dataclass(frozen=True, kw_only=True)
class GgufTensor:
    hf_name: str
    type_name: str  # ggml's: F32, F16, Q4_0, Q4_1, Q8_0, ...
    type_id: int
    shape: tuple[int, ...]  # HF order: [out_features, in_features]
    data: np.ndarray  # as the file has it: float rows, or uint8 rows of blocks [out_features, row_bytes]


def unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate_half halves).

    llama.cpp: w.reshape(H, 2, D/2, C).swapaxes(1, 2); the inverse swaps the same axes back. It
    moves whole rows, so it applies as well to rows of quantized blocks (bytes kept)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def find_gguf_file(model: Path) -> Path | None:
    """The model's GGUF file: the model itself when it is one, else the folder's one *.gguf file (a link to
    it counts), or None. A folder of several is refused, naming them: --model FOLDER/FILE.gguf picks one."""
    model = Path(model)
    if model.is_file():
        return model if model.suffix.lower() == ".gguf" else None
    files = sorted(p for p in model.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        raise InvalidArgument("model", f"{model} holds several GGUF files ({', '.join(p.name for p in files)}): "
                                       f"name one, --model {model / files[0].name}")
    return files[0] if files else None


def gguf_arch_of(path: Path):
    """The file's row of services/worker/gguf_arch.py ARCHITECTURES."""
    from services.core.gguf_file import read_metadata

    return architecture(read_metadata(path), Path(path))[1]


def read_tensors(path: Path, num_heads: int, num_kv_heads: int) -> Iterator[GgufTensor]:
    """Every weight tensor of the file under its HF name, q/k rows in HF order (llama.cpp permuted them for
    the architectures ARCHITECTURES says), the data a view of the mapped file where it can be."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch, spec = architecture({"general.architecture": field.contents() if field else "llama"}, Path(path))
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:  # rope_freqs: read into the config
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
        data = tensor.data
        inner = name.split(".", 3)[-1] if name.startswith("model.layers.") else None
        if len(shape) == 3:  # a mixture's experts stacked [experts, rows, cols]: each under its own name
            for expert in range(shape[0]):
                yield GgufTensor(hf_name=name.replace(".mlp.experts.", f".mlp.experts.{expert}."),
                                 type_name=tensor.tensor_type.name, type_id=int(tensor.tensor_type.value),
                                 shape=shape[1:], data=data[expert])
            continue
        if inner in FUSED:  # Phi-3's qkv and gate_up: each piece's rows (whole rows of blocks) under its name
            kv = shape[0] // (num_heads + 2 * num_kv_heads) * num_kv_heads
            rows = (shape[0] - 2 * kv, kv, kv) if len(FUSED[inner]) == 3 else (shape[0] // 2,) * 2
            start = 0
            for piece, count in zip(FUSED[inner], rows):
                yield GgufTensor(hf_name=name[:-len(inner)] + piece, type_name=tensor.tensor_type.name,
                                 type_id=int(tensor.tensor_type.value), shape=(count, *shape[1:]),
                                 data=data[start:start + count])
                start += count
            continue
        if spec.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute(data, num_heads)
        elif spec.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute(data, num_kv_heads)
        yield GgufTensor(hf_name=name, type_name=tensor.tensor_type.name, type_id=int(tensor.tensor_type.value),
                         shape=shape, data=data)


def read_encoder_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """An encoder file's tensors (services/worker/gguf_arch.py ENCODER_NAMES) under transformers' BertModel
    names, as float32 arrays in HF order (Q8_0 and F16 dequantized: an encoder is served dense). A tensor of
    another type is refused, naming it, its type and the served ones."""
    from gguf import GGUFReader, dequantize

    for tensor in GGUFReader(str(path)).tensors:
        name, kind = encoder_hf_name(tensor.name), tensor.tensor_type.name
        if kind not in ENCODER_TYPES:
            raise InvalidArgument("model", f"{Path(path).name}: tensor {tensor.name} is {kind}; an encoder's served "
                                           f"GGUF types are {', '.join(ENCODER_TYPES)}")
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
        yield name, dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
