"""Kernels compiled for the CPU (kernels/csrc/*.c), called through ctypes: paged attention,
the row-wise ops (RMSNorm with the residual add, rotary, SiLU-and-mul, KV write) and the
linear layers' GEMM on a packed weight (gemm.c; kernels/linear.py decides when it runs).

The PyTorch references are the oracles and the fallbacks; these are the CPU's fast path, as
the Triton kernels are the GPU's, with the same signatures. Attention reads K and V in place
through the block table (the reference gathers 128-key tiles and runs a few small products
per tile); each row-wise op is one call instead of 4-10 small torch ops, with the
reference's bf16 rounding points (bf16 results differ from the reference's in about 1
element in 10^5, by one bf16 step, where a sum or an exp rounds the other way). Every
token's result is computed on its own, in one fixed order, so its bits do not depend on the
batch.

The library is built on first use with the system C compiler (`cc -O3 -march=native
-fopenmp`: it runs on the machine that built it) into ~/.cache/pagedserve-kernels, keyed by
a hash of the sources, the flags, the compiler and the CPU; its OpenMP calls land in the
libgomp that torch has already loaded, so it shares torch's threads.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref, token_layout
from kernels.cache import write_kv_ref
from kernels.norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_attention.c", "elementwise.c", "gemm.c", "decoder.c", "quant_gemm.c")]  # one library
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
PANEL = 48  # output features per packed weight panel, as in gemm.c
LANES, MAX_HEADS, MAX_CHUNKS = 16, 256, 16  # as in the C source: head_dim % 16 == 0, <= 256; heads <= 256
OUT_OF_MEMORY = 1  # paged_attention's status codes, as in the C source (0: done, 2: shape not supported)


class KernelUnavailable(RuntimeError):
    """No C compiler, or the build failed: the caller falls back to the PyTorch reference."""


def paged_attention_cpu(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], fp32 or bf16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    scale: float,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [T, H, D] in q's dtype; same contract as kernels.attention.paged_attention_ref
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not _supported(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim):  # a fixed choice per model
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout)
    token_seq, token_pos = layout if layout is not None else token_layout(seq_lens, query_start_loc)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    if num_tokens == 0:
        return out
    q = _heads(q)  # the kernel scales q in fp32 and writes out in q's dtype, as q.float() * scale and .to() would
    tables = block_tables.to(torch.int64).contiguous()
    token_seq, token_pos = token_seq.to(torch.int64).contiguous(), token_pos.to(torch.int64).contiguous()
    status = library().paged_attention(
        q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16), scale, k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.dtype == torch.bfloat16), tables.data_ptr(), tables.shape[1], token_seq.data_ptr(),
        token_pos.data_ptr(), out.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim, block_size,
        torch.get_num_threads())
    if status == OUT_OF_MEMORY:
        raise MemoryError("paged_attention_cpu: out of memory for the score buffers")
    if status != 0:  # _supported() let through a shape the kernel refuses
        raise ValueError(f"paged_attention_cpu: shape not supported (status {status})")
    return out


def _supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> bool:
    group = num_heads // num_kv_heads
    return (is_available() and k_cache.dtype in (torch.float32, torch.bfloat16) and v_cache.dtype == k_cache.dtype
            and q.dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu"
            and k_cache.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
            and head_dim % LANES == 0 and head_dim // LANES <= MAX_CHUNKS
            and num_heads <= MAX_HEADS and group * num_kv_heads == num_heads)


# ---- row-wise ops ------------------------------------------------------------------------
_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _kind(*tensors: torch.Tensor) -> int | None:
    """1 for bf16, 0 for fp32 (all the same dtype, on the CPU), None: take the reference.
    (Called ~150 times a step: plain loops and is_cpu, ~1 us cheaper than any() and .device.type.)"""
    dtype = tensors[0].dtype
    kind = _KINDS.get(dtype)
    if kind is None or not is_available():
        return None
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return None
    return kind


def _rows(x: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """x as rows of `width` contiguous elements: (tensor, row stride), copying only when needed."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x, x.stride(0)
    x = x.reshape(-1, width)
    return (x, x.stride(0)) if x.stride(1) == 1 else (x.contiguous(), width)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    kind = _kind(x, weight, *([residual] if residual is not None else []))
    if kind is None or not weight.is_contiguous():
        return rms_norm_ref(x, weight, eps, residual)
    n = x.shape[-1]
    rows, stride = _rows(x, n)
    out = torch.empty(x.shape, dtype=x.dtype)
    new_residual, res_rows, res_stride = None, None, 0
    if residual is not None:
        res_rows, res_stride = _rows(residual, n)
        new_residual = torch.empty(x.shape, dtype=x.dtype)
    library().rms_norm(rows.data_ptr(), stride, res_rows.data_ptr() if res_rows is not None else None, res_stride,
                       weight.data_ptr(), out.data_ptr(), new_residual.data_ptr() if new_residual is not None else None,
                       rows.shape[0], n, eps, kind, torch.get_num_threads())
    return out, new_residual


def apply_rotary_cpu(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kind = _kind(q, k)
    if kind is None or cache.dtype not in (torch.float32, torch.bfloat16) or q.shape[-1] % 2:
        return apply_rotary_ref(q, k, positions, cache)
    num_tokens, num_heads, head_dim = q.shape
    q, k = _heads(q), _heads(k)
    cache, positions = cache.contiguous(), positions.to(torch.int64).contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    library().apply_rotary(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(),
                           cache.data_ptr(), int(cache.dtype == torch.bfloat16), q_out.data_ptr(), k_out.data_ptr(),
                           num_tokens, num_heads, k.shape[1], head_dim, kind, torch.get_num_threads())
    return q_out, k_out


def _heads(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with contiguous heads (any token stride): a view of the fused QKV output is."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    kind = _kind(x)
    if kind is None or x.dim() != 2:
        return silu_and_mul_ref(x)
    rows, stride = _rows(x, x.shape[1])
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    library().silu_and_mul(rows.data_ptr(), stride, out.data_ptr(), x.shape[0], inter, kind, torch.get_num_threads())
    return out


def write_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    kind = _kind(k, v, k_cache, v_cache)
    if kind is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    k, v = _heads(k), _heads(v)
    slots = slot_mapping.to(torch.int64).contiguous()
    library().write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                       slots.data_ptr(), k.shape[0], k.shape[1] * k.shape[2], kind)


def argmax_cpu(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> [R] int64, exactly torch's x.argmax(-1) (first index on ties, first NaN), ~20x
    faster on fp32 rows of a vocabulary (torch takes ~14 us a row of 49152)."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu or x.shape[1] == 0 or not is_available():
        return x.argmax(-1)
    rows, stride = _rows(x, x.shape[1])
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        library().argmax_rows(rows.data_ptr(), stride, out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


# ---- linear layers ----------------------------------------------------------------------
@lru_cache(maxsize=None)
def gemm_supported(dtype: torch.dtype) -> bool:
    """Whether the compiled GEMM runs this dtype here (it needs AVX-512; bf16 also AVX-512 BF16)."""
    if dtype not in (torch.float32, torch.bfloat16) or not is_available():
        return False
    return bool(library().gemm_supported(int(dtype == torch.bfloat16)))


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in gemm.c's layout: panels of PANEL output features, k-major within a panel
    (bf16: k in pairs), the last panel padded with zeros."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - out_features))
    if weight.dtype == torch.bfloat16:
        pairs = -(-in_features // 2)
        padded = F.pad(padded, (0, 2 * pairs - in_features))
        return padded.view(panels, PANEL, pairs, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def linear_cpu(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
               bias: torch.Tensor | None) -> torch.Tensor:  # [..., K] -> [..., N] in x's dtype
    """x W^T + bias on a weight [out_features, in_features] from pack_gemm_weight, x in its dtype.
    Shapes are checked here: the kernel trusts them and would read past the weight."""
    if x.dtype != packed.dtype:
        raise TypeError(f"linear_cpu: input is {x.dtype}, weight is {packed.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"linear_cpu: input has {x.shape[-1]} features, the weight takes {in_features}")
    if bias is not None and bias.numel() != out_features:
        raise ValueError(f"linear_cpu: bias has {bias.numel()} elements, the weight gives {out_features}")
    rows, stride = _rows(x, in_features)
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    if rows.shape[0]:
        library().linear(rows.data_ptr(), stride, packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                         out.data_ptr(), out_features, rows.shape[0], out_features, in_features,
                         int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernels, built if this machine has not built these sources yet."""
    lib = ctypes.CDLL(str(build()))
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "paged_attention": [ptr, i64, i32, f32, ptr, ptr, i32, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32, i32],
        "rms_norm": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32, i32],
        "apply_rotary": [ptr, i64, ptr, i64, ptr, ptr, i32, ptr, ptr, i64, i32, i32, i32, i32, i32],
        "silu_and_mul": [ptr, i64, ptr, i64, i64, i32, i32],
        "write_kv": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i32],
        "argmax_rows": [ptr, i64, ptr, i64, i64, i32],
        "linear": [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32],
        "gemm_supported": [i32],
        "decoder_stack": [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i32],  # kernels/decoder.py
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = i32 if name in ("paged_attention", "gemm_supported", "decoder_stack") else None
    return lib


@lru_cache(maxsize=1)
def is_available() -> bool:
    """Whether the library builds here (asked once: a failed build is not retried per call)."""
    try:
        library()
    except KernelUnavailable:
        return False
    return True


def build(build_dir: Path | None = None) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc) on PATH")
    folder = build_dir or _default_build_dir()
    target = folder / f"cpu_kernels-{_build_key(compiler)}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)  # renamed into place: racing builds are safe
    os.close(fd)
    result = subprocess.run([compiler, *FLAGS, "-o", partial, *map(str, SOURCES)], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(partial)
        raise KernelUnavailable(f"{compiler} failed: {result.stderr.strip()[:2000]}")
    os.replace(partial, target)
    return target


def _default_build_dir() -> Path:
    home = Path.home() / ".cache" / "pagedserve-kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"pagedserve-kernels-{os.getuid()}"


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(CSRC.iterdir())))
    for part in (" ".join(FLAGS), version, platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """-march=native compiles for this CPU: a library built on another must not be reused."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
