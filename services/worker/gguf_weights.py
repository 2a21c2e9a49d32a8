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


MXFP4_BYTES, Q8_0_BYTES = 17, 34  # ggml's blocks of 32: an E8M0 byte + 16 of E2M1 pairs; a float16 + 32 int8
MXFP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # E2M1 x 2


def mxfp4_fits_q8_0(rows: np.ndarray) -> bool:
    """Whether `mxfp4_as_q8_0` holds every value of these MXFP4 rows: each block with a non-zero value has a
    scale float16 holds (2 ** (e - 128) within [2 ** -24, 2 ** 15])."""
    blocks = np.asarray(rows).reshape(-1, MXFP4_BYTES)
    nonzero = (blocks[:, 1:] & 0x77).any(axis=1)  # a nibble other than +-0
    exponent = blocks[:, 0].astype(np.int32) - 128
    return bool(((exponent >= -24) & (exponent <= 15) | ~nonzero).all())


def mxfp4_as_q8_0(rows: np.ndarray) -> np.ndarray:
    """ggml's MXFP4 rows [..., blocks * 17] as Q8_0 rows [..., blocks * 34] of the same values, exactly (where
    `mxfp4_fits_q8_0`): a block's values are E2M1 values x 2 ** (e - 127), that is the int8 MXFP4_DOUBLED[nibble]
    x 2 ** (e - 128), a power of two float16 holds. So the quantized kernels multiply gpt-oss's experts as
    they are, in 34 bytes a block (MXFP4's 17, bfloat16's 64; kernels/quant.py has no MXFP4 format)."""
    rows = np.asarray(rows)
    blocks = rows.reshape(-1, MXFP4_BYTES)
    qs = blocks[:, 1:]
    values = MXFP4_DOUBLED[np.concatenate([qs & 0x0F, qs >> 4], axis=1)]  # element j: byte j's low nibble, j + 16: high
    scale = np.ldexp(np.float32(1.0), blocks[:, 0].astype(np.int32) - 128).astype(np.float16)
    scale[~values.any(axis=1)] = 0  # an all-zero block: any scale holds it
    out = np.empty((blocks.shape[0], Q8_0_BYTES), np.uint8)
    out[:, :2] = scale.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = values.view(np.uint8)
    return out.reshape(*rows.shape[:-1], rows.shape[-1] // MXFP4_BYTES * Q8_0_BYTES)


def dequantize_mxfp4(rows: np.ndarray) -> np.ndarray:
    """ggml's MXFP4 rows (blocks of 32: an E8M0 exponent byte, then 16 bytes of E2M1 pairs) as float32, by
    the `gguf` package. Exact: each value is an E2M1 value (a 2-bit mantissa) times a power of two, which
    float32 holds (and bfloat16: 8 exponent bits, 7 mantissa bits). gpt-oss's checkpoints and llama.cpp's
    converter hold the same values (checkpoint_names.dequantize_mxfp4 reads the former)."""
    from gguf import GGMLQuantizationType, dequantize

    return np.ascontiguousarray(dequantize(rows, GGMLQuantizationType.MXFP4), dtype=np.float32)


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
    the architectures ARCHITECTURES says), the data a view of the mapped file where it can be; MXFP4
    experts (gpt-oss) as Q8_0 rows of the same values (`mxfp4_as_q8_0`) where every MXFP4 block of the
    file fits, else as F32 rows (`dequantize_mxfp4`), one expert at a time."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch, spec = architecture({"general.architecture": field.contents() if field else "llama"}, Path(path))
    as_q8_0 = None  # MXFP4 tensors as Q8_0 (decided at the first one), else dequantized to F32
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:  # rope_freqs: read into the config
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
        data = tensor.data
        type_name, type_id = tensor.tensor_type.name, int(tensor.tensor_type.value)
        inner = name.split(".", 3)[-1] if name.startswith("model.layers.") else None
        if len(shape) == 3 or ".mlp.experts." in name:  # a mixture's experts stacked [experts, rows, cols]
            for expert in range(shape[0]):  # (gpt-oss's biases [experts, rows]): each under its own name
                if type_name == "MXFP4":  # gpt-oss's experts: the same values in a served form
                    q8 = as_q8_0 if as_q8_0 is not None else all(mxfp4_fits_q8_0(t.data) for t in reader.tensors
                                                                 if t.tensor_type.name == "MXFP4")
                    as_q8_0 = q8  # one form for the whole file: a layer's gate and up stack as one weight
                    kind = GGMLQuantizationType.Q8_0 if q8 else GGMLQuantizationType.F32
                    rows = mxfp4_as_q8_0(data[expert]) if q8 else dequantize_mxfp4(data[expert])
                    yield GgufTensor(hf_name=name.replace(".mlp.experts.", f".mlp.experts.{expert}."),
                                     type_name=kind.name, type_id=int(kind), shape=shape[1:], data=rows)
                    continue
                yield GgufTensor(hf_name=name.replace(".mlp.experts.", f".mlp.experts.{expert}."),
                                 type_name=type_name, type_id=type_id, shape=shape[1:], data=data[expert])
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
