"""Paged attention over a flattened batch: one code path for prefill chunks and decode.

Reference (the CPU path): every query token attends to keys 0..position of its own
sequence, read through the sequence's block table. Keys are reduced in tiles of
KEY_TILE keys, always from key 0 and in order, with an online softmax in fp32. Every
matrix product has a fixed shape ([G, D] x [D, KEY_TILE] per token and KV head), so a
token's result does not depend on its batch neighbours, its place in the batch, or on
whether it arrives in a prefill chunk or as a decode token (DESIGN rule 4).
"""
from __future__ import annotations

import torch

KEY_TILE = 128  # keys per reduction step; a multiple of every allowed block size


def token_layout(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token: the index of its sequence and its position. [T], [T]."""
    num_queries = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    token_seq = torch.repeat_interleave(torch.arange(len(num_queries), device=seq_lens.device), num_queries)
    first_pos = (seq_lens - num_queries)[token_seq]  # position of each sequence's first query
    local = torch.arange(len(token_seq), device=seq_lens.device) - query_start_loc[:-1][token_seq]
    return token_seq, first_pos + local


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int, padded with any valid id
    seq_lens: torch.Tensor,  # [S] context length of each sequence after this step
    query_start_loc: torch.Tensor,  # [S + 1] offsets of each sequence's queries in q
    scale: float,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,  # token_layout(), computed once per step
) -> torch.Tensor:  # [T, H, D] in q's dtype
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    blocks_per_tile = KEY_TILE // block_size
    token_seq, token_pos = layout if layout is not None else token_layout(seq_lens, query_start_loc)

    # [T, KVH, G, D]: the query heads that share one KV head form the rows of one product
    q32 = (q.float() * scale).view(num_tokens, num_kv_heads, group, head_dim)
    max_score = torch.full((num_tokens, num_kv_heads, group, 1), float("-inf"), device=q.device)
    denom = torch.zeros((num_tokens, num_kv_heads, group, 1), device=q.device)
    acc = torch.zeros((num_tokens, num_kv_heads, group, head_dim), device=q.device)
    num_tiles = token_pos // KEY_TILE + 1  # [T]
    padded = torch.nn.functional.pad(block_tables, (0, int(num_tiles.max()) * blocks_per_tile), value=0)

    for tile in range(int(num_tiles.max())):
        rows = torch.nonzero(num_tiles > tile).squeeze(1)  # tokens that reach this tile
        cols = padded[:, tile * blocks_per_tile:(tile + 1) * blocks_per_tile]
        blocks = cols[token_seq[rows]]  # [A, blocks_per_tile]
        k = k_cache[blocks].float().view(len(rows), KEY_TILE, num_kv_heads, head_dim)
        v = v_cache[blocks].float().view(len(rows), KEY_TILE, num_kv_heads, head_dim)
        # Always a fresh contiguous copy: with A == 1 a reshape would return a strided view and
        # the matrix library would take another path, with other bits.
        k = k.permute(0, 2, 3, 1).contiguous().view(-1, head_dim, KEY_TILE)  # [A*KVH, D, KT]
        v = v.permute(0, 2, 1, 3).contiguous().view(-1, KEY_TILE, head_dim)  # [A*KVH, KT, D]
        scores = torch.bmm(q32[rows].reshape(-1, group, head_dim), k)  # [A*KVH, G, KT]
        scores = scores.view(len(rows), num_kv_heads, group, KEY_TILE)
        key_pos = tile * KEY_TILE + torch.arange(KEY_TILE, device=q.device)
        masked = key_pos[None, :] > token_pos[rows][:, None]  # [A, KT] causal
        scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))

        # online softmax update, in a fixed order over tiles
        new_max = torch.maximum(max_score[rows], scores.amax(-1, keepdim=True))
        alpha = torch.exp(max_score[rows] - new_max)
        probs = torch.exp(scores - new_max)  # [A, KVH, G, KT]
        pv = torch.bmm(probs.reshape(-1, group, KEY_TILE), v).view(len(rows), num_kv_heads, group, head_dim)
        acc[rows] = acc[rows] * alpha + pv
        denom[rows] = denom[rows] * alpha + probs.sum(-1, keepdim=True)
        max_score[rows] = new_max

    out = acc / denom
    return out.view(num_tokens, num_heads, head_dim).to(q.dtype)
