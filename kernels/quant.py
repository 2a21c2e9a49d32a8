"""Linear layers and embeddings on quantized weights, kept in their storage format.

Formats (kernels/csrc/quant_gemm.c has the block layouts):
  q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl   GGUF's blocks of 32, byte for byte as the file has them
                    (ggml type ids 2, 3, 6, 7, 8, 20);
  q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs   GGUF's super-blocks of 256 (ggml type ids 10-14, 23);
  int8              weight-only, symmetric, one fp32 scale per output channel, made at load
                    (`quantize_int8`) from a bf16 or fp32 checkpoint.
`dequantize_rows` gives every format's stored values exactly (each value is the fp32 rounding of
its exact product, as ggml's and the gguf package's dequantizers compute it).

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
import functools
from dataclasses import dataclass, replace

import numpy as np
import torch

# as in quant_blocks.h (the GGUF ones are ggml's type ids)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, INT8 = 2, 3, 6, 7, 8, 100
PARTS = 101  # quant_blocks.h's FMT_PARTS: row-stacked weights of their own formats (`QuantParts`)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 10, 11, 12, 13, 14, 20, 23
FORMATS = {"q4_0": Q4_0, "q4_1": Q4_1, "q5_0": Q5_0, "q5_1": Q5_1, "q8_0": Q8_0, "q2_k": Q2_K, "q3_k": Q3_K,
           "q4_k": Q4_K, "q5_k": Q5_K, "q6_k": Q6_K, "iq4_nl": IQ4_NL, "iq4_xs": IQ4_XS, "int8": INT8}
NAMES = {code: name for name, code in FORMATS.items()}
BLOCK = 32  # elements per block of the small formats (and the kernels' runs of 32 in a super-block)
QK_K = 256  # elements per super-block (the K-quants, IQ4_XS)
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, IQ4_NL: 18,
               Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210, IQ4_XS: 136}
BLOCK_ELEMS = {fmt: QK_K if fmt in (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) else BLOCK for fmt in BLOCK_BYTES}
GGUF_FORMATS = tuple(BLOCK_BYTES)  # every GGUF block format served
SUPER_FORMATS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)
# read as integers per block by kernels/kquant_int8.py (int8 activations); Q4_0, Q4_1, Q8_0, INT8 here
KQUANT_INT8 = (Q5_0, Q5_1, IQ4_NL, *SUPER_FORMATS)
INT8_ACTIVATION_FORMATS = (Q4_0, Q4_1, Q8_0, INT8, *KQUANT_INT8)  # what quant_dot.c takes (quant_blocks.h's int8_activation_format)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
OK, OUT_OF_MEMORY, BAD_SHAPE = 0, 1, 2  # kernels/csrc/kernels.h
ACT_INT8 = 0x100  # kernels.h's QUANT_ACT_INT8: a format code with this bit takes int8 activations
INTERLEAVED = 0x200  # kernels.h's QUANT_INTERLEAVED: the rows interleaved by groups of GROUP (int8 activations only)
GROUP = 16  # outputs per interleaved group: one AVX-512 register of int32 lanes (quant_dot.c)


def block_elems(fmt: int) -> int:
    """Elements per block of a GGUF format: 32, or 256 for the super-block formats (INT8: 32, the kernels')."""
    return BLOCK_ELEMS.get(fmt, BLOCK)


def row_bytes(fmt: int, in_features: int) -> int:
    if fmt == INT8:
        return 4 + in_features
    if fmt not in BLOCK_BYTES or in_features % BLOCK_ELEMS[fmt]:
        raise ValueError(f"{NAMES.get(fmt, fmt)}: rows of {in_features} elements are not whole blocks of "
                         f"{block_elems(fmt)}")
    return in_features // BLOCK_ELEMS[fmt] * BLOCK_BYTES[fmt]


@dataclass(frozen=True, kw_only=True)
class QuantWeight:
    """A weight [out_features, in_features] as rows of blocks (`data`, uint8 [out_features, row_bytes]).
    `dtype` is the activation dtype it multiplies and returns."""
    data: torch.Tensor
    fmt: int
    out_features: int
    in_features: int
    dtype: torch.dtype
    int8_activations: bool = False  # activations rounded to int8 per block of 32 (kernels/csrc/quant_dot.c)
    interleaved: bool = False  # data's whole groups of 16 rows in quant_dot.c's interleaved order (`interleave`)

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

    @property
    def kernel_fmt(self) -> int:
        """The format code the C kernels take: fmt, with ACT_INT8 set for int8 activations."""
        if not self.int8_activations:
            return self.fmt
        return self.fmt | ACT_INT8 | (INTERLEAVED if self.interleaved else 0)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quant_linear(x, self, bias)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` dequantized, in `dtype` (an embedding lookup)."""
        return dequantize_rows(self.rows(ids.reshape(-1)), self.fmt, self.in_features).to(self.dtype).reshape(
            *ids.shape, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The stored rows `ids` [R] in row order (uint8 [R, row_bytes]), interleaved or not."""
        if not self.interleaved:
            return self.data[ids]
        return row_bytes_of(self.data, self.fmt, self.in_features, ids)

    def row_data(self) -> torch.Tensor:
        """data in row order (uint8 [out_features, row_bytes])."""
        return deinterleave(self.data, self.fmt, self.in_features) if self.interleaved else self.data

    def dequantize(self) -> torch.Tensor:
        """The whole weight in fp32 (tests, the fallback path)."""
        return dequantize_rows(self.row_data(), self.fmt, self.in_features)

    def with_dtype(self, dtype: torch.dtype) -> QuantWeight:
        return replace(self, dtype=dtype)

    def with_activations(self, int8: bool) -> QuantWeight:
        """int8: the int8-activation kernels, the rows interleaved for them where they can be (`interleave`);
        else the fp32-activation ones, on rows in row order."""
        if int8 and self.fmt not in INT8_ACTIVATION_FORMATS:
            raise ValueError(f"int8 activations: {self.format} weights take fp32 activations only (served with int8 "
                             f"activations: {', '.join(NAMES[f] for f in INT8_ACTIVATION_FORMATS)})")
        if int8 and not self.interleaved and can_interleave(self.fmt, self.out_features, self.in_features):
            return replace(self, data=interleave(self.data, self.fmt, self.in_features), interleaved=True,
                           int8_activations=True)
        if not int8 and self.interleaved:
            return replace(self, data=self.row_data(), interleaved=False, int8_activations=False)
        return replace(self, int8_activations=int8)


@dataclass(frozen=True, kw_only=True)
class QuantParts:
    """Quantized weights of their own formats stacked by rows: a fused q/k/v or gate/up whose parts a
    llama.cpp mix stores in different types (Q4_K_M: attn_v Q6_K, attn_q/k Q4_K). `data` is one buffer,
    a table (int64: the number of parts, then per part its kernel format, rows and byte offset) and
    each part's rows (quant_gemm.c's FMT_PARTS), so that quant_linear and decoder.c run it in one call:
    each output is its part's chain, the bits of that part alone."""
    parts: tuple[QuantWeight, ...]
    data: torch.Tensor
    dtype: torch.dtype
    fmt: int = PARTS

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def format(self) -> str:
        return "+".join(p.format for p in self.parts)

    @property
    def int8_activations(self) -> bool:
        return self.parts[0].int8_activations

    @property
    def kernel_fmt(self) -> int:
        return PARTS | (ACT_INT8 if self.int8_activations else 0)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quant_linear(x, self, bias)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def with_dtype(self, dtype: torch.dtype) -> QuantParts:
        return stack_parts([p.with_dtype(dtype) for p in self.parts], dtype)

    def with_activations(self, int8: bool) -> QuantParts:
        return stack_parts([p.with_activations(int8) for p in self.parts], self.dtype)


def stack_parts(parts: list[QuantWeight], dtype: torch.dtype) -> QuantWeight | QuantParts:
    """Row-stacked weights: one QuantWeight where the parts share a format (their rows concatenated),
    else a QuantParts."""
    if len({p.fmt for p in parts}) == 1 and not any(p.interleaved for p in parts):
        first = parts[0]
        return replace(first, data=torch.cat([p.data for p in parts]), out_features=sum(p.out_features for p in parts),
                       dtype=dtype)
    if len({p.in_features for p in parts}) != 1 or len({p.int8_activations for p in parts}) != 1:
        raise ValueError("stack_parts: the parts must take the same inputs and activations")
    offsets, at = [], 8 * (1 + 3 * len(parts))  # the table, then each part 64-byte aligned
    for p in parts:
        at = -(-at // 64) * 64
        offsets.append(at)
        at += p.data.numel()
    data = torch.zeros(at, dtype=torch.uint8)
    table = [len(parts)] + [v for p, o in zip(parts, offsets) for v in (p.kernel_fmt, p.out_features, o)]
    data[:8 * len(table)] = torch.tensor(table, dtype=torch.int64).view(torch.uint8)
    for p, o in zip(parts, offsets):
        data[o:o + p.data.numel()] = p.data.reshape(-1)
    return QuantParts(parts=tuple(replace(p, dtype=dtype) for p in parts), data=data, dtype=dtype)


def from_blocks(blocks: np.ndarray | torch.Tensor, fmt: int, in_features: int, dtype: torch.dtype) -> QuantWeight:
    """Rows of GGUF blocks (uint8 [N, row_bytes], e.g. gguf's ReaderTensor.data), copied byte for byte
    out of the mapped file."""
    data = torch.from_numpy(np.array(blocks, dtype=np.uint8)) if isinstance(blocks, np.ndarray) else blocks.contiguous()
    return QuantWeight(data=data, fmt=fmt, out_features=data.shape[0], in_features=in_features, dtype=dtype)


# ---- interleaved rows (quant_dot.c's header has the layout) -------------------------------------
def can_interleave(fmt: int, out_features: int, in_features: int) -> bool:
    """At least one whole group of 16 rows, and (INT8) whole blocks of 32 per row."""
    if fmt not in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, INT8, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS):  # quant_dot.c's layouts
        return False
    return out_features >= GROUP and (fmt != INT8 or in_features % BLOCK == 0)


@functools.lru_cache(maxsize=64)
def interleave_order(fmt: int, in_features: int) -> np.ndarray:
    """For one group of 16 rows (16 row_bytes bytes): interleaved byte j is row-order byte order[j]."""
    width = row_bytes(fmt, in_features)
    if fmt in (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS):
        return _kquant_order(fmt, in_features)
    lanes = np.arange(GROUP)[:, None] * width + np.arange(4)[None, :]  # [16, 4]: bytes 0..3 of each row
    blocks = in_features // BLOCK
    if fmt == INT8:  # the 16 scales, then per block its 8 k-groups: row c's 4 bytes of group g at 4 c
        groups = 4 + np.arange(blocks)[:, None, None, None] * BLOCK + 4 * np.arange(8)[None, :, None, None]
        return np.concatenate([lanes.reshape(-1), (groups + lanes[None, None]).reshape(-1)])
    size, head = BLOCK_BYTES[fmt], 4 if fmt in (Q4_1, Q5_1) else 2
    per_block = [(np.arange(GROUP)[:, None] * width + np.arange(2)[None, :])[None]]  # each row's d
    if head == 4:
        per_block.append((np.arange(GROUP)[:, None] * width + 2 + np.arange(2)[None, :])[None])  # each row's m
    # the k-groups (Q5_0, Q5_1: the 4 qh bytes first, then the 16 of nibbles)
    per_block.append((head + 4 * np.arange((size - head) // 4))[:, None, None] + lanes[None])
    block = np.concatenate([part.reshape(-1) for part in per_block])  # block 0's bytes
    return (np.arange(blocks)[:, None] * size + block[None, :]).reshape(-1)


def _kquant_position(fmt: int) -> np.ndarray:
    """[16, block bytes]: where byte j of output c's super-block lies in its group's 16 (quant_dot.c's kqi_position).
    Q4_K, Q5_K (IQ4_XS: its scales_h for dmin): the 16 d, the 16 dmin, then the block's bytes 4.. as k-groups (64 bytes each: output c's 4 at 4 c);
    Q6_K: the 16 d, the 16 scales as 4 k-groups, then per 128 elements n and l = 0, 4, .. 28 the k-groups of
    ql[64 n + l], ql[64 n + 32 + l] and qh[32 n + l]: one sub-block's values per 4 k-groups;
    Q2_K: the 16 d, the 16 dmin, then scales[16] and qs[64] as k-groups;
    Q3_K: the 16 d, scales[12] as 3 k-groups, then hmask[32] and qs[64] as k-groups."""
    c, j = np.arange(GROUP)[:, None], np.arange(BLOCK_BYTES[fmt])[None, :]
    groups = 64 * (j // 4) + 4 * c + j % 4  # byte j as a k-group, counted from byte 0
    if fmt == Q2_K:
        return np.where(j >= 80, 32 * ((j - 80) // 2) + 2 * c + j % 2, 64 + groups)
    if fmt == Q3_K:
        return np.where(j >= 108, 2 * c + j - 108, np.where(j >= 96, 32 + groups - 64 * 24, 224 + groups))
    if fmt != Q6_K:
        return np.where(j < 4, 32 * (j // 2) + 2 * c + j % 2, 64 + 64 * ((j - 4) // 4) + 4 * c + j % 4)
    n = np.where(j < 128, j // 64, (j - 128) // 32)
    slot = np.where(j < 128, j % 64 // 32, 2)
    lane = np.where(j < 128, j % 32, (j - 128) % 32)
    values = 288 + 192 * (8 * n + lane // 4) + 64 * slot + 4 * c + lane % 4
    return np.where(j >= 208, 2 * c + j - 208, np.where(j >= 192, 32 + 64 * ((j - 192) // 4) + 4 * c + j % 4, values))


def _kquant_order(fmt: int, in_features: int) -> np.ndarray:
    size, blocks = BLOCK_BYTES[fmt], in_features // BLOCK_ELEMS[fmt]
    width = blocks * size
    position = _kquant_position(fmt)  # [16, size]
    order = np.empty(GROUP * width, np.int64)
    b = np.arange(blocks)[:, None, None]
    source = np.arange(GROUP)[None, :, None] * width + b * size + np.arange(size)[None, None, :]
    order[(b * GROUP * size + position[None]).reshape(-1)] = source.reshape(-1)
    return order


@functools.lru_cache(maxsize=64)
def _inverse_order(fmt: int, in_features: int) -> np.ndarray:
    return np.argsort(interleave_order(fmt, in_features))


def interleave(data: torch.Tensor, fmt: int, in_features: int) -> torch.Tensor:
    """Rows in row order [N, row_bytes] -> each whole group of 16 rows interleaved in place of its rows
    (the same shape and bytes; the rows past the last whole group as they were)."""
    return _reorder_groups(data, interleave_order(fmt, in_features))


def deinterleave(data: torch.Tensor, fmt: int, in_features: int) -> torch.Tensor:
    """`interleave` undone: the rows in row order."""
    return _reorder_groups(data, _inverse_order(fmt, in_features))


def _reorder_groups(data: torch.Tensor, order: np.ndarray) -> torch.Tensor:
    """A copy of data with each whole group of 16 rows' bytes taken in `order`."""
    whole = data.shape[0] // GROUP * GROUP
    out = data.numpy().copy()
    out[:whole] = out[:whole].reshape(-1, GROUP * data.shape[1])[:, order].reshape(whole, -1)
    return torch.from_numpy(out)


def row_bytes_of(data: torch.Tensor, fmt: int, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of interleaved data, in row order (uint8 [R, row_bytes]): one gather, no copy of the rest
    (a decode step's embedding lookup of a tied lm_head)."""
    width = data.shape[1]
    whole = data.shape[0] // GROUP * GROUP
    ids = ids.to(torch.int64)
    if not bool((ids < whole).all()):  # rows past the last whole group are in row order
        return torch.stack([data[i] if i >= whole else row_bytes_of(data, fmt, in_features, i.view(1))[0]
                            for i in ids]) if len(ids) else data[ids]
    return data.view(-1)[(ids // GROUP * (GROUP * width))[:, None] + _row_gather(fmt, in_features)[ids % GROUP]]


@functools.lru_cache(maxsize=64)
def _row_gather(fmt: int, in_features: int) -> torch.Tensor:
    """[16, row_bytes]: where row c's bytes lie in its interleaved group."""
    return torch.from_numpy(_inverse_order(fmt, in_features)).view(GROUP, -1)


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
    if fmt in _NUMPY_DEQUANTIZERS:
        blocks = data.numpy().reshape(num_rows, in_features // BLOCK_ELEMS[fmt], BLOCK_BYTES[fmt])
        return torch.from_numpy(_NUMPY_DEQUANTIZERS[fmt](blocks).reshape(num_rows, in_features))
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


# ---- the formats added with the K-quants, in numpy (ggml's layouts; each value rounded once) ------
# Each takes blocks uint8 [R, B, block bytes] and gives fp32 [R, B, block elements]. Every product of a
# scale and a quant is exact in fp32 but the last one, so the value is the fp32 rounding of the exact
# d * sc * q (- dmin * m): the same bits whatever the order of the exact products.
def _half(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] (little-endian IEEE halves) -> fp32 [..., 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes of nibbles [..., 16] -> their 32 values [..., 32]: byte j holds element j low, j + 16 high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> its 8 n bits [..., 8 n], bit i of byte i // 8 at i (a little-endian integer's)."""
    return np.unpackbits(raw, axis=-1, bitorder="little")


def _dequant_q5_0(blocks: np.ndarray) -> np.ndarray:  # fp16 d, 4 bytes qh, 16 bytes qs: (q - 16) d
    q = _nibbles(blocks[..., 6:22]) | (_bits(blocks[..., 2:6]) << 4)
    return (q.astype(np.float32) - np.float32(16)) * _half(blocks[..., 0:2])


def _dequant_q5_1(blocks: np.ndarray) -> np.ndarray:  # fp16 d, fp16 m, 4 bytes qh, 16 bytes qs: q d + m
    q = _nibbles(blocks[..., 8:24]) | (_bits(blocks[..., 4:8]) << 4)
    return q.astype(np.float32) * _half(blocks[..., 0:2]) + _half(blocks[..., 2:4])


def _dequant_iq4_nl(blocks: np.ndarray) -> np.ndarray:  # fp16 d, 16 bytes of 4-bit codes: d IQ4_VALUES[code]
    return IQ4_VALUES[_nibbles(blocks[..., 2:18])] * _half(blocks[..., 0:2])


def _dequant_q2_k(blocks: np.ndarray) -> np.ndarray:
    """16 bytes of (scale | min << 4) per 16 elements, 64 bytes of 2-bit quants, fp16 d, fp16 dmin:
    element 128 n + 32 j + 16 s + l is (qs[32 n + 16 s + l] >> 2 j) & 3, scale 8 n + 2 j + s."""
    scales, qs = blocks[..., 0:16], blocks[..., 16:80]
    d, dmin = _half(blocks[..., 80:82]), _half(blocks[..., 82:84])
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
    q = (qs.reshape(*qs.shape[:-1], 2, 1, 2, 16) >> shifts) & 3  # [.., n, j, s, l]
    q = q.reshape(*qs.shape[:-1], 16, 16).astype(np.float32)
    dl = (d * (scales & 0x0F).astype(np.float32))[..., None]
    ml = (dmin * (scales >> 4).astype(np.float32))[..., None]
    return (dl * q - ml).reshape(*qs.shape[:-1], QK_K)


def _q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> its 16 signed 6-bit scales (fp32): low 4 bits from bytes 0-7 (j < 8: low
    nibble of byte j, else high nibble of byte j - 8), high 2 bits from byte 8 + j % 4 at 2 (j // 4)."""
    j = np.arange(16)
    low = np.where(j < 8, raw[..., j % 8] & 0x0F, raw[..., j % 8] >> 4)
    high = (raw[..., 8 + j % 4] >> (2 * (j // 4)).astype(np.uint8)) & 3
    return ((low | (high << 4)).astype(np.int32) - 32).astype(np.float32)


def _dequant_q3_k(blocks: np.ndarray) -> np.ndarray:
    """32 bytes hmask, 64 bytes of 2-bit quants, 12 bytes of scales, fp16 d: element 128 n + 32 j + 16 s + l
    is ((qs[32 n + 16 s + l] >> 2 j) & 3) - (4 unless bit 4 n + j of hmask[16 s + l]), scale 8 n + 2 j + s."""
    hmask, qs, lead = blocks[..., 0:32], blocks[..., 32:96], blocks.shape[:-1]
    scales, d = _q3_k_scales(blocks[..., 96:108]), _half(blocks[..., 108:110])
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1, 1)
    low = ((qs.reshape(*lead, 2, 1, 2, 16) >> shifts) & 3).astype(np.int8)  # [.., n, j, s, l]
    high = _bits(hmask[..., :, None]).reshape(*lead, 2, 16, 2, 4)  # [.., s, l, n, j]: bit 4 n + j of hmask[16 s + l]
    high = np.moveaxis(high, (-2, -1), (-4, -3))  # [.., n, j, s, l]
    q = (low - np.where(high == 1, 0, 4).astype(np.int8)).reshape(*lead, 16, 16).astype(np.float32)
    return ((d * scales)[..., None] * q).reshape(*lead, QK_K)


def _k4_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> 8 scales, 8 mins (6 bits each; ggml's get_scale_min_k4), as fp32."""
    j = np.arange(4)
    sc_low, m_low = raw[..., j] & 63, raw[..., j + 4] & 63
    sc_high = (raw[..., j + 8] & 0x0F) | ((raw[..., j] >> 6) << 4)
    m_high = (raw[..., j + 8] >> 4) | ((raw[..., j + 4] >> 6) << 4)
    return (np.concatenate([sc_low, sc_high], axis=-1).astype(np.float32),
            np.concatenate([m_low, m_high], axis=-1).astype(np.float32))


def _dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    """fp16 d, fp16 dmin, 12 bytes of scales and mins, 128 bytes of nibbles: run j of 32 is the low
    (j even) or high nibbles of bytes 32 (j // 2) .. + 31, d sc_j q - dmin m_j."""
    lead = blocks.shape[:-1]
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    sc, m = _k4_scales(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(*lead, 4, 1, 32)
    q = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(*lead, 8, 32).astype(np.float32)
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(*lead, QK_K)


def _dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K's with 32 bytes qh after the scales: run j's element l has bit j of qh[l] as its fifth bit."""
    lead = blocks.shape[:-1]
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    sc, m = _k4_scales(blocks[..., 4:16])
    qs = blocks[..., 48:176].reshape(*lead, 4, 1, 32)
    low = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(*lead, 8, 32)
    high = np.moveaxis(_bits(blocks[..., 16:48, None]), -1, -2)  # [.., j, l]: bit j of qh[l]
    q = (low | (high << 4)).astype(np.float32)
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(*lead, QK_K)


def _dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    """128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d: element 128 n + 32 r + l has low 4 bits from
    ql[64 n + 32 (r % 2) + l] (r < 2: low nibble, else high), high 2 from qh[32 n + l] >> 2 r, minus 32;
    scale 8 n + 2 r + l // 16."""
    lead = blocks.shape[:-1]
    ql, qh = blocks[..., 0:128].reshape(*lead, 2, 1, 2, 32), blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _half(blocks[..., 208:210])
    low = (ql >> np.array([0, 4], np.uint8).reshape(2, 1, 1)) & 0x0F  # [.., n, r // 2, r % 2, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [.., n, r, l]
    q = (low.reshape(*lead, 2, 4, 32) | (high << 4)).astype(np.int8) - np.int8(32)
    return ((d * scales)[..., None] * q.reshape(*lead, 16, 16).astype(np.float32)).reshape(*lead, QK_K)


def _dequant_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """fp16 d, 2 bytes scales_h, 4 bytes scales_l, 128 bytes of codes: run j of 32 is d (ls_j - 32)
    IQ4_VALUES[code] with ls_j 4 bits from scales_l[j // 2] (j even: low) and 2 from scales_h at 2 j,
    the codes as IQ4_NL's 16 bytes at 16 j."""
    lead = blocks.shape[:-1]
    d = _half(blocks[..., 0:2])
    j = np.arange(8)
    high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # [.., 1]
    low = (blocks[..., 4 + j // 2] >> (4 * (j % 2)).astype(np.uint8)) & 0x0F
    ls = (low.astype(np.int32) | (((high >> (2 * j).astype(np.uint16)) & 3).astype(np.int32) << 4)) - 32
    q = IQ4_VALUES[_nibbles(blocks[..., 8:136].reshape(*lead, 8, 16))]
    return ((d * ls.astype(np.float32))[..., None] * q).reshape(*lead, QK_K)


_NUMPY_DEQUANTIZERS = {Q5_0: _dequant_q5_0, Q5_1: _dequant_q5_1, IQ4_NL: _dequant_iq4_nl, Q2_K: _dequant_q2_k,
                       Q3_K: _dequant_q3_k, Q4_K: _dequant_q4_k, Q5_K: _dequant_q5_k, Q6_K: _dequant_q6_k,
                       IQ4_XS: _dequant_iq4_xs}


# ---- the compiled kernel -----------------------------------------------------------------
def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] W^T + bias -> [..., N] in x's dtype; batch-invariant on every path."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"quant_linear: input has {x.shape[-1]} features, the weight takes {weight.in_features}")
    if bias is not None and bias.numel() != weight.out_features:
        raise ValueError(f"quant_linear: bias has {bias.numel()} elements, the weight gives {weight.out_features}")
    lib = _library() if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) else None
    if lib is None and isinstance(weight, QuantParts):  # each part's own fallback, outputs side by side
        sizes = [p.out_features for p in weight.parts]
        biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
        return torch.cat([quant_linear(x, p, b) for p, b in zip(weight.parts, biases)], dim=-1)
    if lib is None and weight.int8_activations:  # the reference gives the kernels' bits
        return int8_linear_reference(x.reshape(-1, weight.in_features), weight, bias).to(x.dtype).view(
            *x.shape[:-1], weight.out_features)
    if lib is None:
        from kernels.linear import invariant_linear  # dense fallback: dequantized on each call

        return invariant_linear(x, weight.dequantize().to(x.dtype).to(x.device), bias)
    return run_kernel(lib, x, weight, bias)


def run_kernel(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """quant_linear on a given build of the kernels (`declare`d): the tests run every tier's. out: rows
    [M, N] with unit column stride (a slice of a caller's buffer) to write into instead of a new tensor."""
    from kernels.cpu_kernels import _rows

    rows, stride = _rows(x, weight.in_features)
    if out is None:
        out = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    status = lib.quant_linear(rows.data_ptr(), stride, weight.data.data_ptr(), weight.kernel_fmt,
                              bias.data_ptr() if bias is not None else None, out.data_ptr(), out.stride(0),
                              rows.shape[0], weight.out_features, weight.in_features, int(x.dtype == torch.bfloat16),
                              torch.get_num_threads())
    if status == OUT_OF_MEMORY:
        raise MemoryError("quant_linear: out of memory for the widened input")
    if status != OK:
        raise ValueError(f"quant_linear: {weight.format} with {weight.in_features} inputs is not supported")
    return out.view(*x.shape[:-1], weight.out_features)


def _library() -> ctypes.CDLL | None:
    """The active CPU kernel library, its quant_linear declared (once per library), or None."""
    from kernels import cpu_kernels

    if not cpu_kernels.is_available():
        return None
    return declare(cpu_kernels.library())


_ptr, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {"quant_linear": ([_ptr, _i64, _ptr, _i32, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32, _i32], _i32),
              "quant_row_bytes": ([_i32, _i64], _i64),
              "quant_dot_amx": ([], _i32),
              "quant_experts_int8": ([_ptr, _i64, _ptr, _ptr, _i64, _i32, _i64, _i64, _i64, _i64, _i32, _ptr, _i64,
                                      _i32], _i32)}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with quant_linear's signature set (once per library object)."""
    from kernels import cpu_kernels

    return cpu_kernels.declare(lib, SIGNATURES)


# ---- int8 activations: the reference of kernels/csrc/quant_dot.c, bit for bit -----------------
TINY = np.float32(2.0 ** -120)  # a block whose largest |x| is below this is all zeros


def quantize_activations_reference(x: torch.Tensor, span: int = BLOCK
                                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] (any float dtype, widened to fp32) -> q int8 [M, B, span], d fp32 [M, B], sum int32 [M, B]
    (span 256: [M, B, 16], the sums of each 16), sx fp32 [M, B] (d * sum of the block): quant_dot.c's
    rounding rule (its header), per block of `span` (32, or a super-block of 256) from each row's first
    element, the last block padded with zeros."""
    values = x.detach().float().cpu().numpy()
    rows, k = values.shape
    blocks = -(-k // span)
    padded = np.zeros((rows, blocks * span), dtype=np.float32)
    padded[:, :k] = values
    padded = padded.reshape(rows, blocks, span)
    amax_bits = (padded.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(axis=-1)
    amax = amax_bits.view(np.float32)
    nonfinite, tiny = amax_bits >= 0x7F800000, amax < TINY
    zero = nonfinite | tiny
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(zero, np.float32(0), np.float32(127) / np.where(zero, np.float32(1), amax))
        q = np.rint(padded * inv[..., None]).astype(np.int32)  # half to even, as the kernels round
        q[zero] = 0
        d = np.where(nonfinite, np.float32(np.nan), np.where(tiny, np.float32(0), amax / np.float32(127)))
    d = d.astype(np.float32)
    total = q.sum(axis=-1).astype(np.int32)
    sx = np.where(zero, np.float32(0), d * total.astype(np.float32)).astype(np.float32)
    if span == QK_K:
        total = q.reshape(rows, blocks, 16, 16).sum(axis=-1).astype(np.int32)
    return q.astype(np.int8), d, total, sx


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 a * b + c rounded once (what fmaf and the FMA instructions give): the product is exact in
    fp64, the sum is rounded to odd in fp64 (TwoSum, then the odd neighbour when inexact), and
    rounding that to fp32 is the correctly rounded result."""
    product = np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)
    addend = np.asarray(c, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        total = product + addend
        back = total - product
        error = (product - (total - back)) + (addend - back)
        even = (total.view(np.int64) & 1) == 0
        toward = np.where(error > 0, np.inf, -np.inf)
        total = np.where((error != 0) & even & np.isfinite(total), np.nextafter(total, toward), total)
    return total.astype(np.float32)


def _integer_blocks(weight: QuantWeight) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The weight's integers [N, B, 32] (int32) and its per-block d, m [N, B] (GGUF) or row scale [N] (INT8)."""
    data = weight.row_data().numpy()
    n, k = weight.out_features, weight.in_features
    if weight.fmt == INT8:
        blocks = -(-k // BLOCK)
        values = np.zeros((n, blocks * BLOCK), dtype=np.int32)
        values[:, :k] = data[:, 4:].view(np.int8)
        return values.reshape(n, blocks, BLOCK), None, None, data[:, :4].copy().view(np.float32)[:, 0]
    raw = data.reshape(n, k // BLOCK, BLOCK_BYTES[weight.fmt])
    d = raw[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    if weight.fmt == Q8_0:
        return raw[..., 2:].copy().view(np.int8).astype(np.int32), d, None, None
    qs = raw[..., 4:] if weight.fmt == Q4_1 else raw[..., 2:]
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)
    if weight.fmt == Q4_0:
        return u - 8, d, None, None
    return u, d, raw[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0], None


def int8_linear_reference(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] W^T + bias with int8 activations -> fp32 [M, N], the bits of quant_dot.c (round to
    bf16 with .to() for a bf16 result): one fp32 chain per output over the blocks, in block order."""
    if weight.fmt in KQUANT_INT8:
        from kernels import kquant_int8

        acts = quantize_activations_reference(x, BLOCK_ELEMS[weight.fmt])
        acc = kquant_int8.linear_reference(*acts, weight.row_data().numpy(), weight.fmt, weight.in_features)
        add = np.zeros(weight.out_features, np.float32) if bias is None else bias.detach().float().numpy()
        return torch.from_numpy(fma32(acc, np.ones((1, weight.out_features), np.float32), add[None, :]))
    q, dx, _, sx = quantize_activations_reference(x)
    w, dw, mw, scale = _integer_blocks(weight)
    rows, n = q.shape[0], weight.out_features
    acc = np.zeros((rows, n), dtype=np.float32)
    for b in range(q.shape[1]):
        isum = (q[:, b, :].astype(np.int64) @ w[:, b, :].astype(np.int64).T).astype(np.float32)  # exact
        step = dx[:, b, None] * np.ones((1, n), np.float32) if dw is None else dx[:, b, None] * dw[None, :, b]
        acc = fma32(step.astype(np.float32), isum, acc)
        if mw is not None:
            acc = fma32(mw[None, :, b], sx[:, b, None], acc)
    add = np.zeros(n, np.float32) if bias is None else bias.detach().float().numpy()
    ones = np.ones(n, np.float32) if scale is None else scale
    return torch.from_numpy(fma32(acc, ones[None, :], add[None, :]))
