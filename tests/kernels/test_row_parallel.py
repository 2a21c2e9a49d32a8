"""The row-parallel layers' one reduction order: the same bits whichever ranks computed the groups.

A layout with tp ranks gives rank r the groups [r G / tp, (r + 1) G / tp) of the weight's K; its
partials, gathered in rank order and folded, must equal the one-process result bit for bit, on
every kernel tier, dense and quantized, fp32 and bf16.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_kernels, quant
from kernels.linear import GemmWeight, prepack
from kernels.row_parallel import (RowParallelWeight, fold_reference, library, partials_reference, reduction_groups,
                                  split_dense, split_quant)
from tests.kernels.quant_helpers import gguf_blocks, random_blocks

GROUPS = 4


def _parts(dense: torch.Tensor, fmt: str, dtype: torch.dtype, groups: int) -> list:
    """The weight's column groups as the loader makes them (each a weight of its own)."""
    if fmt == "dense":
        parts = [prepack(p) for p in split_dense(dense, groups)]
        if not isinstance(parts[0], GemmWeight):
            pytest.skip("no C compiler: no compiled GEMM")
        return parts
    if fmt == "int8":
        return [quant.quantize_int8(p, dtype) for p in split_dense(dense, groups)]
    blocks, _ = gguf_blocks(dense.float().numpy(), fmt)
    return split_quant(quant.from_blocks(blocks, quant.FORMATS[fmt], dense.shape[1], dtype), groups)


def _layout(parts: list, x: torch.Tensor, tp: int) -> torch.Tensor:
    """What a group of tp ranks computes: each rank its groups on its columns, gathered, folded."""
    per_rank, kg = len(parts) // tp, x.shape[1] // len(parts)
    ranks = [RowParallelWeight.build(parts[r * per_rank:(r + 1) * per_rank], len(parts)) for r in range(tp)]
    partials = torch.cat([w.partials(x[:, r * per_rank * kg:(r + 1) * per_rank * kg]) for r, w in enumerate(ranks)])
    return ranks[0].fold(partials, x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["dense", "int8", "q4_0", "q8_0"])
def test_every_tensor_parallel_size_gives_the_same_bits(cpu_tier, fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(96, 256, generator=gen).to(dtype)
    parts = _parts(dense, fmt, dtype, GROUPS)
    for rows in (1, 7, 16):
        x = torch.randn(rows, 256, generator=gen).to(dtype)
        whole = RowParallelWeight.build(parts, GROUPS)(x, None)  # one process
        for tp in (2, 4):
            assert torch.equal(_layout(parts, x, tp), whole), (fmt, dtype, rows, tp)
        values = dense.float() if fmt == "dense" else torch.cat([p.dequantize() for p in parts], dim=1)
        want = x.float() @ values.T
        assert torch.allclose(whole.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_dense_groups_match_the_plain_product(cpu_tier):
    """A sanity check of the dense groups against x W^T (the quantized ones: above, against their values)."""
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(64, 128, generator=gen)
    x = torch.randn(5, 128, generator=gen)
    got = RowParallelWeight.build(_parts(dense, "dense", torch.float32, GROUPS), GROUPS)(x, None)
    assert torch.allclose(got, x @ dense.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fold_is_the_references_order(dtype):
    """The compiled fold adds partial 0, 1, 2, ... in fp32 and rounds once: the reference's bits; another
    order (the last partial first) gives other bits, so the order is what the test pins."""
    if not cpu_kernels.is_available():
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(2)
    partials = torch.randn(GROUPS, 33, 80, generator=gen) * torch.tensor([1e4, 1.0, 1e-3, 3.0]).view(-1, 1, 1)
    weight = RowParallelWeight.build(_parts(torch.randn(80, 64), "dense", torch.float32, GROUPS), GROUPS)
    assert torch.equal(weight.fold(partials, dtype), fold_reference(partials, dtype))
    assert not torch.equal(fold_reference(partials.flip(0), torch.float32), fold_reference(partials, torch.float32))


def test_one_group_is_the_plain_linear_layer(cpu_tier):
    """G = 1 (a model whose heads and MLP share no factor) keeps today's bits: one chain, rounded once."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        dense = torch.randn(48, 96, generator=gen).to(dtype)
        x = torch.randn(9, 96, generator=gen).to(dtype)
        plain = prepack(dense)
        if not isinstance(plain, GemmWeight):
            pytest.skip("no C compiler")
        assert torch.equal(RowParallelWeight.build([plain], 1)(x, None), plain(x, None))


def test_the_reference_path_is_layout_invariant_too():
    """Without the compiled kernels (another device) the PyTorch reference keeps the same contract."""
    gen = torch.Generator().manual_seed(4)
    dense = torch.randn(32, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    parts = split_dense(dense, GROUPS)
    whole = fold_reference(partials_reference(x, parts), torch.float32)
    halves = torch.cat([partials_reference(x[:, :32], parts[:2]), partials_reference(x[:, 32:], parts[2:])])
    assert torch.equal(fold_reference(halves, torch.float32), whole)


@pytest.mark.parametrize("heads, inter, groups", [(9, 1536, 3), (4, 128, 4), (32, 14336, 8), (12, 2560, 4), (7, 96, 1)])
def test_reduction_groups(heads, inter, groups):
    """SmolLM2-135M (9 heads, MLP 1536): 3 groups, so TP 1 and 3; the tiny test models: 4; big ones: 8."""
    assert reduction_groups(heads, inter) == groups


def test_gguf_groups_hold_whole_blocks():
    """The tiny model's o_proj is 64 wide: 4 groups of 16 for dense weights, 2 of 32 for GGUF blocks; the
    default model's (576 and 1536 wide) keep 3 groups of whole blocks."""
    assert reduction_groups(4, 128, head_dim=16) == 4
    assert reduction_groups(4, 128, head_dim=16, align=32) == 2
    assert reduction_groups(9, 1536, head_dim=64, align=32) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_over_k_gives_the_bits_of_partials_and_their_fold(cpu_tier, dtype):
    """One process folds gemm.c's groups in registers in one pass over K (row_parallel_linear); a rank of a
    group computes partials and folds them after the gather. The same bits, on shapes that stress the
    tiles: a partial last panel (100 features), odd groups (33 columns: a half bf16 pair per group), three
    groups, and row counts across tile and row-block edges."""
    gen = torch.Generator().manual_seed(5)
    for out_features, groups, kg in ((100, 3, 33), (48, 4, 16), (130, 2, 64)):
        dense = torch.randn(out_features, groups * kg, generator=gen).to(dtype)
        parts = _parts(dense, "dense", dtype, groups)
        whole = RowParallelWeight.build(parts, groups)
        for rows in (1, 2, 5, 9, 17, 100):
            x = torch.randn(rows, groups * kg, generator=gen).to(dtype)
            assert torch.equal(whole(x, None), whole.fold(whole.partials(x), dtype)), (out_features, groups, rows)


def _assert_one_pass(whole: RowParallelWeight, x: torch.Tensor, dtype: torch.dtype) -> None:
    """quant_dot.c's quant_linear_int8_groups takes the shape (row_parallel_linear would otherwise fall back
    to the partials and their fold, which a comparison with them could not tell) and gives the bits of the
    partials folded after a gather, as does the layer's own call, at 1 and 3 threads (the outputs cut elsewhere)."""
    want = whole.fold(whole.partials(x), dtype)
    for threads in (1, 3):
        got = torch.empty(x.shape[0], whole.out_features, dtype=dtype)
        status = library().quant_linear_int8_groups(
            x.data_ptr(), x.shape[1], whole.buffer.data_ptr(), whole.fmt & ~quant.ACT_INT8, whole.groups, x.shape[0],
            whole.out_features, whole.in_features // whole.groups, int(dtype == torch.bfloat16), got.data_ptr(),
            whole.out_features, threads)
        assert status == 0, f"quant_linear_int8_groups refused the shape: status {status}"
        assert torch.equal(got, want), threads
    assert torch.equal(whole(x, None), want)


ROW_COUNTS = (1, 3, 4, 5, 8, 9, 17)  # across the tiles' edges: the wide tiles' 4 rows, the tiles' 4 or 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "q4_0", "q4_1", "q8_0", "q5_0"])
def test_int8_activations_fold_the_groups_in_one_pass(cpu_tier, fmt, dtype):
    """With int8 activations one process folds each tile's group partials in registers (quant_dot.c's
    quant_linear_int8_groups); a rank computes the partials and folds them after the gather. The same
    bits, with interleaved groups of 16 rows (two whole ones: the wide tiles) and rows past them (40, 100
    outputs), int8 groups that end inside a block (45 columns), and row counts across the tiles' edges."""
    gen = torch.Generator().manual_seed(6)
    shapes = [(40, 3, 64), (100, 2, 96)] + ([(24, 3, 45)] if fmt == "int8" else [])
    for out_features, groups, kg in shapes:
        dense = torch.randn(out_features, groups * kg, generator=gen).to(dtype)
        parts = [p.with_activations(True) for p in _parts(dense, fmt, dtype, groups)]
        assert parts[0].interleaved == (kg % 32 == 0 or fmt != "int8")
        whole = RowParallelWeight.build(parts, groups)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, groups * kg, generator=gen).to(dtype)
            _assert_one_pass(whole, x, dtype)


def _kquant_parts(fmt: str, out_features: int, groups: int, kg: int, dtype: torch.dtype, seed: int) -> list:
    """A K-quant weight of valid random blocks (gguf quantizes none of these) cut into its K groups."""
    data = random_blocks(fmt, out_features, groups * kg, np.random.default_rng(seed))
    weight = quant.from_blocks(data, quant.FORMATS[fmt], groups * kg, dtype).with_activations(True)
    return split_quant(weight, groups)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_k", "iq4_xs"])
def test_kquants_fold_the_groups_in_one_pass(cpu_tier, fmt, dtype):
    """The super-block K-quants (what Q4_K_M, Q5_K_M and Q6_K files' o_proj and down_proj are) in the same one
    pass: each group's rows quantized per super-block of 256 as its own call does, each tile's group values
    added in order; two whole interleaved groups (the wide tiles), rows past them (40 outputs), rows in
    order (12 outputs: no whole group), 1 and 3 groups."""
    gen = torch.Generator().manual_seed(7)
    for out_features, groups, kg in ((40, 3, 256), (12, 1, 512)):
        whole = RowParallelWeight.build(_kquant_parts(fmt, out_features, groups, kg, dtype, seed=groups), groups)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, groups * kg, generator=gen).to(dtype)
            _assert_one_pass(whole, x, dtype)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_kquant_experts_in_one_call_fold_as_each_experts_own_layer(cpu_tier, fmt):
    """quant_experts_int8 (a MoE layer's experts in one call, what Q4_K_M MoE files' experts are) on K-quant
    experts: each expert's rows get the bits of its own one-pass layer, its K groups folded in order, whatever
    rows share the call (an expert of 1 row, one of 6: the wide tiles)."""
    gen = torch.Generator().manual_seed(8)
    experts = [RowParallelWeight.build(_kquant_parts(fmt, 40, 2, 256, torch.float32, seed=e), 2) for e in range(2)]
    x = torch.randn(7, 512, generator=gen)
    spans = torch.tensor([[0, 1], [1, 7]], dtype=torch.int64)
    addresses = torch.tensor([w.buffer.data_ptr() for w in experts], dtype=torch.int64)
    got = torch.empty(7, 40)
    status = quant.declare(cpu_kernels.library()).quant_experts_int8(
        x.data_ptr(), 512, spans.data_ptr(), addresses.data_ptr(), 2, experts[0].fmt & ~quant.ACT_INT8, 2, 7, 40, 512,
        0, got.data_ptr(), 40, torch.get_num_threads())
    assert status == 0, f"quant_experts_int8 refused {fmt}: status {status}"
    for w, (start, stop) in zip(experts, spans.tolist()):
        rows = x[start:stop]
        assert torch.equal(got[start:stop], w.fold(w.partials(rows), torch.float32)), (fmt, start)
