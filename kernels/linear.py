"""Linear layers whose per-row result does not depend on how many rows share the call.

Measured on these CPUs (torch 2.13, MKL, AVX-512): fp32 F.linear computes rows in
micro-tiles of 4; the rows of a last, partial tile (M mod 4 of them) take another code
path and get other bits. So a row's bits depend on M and on its position unless every row
sits in a full tile: padding M up to a multiple of ROW_MULTIPLE makes the CPU path
batch-invariant for at most 3 extra rows. bf16 gave the same bits for every M and
position (measured M=1..69). On CUDA, where the library picks a kernel per shape, rows
run in fixed tiles of CUDA_ROW_TILE (the last one padded).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 4
CUDA_ROW_TILE = 64


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = x.contiguous()  # a strided input can take another library path
    num_rows = x.shape[0]
    if x.is_cuda:
        return _tiled(x, weight, bias)
    num_padded = -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE
    if num_padded == num_rows:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, num_padded - num_rows)), weight, bias)[:num_rows]


def _tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    num_rows = x.shape[0]
    num_padded = -(-num_rows // CUDA_ROW_TILE) * CUDA_ROW_TILE
    padded = F.pad(x, (0, 0, 0, num_padded - num_rows))
    tiles = [F.linear(tile, weight, bias) for tile in padded.split(CUDA_ROW_TILE)]
    return torch.cat(tiles)[:num_rows]


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)
