"""KV-cache write in Triton: new K/V rows into the paged cache through a slot mapping."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import DTYPES, Launch, round_to


@triton.jit
def _copy_row(
    src_ptr, dst_ptr, src_stride_h, dst_stride_h,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Copies one token's [KVH, D] from src to dst, casting to dst's dtype."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
    row = tl.load(src_ptr + heads[:, None] * src_stride_h + dims[None, :], mask=mask)
    tl.store(dst_ptr + heads[:, None] * dst_stride_h + dims[None, :], round_to(row, dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D], same strides as k
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    v_cache_ptr,  # [num_blocks, block_size, KVH, D], same strides as k_cache
    slot_mapping_ptr,  # [T] int: block_id * block_size + offset; negative = skip
    stride_t, stride_h,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        src = token * stride_t
        _copy_row(k_ptr + src, k_cache_ptr + dst, stride_h, stride_ch, NUM_HEADS, HEADS_PAD, HEAD_DIM, HEAD_DIM_PAD)
        _copy_row(v_ptr + src, v_cache_ptr + dst, stride_h, stride_ch, NUM_HEADS, HEADS_PAD, HEAD_DIM, HEAD_DIM_PAD)


def write_kv_triton(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int
) -> None:
    """Drop-in for kernels.cache.write_kv_ref (writes in place, returns None)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, "k and v: same shape"
    if v.stride() != k.stride():  # e.g. v a slice of a fused qkv projection: one layout for both
        k, v = k.contiguous(), v.contiguous()
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), f"cache {tuple(k_cache.shape)} vs k {tuple(k.shape)}"
    assert k.dtype in DTYPES and v.dtype == k.dtype and k_cache.dtype in DTYPES and v_cache.dtype == k_cache.dtype
    assert k.stride(-1) == 1 and k_cache.stride(-1) == 1, "head_dim must be the contiguous dimension"
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.dtype.is_floating_point
    if num_tokens == 0:
        return
    Launch(kernel=_write_kv_kernel, grid=(num_tokens,), args=(
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
    ), constexprs=dict(
        BLOCK_SIZE=k_cache.shape[1], NUM_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )).launch()
