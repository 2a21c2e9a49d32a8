"""The Triton paged-attention kernel against the reference, and the batch invariance of both."""
import pytest
import torch

from kernel_helpers import DEVICE, DTYPES, dtype_id, make_paged_batch, randn
from kernels.attention import paged_attention_ref
from kernels.cpu_kernels import paged_attention_cpu
from kernels.triton_attention import paged_attention_triton

# Against the fp32-accumulating reference. fp32: summation order only. bf16/fp16: one
# rounding of the output, plus on the GPU the probabilities rounded for the P @ V product.
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
MIXED = [(150, 6), (1, 1), (20, 20)]  # a chunk crossing a key tile, a decode at position 0, a prefill


def check_against_reference(batch: dict, dtype: torch.dtype) -> None:
    out = paged_attention_triton(**batch)
    ref = paged_attention_ref(**batch)
    assert out.dtype == dtype and out.shape == batch["q"].shape
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) output elements"
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_reference_dtypes_and_block_sizes(dtype, block_size, poisoned_empty):
    check_against_reference(make_paged_batch(MIXED, 8, 2, 64, block_size, dtype=dtype), dtype)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (4, 4, 64),  # no GQA
    (8, 2, 128),  # group of 4, large head
    (6, 2, 80),  # group of 3, padded head_dim
    (8, 1, 96),  # multi-query, padded head_dim
    (32, 8, 64),  # Llama-3.2-1B's heads
])
def test_matches_reference_heads(heads, kv_heads, head_dim, poisoned_empty):
    batch = make_paged_batch([(135, 2), (9, 1)], heads, kv_heads, head_dim, 16, dtype=torch.bfloat16)
    check_against_reference(batch, torch.bfloat16)


def test_non_contiguous_query_and_precomputed_layout(poisoned_empty):
    """The worker passes q as a view of the fused QKV projection, and a layout made once per step."""
    from kernels.attention import token_layout

    batch = make_paged_batch([(140, 4), (3, 3)], 8, 2, 64, 16)
    qkv = randn(7, 12 * 64)
    batch["q"] = qkv[:, : 8 * 64].view(7, 8, 64)
    layout = token_layout(batch["seq_lens"], batch["query_start_loc"])
    out = paged_attention_triton(**batch, layout=layout)
    torch.testing.assert_close(out, paged_attention_ref(**batch), **TOLERANCE[torch.float32])


# Batch invariance: steps over one shared cache. Entries are (sequence, context, queries);
# sequence 0 is the one watched, at positions on both sides of the first key tile boundary.
INVARIANCE_STEPS = [
    [(0, 150, 40)],  # alone, one prefill chunk: the baseline for positions 110..149
    [(0, 150, 1)],  # alone, decode
    [(2, 33, 5), (0, 130, 20), (1, 60, 1)],  # a chunk between a prefill and a decode
    [(1, 90, 1), (3, 200, 1), (0, 140, 10), (2, 33, 1)],  # a chunk among decodes, batch of 4
    [(3, 200, 2), (0, 121, 1)],  # decode behind a two-token chunk
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("attention", [paged_attention_triton, paged_attention_ref], ids=["triton", "reference"])
def test_batch_invariance(attention, dtype):
    check_batch_invariance(attention, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_cpu_batch_invariance(cpu_tier, dtype):
    check_batch_invariance(paged_attention_cpu, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (6, 2, 80), (4, 4, 128)])
def test_cpu_matches_reference(cpu_tier, dtype, heads, kv_heads, head_dim, poisoned_empty):
    batch = make_paged_batch(MIXED, heads, kv_heads, head_dim, 16, dtype=dtype, device="cpu")
    out = paged_attention_cpu(**batch)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) output elements"
    torch.testing.assert_close(out, paged_attention_ref(**batch), **TOLERANCE[dtype])


@pytest.mark.parametrize("attention", [paged_attention_triton, paged_attention_ref, paged_attention_cpu],
                         ids=["triton", "reference", "cpu"])
def test_sliding_window_batch_invariance(attention):
    """A window of 50 keys: sequence 0's positions 110..149 start their window in the first key tile or
    the second, each token's bits the same in every batch."""
    if attention is paged_attention_cpu and DEVICE != "cpu":
        pytest.skip("the CPU kernel reads CPU tensors")
    check_batch_invariance(attention, torch.float32, window=50)


@pytest.mark.parametrize("window", [50, 128])
def test_sliding_window_triton_matches_reference(window, poisoned_empty):
    batch = make_paged_batch([(300, 5), (200, 150), (1, 1)], 8, 2, 64, 16)
    out = paged_attention_triton(**batch, window=window)
    torch.testing.assert_close(out, paged_attention_ref(**batch, window=window), **TOLERANCE[torch.float32])


def test_sinks_triton_matches_reference(poisoned_empty):
    """Sinks with a window shorter than two of the contexts (the interpreter is slow: the smallest batch that
    has a decode, a prefill crossing the window and a one-token sequence)."""
    batch = make_paged_batch([(120, 3), (70, 40), (1, 1)], 8, 2, 64, 16)
    sinks = torch.tensor([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0, 12.0], device=DEVICE)
    out = paged_attention_triton(**batch, window=50, sinks=sinks)
    torch.testing.assert_close(out, paged_attention_ref(**batch, window=50, sinks=sinks),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("attention", [paged_attention_triton, paged_attention_ref, paged_attention_cpu],
                         ids=["triton", "reference", "cpu"])
def test_sinks_batch_invariance(attention):
    """gpt-oss's sinks with its sliding window: each token's bits the same in every batch."""
    if attention is paged_attention_cpu and DEVICE != "cpu":
        pytest.skip("the CPU kernel reads CPU tensors")
    check_batch_invariance(attention, torch.float32, window=50,
                           sinks=torch.linspace(-2.0, 3.0, 8, device=DEVICE))


def check_batch_invariance(attention, dtype: torch.dtype, window: int = 0, sinks=None) -> None:
    heads, kv_heads, head_dim = 8, 2, 64
    shared = make_paged_batch([(150, 1), (90, 1), (33, 1), (200, 1)], heads, kv_heads, head_dim, 16, dtype=dtype)
    queries = [randn(ctx, heads, head_dim, dtype=dtype) for ctx in (150, 90, 33, 200)]  # one per position
    results = {}  # position of sequence 0 -> list of outputs
    for step in INVARIANCE_STEPS:
        num_queries = torch.tensor([n for _, _, n in step])
        out = attention(
            q=torch.cat([queries[s][ctx - n:ctx] for s, ctx, n in step]),
            k_cache=shared["k_cache"], v_cache=shared["v_cache"],
            block_tables=shared["block_tables"][[s for s, _, _ in step]],
            seq_lens=torch.tensor([ctx for _, ctx, _ in step], device=DEVICE),
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), num_queries.cumsum(0)]).to(DEVICE),
            scale=head_dim ** -0.5, **({"window": window} if window else {}),
            **({"sinks": sinks} if sinks is not None else {}),
        )
        start = 0
        for s, ctx, n in step:
            if s == 0:
                for i, pos in enumerate(range(ctx - n, ctx)):
                    results.setdefault(pos, []).append(out[start + i])
            start += n
    assert sum(len(v) for v in results.values()) == 72
    for pos, outs in results.items():
        for other in outs[1:]:
            assert torch.equal(outs[0], other), f"position {pos}: bits differ between batches"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_reference_realistic_sizes(dtype):
    """Llama-3.2-1B-shaped heads, 64 sequences, long contexts (too slow for the interpreter)."""
    seqs = [(int(ctx), 1) for ctx in torch.randint(1, 2049, (56,))] + [(int(c), 64) for c in (64, 500, 1000, 2048)]
    seqs += [(4096, 512)] * 4
    check_against_reference(make_paged_batch(seqs, 32, 8, 64, 16, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 80), (4, 4, 16), (8, 1, 48)])
def test_the_8_lane_attention_gives_the_16_lane_bits(dtype, heads, kv_heads, head_dim):
    """The AVX2 (8-lane) path splits every 16-lane sum into two halves added as fold's first
    level, so it makes the AVX-512 path's sums in the same order: the same bits, at contexts
    ending inside, on and past each 8- and 16-key chunk."""
    from kernels import build, cpu_kernels

    if not {"avx512", "avx2"} <= set(build.host_tiers()):
        pytest.skip("needs a CPU that runs both the avx512 and the avx2 tier")
    batch = make_paged_batch([(1, 1), (7, 1), (8, 1), (9, 1), (16, 1), (17, 1), (300, 1), (40, 40)], heads,
                             kv_heads, head_dim, 16, dtype=dtype, device="cpu")
    outputs = {}
    for tier in ("avx512", "avx2"):
        with cpu_kernels.use_isa(tier):
            outputs[tier] = paged_attention_cpu(**batch)
    assert torch.equal(outputs["avx2"], outputs["avx512"])
