"""The kernel tiers give the same bits wherever the avx2 tier's build has an equal on the others:
each kernel (attention, the row-wise ops, the dense GEMM, the quantized GEMM with fp32 activations)
on the generic tier (GCC vector extensions, no FMA instruction on a baseline x86-64: its fused
multiply-adds are libm's correctly rounded fmaf) and on the avx512 tier equals the avx2 tier's
output bit for bit. The one exception is bf16 GEMM on a CPU with AVX-512 BF16 (vdpbf16ps takes k in
pairs): there the avx512 tier is left out and avx512-nobf16, the same tier as built without it,
is compared instead (docs/ARCHITECTURE.md, "Kernels")."""
from __future__ import annotations

import pytest
import torch

from kernels import build, cpu_kernels
from kernels.linear import invariant_linear, prepack
from tests.kernels.kernel_helpers import make_paged_batch, randn
from tests.kernels.test_quant import make_weight

DTYPES = [torch.float32, torch.bfloat16]
OTHERS = [tier for tier in build.testable_tiers() if tier != "avx2"]

pytestmark = pytest.mark.skipif("avx2" not in build.host_tiers(), reason="needs a CPU that runs the avx2 tier")


def _on_each_tier(fn, tiers=("avx2", *OTHERS)) -> dict[str, torch.Tensor]:
    outputs = {}
    for tier in tiers:
        with cpu_kernels.use_isa(tier):
            outputs[tier] = fn()
    return outputs


def _same_bits(outputs: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    want = outputs["avx2"]
    for tier, got in outputs.items():
        if tier in skip:
            continue
        differ = (got.float().view(torch.int32) != want.float().view(torch.int32)).sum().item()
        assert differ == 0, f"{tier}: {differ} of {want.numel()} elements differ from avx2's bits"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 48)])
def test_attention(dtype, heads, kv_heads, head_dim):
    batch = make_paged_batch([(1, 1), (9, 1), (17, 1), (300, 1), (40, 40)], heads, kv_heads, head_dim, 16,
                             dtype=dtype, device="cpu")
    batch["q"] = batch["q"] * 4  # peaked softmax: exp's whole range
    _same_bits(_on_each_tier(lambda: cpu_kernels.paged_attention_cpu(**batch)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype):
    x, res, w = randn(13, 200, dtype=dtype), randn(13, 200, dtype=dtype), randn(200, dtype=dtype)
    _same_bits(_on_each_tier(lambda: torch.cat(cpu_kernels.rms_norm_cpu(x, w, 1e-5, res))))
    _same_bits(_on_each_tier(lambda: cpu_kernels.rms_norm_cpu(x, w, 1e-5)[0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary(dtype):
    q, k = randn(11, 4, 64, dtype=dtype), randn(11, 2, 64, dtype=dtype)
    angles = torch.arange(40)[:, None] * torch.rand(32)[None]
    cache = torch.cat([angles.cos(), angles.sin()], -1)
    positions = torch.randint(0, 40, (11,))
    _same_bits(_on_each_tier(lambda: torch.cat([t.flatten() for t in
                                                cpu_kernels.apply_rotary_cpu(q, k, positions, cache)])))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype):
    x = randn(9, 2 * 150, dtype=dtype) * 6
    _same_bits(_on_each_tier(lambda: cpu_kernels.silu_and_mul_cpu(x)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7])
def test_dense_gemm(dtype, rows):
    weight, bias = randn(100, 77, dtype=dtype), randn(100, dtype=dtype)
    x = randn(rows, 77, dtype=dtype)

    def run():
        return invariant_linear(x, prepack(weight), bias)  # packed for the active tier

    skip = ()
    if dtype == torch.bfloat16 and "avx512" in OTHERS and \
            cpu_kernels.compiled_path(cpu_kernels.tier_library("avx512")) == "avx512+bf16":
        skip = ("avx512",)  # vdpbf16ps: k in pairs
    _same_bits(_on_each_tier(run), skip=skip)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int8"])
def test_quantized_gemm_fp32_activations(fmt, dtype):
    weight, _ = make_weight(fmt, 40, 96, dtype)
    x, bias = randn(5, 96, dtype=dtype), randn(40, dtype=dtype)
    _same_bits(_on_each_tier(lambda: cpu_kernels_quant_linear(x, weight, bias)))


def cpu_kernels_quant_linear(x, weight, bias):
    from kernels import quant

    return quant.run_kernel(quant.declare(cpu_kernels.library()), x, weight, bias)
