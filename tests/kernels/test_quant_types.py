"""Every GGUF block type served (kernels/quant.py's FORMATS): the sizes ggml gives, the dequantizer
against the `gguf` package's bit for bit, and the tests' writer of valid blocks (quant_helpers.random_blocks)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import quant
from tests.kernels.quant_helpers import (ALL_TYPES, GGUF_QUANTIZES, SCALE_FIELDS, gguf_blocks, gguf_dequantize,
                                         random_blocks)

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
