"""Linear layers and embeddings on quantized weights, kept in their storage format.

Formats (kernels/csrc/quant_gemm.c has the block layouts):
  q4_0, q4_1, q8_0  GGUF's blocks of 32, byte for byte as the file has them (ggml type ids 2, 3, 8);
  int8              weight-only, symmetric, one fp32 scale per output channel, made at load
                    (`quantize_int8`) from a bf16 or fp32 checkpoint.

Per output channel rather than per group for int8: at 8 bits the rounding error of a channel's
absmax/127 step is already ~0.4% of its largest weight (the greedy tokens of the default model
are reported against fp32 in bench/results/quant_decode.md), and one scale per row lets the
kernel apply it once, after the dot product, instead of once per group inside it: the inner
loop is the same load-widen-FMA as the GGUF formats' minus the scale. Groups pay off at 4 bits,
which is what the GGUF formats bring.

`QuantWeight(x, bias)` multiplies on the compiled kernel (`quant_linear`, every CPU tier):
each block is dequantized in registers and accumulated in fp32 in a fixed order, so a row's
bits do not depend on the batch, its position or the thread count. Without the compiled
kernels (another device, a failed build) it dequantizes on each call and takes the dense
invariant path. `weight[ids]` dequantizes just those rows (the embedding lookup).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

Q4_0, Q4_1, Q8_0, INT8 = 2, 3, 8, 100  # as in quant_gemm.c (the GGUF ones are ggml's type ids)
FORMATS = {"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0, "int8": INT8}
NAMES = {code: name for name, code in FORMATS.items()}
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
OK, OUT_OF_MEMORY, BAD_SHAPE = 0, 1, 2  # kernels/csrc/kernels.h


def row_bytes(fmt: int, in_features: int) -> int:
    if fmt == INT8:
        return 4 + in_features
    if fmt not in BLOCK_BYTES or in_features % BLOCK:
        raise ValueError(f"{NAMES.get(fmt, fmt)}: rows of {in_features} elements are not whole blocks of {BLOCK}")
    return in_features // BLOCK * BLOCK_BYTES[fmt]


@dataclass(frozen=True, kw_only=True)
class QuantWeight:
    """A weight [out_features, in_features] as rows of blocks (`data`, uint8 [out_features, row_bytes]).
    `dtype` is the activation dtype it multiplies and returns."""
    data: torch.Tensor
    fmt: int
    out_features: int
    in_features: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        want = (self.out_features, row_bytes(self.fmt, self.in_features))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            raise ValueError(f"QuantWeight {NAMES[self.fmt]}: data must be contiguous uint8 {want}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def format(self) -> str:
        return NAMES[self.fmt]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quant_linear(x, self, bias)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` dequantized, in `dtype` (an embedding lookup)."""
        return dequantize_rows(self.data[ids.reshape(-1)], self.fmt, self.in_features).to(self.dtype).reshape(
            *ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole weight in fp32 (tests, the fallback path)."""
        return dequantize_rows(self.data, self.fmt, self.in_features)

    def with_dtype(self, dtype: torch.dtype) -> QuantWeight:
        return QuantWeight(data=self.data, fmt=self.fmt, out_features=self.out_features, in_features=self.in_features,
                           dtype=dtype)


def from_blocks(blocks: np.ndarray | torch.Tensor, fmt: int, in_features: int, dtype: torch.dtype) -> QuantWeight:
    """Rows of GGUF blocks (uint8 [N, row_bytes], e.g. gguf's ReaderTensor.data), copied byte for byte
    out of the mapped file."""
    data = torch.from_numpy(np.array(blocks, dtype=np.uint8)) if isinstance(blocks, np.ndarray) else blocks.contiguous()
    return QuantWeight(data=data, fmt=fmt, out_features=data.shape[0], in_features=in_features, dtype=dtype)


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype | None = None) -> QuantWeight:
    """weight [N, K] (any float dtype) -> int8 per output channel: s = absmax / 127, q = round(w / s).
    Each row is stored as its fp32 scale then its K int8 (quant_gemm.c's INT8 rows)."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0  # an all-zero row: q = 0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    data = torch.empty(out_features, 4 + in_features, dtype=torch.uint8)
    data[:, :4] = scale.contiguous().view(torch.uint8).view(out_features, 4)
    data[:, 4:] = q.view(torch.uint8)
    return QuantWeight(data=data, fmt=INT8, out_features=out_features, in_features=in_features,
                       dtype=dtype or weight.dtype)


def dequantize_rows(data: torch.Tensor, fmt: int, in_features: int) -> torch.Tensor:
    """uint8 rows [R, row_bytes] -> fp32 [R, in_features], exactly the stored values."""
    num_rows = data.shape[0]
    if fmt == INT8:
        scale = data[:, :4].contiguous().view(torch.float32)  # [R, 1]
        return data[:, 4:].contiguous().view(torch.int8).float() * scale
    blocks = data.reshape(num_rows, in_features // BLOCK, BLOCK_BYTES[fmt])
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [R, B, 1]
    if fmt == Q8_0:
        values = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        qs = blocks[..., 4:] if fmt == Q4_1 else blocks[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # low nibbles are elements 0-15
        values = q * d + blocks[..., 2:4].contiguous().view(torch.float16).float() if fmt == Q4_1 else (q - 8) * d
    return values.reshape(num_rows, in_features)


# ---- the compiled kernel -----------------------------------------------------------------
def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] W^T + bias -> [..., N] in x's dtype; batch-invariant on every path."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_linear: input has {x.shape[-1]} features, the weight takes {weight.in_features}")
    if bias is not None and bias.numel() != weight.out_features:
        raise ValueError(f"quant_linear: bias has {bias.numel()} elements, the weight gives {weight.out_features}")
    lib = _library() if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) else None
    if lib is None:
        from kernels.linear import invariant_linear  # dense fallback: dequantized on each call

        return invariant_linear(x, weight.dequantize().to(x.dtype).to(x.device), bias)
    return run_kernel(lib, x, weight, bias)


def run_kernel(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """quant_linear on a given build of the kernels (`declare`d): the tests run every tier's."""
    from kernels.cpu_kernels import _rows

    rows, stride = _rows(x, weight.in_features)
    out = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    status = lib.quant_linear(rows.data_ptr(), stride, weight.data.data_ptr(), weight.fmt,
                              bias.data_ptr() if bias is not None else None, out.data_ptr(), weight.out_features,
                              rows.shape[0], weight.out_features, weight.in_features, int(x.dtype == torch.bfloat16),
                              torch.get_num_threads())
    if status == OUT_OF_MEMORY:
        raise MemoryError("quant_linear: out of memory for the widened input")
    if status != OK:
        raise ValueError(f"quant_linear: {weight.format} with {weight.in_features} inputs is not supported")
    return out.view(*x.shape[:-1], weight.out_features)


_declared: set[int] = set()


def _library() -> ctypes.CDLL | None:
    """The active CPU kernel library, its quant_linear declared (once per library), or None."""
    from kernels import cpu_kernels

    if not cpu_kernels.is_available():
        return None
    return declare(cpu_kernels.library())


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with quant_linear's signature set (once per library object)."""
    if id(lib) not in _declared:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.quant_linear.argtypes = [ptr, i64, ptr, i32, ptr, ptr, i64, i64, i64, i64, i32, i32]
        lib.quant_linear.restype = i32
        lib.quant_row_bytes.argtypes = [i32, i64]
        lib.quant_row_bytes.restype = i64
        _declared.add(id(lib))
    return lib
