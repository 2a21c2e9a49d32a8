"""The linear layer gives a row the same bits whatever the number of rows and its position."""
from __future__ import annotations

import pytest
import torch

from kernels.linear import invariant_linear, plain_linear, prepack


@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 512), (576, 1536)])
def test_row_bits_do_not_depend_on_batch(dtype, shape, packed):
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    weight = prepack(dense) if packed else dense
    row = torch.randn(1, in_features, generator=gen).to(dtype)
    want = invariant_linear(row, weight, bias)[0]
    for num_rows in [*range(1, 19), 64, 65, 300]:
        for position in sorted({0, num_rows // 2, num_rows - 1}):
            x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
            x[position] = row[0]
            assert torch.equal(invariant_linear(x, weight, bias)[position], want), (num_rows, position)


def test_row_bits_do_not_depend_on_thread_count():
    """One worker may run with 1 thread and another with 2 (the launcher splits the cores)."""
    gen = torch.Generator().manual_seed(2)
    weight = prepack(torch.randn(1536, 576, generator=gen))
    x = torch.randn(37, 576, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = invariant_linear(x, weight, None)
        torch.set_num_threads(2)
        two = invariant_linear(x, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_packed_weight_gives_the_dense_result():
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(256, 64, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(invariant_linear(x, prepack(dense), None), x @ dense.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain_linear(x, prepack(dense), None), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_plain_linear_is_not_invariant_here():
    """Documents why the invariant path pads: a single row takes oneDNN's matrix-vector path."""
    gen = torch.Generator().manual_seed(1)
    weight, x = prepack(torch.randn(512, 64, generator=gen)), torch.randn(6, 64, generator=gen)
    alone = plain_linear(x[:1], weight, None)[0]
    in_batch = plain_linear(x, weight, None)[0]
    if torch.equal(alone, in_batch):
        pytest.skip("this CPU's oneDNN gives a single row the same bits; the padding is harmless")
    assert not torch.equal(alone, in_batch)
