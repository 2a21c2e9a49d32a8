"""A GGUF file's tensors under Hugging Face Llama names, read with the `gguf` package.

One place for what both the default model's conversion (services/tools/default_model.py,
which dequantizes) and the worker's `--quantization gguf` (services/worker/loader.py, which
keeps the blocks) need: the name map, llama.cpp's q/k row permutation undone, and which
file of a model folder is its GGUF.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from services.core.errors import InvalidArgument

# GGUF (llama.cpp) tensor names -> Hugging Face Llama names; {i} is the layer index.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass(frozen=True, kw_only=True)
class GgufTensor:
    hf_name: str
    type_name: str  # ggml's: F32, F16, Q4_0, Q4_1, Q8_0, ...
    type_id: int
    shape: tuple[int, ...]  # HF order: [out_features, in_features]
    data: np.ndarray  # as the file has it: float rows, or uint8 rows of blocks [out_features, row_bytes]


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    prefix, layer, rest = gguf_name.split(".", 2) if gguf_name.startswith("blk.") else ("", "", "")
    if prefix == "blk" and rest in LAYER_NAMES:
        return f"model.layers.{int(layer)}.{LAYER_NAMES[rest]}"
    raise InvalidArgument("model", f"unexpected GGUF tensor {gguf_name!r}")


def unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate_half halves).

    llama.cpp: w.reshape(H, 2, D/2, C).swapaxes(1, 2); the inverse swaps the same axes back. It
    moves whole rows, so it applies as well to rows of quantized blocks (bytes kept)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def find_gguf_file(folder: Path) -> Path | None:
    """The model folder's one *.gguf file (a link to it counts), or None."""
    files = sorted(p for p in Path(folder).glob("*.gguf") if p.is_file())
    if len(files) > 1:
        raise InvalidArgument("model", f"{folder} holds several GGUF files: {[p.name for p in files]}")
    return files[0] if files else None


def read_tensors(path: Path, num_heads: int, num_kv_heads: int) -> Iterator[GgufTensor]:
    """Every tensor of the file, q/k rows in HF order, the data a view of the mapped file where it can be."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    if reader.fields.get("general.architecture") is not None:
        arch = reader.fields["general.architecture"].contents()
        if arch != "llama":
            raise InvalidArgument("model", f"{path.name}: expected a llama GGUF, got {arch!r}")
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
        data = tensor.data
        if name.endswith("q_proj.weight"):
            data = unpermute(data, num_heads)
        elif name.endswith("k_proj.weight"):
            data = unpermute(data, num_kv_heads)
        yield GgufTensor(hf_name=name, type_name=tensor.tensor_type.name, type_id=int(tensor.tensor_type.value),
                         shape=shape, data=data)
