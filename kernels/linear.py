"""Linear layers whose per-row result does not depend on how many rows share the call.

On the CPU the weights are packed once for oneDNN (`prepack`). Measured on these CPUs
(torch 2.13, AMD Zen 5, AVX-512): oneDNN's packed fp32 and bf16 GEMM gives a row the
same bits for every M >= 2, at any position, with 1 or 2 threads (M = 2..700 tried);
only M = 1 takes a matrix-vector path with other bits, so a single row is padded to
ONEDNN_MIN_ROWS. It is also the fast path: fp32 runs at ~460 GFLOP/s where MKL's sgemm
(F.linear on a dense weight) reaches ~210 on this AMD CPU, and 2.5-4x faster at M <= 4.

Dense weights (no oneDNN, or a caller that did not pack) go through F.linear, where MKL
computes fp32 rows in micro-tiles of 4 and the rows of a last, partial tile get other
bits: M is padded up to a multiple of MKL_ROW_MULTIPLE. On CUDA, where the library
picks a kernel per shape, rows run in fixed tiles of CUDA_ROW_TILE (the last one padded).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ONEDNN_MIN_ROWS = 2
MKL_ROW_MULTIPLE = 4
CUDA_ROW_TILE = 64


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the layout the CPU path multiplies fastest: oneDNN's, where available."""
    if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) \
            and torch.backends.mkldnn.is_available():
        return weight.detach().to_mkldnn()
    return weight


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = x.contiguous()  # a strided input can take another library path
    if weight.is_mkldnn:
        return _padded(x, ONEDNN_MIN_ROWS, lambda rows: _onednn(rows, weight, bias), at_least=True)
    if x.is_cuda:
        return _tiled(x, weight, bias)
    return _padded(x, MKL_ROW_MULTIPLE, lambda rows: F.linear(rows, weight, bias), at_least=False)


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.is_mkldnn:
        return _onednn(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _padded(x: torch.Tensor, multiple: int, fn, at_least: bool) -> torch.Tensor:
    """fn over x with its rows padded: to at least `multiple` rows, or to a multiple of it."""
    num_rows = x.shape[0]
    num_padded = max(num_rows, multiple) if at_least else -(-num_rows // multiple) * multiple
    if num_padded == num_rows:
        return fn(x)
    return fn(F.pad(x, (0, 0, 0, num_padded - num_rows)))[:num_rows]


def _tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    num_rows = x.shape[0]
    num_padded = -(-num_rows // CUDA_ROW_TILE) * CUDA_ROW_TILE
    padded = F.pad(x, (0, 0, 0, num_padded - num_rows))
    tiles = [F.linear(tile, weight, bias) for tile in padded.split(CUDA_ROW_TILE)]
    return torch.cat(tiles)[:num_rows]
