"""Linear layers whose per-row result does not depend on how many rows share the call.

Measured on these CPUs (torch 2.13, MKL): fp32 F.linear gives a row one of three bit
patterns depending on M (M=1, M=2..3, M>=4) and the same bits at any row position for a
fixed M; bf16 gives the same bits for every M. Padding to at least MIN_ROWS rows therefore
makes the CPU path batch-invariant at almost no cost. On CUDA, where the library picks a
kernel per shape, rows are run in fixed tiles of CUDA_ROW_TILE (the last one padded).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 4
CUDA_ROW_TILE = 64


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    num_rows = x.shape[0]
    if x.is_cuda:
        return _tiled(x, weight, bias)
    if num_rows >= MIN_ROWS:
        return F.linear(x, weight, bias)
    padded = F.pad(x, (0, 0, 0, MIN_ROWS - num_rows))
    return F.linear(padded, weight, bias)[:num_rows]


def _tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    num_rows = x.shape[0]
    num_padded = -(-num_rows // CUDA_ROW_TILE) * CUDA_ROW_TILE
    padded = F.pad(x, (0, 0, 0, num_padded - num_rows))
    tiles = [F.linear(tile, weight, bias) for tile in padded.split(CUDA_ROW_TILE)]
    return torch.cat(tiles)[:num_rows]


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)
