"""The Triton SiLU-and-multiply against the reference."""
import pytest
import torch

from kernel_helpers import DTYPES, dtype_id, randn
from kernels.activation import silu_and_mul_ref
from kernels.triton_activation import silu_and_mul_triton

# Both round silu(gate) to the dtype, then the product; exp may differ in its last bit.
TOLERANCE = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("inter", [64, 200, 2500])  # 2500: several column steps and a ragged tail
def test_matches_reference(inter, dtype, poisoned_empty):
    x = randn(5, 2 * inter, dtype=dtype) * 3
    out = silu_and_mul_triton(x)
    ref = silu_and_mul_ref(x)
    assert out.dtype == dtype and out.shape == (5, inter)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
