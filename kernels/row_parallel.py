"""Row-parallel linear layers (o_proj, down_proj) with one reduction order at every tensor-parallel size.

With tensor parallelism a row-parallel layer's K is split across ranks, and the usual all-reduce
adds the ranks' partial sums in an order that depends on how many there are: TP=1 and TP=2 give
other logits. Here K is cut into a fixed number of groups G per model (`reduction_groups`), the
same at every layout, TP=1 included:

    partial_g = x[:, g kg : (g + 1) kg] W[:, g kg : (g + 1) kg]^T     one fp32 result per group, each
                                                                      the kernel's fixed chain over kg
    out       = (((partial_0 + partial_1) + partial_2) + ...)         folded in the order 0..G-1 in fp32,
                                                                      rounded once to the activations' dtype

A rank holding groups [g0, g1) computes only their partials; the gather concatenates the ranks'
partials in rank order, and every rank folds all G. The groups' bits do not depend on which rank
computed them, so neither do the outputs (TBIK, arXiv 2511.17826, does the same on the GPU).

`RowParallelWeight(x, None)` runs the compiled kernels (kernels/csrc/row_parallel.c) where every
group is packed for gemm.c or quantized (kernels/quant.py), else the PyTorch reference below.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from kernels import cpu_kernels
from kernels.quant import QuantWeight, row_bytes

MAX_GROUPS = 8  # more groups only cost (fp32 partials, folds) once every useful TP size divides G

Gather = Callable[[torch.Tensor], torch.Tensor]  # local partials [G_local, T, N] -> all [G, T, N], rank order


def reduction_groups(num_heads: int, intermediate_size: int, head_dim: int = 0,
                     align: int | tuple[int, int] = 1) -> int:
    """G: the largest divisor of gcd(num_heads, intermediate_size) that is at most MAX_GROUPS and keeps
    each group a multiple of `align` columns wide (GGUF's blocks: a group holds whole blocks of 32, or of
    256 for the K-quants; a pair: o_proj's and down_proj's, whose types may differ). A group of
    o_proj is whole heads and one of down_proj whole MLP columns, so every TP size that divides G
    splits both layers at group boundaries (SmolLM2-135M: gcd(9, 1536) = 3, so TP 1 and 3)."""
    align_o, align_down = align if isinstance(align, tuple) else (align, align)
    common = math.gcd(num_heads, intermediate_size)
    return max(d for d in range(1, MAX_GROUPS + 1) if common % d == 0
               and (num_heads * head_dim // d) % align_o == 0 and (intermediate_size // d) % align_down == 0)


def fold_reference(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [G, T, N] fp32 -> [T, N]
    """The fold: partial 0, then + partial 1, + partial 2, ... in fp32, rounded once to dtype."""
    total = partials[0].clone()
    for g in range(1, partials.shape[0]):
        total += partials[g]
    return total.to(dtype)


def partials_reference(x: torch.Tensor, groups: list, linear: Callable | None = None) -> torch.Tensor:
    """Each group weight [N, kg] (dense, or packed for oneDNN) on its columns of x by `linear` (the model's
    linear function; default the batch-invariant one), widened to fp32: [G_local, T, N]. A group's result
    is the same whichever rank computes it, so the fold's bits do not depend on the layout here either."""
    if linear is None:
        from kernels.linear import invariant_linear as linear
    kg = x.shape[1] // len(groups)
    return torch.stack([linear(x[:, g * kg:(g + 1) * kg].contiguous(), w, None).float() for g, w in enumerate(groups)])


def split_dense(weight: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """weight [N, K] -> `groups` weights [N, K / groups], columns in order."""
    return [part.contiguous() for part in weight.chunk(groups, dim=1)]


def split_quant(weight: QuantWeight, groups: int) -> list[QuantWeight]:
    """A quantized weight's rows cut into `groups` column groups of whole blocks (INT8: each group's
    rows keep the row's scale, so a group's partial is its dot product times the same scale)."""
    kg = weight.in_features // groups
    data, parts = weight.row_data(), []
    for g in range(groups):
        if weight.fmt == 100:  # INT8: [scale (4 bytes)][K int8]
            part = torch.cat([data[:, :4], data[:, 4 + g * kg:4 + (g + 1) * kg]], dim=1)
        else:
            width = row_bytes(weight.fmt, kg)
            part = data[:, g * width:(g + 1) * width]
        parts.append(QuantWeight(data=part.contiguous(), fmt=weight.fmt, out_features=weight.out_features,
                                 in_features=kg, dtype=weight.dtype).with_activations(weight.int8_activations))
    return parts


@dataclass(frozen=True, kw_only=True)
class RowParallelWeight:
    """A row-parallel weight [out_features, in_features] (this rank's K columns) as its local groups:
    `groups` of the model's `total_groups`. `buffer` holds every local group's packed or quantized
    bytes back to back (what decoder.c reads), `parts` the per-group weights (GemmWeight, QuantWeight
    or dense tensors), `gather` the worker group's transport (None in a single process)."""
    parts: tuple
    out_features: int
    in_features: int
    total_groups: int
    buffer: torch.Tensor | None = None
    gather: Gather | None = None
    linear: Callable | None = None  # the model's linear function, for dense groups (the reference path)

    @property
    def groups(self) -> int:
        return len(self.parts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def fmt(self) -> int | None:
        """0: packed for gemm.c; a quant format (as the C kernels take it: QuantWeight.kernel_fmt); None:
        dense (the reference path)."""
        from kernels.linear import GemmWeight

        first = self.parts[0]
        return 0 if isinstance(first, GemmWeight) else first.kernel_fmt if isinstance(first, QuantWeight) else None

    @classmethod
    def build(cls, parts: list, total_groups: int, gather: Gather | None = None,
              linear: Callable | None = None) -> RowParallelWeight:
        from kernels.linear import GemmWeight

        first = parts[0]
        if isinstance(first, GemmWeight):
            buffer = torch.cat([p.packed.reshape(-1) for p in parts])
        elif isinstance(first, QuantWeight):
            buffer = torch.cat([p.data.reshape(-1) for p in parts])
        else:
            buffer = None
        out_features, kg = first.shape
        return cls(parts=tuple(parts), out_features=out_features, in_features=kg * len(parts),
                   total_groups=total_groups, buffer=buffer, gather=gather, linear=linear)

    def with_gather(self, gather: Gather | None) -> RowParallelWeight:
        return replace(self, gather=gather)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None:
            raise ValueError("row-parallel layers take no bias")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"row_parallel: input has {x.shape[-1]} features, the weight takes {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if self.gather is None and self.groups == self.total_groups and self._compiled(rows):  # one process: one call
            return self._linear(rows).view(*x.shape[:-1], self.out_features)
        partials = self.partials(rows)
        if self.gather is not None:
            partials = self.gather(partials)
        return self.fold(partials, x.dtype).view(*x.shape[:-1], self.out_features)

    def _compiled(self, rows: torch.Tensor) -> bool:
        """The compiled kernels run these rows (else the PyTorch reference)."""
        return self.fmt is not None and rows.is_cpu and cpu_kernels.is_available() and rows.dtype == self.dtype

    def _linear(self, rows: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N] in rows' dtype: every group, folded
        """row_parallel.c's row_parallel_linear: gemm.c's groups in one pass over K (each group's chain folded
        into a running fp32 total in registers), quantized ones as partials and their fold; the same bits."""
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype)
        if not rows.shape[0]:
            return out
        scratch = None if self.fmt == 0 else torch.empty(self.groups, rows.shape[0], self.out_features)
        status = library().row_parallel_linear(
            rows.data_ptr(), self.in_features, self.buffer.data_ptr(), self.fmt, self.groups, rows.shape[0],
            self.out_features, self.in_features // self.groups, int(rows.dtype == torch.bfloat16), out.data_ptr(),
            self.out_features, None if scratch is None else scratch.data_ptr(), torch.get_num_threads(), None)
        if status != 0:
            raise ValueError(f"row_parallel_linear: status {status}")
        return out

    def partials(self, rows: torch.Tensor) -> torch.Tensor:  # [T, K_local] -> [G_local, T, N] fp32
        fmt = self.fmt
        if not self._compiled(rows):
            from kernels.linear import GemmWeight
            from kernels.quant import int8_linear_reference

            if all(isinstance(p, QuantWeight) and p.int8_activations for p in self.parts):  # the kernels' bits
                kg = self.parts[0].in_features
                return torch.stack([int8_linear_reference(rows[:, g * kg:(g + 1) * kg], p, None)
                                    for g, p in enumerate(self.parts)])
            if any(isinstance(p, GemmWeight) for p in self.parts):
                raise TypeError("row_parallel: weights packed for gemm.c need the compiled kernels")
            dense = [p.dequantize().to(rows.dtype) if isinstance(p, QuantWeight) else p for p in self.parts]
            return partials_reference(rows, dense, self.linear)
        rows = rows.contiguous()
        out = torch.empty(self.groups, rows.shape[0], self.out_features, dtype=torch.float32)
        if rows.shape[0]:
            status = library().row_parallel_partials(
                rows.data_ptr(), self.in_features, self.buffer.data_ptr(), fmt, self.groups, rows.shape[0],
                self.out_features, self.in_features // self.groups, int(rows.dtype == torch.bfloat16), out.data_ptr(),
                torch.get_num_threads(), None)
            if status != 0:
                raise ValueError(f"row_parallel_partials: status {status}")
        return out

    def fold(self, partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [G, T, N] -> [T, N]
        if partials.shape[0] != self.total_groups:
            raise ValueError(f"row_parallel: {partials.shape[0]} partials for {self.total_groups} groups")
        if not partials.is_cpu or not cpu_kernels.is_available() or dtype not in (torch.float32, torch.bfloat16):
            return fold_reference(partials, dtype)
        partials = partials.contiguous()
        out = torch.empty(partials.shape[1], partials.shape[2], dtype=dtype)
        library().fold_partials(partials.data_ptr(), partials.shape[0], partials.shape[1], partials.shape[2],
                                out.data_ptr(), partials.shape[2], int(dtype == torch.bfloat16),
                                torch.get_num_threads())
        return out


def library() -> ctypes.CDLL:
    return declare(cpu_kernels.library())


_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "row_parallel_partials": ([_ptr, _i64, _ptr, _i32, _i64, _i64, _i64, _i64, _i32, _ptr, _i32, _ptr], _i32),
    "row_parallel_linear": ([_ptr, _i64, _ptr, _i32, _i64, _i64, _i64, _i64, _i32, _ptr, _i64, _ptr, _i32, _ptr], _i32),
    "fold_partials": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _i32, _i32], None),
    # quant_dot.c's one pass of row_parallel_linear (int8 activations); the tests call it to see it took the shape
    "quant_linear_int8_groups": ([_ptr, _i64, _ptr, _i32, _i64, _i64, _i64, _i64, _i32, _ptr, _i64, _i32], _i32),
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with row_parallel.c's signatures set (once per library object)."""
    return cpu_kernels.declare(lib, SIGNATURES)
