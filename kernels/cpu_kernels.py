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

The libraries (one per tier: TIER_FLAGS, SOURCES) are built by kernels/build.py; `select_isa` makes one
tier the process's (the worker does, from its cpu_isa argument; `auto` is the best tier this CPU runs
that builds here); `use_isa` does it for a block (tests).
"""
from __future__ import annotations

import ctypes
import platform
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref, token_layout
from kernels.build import TIER_FLAGS, TIERS, KernelUnavailable, build, host_tiers, testable_tiers
from kernels.cache import write_kv_ref
from kernels.norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref

PANEL = 48  # output features per packed weight panel, as in gemm.c
LANES, MAX_HEADS, MAX_CHUNKS = 16, 256, 16  # as in the C source: head_dim % 16 == 0, <= 256; heads <= 256
OUT_OF_MEMORY = 1  # paged_attention's status codes, as in the C source (0: done, 2: shape not supported)


def paged_attention_cpu(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], fp32 or bf16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    scale: float,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,  # > 0: a sliding-window layer's keys, positions pos - window + 1 .. pos
    sinks: torch.Tensor | None = None,  # [H]: each head's sink logit (gpt-oss)
) -> torch.Tensor:  # [T, H, D] in q's dtype; same contract as kernels.attention.paged_attention_ref
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not _supported(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim):  # a fixed choice per model
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout,
                                   window, sinks)
    token_seq, token_pos = layout if layout is not None else token_layout(seq_lens, query_start_loc)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    if num_tokens == 0:
        return out
    q = _heads(q)  # the kernel scales q in fp32 and writes out in q's dtype, as q.float() * scale and .to() would
    tables = block_tables.to(torch.int64).contiguous()
    token_seq, token_pos = token_seq.to(torch.int64).contiguous(), token_pos.to(torch.int64).contiguous()
    sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    status = library().paged_attention_window(
        q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16), scale, k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.dtype == torch.bfloat16), tables.data_ptr(), tables.shape[1], token_seq.data_ptr(),
        token_pos.data_ptr(), out.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim, block_size, window,
        None if sinks is None else sinks.data_ptr(), torch.get_num_threads())
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
def gemm_supported(dtype: torch.dtype) -> bool:
    """Whether the active tier's GEMM runs this dtype (every tier runs fp32 and bf16)."""
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


MOE_MAX_EXPERTS = 512  # kernels.h


def moe_route_cpu(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router's choice (moe.c's moe_route): logits [T, E] -> weights [T, k] fp32 and
    experts [T, k] int64, each token's k experts in ascending id; softmax over E, the k largest (ties to the
    lower id), divided by their sum where normalize. Tier-invariant, row by row."""
    logits = logits.float().contiguous()
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts <= MOE_MAX_EXPERTS:
        raise ValueError(f"moe_route: top {k} of {num_experts} experts (at most {MOE_MAX_EXPERTS})")
    experts = torch.empty(num_tokens, k, dtype=torch.int64)
    weights = torch.empty(num_tokens, k, dtype=torch.float32)
    library().moe_route(logits.data_ptr(), num_tokens, num_experts, k, int(normalize), experts.data_ptr(),
                        weights.data_ptr())
    return weights, experts


def linear_cpu(x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int,
               bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:  # [..., K] -> [..., N]
    """x W^T + bias on a weight [out_features, in_features] from pack_gemm_weight, x in its dtype; out: rows
    [M, N] with unit column stride (a slice of a caller's buffer) to write into instead of a new tensor.
    Shapes are checked here: the kernel trusts them and would read past the weight."""
    if x.dtype != packed.dtype:
        raise TypeError(f"linear_cpu: input is {x.dtype}, weight is {packed.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"linear_cpu: input has {x.shape[-1]} features, the weight takes {in_features}")
    if bias is not None and bias.numel() != out_features:
        raise ValueError(f"linear_cpu: bias has {bias.numel()} elements, the weight gives {out_features}")
    rows, stride = _rows(x, in_features)
    if out is None:
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    if rows.shape[0]:
        library().linear(rows.data_ptr(), stride, packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                         out.data_ptr(), out.stride(0), rows.shape[0], out_features, in_features,
                         int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


@dataclass(kw_only=True)
class _Active:
    isa: str = "auto"  # what was asked for
    tier: str | None = None  # what runs (None: not chosen yet)
    lib: ctypes.CDLL | None = None
    error: KernelUnavailable | None = None  # auto found no tier that builds


_active = _Active()
_loaded: dict[str, ctypes.CDLL] = {}


def select_isa(isa: str = "auto") -> str:
    """Make `isa`'s kernels the process's: auto (the best tier this CPU runs that builds here),
    or a tier name. Returns the tier. ValueError for a tier this CPU cannot execute (nothing
    changes); KernelUnavailable when the forced tier (for auto: every tier) fails to build, and
    then the kernels are unavailable (the callers take the references) until another select."""
    global _active
    if isa != "auto" and isa not in TIER_FLAGS:
        raise ValueError(f"cpu_isa: must be one of {('auto', *TIERS)}, got {isa!r}")
    if isa != "auto" and isa not in testable_tiers():
        raise ValueError(f"cpu_isa: this CPU ({platform.machine()}) cannot execute the {isa} kernels; "
                         f"it runs {', '.join(host_tiers())} (or auto)")
    errors = []
    for tier in host_tiers() if isa == "auto" else (isa,):
        try:
            _active = _Active(isa=isa, tier=tier, lib=tier_library(tier))
            return tier
        except KernelUnavailable as error:
            errors.append(error if isa != "auto" else KernelUnavailable(f"{tier}: {error}"))
    _active = _Active(isa=isa, error=errors[0] if len(errors) == 1 else
                      KernelUnavailable("no kernel tier builds here; " + "; ".join(map(str, errors))))
    raise _active.error


@contextmanager
def use_isa(isa: str) -> Iterator[str]:
    """select_isa for a block, then back to what was selected before."""
    global _active
    before = _active
    try:
        yield select_isa(isa)
    finally:
        _active = before


def active_tier() -> str | None:
    """The tier the kernels run on (choosing auto's now if none was), or None where none builds."""
    return _active.tier if is_available() else None


def library() -> ctypes.CDLL:
    """The active tier's compiled kernels (auto's, built if needed, when none was selected)."""
    lib = _active.lib
    if lib is not None:
        return lib
    if _active.error is not None:
        raise _active.error
    select_isa(_active.isa)
    return _active.lib


def is_available() -> bool:
    """Whether the active tier's library builds here (asked once: a failed build is not retried per call)."""
    if _active.lib is not None:
        return True
    try:
        library()
    except KernelUnavailable:
        return False
    return True


def tier_library(tier: str) -> ctypes.CDLL:
    """One tier's library, built if this machine has not built it yet (loaded once per process)."""
    lib = _loaded.get(tier)
    if lib is None:
        lib = _declare(ctypes.CDLL(str(build(tier))))
        lib.quant_dot_set_amx(int(_amx))
        _loaded[tier] = lib
    return lib


_declared: set[tuple[int, int]] = set()


def declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """lib with the ctypes signatures {name: (argtypes, restype)} of another module's kernels set, once per
    library object and table (kernels/quant.py, kernels/row_parallel.py; this module's own: _declare)."""
    key = (id(lib), id(signatures))
    if key not in _declared:
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        _declared.add(key)
    return lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "paged_attention": [ptr, i64, i32, f32, ptr, ptr, i32, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32, i32],
        "paged_attention_window": [ptr, i64, i32, f32, ptr, ptr, i32, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32, i32,
                                   i64, ptr, i32],
        "rms_norm": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32, i32],
        "apply_rotary": [ptr, i64, ptr, i64, ptr, ptr, i32, ptr, ptr, i64, i32, i32, i32, i32, i32],
        "silu_and_mul": [ptr, i64, ptr, i64, i64, i32, i32],
        "write_kv": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i32],
        "argmax_rows": [ptr, i64, ptr, i64, i64, i32],
        "linear": [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32],
        "gemm_supported": [i32],
        "kernel_tier": [],
        "quant_dot_set_amx": [i32],
        "decoder_stack": [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i32],  # decoder.py
        "moe_route": [ptr, i64, i64, i64, i32, ptr, ptr],
        "moe_forward": [ptr, ptr, i64, i64, i32, ptr, i64, i32],  # services/worker/models/moe.py
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        windowed = ("paged_attention", "paged_attention_window")
        fn.restype = i32 if name in (*windowed, "gemm_supported", "decoder_stack", "moe_route", "moe_forward") else None
    lib.kernel_tier.restype = ctypes.c_char_p
    return lib


def compiled_path(lib: ctypes.CDLL | None = None) -> str:
    """The code path a library's build took (kernel_tier in gemm.c): avx512+bf16, avx512, avx2,
    generic-neon or generic."""
    return (lib or library()).kernel_tier().decode()


_amx = True  # WorkerConfig.amx, given by the worker (set_amx)


def set_amx(on: bool) -> None:
    """Whether int8-activation linear layers may take the AMX tiles where the CPU has them (the same bits
    as the VNNI tiles; the amx setting): every library loaded now and later."""
    global _amx
    _amx = bool(on)
    for lib in _loaded.values():
        lib.quant_dot_set_amx(int(_amx))
