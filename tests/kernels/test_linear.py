"""The linear layer gives a row the same bits whatever the number of rows and its position."""
from __future__ import annotations

import pytest
import torch

from kernels.linear import invariant_linear, plain_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 512), (576, 1536)])
def test_row_bits_do_not_depend_on_batch(dtype, shape):
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    row = torch.randn(1, in_features, generator=gen).to(dtype)
    want = invariant_linear(row, weight, None)[0]
    for num_rows in range(1, 19):
        for position in range(num_rows):
            x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
            x[position] = row[0]
            assert torch.equal(invariant_linear(x, weight, None)[position], want), (num_rows, position)


def test_plain_linear_is_not_invariant_here():
    """Documents why the invariant path exists: fp32 MKL rows in a partial tile differ."""
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(512, 64, generator=gen), torch.randn(6, 64, generator=gen)
    full = plain_linear(torch.cat([x[4:5], x[:3]]), weight, None)[0]  # the row inside a full tile
    tail = plain_linear(x, weight, None)[4]  # the same row in the partial tile of M=6
    if torch.equal(full, tail):
        pytest.skip("this CPU's BLAS gives the same bits; the padding is harmless")
    assert not torch.equal(full, tail)
