"""Rotary embedding in Triton (neox / "rotate_half" layout): q and k of one token per program.

Rounds where the reference rounds: cos/sin are cast to q's dtype, and each product and
the sum are rounded to it, so bf16/fp16 results match kernels.rotary.apply_rotary_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import DTYPES, Launch, round_to


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, cos, sin,  # cos, sin: [HALF_PAD] in x's dtype
    stride_xh, stride_oh,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """out = x * cos + rotate_half(x) * sin for the [NUM_HEADS, 2 * HALF] heads of one token."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    x1 = tl.load(x_ptr + heads * stride_xh + dims, mask=mask, other=0.0)  # [HP, HALF_PAD]
    x2 = tl.load(x_ptr + heads * stride_xh + HALF + dims, mask=mask, other=0.0)
    dtype = x1.dtype
    c = cos.to(tl.float32)[None, :]
    s = sin.to(tl.float32)[None, :]
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = round_to(x1 * c, dtype).to(tl.float32) + round_to(-x2 * s, dtype).to(tl.float32)
    out2 = round_to(x2 * c, dtype).to(tl.float32) + round_to(x1 * s, dtype).to(tl.float32)
    tl.store(out_ptr + heads * stride_oh + dims, round_to(out1, dtype), mask=mask)
    tl.store(out_ptr + heads * stride_oh + HALF + dims, round_to(out2, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, KVH, D]
    positions_ptr,  # [T] int
    cache_ptr,  # [max_positions, D] fp32 or q's dtype: cos in the first half, sin in the second
    q_out_ptr,  # [T, H, D] contiguous
    k_out_ptr,  # [T, KVH, D] contiguous
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    cos = tl.load(cache_ptr + pos * stride_cache + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + dims, mask=dims < HALF, other=0.0)
    dtype = q_out_ptr.dtype.element_ty
    cos, sin = round_to(cos, dtype), round_to(sin, dtype)  # the reference rounds the table to q's dtype
    _rotate_heads(q_ptr + token * stride_qt, q_out_ptr + token * NUM_HEADS * 2 * HALF, cos, sin,
                  stride_qh, 2 * HALF, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_kt, k_out_ptr + token * NUM_KV_HEADS * 2 * HALF, cos, sin,
                  stride_kh, 2 * HALF, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def apply_rotary_triton(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T] int
    cache: torch.Tensor,  # [max_positions, D] from cos_sin_cache
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for kernels.rotary.apply_rotary_ref: new rotated (q, k); inputs untouched."""
    num_tokens, num_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k {tuple(k.shape)} vs q"
    assert head_dim % 2 == 0 and cache.dim() == 2 and cache.shape[1] == head_dim, "cache: [max_positions, D]"
    assert q.dtype in DTYPES and k.dtype == q.dtype, f"q/k dtypes {q.dtype}, {k.dtype}"
    # fp32 from cos_sin_cache, or already in q's dtype: Module.to(dtype) casts the model's buffers too,
    # and rounding the table once at load gives the bits the kernel's own rounding gives
    assert cache.dtype in (torch.float32, q.dtype) and cache.stride(-1) == 1, f"cache dtype {cache.dtype}"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be the contiguous dimension"
    assert positions.shape == (num_tokens,) and not positions.dtype.is_floating_point
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    Launch(kernel=_rotary_kernel, grid=(num_tokens,), args=(
        q, k, positions, cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0),
    ), constexprs=dict(
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=k.shape[1], KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
    )).launch()
    return q_out, k_out
