"""Linear layers whose per-row result does not depend on how many rows share the call.

On the CPU the weights are packed once (`prepack`) for the project's own GEMM
(kernels/csrc/gemm.c, in every kernel tier: AVX-512, AVX2+FMA, generic): every output element
is one fused multiply-add chain over k in a fixed order, so it is batch-invariant by
construction, at every M and thread count, with no padding. It is also the fast path:
measured on this 2-core Zen 5 (bench/linear_bound.py), it streams the weights at 60-72 GB/s
at batch 1 (oneDNN: ~25) and reaches ~90% of the machine's GEMM peak at batch 64.

Without it (no C compiler), the weights are packed for oneDNN where oneDNN runs the dtype
on this CPU (bf16 needs AVX-512), else stay dense. oneDNN's packed fp32 and bf16 GEMM gives a
row the same bits for every M >= 2, at any position, with 1 or 2 threads (M = 2..700 tried
on Zen 5, torch 2.13); only M = 1 takes a matrix-vector path with other bits, so a single
row is padded to ONEDNN_MIN_ROWS.

Dense weights (no oneDNN, or a caller that did not pack) go through F.linear, whose fp32 row
bits depend on M: on AMD (Zen 3-5) MKL computes rows in micro-tiles of 4 and only a last,
partial tile's rows differ; on an Intel Xeon with AVX-512 it also switches kernels with M
(576 -> 1536: rows of M >= 13 differ from M <= 12; 100 -> 37 at M >= 5). So every F.linear
call takes exactly MKL_ROW_MULTIPLE rows: M is padded to a multiple of it and the tiles are
multiplied one call each, and no call's M varies. On CUDA, where the library
picks a kernel per shape, rows run in fixed tiles of CUDA_ROW_TILE (the last one padded).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from kernels.mkl import MKL_ROW_MULTIPLE
from kernels.quant import QuantParts, QuantWeight
from kernels.row_parallel import RowParallelWeight

ONEDNN_MIN_ROWS = 2
CUDA_ROW_TILE = 64


@dataclass(frozen=True)
class GemmWeight:
    """A weight [out_features, in_features] packed for kernels/csrc/gemm.c."""
    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias: batch-invariant by construction, so both linear modes call this."""
        return cpu_kernels.linear_cpu(x, self.packed, self.out_features, self.in_features, bias)


def prepack(weight: torch.Tensor, library: str = "auto") -> torch.Tensor | GemmWeight:
    """The weight in the layout the CPU path multiplies fastest: the own GEMM's (every kernel
    tier runs fp32 and bf16), else, without a C compiler, oneDNN's where oneDNN runs the dtype
    on this CPU. library: auto, gemm, onednn or dense (benchmarks compare them)."""
    on_cpu = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
    if library in ("auto", "gemm") and on_cpu and cpu_kernels.gemm_supported(weight.dtype):
        return GemmWeight(cpu_kernels.pack_gemm_weight(weight), *weight.shape)
    if library in ("auto", "onednn") and on_cpu and onednn_runs(weight.dtype):
        return weight.detach().to_mkldnn()
    return weight


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's inner product runs this dtype on this CPU: its bf16 one needs AVX-512
    (an AVX2-only CPU fails to create the primitive at the first call)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


# the weights that multiply themselves (each batch-invariant by construction): the own GEMM's, GGUF blocks (a
# llama.cpp mix's fused q/k/v or gate/up of several types: QuantParts), the row-parallel groups
OWN_KERNELS = (GemmWeight, QuantWeight, QuantParts, RowParallelWeight)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor | GemmWeight | QuantWeight | QuantParts,
                     bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, OWN_KERNELS):
        return weight(x, bias)
    x = x.contiguous()  # a strided input can take another library path
    if weight.is_mkldnn:
        return _padded(x, ONEDNN_MIN_ROWS, lambda rows: _onednn(rows, weight, bias), at_least=True)
    if x.is_cuda:
        return _tiled(x, weight, bias)
    return _row_tiles(x, MKL_ROW_MULTIPLE, lambda rows: F.linear(rows, weight, bias))


def plain_linear(x: torch.Tensor, weight: torch.Tensor | GemmWeight | QuantWeight | QuantParts,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """Without invariance: no padding. The own GEMM is invariant anyway, and the fastest here."""
    if isinstance(weight, OWN_KERNELS):
        return weight(x, bias)
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


def _row_tiles(x: torch.Tensor, rows: int, fn) -> torch.Tensor:
    """fn over x in calls of exactly `rows` rows (the last one zero-padded), concatenated."""
    num_rows = x.shape[0]
    if num_rows <= rows:
        return _padded(x, rows, fn, at_least=True)
    padded = F.pad(x, (0, 0, 0, -(-num_rows // rows) * rows - num_rows))
    return torch.cat([fn(tile) for tile in padded.split(rows)])[:num_rows]


def _tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    num_rows = x.shape[0]
    num_padded = -(-num_rows // CUDA_ROW_TILE) * CUDA_ROW_TILE
    padded = F.pad(x, (0, 0, 0, num_padded - num_rows))
    tiles = [F.linear(tile, weight, bias) for tile in padded.split(CUDA_ROW_TILE)]
    return torch.cat(tiles)[:num_rows]
