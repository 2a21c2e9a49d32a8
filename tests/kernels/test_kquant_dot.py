"""The K-quants (Q2_K .. Q6_K, IQ4_XS: int8 activations per super-block of 256) and Q5_0, Q5_1, IQ4_NL (per
block of 32) with int8 activations (kernels/csrc/quant_dot.c): the numpy reference's bits (kernels/
kquant_int8.py) on every tier this CPU builds, whatever the batch or the thread count; the blocks read as
gguf's dequantizer reads them; and the product within int8 activations' error of the dequantized one."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kernels import cpu_kernels, kquant_int8, quant
from kernels.row_parallel import RowParallelWeight, fold_reference, split_quant
from tests.kernels.quant_helpers import SCALE_FIELDS, gguf_dequantize, random_blocks
from tests.kernels.test_quant_dot import _bits, _hard_rows, _tiers, assert_rows_independent

FORMATS = ["q4_k", "q6_k", "q5_k", "q3_k", "q2_k", "iq4_xs", "q5_0", "q5_1", "iq4_nl"]


def kquant_weight(name: str, n: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> quant.QuantWeight:
    """A weight [n, k] of valid random blocks (quant_helpers.random_blocks) for int8 activations."""
    data = random_blocks(name, n, k, np.random.default_rng(seed))
    return quant.from_blocks(data, quant.FORMATS[name], k, dtype).with_activations(True)


@pytest.fixture(scope="module")
def libs():
    return {tier: quant.declare(cpu_kernels.tier_library(tier)) for tier in _tiers()}


@pytest.mark.parametrize("name", FORMATS)
def test_blocks_read_as_ggufs_dequantizer_reads_them(name):
    """The integers the kernel multiplies (and their scales) are the values gguf's dequantizer gives."""
    weight = kquant_weight(name, 6, 512, seed=1)
    fmt = quant.FORMATS[name]
    raw = weight.row_data().numpy().reshape(6, -1, quant.BLOCK_BYTES[fmt])
    want = gguf_dequantize(weight.row_data().numpy(), name).numpy().reshape(6, 512)
    got = kquant_int8.values(raw, fmt).reshape(6, 512)
    assert np.allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_every_tier_gives_the_references_bits(libs, name, dtype):
    m, n, k = 5, 37, 512
    weight = kquant_weight(name, n, k, seed=len(name), dtype=dtype)
    x, bias = _hard_rows(m, k, dtype, seed=n), torch.randn(n).to(dtype)
    want = quant.int8_linear_reference(x, weight, bias).to(dtype)
    for tier, lib in libs.items():
        got = quant.run_kernel(lib, x, weight, bias)
        assert torch.equal(_bits(got), _bits(want)), tier
    values = gguf_dequantize(weight.row_data().numpy(), name).reshape(n, k)
    exact = x.float() @ values.T + bias.float()  # gguf's values: within int8 activations' error of the product
    assert (got.float() - exact).norm() < 0.03 * exact.norm()


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q5_k", "q2_k", "q5_1"])
@pytest.mark.parametrize("tier", _tiers())
def test_a_rows_bits_do_not_depend_on_the_batch_or_threads(libs, name, tier):
    lib = libs[tier]
    weight = kquant_weight(name, 70, 512, seed=3)
    assert_rows_independent(lib, _hard_rows(11, 512, torch.float32, seed=5), weight)


@pytest.mark.parametrize("name", ["q4_k", "q5_1"])
def test_row_parallel_groups_fold_the_groups_chains(name):
    """Tensor-parallel K groups of whole blocks: each group's partial (bias none, fp32), folded in order."""
    weight = kquant_weight(name, 40, 768, seed=9)
    parts = split_quant(weight, 3)
    rows = _hard_rows(5, 768, torch.float32, seed=2)
    got = RowParallelWeight.build(parts, 3)(rows, None)
    want = fold_reference(torch.stack([quant.int8_linear_reference(rows[:, g * 256:(g + 1) * 256], p, None)
                                       for g, p in enumerate(parts)]), torch.float32)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs", "iq4_nl", "q5_0", "q5_1"])
def test_interleaved_rows_give_the_bits_of_rows_in_order(libs, name):
    """Q2_K .. Q6_K, IQ4_XS, IQ4_NL, Q5_0 and Q5_1's rows interleaved by groups of 16 at load (the x86 tiles' layout, quant_dot.c's
    header): the bits of the same rows in row order on every tier, and the same rows back for the embedding
    lookup and the fp32-activation path."""
    weight = quant.from_blocks(random_blocks(name, 40, 512, np.random.default_rng(4)), quant.FORMATS[name], 512,
                               torch.float32)  # two whole groups, then 8 rows in order
    interleaved = weight.with_activations(True)
    assert interleaved.interleaved and not torch.equal(interleaved.data[:32], weight.data[:32])
    assert torch.equal(interleaved.data[32:], weight.data[32:])
    in_order = replace(weight, int8_activations=True)
    x = _hard_rows(9, 512, torch.float32, seed=6)
    want = quant.int8_linear_reference(x, weight, None)
    for tier, lib in libs.items():
        assert torch.equal(_bits(quant.run_kernel(lib, x, interleaved, None)), _bits(want)), tier
        assert torch.equal(_bits(quant.run_kernel(lib, x, in_order, None)), _bits(want)), tier
    ids = torch.tensor([[0, 15, 16], [31, 33, 39]])
    assert torch.equal(interleaved[ids], weight[ids])  # the embedding lookup of a tied lm_head
    assert torch.equal(interleaved.row_data(), weight.data)
    assert torch.equal(interleaved.with_activations(False).data, weight.data)


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs", "iq4_nl", "q5_0", "q5_1"])
def test_largest_integers_stay_exact_on_every_tier(libs, name):
    """The x86 kernels add u q in int16 pairs (vpmaddubsw) before the sub-block scales: blocks whose every
    value, scale and min is at its largest (Q4_K: 15, 63, 63; Q5_K: 31, 63, 63; Q2_K: 3, 15, 15; Q6_K: u = 63
    with scale -128, and u = 0; Q3_K: w = 3 with scale 31, and w = -4 with scale -32; IQ4_XS: 113 with scale 31, and -127
    with scale -32; IQ4_NL: 113 and -127; Q5_0, Q5_1: u = 31 (Q5_0 w = 15), and u = 0 (Q5_0 w = -16))
    against activations of +-127 give the reference's bits, so no pair or sum saturates or wraps."""
    fmt, k = quant.FORMATS[name], 512
    data = np.full((32, quant.row_bytes(fmt, k)), 0xFF, np.uint8)
    blocks = data.reshape(32, -1, quant.BLOCK_BYTES[fmt])
    if name == "q6_k":
        blocks[16:, :, :192] = 0  # u = 0: w = -32
        blocks[..., 192:208] = 0x80  # scales -128
    if name == "q3_k":
        blocks[16:, :, :108] = 0  # hmask and qs 0: w = -4, scales 0 - 32
    if name in ("iq4_nl", "iq4_xs", "q5_0", "q5_1"):
        blocks[16:, :, 4 if name == "q5_1" else 2:] = 0  # nibbles 0: -127 (IQ4_XS: scales 0 - 32; Q5: qh 0, u = 0)
    for offset, _ in SCALE_FIELDS[name][0]:
        blocks[..., offset:offset + 2] = np.array([1e-3], np.float16).view(np.uint8)
    weight = quant.from_blocks(data, fmt, k, torch.float32).with_activations(True)
    signs = torch.ones(5, k)  # 5 rows: avx512 VNNI's wide tile (4 rows by 32 outputs), then a row of 16-output tiles
    signs[1] = -1
    signs[2, ::2] = -1
    signs[3, 1::2] = -1
    want = quant.int8_linear_reference(signs, weight, None)
    for tier, lib in libs.items():
        assert torch.equal(_bits(quant.run_kernel(lib, signs, weight, None)), _bits(want)), tier
