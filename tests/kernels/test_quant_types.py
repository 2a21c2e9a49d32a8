"""Every GGUF block type served (kernels/quant.py's FORMATS): the sizes ggml gives, the dequantizer
against the `gguf` package's bit for bit, the tests' writer of valid blocks (quant_helpers.random_blocks),
and quant_gemm.c's fp32-activation product of each type on every tier: the bits of one fused chain per
output in a fixed order (quant_helpers.fp32_linear_reference) on every tier (x86's generic one with libm's
fmaf), aarch64 under qemu included, whatever the batch, the row's position or the thread count."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from kernels import cpu_kernels, quant
from tests.kernels import aarch64
from tests.kernels.quant_helpers import (ALL_TYPES, GGUF_QUANTIZES, GGUF_TYPES, SCALE_FIELDS, fp32_linear_reference,
                                         gguf_blocks, gguf_dequantize, host_tiers, random_blocks, tier_library)

NEW_TYPES = [name for name in ALL_TYPES if name not in GGUF_TYPES]  # tests/kernels/test_quant.py has the others
DTYPES = [torch.float32, torch.bfloat16]

gguf = pytest.importorskip("gguf")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_block_sizes_are_ggmls(name):
    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]
    fmt = quant.FORMATS[name]
    assert fmt == gguf.GGMLQuantizationType[name.upper()].value  # ggml's type id
    assert (quant.block_elems(fmt), quant.BLOCK_BYTES[fmt]) == (elems, size)
    assert quant.row_bytes(fmt, 3 * elems) == 3 * size
    with pytest.raises(ValueError, match=f"whole blocks of {elems}"):
        quant.row_bytes(fmt, elems + 32 if elems > 32 else 48)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantizer_is_ggufs_bit_for_bit(name):
    """Random valid blocks (every quant, scale and min bit pattern the writer draws) dequantize to gguf's bits."""
    rng = np.random.default_rng(7)
    k = 512
    blocks = random_blocks(name, 9, k, rng, scale=0.05)
    want = gguf_dequantize(blocks, name)
    got = quant.dequantize_rows(torch.from_numpy(blocks), quant.FORMATS[name], k)
    assert same_bits(got, want)
    assert torch.isfinite(want).all() and 0.01 < want.abs().mean() < 0.25  # the writer's values are of its scale
    weight = quant.from_blocks(blocks, quant.FORMATS[name], k, torch.bfloat16)
    assert torch.equal(weight[torch.tensor([8, 0])], want[[8, 0]].to(torch.bfloat16))  # the embedding lookup


@pytest.mark.parametrize("name", GGUF_QUANTIZES)
def test_dequantizer_on_ggufs_own_quantizer(name):
    dense = np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32)
    blocks, want = gguf_blocks(dense, name)
    assert same_bits(quant.dequantize_rows(torch.from_numpy(blocks), quant.FORMATS[name], 256), want)


def test_dequantizer_extremes():
    """Subnormal, negative and zero scales, the largest quants: still gguf's bits (K-quants and IQ4_XS)."""
    rng = np.random.default_rng(11)
    for name in ALL_TYPES:
        blocks = random_blocks(name, 4, 256, rng)
        blocks[0] = 0xFF  # every quant at its largest code; the fp16 fields NaN, set below
        blocks[1] = 0x00
        for offset, _ in SCALE_FIELDS[name][0]:
            blocks[0, offset:offset + 2] = np.array([np.float16(-3.0e-7)]).view(np.uint8)  # subnormal, negative
            blocks[1, offset:offset + 2] = np.array([np.float16(65504.0)]).view(np.uint8)
        want = gguf_dequantize(blocks, name)
        assert same_bits(quant.dequantize_rows(torch.from_numpy(blocks), quant.FORMATS[name], 256), want), name


@pytest.fixture(scope="module", params=host_tiers())
def tier(request):
    return request.param


def typed_weight(name: str, out_features: int, in_features: int, dtype: torch.dtype, seed: int):
    blocks = random_blocks(name, out_features, in_features, np.random.default_rng(seed), scale=0.1)
    return quant.from_blocks(blocks, quant.FORMATS[name], in_features, dtype), gguf_dequantize(blocks, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ALL_TYPES)
def test_fp32_product_of_every_type(tier, name, dtype):
    """The product of gguf's dequantized values, with the reference chain's bits on every tier: avx512, avx2
    and x86's generic tier, whose multiply-adds are libm's fmaf (kernels/csrc/vec.h), fused as the instruction."""
    weight, values = typed_weight(name, 37, 512, dtype, seed=len(name))
    lib = tier_library(tier)
    bias = torch.randn(37).to(dtype)
    for rows in (1, 3, 6):
        x = torch.randn(rows, 512).to(dtype)
        got = quant.run_kernel(lib, x, weight, bias)
        want = fp32_linear_reference(x, values, bias)
        assert torch.equal(got, want), (rows, (got.float() - want.float()).abs().max())
        bound = (x.float().abs() @ values.abs().T) * 1e-6 + 1e-6 + want.float().abs() * (2 ** -8 if
                                                                                           dtype == torch.bfloat16 else 0)
        assert ((got.float() - (x.float() @ values.T + bias.float())).abs() <= bound).all()


@pytest.mark.parametrize("name", NEW_TYPES)
def test_fp32_row_bits_do_not_depend_on_batch_position_or_threads(tier, name):
    weight, _ = typed_weight(name, 70, 256, torch.float32, seed=3)  # 70: no multiple of a tile or a thread's chunk
    lib = tier_library(tier)
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(1, 256, generator=gen)
    want = quant.run_kernel(lib, row, weight, None)[0]
    threads = torch.get_num_threads()
    try:
        for count, num_rows in ((1, 2), (1, 5), (2, 9), (3, 6)):
            torch.set_num_threads(count)
            for position in sorted({0, num_rows // 2, num_rows - 1}):
                x = torch.randn(num_rows, 256, generator=gen)
                x[position] = row[0]
                assert torch.equal(quant.run_kernel(lib, x, weight, None)[position], want), (count, num_rows, position)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", NEW_TYPES)
def test_rows_that_are_not_whole_blocks_are_refused(name):
    fmt = quant.FORMATS[name]
    lib = quant.declare(cpu_kernels.library())
    assert lib.quant_row_bytes(fmt, 3 * quant.block_elems(fmt)) == quant.row_bytes(fmt, 3 * quant.block_elems(fmt))
    assert lib.quant_row_bytes(fmt, quant.block_elems(fmt) + 32 if quant.block_elems(fmt) > 32 else 48) == 0


@pytest.mark.parametrize("name", NEW_TYPES)
def test_int8_activations_take_every_type(name):
    """quant_dot.c takes every type (tests/kernels/test_kquant_dot.py has their bits); their rows are
    interleaved as Q4_0's are (the same bytes moved)."""
    weight, _ = typed_weight(name, 16, 256, torch.float32, seed=1)
    int8 = weight.with_activations(True)
    assert int8.int8_activations and int8.interleaved
    assert torch.equal(int8.row_data(), weight.data)
    assert torch.equal(int8.data, weight.data) != int8.interleaved


@pytest.mark.slow
@pytest.mark.skipif(aarch64.MISSING is not None, reason=str(aarch64.MISSING))
def test_aarch64_gives_the_same_bits(tmp_path):
    """Every type, fp32 and bf16, built for aarch64 (NEON FMAs) and run under qemu: the reference chain's bits."""
    exe = aarch64.check_executable("quant_dot_check.c", tmp_path / "quant_check")
    blob, expected = b"", []
    for i, (name, dtype) in enumerate([(n, d) for n in ALL_TYPES for d in DTYPES]):
        weight, values = typed_weight(name, 20, 256, dtype, seed=i)
        gen = torch.Generator().manual_seed(i)
        x, bias = torch.randn(3, 256, generator=gen).to(dtype), torch.randn(20, generator=gen).to(dtype)
        header = np.array([3, 20, 256, weight.kernel_fmt, int(dtype == torch.bfloat16), 1, weight.data.numel()],
                          np.int64)
        blob += header.tobytes() + _bytes(x) + weight.data.numpy().tobytes() + _bytes(bias)
        expected.append(_bytes(fp32_linear_reference(x, values, bias)))
    assert aarch64.run(exe, blob, tmp_path)[1] == b"".join(expected)


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
