"""The quantized linear kernel (kernels/csrc/quant_gemm.c) in every tier this CPU runs: the
product of the `gguf` package's own dequantized weights, and the same bits for a row whatever
the batch, its position in it or the thread count."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import quant
from tests.kernels.quant_helpers import GGUF_TYPES, gguf_blocks, host_tiers, tier_library

FORMATS = [*GGUF_TYPES, "int8"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=host_tiers())
def lib(request):
    return tier_library(request.param)


def make_weight(fmt: str, out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    """(QuantWeight, its fp32 values by the oracle: gguf's dequantizer, or int8's scale times q)."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((out_features, in_features)).astype(np.float32)
    dense[: max(1, out_features // 8)] *= 20  # rows of other magnitudes: scales vary
    if fmt == "int8":
        weight = quant.quantize_int8(torch.from_numpy(dense), dtype)
        data = weight.data
        scale = data[:, :4].contiguous().view(torch.float32)
        return weight, data[:, 4:].contiguous().view(torch.int8).float() * scale
    blocks, values = gguf_blocks(dense, fmt)
    return quant.from_blocks(blocks, GGUF_TYPES[fmt], in_features, dtype), values


def close_to(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, x: torch.Tensor, values: torch.Tensor):
    """fp32: within a few ulps of the sum of |products|; bf16: and one bf16 step of the result."""
    bound = (x.float().abs() @ values.abs().T) * 1e-6 + 1e-6
    if dtype == torch.bfloat16:
        bound = bound + want.abs() * 2 ** -8
    assert ((got.float() - want).abs() <= bound).all(), (got.float() - want).abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(64, 576), (40, 1536), (3, 32)], ids=str)
def test_product_of_the_gguf_dequantized_weights(lib, fmt, dtype, shape):
    out_features, in_features = shape
    weight, values = make_weight(fmt, out_features, in_features, dtype)
    assert torch.equal(weight.dequantize(), values)  # the torch dequantizer (embedding, fallback) is exact too
    bias = torch.randn(out_features).to(dtype)
    for num_rows in (1, 2, 3, 5, 8, 17):
        x = torch.randn(num_rows, in_features).to(dtype)
        got = quant.run_kernel(lib, x, weight, bias)
        assert got.dtype == dtype and got.shape == (num_rows, out_features)
        want = x.float() @ values.T + bias.float()
        close_to(got, want, dtype, x, values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_features", [100, 1, 33])
def test_int8_any_width(lib, dtype, in_features):
    """int8 rows need not be whole blocks: the tail is zero-padded on both sides."""
    weight, values = make_weight("int8", 40, in_features, dtype)
    x = torch.randn(9, in_features).to(dtype)
    close_to(quant.run_kernel(lib, x, weight, None), x.float() @ values.T, dtype, x, values)


def test_int8_quantization_error_is_half_a_step():
    w = torch.randn(64, 300) * torch.logspace(-3, 2, 64)[:, None]
    w[5] = 0  # an all-zero channel stays zero
    q = quant.quantize_int8(w)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    # half a step, plus the fp32 roundings of w / s and of q * s (a few ulps of the value itself)
    assert ((q.dequantize() - w).abs() <= scale / 2 + w.abs() * 2**-22 + 1e-30).all()
    assert torch.equal(q.dequantize()[5], torch.zeros(300))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_row_bits_do_not_depend_on_batch(lib, fmt, dtype):
    in_features, out_features = 576, 199  # out not a multiple of any tile or thread chunk
    weight, _ = make_weight(fmt, out_features, in_features, dtype, seed=1)
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    row = torch.randn(1, in_features, generator=gen).to(dtype)
    want = quant.run_kernel(lib, row, weight, bias)[0]
    for num_rows in [*range(1, 11), 16, 33, 64, 97]:
        for position in sorted({0, num_rows // 2, num_rows - 1}):
            x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
            x[position] = row[0]
            assert torch.equal(quant.run_kernel(lib, x, weight, bias)[position], want), (num_rows, position)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_bits_do_not_depend_on_thread_count(lib, fmt):
    weight, _ = make_weight(fmt, 1536, 576, torch.float32, seed=2)
    x = torch.randn(37, 576)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(quant.run_kernel(lib, x, weight, None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_lookup_is_the_dequantized_rows(fmt):
    weight, values = make_weight(fmt, 50, 64, torch.bfloat16)
    ids = torch.tensor([[3, 0], [49, 3]])
    rows = weight[ids]
    assert rows.dtype == torch.bfloat16 and rows.shape == (2, 2, 64)
    assert torch.equal(rows, values[ids].to(torch.bfloat16))


def test_the_default_models_own_blocks():
    """The Q4_1 and Q8_0 tensors of the shipped GGUF, through the active kernels, against gguf's dequantizer."""
    gguf = pytest.importorskip("gguf")
    from services.tools.default_model import DefaultModelError, find_gguf

    try:
        path = find_gguf()
    except DefaultModelError as exc:
        pytest.skip(str(exc))
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        tensor = tensors[name]
        rows = tensor.data[:300]
        fmt = quant.FORMATS[tensor.tensor_type.name.lower()]
        weight = quant.from_blocks(rows, fmt, int(tensor.shape[0]), torch.float32)
        values = torch.from_numpy(gguf.dequantize(rows, tensor.tensor_type).astype(np.float32))
        assert torch.equal(weight.dequantize(), values)
        x = torch.randn(4, weight.in_features)
        close_to(weight(x, None), x @ values.T, torch.float32, x, values)


def test_bad_shapes_are_refused():
    weight, _ = make_weight("q4_1", 8, 64, torch.float32)
    with pytest.raises(ValueError, match="features"):
        weight(torch.randn(2, 63), None)
    with pytest.raises(ValueError, match="bias"):
        weight(torch.randn(2, 64), torch.randn(7))
    with pytest.raises(ValueError, match="whole blocks"):
        quant.row_bytes(quant.Q4_0, 48)


def test_without_the_compiled_kernels_the_fallback_gives_the_product(monkeypatch):
    weight, values = make_weight("q4_0", 30, 64, torch.float32)
    monkeypatch.setattr(quant, "_library", lambda: None)
    x = torch.randn(3, 64)
    close_to(weight(x, None), x @ values.T, torch.float32, x, values)
