"""Shared by the quantized-kernel tests: each CPU tier's build of quant_gemm.c, and GGUF blocks
made by the `gguf` package's own quantizer (whose dequantizer is the oracle)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import cpu_kernels, quant

GGUF_TYPES = {"q4_0": quant.Q4_0, "q4_1": quant.Q4_1, "q8_0": quant.Q8_0}
# this file's tiers before the tier build (kernels/cpu_kernels.py) takes them over: -march per tier
_OWN_TIERS = {"avx512": ["-march=native"], "avx2": ["-march=x86-64-v3"], "generic": []}
_NEEDS = {"avx512": {"avx512f", "avx512bw"}, "avx2": {"avx2", "fma", "f16c"}, "generic": set()}


def host_tiers() -> list[str]:
    if hasattr(cpu_kernels, "testable_tiers"):
        return list(cpu_kernels.testable_tiers())
    flags = set(cpu_kernels._cpu_flags().split())
    x86 = "avx2" in flags or "sse2" in flags
    return [t for t in _OWN_TIERS if _NEEDS[t] <= flags and (x86 or t == "generic")]


def tier_library(tier: str, build_dir: Path) -> ctypes.CDLL:
    """The kernels as `tier` builds them, quant_linear declared."""
    if hasattr(cpu_kernels, "use_isa"):
        with cpu_kernels.use_isa(tier):
            return quant.declare(cpu_kernels.library())
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    target = build_dir / f"quant-{tier}.so"
    if not target.exists():
        flags = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi", *_OWN_TIERS[tier]]
        subprocess.run([compiler, *flags, "-o", str(target), str(cpu_kernels.CSRC / "quant_gemm.c")], check=True)
    return quant.declare(ctypes.CDLL(str(target)))


def gguf_blocks(weight: np.ndarray, name: str) -> tuple[np.ndarray, torch.Tensor]:
    """(blocks as gguf quantizes them, their values by gguf's dequantizer in fp32)."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[name.upper()]
    blocks = quants.quantize(weight.astype(np.float32), kind)
    return blocks, torch.from_numpy(quants.dequantize(blocks, kind).astype(np.float32))


def write_gguf(folder: Path, out: Path, linear_type: str = "q4_1", embed_type: str = "q8_0") -> Path:
    """A GGUF of the HF folder's weights as llama.cpp's converter lays them out (q/k rows permuted
    for its rotary, HF names mapped back), quantized by the gguf package: a small stand-in for a
    shipped file."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.numpy import load_file

    from services.worker.gguf_weights import GLOBAL_NAMES, LAYER_NAMES

    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    to_gguf = {hf: gguf for gguf, hf in GLOBAL_NAMES.items()}
    writer = GGUFWriter(str(out), "llama")
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
        if kind == "f32":
            writer.add_tensor(name, array)
        else:
            qtype = GGMLQuantizationType[kind.upper()]
            writer.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
