"""Paged attention compiled for the CPU (kernels/csrc/paged_attention.c), called through ctypes.

The PyTorch reference (kernels/attention.py) is the oracle and the fallback; this kernel is
the CPU's fast path, as the Triton kernel is the GPU's. It reads K and V in place through
the block table (the reference gathers 128-key tiles and runs a few small products per
tile), with one work item per (token, KV head), so its bits do not depend on the batch.

The library is built on first use with the system C compiler (`cc -O3 -march=native
-fopenmp`: it runs on the machine that built it) into ~/.cache/pagedserve-kernels, keyed by
a hash of the source, the flags, the compiler and the CPU; its OpenMP calls land in the
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

from kernels.attention import paged_attention_ref, token_layout

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
LANES, MAX_HEADS, MAX_CHUNKS = 16, 256, 16  # as in the C source: head_dim % 16 == 0, <= 256; heads <= 256


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
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if not _supported(k_cache, v_cache, num_heads, num_kv_heads, head_dim):  # a fixed choice per model
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout)
    token_seq, token_pos = layout if layout is not None else token_layout(seq_lens, query_start_loc)
    q32 = (q.float() * scale).contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    if num_tokens == 0:
        return out.to(q.dtype)
    tables = block_tables.to(torch.int64).contiguous()
    token_seq, token_pos = token_seq.to(torch.int64).contiguous(), token_pos.to(torch.int64).contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    status = library().paged_attention(
        q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
        tables.data_ptr(), tables.shape[1], token_seq.data_ptr(), token_pos.data_ptr(), out.data_ptr(),
        num_tokens, num_heads, num_kv_heads, head_dim, block_size, torch.get_num_threads())
    if status == 1:
        raise MemoryError("paged_attention_cpu: out of memory for the score buffers")
    if status != 0:
        raise ValueError(f"paged_attention_cpu: shape not supported (status {status})")
    return out.to(q.dtype)


def _supported(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> bool:
    group = num_heads // num_kv_heads
    return (k_cache.dtype in (torch.float32, torch.bfloat16) and v_cache.dtype == k_cache.dtype
            and k_cache.device.type == "cpu" and head_dim % LANES == 0 and head_dim // LANES <= MAX_CHUNKS
            and num_heads <= MAX_HEADS and group * num_kv_heads == num_heads)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernel, built if this machine has not built this source yet."""
    lib = ctypes.CDLL(str(build()))
    fn = lib.paged_attention
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [ptr, ptr, ptr, i32, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32, i32]
    fn.restype = i32
    return lib


def is_available() -> bool:
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
    target = folder / f"paged_attention-{_build_key(compiler)}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)  # renamed into place: racing builds are safe
    os.close(fd)
    result = subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True)
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
    digest = hashlib.sha256(SOURCE.read_bytes())
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
