"""The linear layer gives a row the same bits whatever the number of rows and its position."""
from __future__ import annotations

import pytest
import torch

from kernels import build, cpu_kernels
from kernels.linear import GemmWeight, invariant_linear, onednn_runs, plain_linear, prepack
from tests.conftest import use_tier

# the own GEMM once per kernel tier this CPU executes, then the libraries it replaces
LIBRARIES = [*(pytest.param(("gemm", tier), id=f"gemm-{tier}") for tier in build.testable_tiers()),
             pytest.param(("onednn", None), id="onednn"), pytest.param(("dense", None), id="dense")]


@pytest.fixture(params=LIBRARIES)
def library(request):
    name, tier = request.param
    if tier is None:
        yield name
        return
    for _ in use_tier(tier):  # the tier active while the test runs
        yield name


def _prepack(dense: torch.Tensor, library: str):
    if library == "onednn" and not onednn_runs(dense.dtype):
        pytest.skip(f"oneDNN does not run {dense.dtype} on this CPU")
    weight = prepack(dense, library)
    if library == "gemm" and not isinstance(weight, GemmWeight):
        pytest.skip("no C compiler: no compiled GEMM")
    return weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 512), (576, 1536), (37, 100)], ids=["64x512", "576x1536", "odd"])
def test_row_bits_do_not_depend_on_batch(dtype, shape, library):
    in_features, out_features = shape
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    weight = _prepack(dense, library)
    row = torch.randn(1, in_features, generator=gen).to(dtype)
    want = invariant_linear(row, weight, bias)[0]
    for num_rows in [*range(1, 19), 64, 65, 97, 300]:
        for position in sorted({0, num_rows // 2, num_rows - 1}):
            x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
            x[position] = row[0]
            assert torch.equal(invariant_linear(x, weight, bias)[position], want), (num_rows, position)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_bits_do_not_depend_on_thread_count(library, dtype):
    """One worker may run with 1 thread and another with 2 (the launcher splits the cores)."""
    if library == "dense":
        pytest.skip("F.linear's threading is MKL's")
    gen = torch.Generator().manual_seed(2)
    weight = _prepack(torch.randn(1536, 576, generator=gen).to(dtype), library)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = invariant_linear(x, weight, None)
        torch.set_num_threads(2)
        two = invariant_linear(x, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("shape", [(256, 64), (49, 37), (1, 1), (100, 1537)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weight_gives_the_dense_result(library, shape, dtype):
    """Every path computes x W^T + b: within fp32 rounding, and for bf16 within one bf16 step of
    the exact product of the bf16 inputs (all accumulate in fp32)."""
    gen = torch.Generator().manual_seed(3)
    out_features, in_features = shape
    dense = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(5, in_features, generator=gen).to(dtype)
    exact = x.double() @ dense.double().T + bias.double()
    weight = _prepack(dense, library)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1 / 128, atol=1e-2)
    for fn in (invariant_linear, plain_linear):
        torch.testing.assert_close(fn(x, weight, bias).double(), exact, **tolerance)


def test_gemm_takes_strided_and_batched_inputs(cpu_tier):
    """A view of a wider tensor (a row stride) and [B, T, K] inputs give the contiguous result."""
    gen = torch.Generator().manual_seed(4)
    weight = _prepack(torch.randn(96, 64, generator=gen), "gemm")
    wide = torch.randn(7, 100, generator=gen)
    view = wide[:, 10:74]
    assert torch.equal(invariant_linear(view, weight, None), invariant_linear(view.contiguous(), weight, None))
    batched = torch.randn(2, 3, 64, generator=gen)
    out = invariant_linear(batched, weight, None)
    assert out.shape == (2, 3, 96)
    assert torch.equal(out.reshape(6, 96), invariant_linear(batched.reshape(6, 64), weight, None))
    assert invariant_linear(torch.empty(0, 64), weight, None).shape == (0, 96)


def test_gemm_refuses_an_input_in_another_dtype():
    weight = _prepack(torch.randn(48, 16), "gemm")
    with pytest.raises(TypeError, match="bfloat16"):
        invariant_linear(torch.randn(2, 16).to(torch.bfloat16), weight, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_packs_for_the_compiled_gemm_on_every_tier(cpu_tier, dtype):
    weight = prepack(torch.randn(48, 16).to(dtype))
    assert isinstance(weight, GemmWeight) and weight.dtype == dtype
    assert weight.shape == (48, 16)


def test_bf16_never_goes_to_a_onednn_that_cannot_run_it(monkeypatch):
    """Without a compiler, on a CPU whose oneDNN has no bf16 (AVX2), bf16 weights stay dense:
    F.linear is slow there but runs, where oneDNN's primitive fails at the first call."""
    monkeypatch.setattr(cpu_kernels, "gemm_supported", lambda dtype: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    weight = prepack(torch.randn(48, 16).to(torch.bfloat16))
    assert isinstance(weight, torch.Tensor) and not weight.is_mkldnn
    assert prepack(torch.randn(48, 16)).is_mkldnn  # fp32 still takes oneDNN


def test_plain_linear_is_not_invariant_on_onednn():
    """Documents why the oneDNN path pads: a single row takes oneDNN's matrix-vector path."""
    gen = torch.Generator().manual_seed(1)
    weight, x = prepack(torch.randn(512, 64, generator=gen), "onednn"), torch.randn(6, 64, generator=gen)
    alone = plain_linear(x[:1], weight, None)[0]
    in_batch = plain_linear(x, weight, None)[0]
    if torch.equal(alone, in_batch):
        pytest.skip("this CPU's oneDNN gives a single row the same bits; the padding is harmless")
    assert not torch.equal(alone, in_batch)


def test_gemm_refuses_mismatched_shapes():
    """The compiled kernel trusts its shapes; a wrong input width or bias length must not reach it."""
    weight = _prepack(torch.randn(4, 8), "gemm")
    with pytest.raises(ValueError, match="16 features, the weight takes 8"):
        invariant_linear(torch.randn(2, 16), weight, None)
    with pytest.raises(ValueError, match="bias has 5 elements"):
        invariant_linear(torch.randn(2, 8), weight, torch.randn(5))
