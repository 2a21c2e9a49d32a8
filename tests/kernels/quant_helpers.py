"""Shared by the quantized-kernel tests: each CPU tier's build of quant_gemm.c, GGUF blocks made by
the `gguf` package's own quantizer (whose dequantizer is the oracle), and `random_blocks`, a writer
of valid blocks of every served type (gguf quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 only)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from kernels import build, cpu_kernels, quant

GGUF_TYPES = {"q4_0": quant.Q4_0, "q4_1": quant.Q4_1, "q8_0": quant.Q8_0}
ALL_TYPES = [name for name, fmt in quant.FORMATS.items() if fmt != quant.INT8]  # every GGUF block type served
GGUF_QUANTIZES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")  # the types gguf.quants.quantize writes

# where each type's fp16 scales lie in its block: (offset, whether it is a min, kept >= 0), and the
# typical magnitude of the integer it multiplies (so that values come out near `scale`)
SCALE_FIELDS = {
    "q4_0": ([(0, False)], 4), "q4_1": ([(0, False), (2, True)], 8), "q5_0": ([(0, False)], 8),
    "q5_1": ([(0, False), (2, True)], 16), "q8_0": ([(0, False)], 64), "iq4_nl": ([(0, False)], 64),
    "q2_k": ([(80, False), (82, True)], 8 * 2), "q3_k": ([(108, False)], 16 * 2),
    "q4_k": ([(0, False), (2, True)], 32 * 8), "q5_k": ([(0, False), (2, True)], 32 * 16),
    "q6_k": ([(208, False)], 64 * 16), "iq4_xs": ([(0, False)], 16 * 64),
}


def host_tiers() -> list[str]:
    """Every tier this CPU executes (kernels/build.py builds each from the same sources)."""
    return list(build.testable_tiers())


def tier_library(tier: str) -> ctypes.CDLL:
    """The kernels as `tier` builds them, quant_linear declared."""
    return quant.declare(cpu_kernels.tier_library(tier))


def gguf_blocks(weight: np.ndarray, name: str) -> tuple[np.ndarray, torch.Tensor]:
    """(blocks as gguf quantizes them, their values by gguf's dequantizer in fp32)."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[name.upper()]
    blocks = quants.quantize(weight.astype(np.float32), kind)
    return blocks, torch.from_numpy(quants.dequantize(blocks, kind).astype(np.float32))


def random_blocks(name: str, rows: int, in_features: int, rng: np.random.Generator,
                  scale: float = 1.0) -> np.ndarray:
    """Valid rows of blocks of a GGUF type (uint8 [rows, row_bytes]): every quant, sub-block scale and
    min random (any bits are valid there), the fp16 scales finite, of random sign (mins: >= 0), so that
    values are of the order of `scale`. Not a quantizer: the tests need valid bytes of each type."""
    fmt = quant.FORMATS[name]
    data = rng.integers(0, 256, size=(rows, quant.row_bytes(fmt, in_features)), dtype=np.uint8)
    blocks = data.reshape(rows, -1, quant.BLOCK_BYTES[fmt])
    halves, magnitude = SCALE_FIELDS[name]
    for offset, is_min in halves:
        value = rng.uniform(0.25, 2.0, size=blocks.shape[:2]) * scale / magnitude
        if not is_min:
            value *= rng.choice([-1.0, 1.0], size=value.shape)
        blocks[..., offset:offset + 2] = value.astype(np.float16)[..., None].view(np.uint8)
    return data


def gguf_dequantize(blocks: np.ndarray, name: str) -> torch.Tensor:
    """gguf's dequantizer (the oracle) on rows of blocks, in fp32."""
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[name.upper()]).astype(np.float32))


def write_gguf(folder: Path, out: Path, linear_type: str = "q4_1", embed_type: str = "q8_0",
               types: dict[str, str] | None = None, seed: int = 0) -> Path:
    """A GGUF of the HF folder's weights as llama.cpp's converter lays them out (q/k rows permuted
    for its rotary, HF names mapped back), quantized by the gguf package: a small stand-in for a
    shipped file. `types` names a tensor's own type by its GGUF name (a llama.cpp mix); a type gguf
    does not quantize is written by `random_blocks` (values of the tensor's spread, not its own), or,
    where kernels/quant.py does not serve it either, as random bytes of its block size."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.numpy import load_file

    from services.worker.gguf_weights import GLOBAL_NAMES, LAYER_NAMES

    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    to_gguf = {hf: gguf for gguf, hf in GLOBAL_NAMES.items()}
    writer = GGUFWriter(str(out), "llama")
    rng = np.random.default_rng(seed)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for hf, array in sorted(tensors.items()):
        array = array.astype(np.float32)
        if hf.startswith("model.layers."):
            _, _, layer, rest = hf.split(".", 3)
            name = f"blk.{layer}." + {v: k for k, v in LAYER_NAMES.items()}[rest]
        else:
            name = to_gguf[hf]
        if hf.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in hf else kv_heads
            array = array.reshape(n, 2, array.shape[0] // n // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
        kind = embed_type if hf == "model.embed_tokens.weight" else linear_type if array.ndim == 2 else "f32"
        kind = (types or {}).get(name, kind)
        if kind == "f32":
            writer.add_tensor(name, array)
            continue
        qtype = GGMLQuantizationType[kind.upper()]
        if kind in (*GGUF_QUANTIZES, "f16", "bf16"):
            blocks = quants.quantize(array, qtype)
        elif kind in ALL_TYPES:
            blocks = random_blocks(kind, array.shape[0], array.shape[1], rng, scale=float(array.std()))
        else:
            elems, size = quants.GGML_QUANT_SIZES[qtype]
            blocks = rng.integers(0, 256, size=(array.shape[0], array.shape[1] // elems * size), dtype=np.uint8)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def fp32_linear_reference(x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """quant_gemm.c's fp32-activation product, bit for bit on the tiers with FMA: x [M, K] (fp32 or bf16)
    times the dequantized weight values [N, K] (fp32), one fused chain per output and lane (lane l of `lo`
    takes elements 32 b + l, `hi` 32 b + 16 + l, run by run), lo + hi folded by vec.h's tree, the bias
    added in one rounding, the result rounded to x's dtype."""
    from kernels.quant import fma32

    xs, w = x.float().numpy(), values.numpy()
    rows, k = xs.shape
    n = w.shape[0]
    acc = np.zeros((rows, n, 32), np.float32)  # lanes 0-15: lo, 16-31: hi
    for b in range(k // 32):
        acc = fma32(w[None, :, 32 * b:32 * b + 32], xs[:, None, 32 * b:32 * b + 32], acc)
    v = acc[..., :16] + acc[..., 16:]
    for width in (8, 4, 2, 1):
        v = v[..., :width] + v[..., width:2 * width]
    add = np.zeros(n, np.float32) if bias is None else bias.float().numpy()
    out = fma32(v[..., 0], np.ones_like(v[..., 0]), add[None, :])
    return torch.from_numpy(out).to(x.dtype)
