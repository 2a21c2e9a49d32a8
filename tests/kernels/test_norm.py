"""The Triton RMSNorm (with the fused residual add) against the reference."""
import pytest
import torch

from kernel_helpers import DTYPES, dtype_id, randn
from kernels.norm import rms_norm_ref
from kernels.triton_norm import rms_norm_triton

# Statistics in fp32 in both; they may differ in the last bit of the scale (sum order,
# sqrt), which bf16/fp16 rounding of the normed row can turn into one ulp of the output.
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
    torch.float16: dict(atol=2e-3, rtol=1e-3),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("num_cols", [64, 200, 2048])
def test_matches_reference(num_cols, with_residual, dtype, poisoned_empty):
    x, weight = randn(7, num_cols, dtype=dtype), randn(num_cols, dtype=dtype)
    residual = randn(7, num_cols, dtype=dtype) if with_residual else None
    out, new_residual = rms_norm_triton(x, weight, 1e-6, residual)
    ref, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])
    if with_residual:
        assert torch.equal(new_residual, ref_residual), "x + residual is one rounding in both"
    else:
        assert new_residual is None


def test_per_head_norm_on_strided_3d_input(poisoned_empty):
    """Qwen3's q/k norm: [T, H, D] views of the QKV projection, weight over D."""
    qkv = randn(5, 12 * 32, dtype=torch.bfloat16)
    q = qkv[:, : 8 * 32].view(5, 8, 32)
    weight = randn(32, dtype=torch.bfloat16)
    out, _ = rms_norm_triton(q, weight, 1e-6)
    assert out.shape == (5, 8, 32)
    torch.testing.assert_close(out, rms_norm_ref(q, weight, 1e-6)[0], **TOLERANCE[torch.bfloat16])


def test_fp32_weight_promotes_output(poisoned_empty):
    x, weight = randn(3, 64, dtype=torch.bfloat16), randn(64)
    out, _ = rms_norm_triton(x, weight, 1e-5)
    ref, _ = rms_norm_ref(x, weight, 1e-5)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=8e-3)
