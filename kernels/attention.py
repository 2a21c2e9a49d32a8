"""Paged attention over a flattened batch: one reduction order for prefill chunks and decode.

Reference (the kernels' oracle, and the CPU path where kernels/csrc cannot be built): every
query token attends to keys 0..position of its own sequence, read through its block table
(with a sliding `window` > 0: keys position - window + 1 .. position). Keys are reduced in
tiles of KEY_TILE keys, always from the tile of the token's first key and in order, with an
online softmax in fp32. With `sinks` (gpt-oss: a learned logit per query head), each head's
softmax denominator also holds exp(sink): a key with that score and a zero value, added after the
last tile (the state's max raised to the sink where it is larger), so that a head may attend to
nothing.

The query heads that share a KV head are the rows of each matrix product. On these CPUs
(MKL) a row's bits do not depend on the product's other rows as long as every row sits in
a full micro-tile of ROW_MULTIPLE rows (see kernels/linear.py, the dense path), so rows are
padded to a multiple of it. That makes two paths give the same bits, and a token's result
independent of its batch neighbours and of prefill vs decode (docs/ARCHITECTURE.md rule 4):
- decode tokens (and short chunks): one small product per token and KV head, batched;
- prefill chunks: one product per sequence and KV head over all its query rows, so each
  key tile is gathered once per sequence rather than once per token.
"""
from __future__ import annotations

import torch

from kernels.mkl import MKL_ROW_MULTIPLE as ROW_MULTIPLE  # rows of a full MKL micro-tile (bmm)

KEY_TILE = 128  # keys per reduction step; a multiple of every allowed block size
CHUNK_MIN_QUERIES = 8  # sequences with at least this many queries take the per-sequence path


def token_layout(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token: the index of its sequence and its position. [T], [T]."""
    num_queries = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    token_seq = torch.repeat_interleave(torch.arange(len(num_queries), device=seq_lens.device), num_queries)
    first_pos = (seq_lens - num_queries)[token_seq]  # position of each sequence's first query
    local = torch.arange(len(token_seq), device=seq_lens.device) - query_start_loc[:-1][token_seq]
    return token_seq, first_pos + local


def _round_up(n: int) -> int:
    return -(-n // ROW_MULTIPLE) * ROW_MULTIPLE


def _softmax_init(shape: tuple[int, ...], head_dim: int, device):
    """Online-softmax state for a set of rows: max [..., 1], denominator [..., 1], acc [..., D]."""
    return (torch.full((*shape, 1), float("-inf"), device=device), torch.zeros((*shape, 1), device=device),
            torch.zeros((*shape, head_dim), device=device))


def _softmax_step(state, scores: torch.Tensor, v: torch.Tensor):
    """One key tile: scores [B, KVH, M, KT] (masked with -inf), v [B, KT, KVH, D] -> the new state."""
    old_max, denom, acc = state
    new_max = torch.maximum(old_max, scores.amax(-1, keepdim=True))
    # a row with no key yet (a window starting past this tile) keeps the initial state: shift by 0, not -inf
    shift = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
    alpha = torch.exp(old_max - shift)
    probs = torch.exp(scores - shift)
    return new_max, denom * alpha + probs.sum(-1, keepdim=True), acc * alpha + _per_head_values(probs, v)


def _gather_tile(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [B, blocks_per_tile] -> the tile's keys or values in the cache layout [B, KT, KVH, D], fp32.
    One gather; the products below read each KV head through a strided view, with no second copy."""
    tile = cache[blocks].flatten(1, 2)  # [B, KT, KVH, D]
    return tile if tile.dtype == torch.float32 else tile.float()


def _per_head_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, KVH, M, D], k [B, KT, KVH, D] -> scores [B, KVH, M, KT], one product per KV head."""
    return torch.stack([torch.bmm(q[:, h].contiguous(), k[:, :, h].transpose(1, 2)) for h in range(k.shape[2])], 1)


def _per_head_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs [B, KVH, M, KT], v [B, KT, KVH, D] -> [B, KVH, M, D], one product per KV head."""
    return torch.stack([torch.bmm(probs[:, h].contiguous(), v[:, :, h]) for h in range(v.shape[2])], 1)


def first_keys(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Each token's first key: 0, or with a sliding window the window's first position."""
    return (positions - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(positions)


def _finish(state, sinks: torch.Tensor | None) -> torch.Tensor:
    """acc / denominator of a softmax state; sinks [..., 1] (broadcast to the rows): a key of that score
    and value zero in every row's denominator."""
    m, l, acc = state
    if sinks is None:
        return acc / l
    top = torch.maximum(m, sinks)
    alpha = torch.exp(m - top)
    return acc * alpha / (l * alpha + torch.exp(sinks - top))


def _decode_path(q32, k_cache, v_cache, tables, positions, window: int, sinks=None) -> torch.Tensor:
    """q32 [A, KVH, Gp, D]; tables [A, max_blocks]; positions [A]; sinks [KVH, Gp, 1] -> [A, KVH, Gp, D]."""
    num_tokens, num_kv_heads, rows, head_dim = q32.shape
    blocks_per_tile = KEY_TILE // k_cache.shape[1]
    num_tiles = positions // KEY_TILE + 1  # [A]
    first = first_keys(positions, window)
    first_tiles = first // KEY_TILE  # [A]
    m, l, acc = _softmax_init((num_tokens, num_kv_heads, rows), head_dim, q32.device)
    min_tiles, all_from = int(num_tiles.min()), int(first_tiles.max())
    for tile in range(int(first_tiles.min()), int(num_tiles.max())):
        # tokens that reach this tile: all of them (a plain slice, no scatter) or some
        every = all_from <= tile < min_tiles
        live = slice(None) if every else torch.nonzero((num_tiles > tile) & (first_tiles <= tile)).squeeze(1)
        blocks = tables[live, tile * blocks_per_tile:(tile + 1) * blocks_per_tile]
        k = _gather_tile(k_cache, blocks)  # [A', KT, KVH, D]
        v = _gather_tile(v_cache, blocks)
        scores = _per_head_scores(q32[live], k)  # [A', KVH, Gp, KT]
        key_pos = tile * KEY_TILE + torch.arange(KEY_TILE, device=q32.device)
        masked = (key_pos[None, :] > positions[live][:, None]) | (key_pos[None, :] < first[live][:, None])  # [A', KT]
        scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
        m[live], l[live], acc[live] = _softmax_step((m[live], l[live], acc[live]), scores, v)
    return _finish((m, l, acc), sinks)


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int, padded with any valid id
    seq_lens: torch.Tensor,  # [S] context length of each sequence after this step
    query_start_loc: torch.Tensor,  # [S + 1] offsets of each sequence's queries in q
    scale: float,
    layout: tuple[torch.Tensor, torch.Tensor] | None = None,  # token_layout(), computed once per step
    window: int = 0,  # > 0: a sliding-window layer's keys, positions pos - window + 1 .. pos
    sinks: torch.Tensor | None = None,  # [H] fp32: each head's sink logit (gpt-oss), in the scaled scores' units
) -> torch.Tensor:  # [T, H, D] in q's dtype
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    token_seq, token_pos = layout if layout is not None else token_layout(seq_lens, query_start_loc)
    max_tiles = int(token_pos.max()) // KEY_TILE + 1 if num_tokens else 0
    tables = torch.nn.functional.pad(block_tables, (0, max_tiles * (KEY_TILE // k_cache.shape[1])), value=0)
    q32 = (q.float() * scale).view(num_tokens, num_kv_heads, group, head_dim)
    out = torch.empty(num_tokens, num_kv_heads, group, head_dim, device=q.device)

    sink_rows = None if sinks is None else sinks.float().view(num_kv_heads, group, 1)
    starts, ends = query_start_loc[:-1].tolist(), query_start_loc[1:].tolist()
    short = [(s, e) for s, e in zip(starts, ends) if e - s < CHUNK_MIN_QUERIES]
    if short:
        rows = torch.cat([torch.arange(s, e, device=q.device) for s, e in short])
        padded = torch.nn.functional.pad(q32[rows], (0, 0, 0, _round_up(group) - group))  # [A, KVH, Gp, D]
        padded_sinks = None if sink_rows is None else torch.nn.functional.pad(sink_rows,
                                                                              (0, 0, 0, _round_up(group) - group))
        out[rows] = _decode_path(padded, k_cache, v_cache, tables[token_seq[rows]], token_pos[rows],
                                 window, padded_sinks)[:, :, :group]
    for seq, (s, e) in enumerate(zip(starts, ends)):
        if e - s >= CHUNK_MIN_QUERIES:
            chunk = q32[s:e].permute(1, 0, 2, 3).reshape(num_kv_heads, (e - s) * group, head_dim)
            result = _sequence_chunk(chunk, k_cache, v_cache, tables[seq], int(token_pos[s]), group, window,
                                     sink_rows)
            out[s:e] = result.view(num_kv_heads, e - s, group, head_dim).permute(1, 0, 2, 3)
    return out.view(num_tokens, num_heads, head_dim).to(q.dtype)


def _sequence_chunk(chunk, k_cache, v_cache, table, first_pos: int, group: int, window: int,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """chunk [KVH, n*G, D] (row = token * G + head), positions first_pos..; sinks [KVH, G, 1] -> [KVH, n*G, D]."""
    num_kv_heads, num_rows, head_dim = chunk.shape
    blocks_per_tile = KEY_TILE // k_cache.shape[1]
    # spare zero rows so every row slice can be padded to full micro-tiles
    q_rows = torch.nn.functional.pad(chunk, (0, 0, 0, ROW_MULTIPLE - 1))
    row_pos = first_pos + torch.arange(q_rows.shape[1], device=chunk.device) // group  # [rows]
    m, l, acc = _softmax_init((1, num_kv_heads, q_rows.shape[1]), head_dim, chunk.device)
    last_pos = first_pos + num_rows // group - 1
    row_first = first_keys(row_pos, window)
    for tile in range(int(row_first[0]) // KEY_TILE, last_pos // KEY_TILE + 1):
        first = max(0, tile * KEY_TILE - first_pos) * group  # rows whose token reaches this tile
        rows = slice(first, first + _round_up(num_rows - first))
        blocks = table[None, tile * blocks_per_tile:(tile + 1) * blocks_per_tile]
        k = _gather_tile(k_cache, blocks)  # [1, KT, KVH, D]
        v = _gather_tile(v_cache, blocks)
        scores = _per_head_scores(q_rows[None, :, rows], k)  # [1, KVH, M, KT]
        key_pos = tile * KEY_TILE + torch.arange(KEY_TILE, device=chunk.device)
        masked = (key_pos[None, :] > row_pos[rows][:, None]) | (key_pos[None, :] < row_first[rows][:, None])
        scores = scores.masked_fill(masked[None, None], float("-inf"))
        state = (m[:, :, rows], l[:, :, rows], acc[:, :, rows])
        m[:, :, rows], l[:, :, rows], acc[:, :, rows] = _softmax_step(state, scores, v)
    row_sinks = None if sinks is None else sinks[None, :, torch.arange(q_rows.shape[1]) % group]  # row's head
    return _finish((m, l, acc), row_sinks)[0, :, :num_rows]
