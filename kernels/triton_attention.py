"""Paged attention in Triton: one kernel for prefill chunks and decode tokens.

Same numerics plan as kernels.attention.paged_attention_ref: one program per (query
token, KV head) takes the G query heads of that KV head as the rows of its tile and
walks the keys 0..position (a sliding window: position - window + 1 .. position) in tiles of
KEY_TILE keys, always from the tile of its first key and in order,
with an online softmax in fp32. Nothing a program computes depends on other tokens, so
a token's result is the same alone, in any batch, in a prefill chunk or as a decode
token (docs/ARCHITECTURE.md rule 4).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import KEY_TILE, token_layout
from kernels.triton_common import DTYPES, INTERPRET, Launch, round_to


@triton.jit
def _attend_tile(
    q, acc, max_score, denom,  # [GP, DP] [GP, DP] [GP] [GP]
    k_head_ptr, v_head_ptr,  # the token's KV head in the caches
    table_ptr,  # [max_blocks] the token's sequence's block table row
    tile, first, pos, max_blocks, scale,
    stride_cb, stride_cs,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEY_TILE: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    """One online-softmax step over keys tile*KEY_TILE .. +KEY_TILE, causal at pos, none before first."""
    key = tile * KEY_TILE + tl.arange(0, KEY_TILE)  # [KT]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [DP]
    block_idx = key // BLOCK_SIZE
    valid = (key <= pos) & (key >= first) & (block_idx < max_blocks)
    block_id = tl.load(table_ptr + block_idx, mask=valid, other=0).to(tl.int64)
    offs = (block_id * stride_cb + (key % BLOCK_SIZE) * stride_cs)[:, None] + dims[None, :]  # [KT, DP]
    kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_head_ptr + offs, mask=kv_mask, other=0.0)  # [KT, DP]
    v = tl.load(v_head_ptr + offs, mask=kv_mask, other=0.0)  # [KT, DP]

    if NATIVE_DOT:  # bf16/fp16 on a GPU: tensor-core products, fp32 accumulation
        scores = tl.dot(q, tl.trans(k)) * scale
    else:  # fp32, or the interpreter (q already fp32 and scaled, as in the reference)
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    scores = tl.where(valid[None, :], scores, float("-inf"))  # [GP, KT]

    new_max = tl.maximum(max_score, tl.max(scores, 1))
    alpha = tl.exp(max_score - new_max)
    probs = tl.exp(scores - new_max[:, None])
    if NATIVE_DOT:
        pv = tl.dot(probs.to(v.dtype), v)
    else:
        pv = tl.dot(probs, v.to(tl.float32), input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    denom = denom * alpha + tl.sum(probs, 1)
    return acc, new_max, denom


# max_blocks and stride_bt follow the batch's longest sequence: not specialised (Triton would
# otherwise compile other code when they equal 1 or are multiples of 16), so one binary serves
# every batch (tests/kernels/test_launch_grid.py)
@triton.jit(do_not_specialize=["max_blocks", "stride_bt", "window"])
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, KVH, D]
    v_cache_ptr,  # [num_blocks, block_size, KVH, D], same strides as k_cache
    block_tables_ptr,  # [S, max_blocks] int32/int64
    token_seq_ptr,  # [T] int64: sequence of each query token
    token_pos_ptr,  # [T] int64: position of each query token
    out_ptr,  # [T, H, D] contiguous
    sinks_ptr,  # [H] fp32 with HAS_SINKS: each head's sink logit (gpt-oss), in its softmax denominator
    scale, max_blocks, window,  # window > 0: keys pos - window + 1 .. pos only
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEY_TILE: tl.constexpr, NATIVE_DOT: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.load(token_seq_ptr + token)
    pos = tl.load(token_pos_ptr + token)

    rows = tl.arange(0, GROUP_PAD)  # query heads kv_head*G .. +G, padded for tl.dot
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + rows
    mask = (rows[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)  # [GP, DP]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32) * scale

    acc = tl.zeros((GROUP_PAD, HEAD_DIM_PAD), dtype=tl.float32)
    max_score = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_ch
    v_head_ptr = v_cache_ptr + kv_head * stride_ch
    first = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    for tile in range(first // KEY_TILE, pos // KEY_TILE + 1):  # fixed order, from the first key's tile
        acc, max_score, denom = _attend_tile(
            q, acc, max_score, denom, k_head_ptr, v_head_ptr, table_ptr, tile, first, pos, max_blocks, scale,
            stride_cb, stride_cs, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, KEY_TILE, NATIVE_DOT,
        )

    if HAS_SINKS:  # one more key of score `sink` and value zero, after the last tile
        sink = tl.load(sinks_ptr + heads, mask=rows < GROUP, other=0.0)
        top = tl.maximum(max_score, sink)
        alpha = tl.exp(max_score - top)
        acc = acc * alpha[:, None]
        denom = denom * alpha + tl.exp(sink - top)
    out = acc / denom[:, None]
    out_offs = token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, round_to(out, out_ptr.dtype.element_ty), mask=mask)


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    scale: float,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:  # [T, H, D] in q's dtype
    """Drop-in for kernels.attention.paged_attention_ref."""
    num_tokens, num_heads, head_dim = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache/v_cache: [num_blocks, block_size, KVH, D]"
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share strides"
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    assert cache_dim == head_dim, f"head_dim {head_dim} != cache head_dim {cache_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads not a multiple of {num_kv_heads} KV heads"
    assert KEY_TILE % block_size == 0, f"block_size {block_size} must divide KEY_TILE {KEY_TILE}"
    assert q.dtype in DTYPES and k_cache.dtype in DTYPES and v_cache.dtype == k_cache.dtype
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "head_dim must be the contiguous dimension"
    assert block_tables.dim() == 2 and not block_tables.dtype.is_floating_point
    block_tables = block_tables.contiguous()  # a no-op in the worker
    assert query_start_loc.shape == (seq_lens.shape[0] + 1,) and block_tables.shape[0] == seq_lens.shape[0]
    token_seq, token_pos = layout if layout is not None else token_layout(seq_lens, query_start_loc)
    assert token_seq.shape == token_pos.shape == (num_tokens,)

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    native_dot = not INTERPRET and q.dtype != torch.float32 and q.dtype == k_cache.dtype
    sinks = None if sinks is None else sinks.to(device=q.device, dtype=torch.float32).contiguous()
    grid = (num_tokens, num_kv_heads)
    Launch(kernel=_paged_attention_kernel, grid=grid, args=(
        q, k_cache, v_cache, block_tables, token_seq.to(torch.int64), token_pos.to(torch.int64), out,
        q if sinks is None else sinks, float(scale), block_tables.shape[1], int(window),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
    ), constexprs=dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, KEY_TILE=KEY_TILE, NATIVE_DOT=native_dot, HAS_SINKS=sinks is not None,
    )).launch()
    return out
