"""The attention reference (the kernels' yardstick) and the compiled CPU kernel against naive dense
attention: per sequence, the whole causal softmax at once, in fp64, no tiles, no pages."""
import pytest
import torch

from kernel_helpers import dtype_id, make_paged_batch
from kernels.attention import KEY_TILE, paged_attention_ref, token_layout
from kernels.cpu_kernels import paged_attention_cpu


def dense_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=0,
                    sinks=None) -> torch.Tensor:
    """[T, H, D] fp64: each sequence's keys gathered into one dense tensor, full softmax (window > 0: keys
    position - window + 1 .. position; sinks [H]: one more logit per head in the softmax, dropped after)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    outs = []
    for i, ctx in enumerate(seq_lens.tolist()):
        start, end = query_start_loc[i].item(), query_start_loc[i + 1].item()
        blocks = block_tables[i, :-(-ctx // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:ctx].double()  # [ctx, KVH, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:ctx].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [ctx, H, D]
        queries = q[start:end].double()  # [n, H, D]
        positions = torch.arange(ctx - (end - start), ctx)
        scores = torch.einsum("nhd,khd->hnk", queries, k) * scale
        keys = torch.arange(ctx)[None, None, :]
        masked = (keys > positions[None, :, None]) | ((keys <= positions[None, :, None] - window) & (window > 0))
        scores = scores.masked_fill(masked, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hnk,khd->nhd", probs, v))
    return torch.cat(outs)


# (sequences as (context, queries), heads, kv heads, head_dim, block_size); contexts beyond KEY_TILE
CASES = [
    ([(300, 5), (1, 1), (129, 129)], 8, 2, 64, 16),  # multi-tile chunk, decode at position 0, long prefill
    ([(257, 1), (40, 40)], 4, 4, 128, 8),  # decode three tiles deep, no GQA
    ([(200, 17), (130, 3), (7, 2)], 12, 4, 80, 32),  # group of 3, padded head_dim
    ([(KEY_TILE, KEY_TILE)], 8, 1, 96, 16),  # multi-query, exactly one tile
]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("seqs,heads,kv_heads,head_dim,block_size", CASES)
@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu], ids=["reference", "cpu"])
def test_matches_dense_attention(attention, seqs, heads, kv_heads, head_dim, block_size, dtype):
    batch = make_paged_batch(seqs, heads, kv_heads, head_dim, block_size, dtype=dtype, device="cpu")
    out = attention(**batch)
    assert out.dtype == dtype and out.shape == batch["q"].shape
    torch.testing.assert_close(out.double(), dense_attention(**batch), **TOLERANCE[dtype])


@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu], ids=["reference", "cpu"])
def test_accepts_precomputed_layout(attention):
    batch = make_paged_batch([(150, 3), (9, 9)], 4, 2, 64, 16, device="cpu")
    layout = token_layout(batch["seq_lens"], batch["query_start_loc"])
    assert layout[1].tolist() == [147, 148, 149] + list(range(9))
    assert torch.equal(attention(**batch, layout=layout), attention(**batch))


def test_cpu_kernel_takes_the_reference_for_shapes_it_does_not_cover():
    batch = make_paged_batch([(40, 3)], 4, 2, 8, 16, device="cpu")  # head_dim 8: not a multiple of 16
    assert torch.equal(paged_attention_cpu(**batch), paged_attention_ref(**batch))


@pytest.mark.parametrize("seq,heads,kv_heads", [((300, 100), 9, 3), ((129, 129), 12, 4)])
def test_reference_gives_a_prefill_row_the_bits_of_its_decode_step(seq, heads, kv_heads):
    """The chunk path's products have M = the chunk's rows x group, the decode path's a padded group:
    MKL keeps a row's bits across those M (on Zen and on an Intel Xeon, whose sgemm switches
    kernels with M for the linear layers' shapes)."""
    context, queries = seq
    batch = make_paged_batch([seq], heads, kv_heads, 64, 16, device="cpu")
    chunk = paged_attention_ref(**batch)
    for i in range(0, queries, 7):
        one = {**batch, "q": batch["q"][i:i + 1], "seq_lens": torch.tensor([context - queries + i + 1]),
               "query_start_loc": torch.tensor([0, 1])}
        assert torch.equal(paged_attention_ref(**one)[0], chunk[i]), i


# a sliding window (Gemma 3's local layers): windows inside one key tile, across tiles, wider than the context
WINDOW_CASES = [
    ([(300, 5), (1, 1), (200, 200), (40, 1)], 8, 2, 64, 16, 100),  # chunk path rows past their window's tile
    ([(257, 1), (129, 129), (130, 3)], 4, 4, 128, 8, 128),  # exactly a tile: decode and chunk
    ([(90, 30), (7, 2)], 12, 4, 80, 32, 17),  # narrow window, group of 3
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("seqs,heads,kv_heads,head_dim,block_size,window", WINDOW_CASES)
@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu], ids=["reference", "cpu"])
def test_sliding_window_matches_dense_attention(attention, seqs, heads, kv_heads, head_dim, block_size, window,
                                                 dtype):
    batch = make_paged_batch(seqs, heads, kv_heads, head_dim, block_size, dtype=dtype, device="cpu")
    out = attention(**batch, window=window)
    assert torch.isfinite(out).all()
    want = dense_attention(**batch, window=window)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[dtype])
    # and the window matters: the full context differs for tokens past it
    assert not torch.allclose(want, dense_attention(**batch), atol=1e-3)


# attention sinks (gpt-oss): per head a logit in the softmax denominator; heads whose sink is below,
# near and far above their scores (the last: outputs near zero), with and without a sliding window
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("attention", [paged_attention_ref, paged_attention_cpu], ids=["reference", "cpu"])
def test_sinks_match_dense_attention(attention, window, dtype):
    batch = make_paged_batch([(300, 5), (1, 1), (200, 200), (40, 1)], 8, 2, 64, 16, dtype=dtype, device="cpu")
    sinks = torch.tensor([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0, 12.0])
    out = attention(**batch, window=window, sinks=sinks)
    assert torch.isfinite(out).all()
    want = dense_attention(**batch, window=window, sinks=sinks)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[dtype])
    assert not torch.allclose(want, dense_attention(**batch, window=window), atol=1e-3)  # the sinks matter
