"""The int8-activation reference for the K-quants (Q2_K .. Q6_K, IQ4_XS: super-blocks of 256) and the
other blocks of 32 (Q5_0, Q5_1, IQ4_NL): kernels/csrc/quant_dot.c's bits, in numpy (its header has the rule).

Each block is read as integers: per element its signed integer w (Q6_K's q - 32, Q3_K's q - 4 or q,
IQ4's table value, Q5_0's u - 16; Q4_K, Q5_K, Q2_K, Q5_1 the unsigned u), and for the super-blocks per
sub-block of 16 an integer scale sc and min mn (the sub-blocks of 32 of Q4_K, Q5_K, IQ4_XS give both
halves the same), with the block's fp16 d and dmin (Q5_1: m). Then, per super-block and row of x
(activations rounded to int8 per super-block, sums per 16):
    S = sum_h sc_h sum_{i in h} w_i q_i,   M = sum_h mn_h s_h         (exact in int32)
    acc = fma(d dx, (float)S, acc);   mins: acc = fma(-(dmin dx), (float)M, acc)
and per block of 32: acc = fma(d dx, (float)isum, acc); Q5_1: acc = fma(m, sx, acc).
"""
from __future__ import annotations

import numpy as np

from kernels import quant

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int32)


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block [..., bytes] as fp32 [...]."""
    return raw[..., at:at + 2].copy().view(np.float16).astype(np.float32)[..., 0]


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> 8 six-bit scales and mins [..., 8] (ggml's get_scale_min_k4)."""
    s = s.astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _nibbles_by_64(qs: np.ndarray) -> np.ndarray:
    """[..., 128] bytes -> [..., 256] nibbles: per 64 elements, 32 bytes' low nibbles then their high ones."""
    qs = qs.astype(np.int32).reshape(*qs.shape[:-1], 4, 32)
    return np.stack([qs & 0xF, qs >> 4], axis=-2).reshape(*qs.shape[:-2], 256)


def _by_32_bits(bits: np.ndarray, count: int) -> np.ndarray:
    """[..., 32] bytes -> [..., count * 32]: element 32 j + t is bit j of byte t."""
    bits = bits.astype(np.int32)
    return np.stack([(bits >> j) & 1 for j in range(count)], axis=-2).reshape(*bits.shape[:-1], count * 32)


def _two_bit_groups(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's [..., 64] bytes -> [..., 256]: element 128 n + 32 j + t is bits 2j of byte 32 n + t."""
    qs = qs.astype(np.int32).reshape(*qs.shape[:-1], 2, 32)
    return np.stack([(qs >> 2 * j) & 3 for j in range(4)], axis=-2).reshape(*qs.shape[:-2], 256)


def _sixteen(per_32: np.ndarray) -> np.ndarray:
    """[..., 8] per sub-block of 32 -> [..., 16] per sub-block of 16 (each half the same)."""
    return np.repeat(per_32, 2, axis=-1)


def _fifth_bit(raw: np.ndarray, at: int) -> np.ndarray:
    """Q5_0 / Q5_1's qh (uint32 at byte `at`) -> [..., 32] the 5th bit of each element (bit j: element j)."""
    qh = raw[..., at:at + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
    return ((qh[..., None] >> np.arange(32)) & 1).astype(np.int32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """A block of 32's 16 bytes of nibbles -> [..., 32]: the low nibbles (elements 0-15), then the high."""
    qs = qs.astype(np.int32)
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def integers(raw: np.ndarray, fmt: int) -> dict:
    """Blocks [..., block bytes] -> w [..., span] (int32), d [...] (fp32) and, by format, sc / mn [..., 16]
    (int32, per sub-block of 16), dmin [...] (K-quant mins) or m [...] (Q5_1)."""
    if fmt == quant.Q4_K:
        sc, mn = _k4_scales(raw[..., 4:16])
        return dict(w=_nibbles_by_64(raw[..., 16:144]), sc=_sixteen(sc), mn=_sixteen(mn), d=_half(raw, 0),
                    dmin=_half(raw, 2))
    if fmt == quant.Q5_K:
        sc, mn = _k4_scales(raw[..., 4:16])
        w = _nibbles_by_64(raw[..., 48:176]) + 16 * _by_32_bits(raw[..., 16:48], 8)
        return dict(w=w, sc=_sixteen(sc), mn=_sixteen(mn), d=_half(raw, 0), dmin=_half(raw, 2))
    if fmt == quant.Q6_K:
        ql, qh = raw[..., 0:128].astype(np.int32), raw[..., 128:192].astype(np.int32)
        halves = []
        for n in range(2):  # per 128 elements: ql's 64 bytes and qh's 32
            lo, hi = ql[..., 64 * n:64 * n + 64], qh[..., 32 * n:32 * n + 32]
            parts = [(lo[..., 0:32] & 0xF) | ((hi & 3) << 4), (lo[..., 32:64] & 0xF) | (((hi >> 2) & 3) << 4),
                     (lo[..., 0:32] >> 4) | (((hi >> 4) & 3) << 4), (lo[..., 32:64] >> 4) | (((hi >> 6) & 3) << 4)]
            halves.append(np.concatenate(parts, axis=-1))
        w = np.concatenate(halves, axis=-1) - 32
        return dict(w=w, sc=raw[..., 192:208].copy().view(np.int8).astype(np.int32), d=_half(raw, 208))
    if fmt == quant.Q3_K:
        s = raw[..., 96:108].astype(np.int32)
        low = np.concatenate([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], axis=-1)
        high = np.concatenate([(s[..., 8:12] >> 2 * (i // 4)) & 3 for i in range(0, 16, 4)], axis=-1)
        w = _two_bit_groups(raw[..., 32:96]) - 4 * (1 - _by_32_bits(raw[..., 0:32], 8))
        return dict(w=w, sc=(low | (high << 4)) - 32, d=_half(raw, 108))
    if fmt == quant.Q2_K:
        s = raw[..., 0:16].astype(np.int32)
        return dict(w=_two_bit_groups(raw[..., 16:80]), sc=s & 0xF, mn=s >> 4, d=_half(raw, 80), dmin=_half(raw, 82))
    if fmt == quant.IQ4_XS:
        high = raw[..., 2:4].copy().view(np.uint16)[..., 0].astype(np.int32)
        low = raw[..., 4:8].astype(np.int32)
        ls = np.stack([((low[..., ib // 2] >> 4 * (ib % 2)) & 0xF) | (((high >> 2 * ib) & 3) << 4) for ib in range(8)],
                      axis=-1)
        qs = raw[..., 8:136].reshape(*raw.shape[:-1], 8, 16)
        w = IQ4_VALUES[_low_high(qs)].reshape(*raw.shape[:-1], 256)
        return dict(w=w, sc=_sixteen(ls - 32), d=_half(raw, 0))
    if fmt == quant.Q5_0:
        return dict(w=_low_high(raw[..., 6:22]) + 16 * _fifth_bit(raw, 2) - 16, d=_half(raw, 0))
    if fmt == quant.Q5_1:
        return dict(w=_low_high(raw[..., 8:24]) + 16 * _fifth_bit(raw, 4), d=_half(raw, 0), m=_half(raw, 2))
    if fmt == quant.IQ4_NL:
        return dict(w=IQ4_VALUES[_low_high(raw[..., 2:18])], d=_half(raw, 0))
    raise ValueError(f"no integer reading of format {fmt}")


def values(raw: np.ndarray, fmt: int) -> np.ndarray:
    """The blocks' values in fp64 from their integers (the tests check them against gguf's dequantizer)."""
    parts = integers(raw, fmt)
    w = parts["w"].astype(np.float64)
    d = parts["d"].astype(np.float64)[..., None]
    if "sc" not in parts:
        return w * d + (parts["m"].astype(np.float64)[..., None] if "m" in parts else 0)
    shape = (*w.shape[:-1], 16, 16)
    out = w.reshape(shape) * (d[..., None] * parts["sc"][..., None])
    if "mn" in parts:
        out = out - parts["dmin"].astype(np.float64)[..., None, None] * parts["mn"][..., None]
    return out.reshape(w.shape)


def linear_reference(q: np.ndarray, dx: np.ndarray, sums: np.ndarray, sx: np.ndarray, data: np.ndarray, fmt: int,
                     in_features: int) -> np.ndarray:
    """acc [M, N] fp32 (before the bias) of int8 activations (quant.quantize_activations_reference at the
    format's span: q [M, B, span], dx [M, B], sums [M, B, 16] or [M, B], sx [M, B]) by rows of blocks
    data [N, row bytes]: quant_dot.c's chain, block by block."""
    n, span = data.shape[0], quant.BLOCK_ELEMS[fmt]
    blocks = in_features // span
    parts = integers(data.reshape(n, blocks, quant.BLOCK_BYTES[fmt]), fmt)
    w, d = parts["w"].astype(np.int64), parts["d"]
    acc = np.zeros((q.shape[0], n), np.float32)
    for b in range(blocks):
        qb = q[:, b].astype(np.int64)
        if "sc" in parts:
            isums = np.einsum("mhi,nhi->mnh", qb.reshape(-1, 16, 16), w[:, b].reshape(n, 16, 16))  # per 16, exact
            total = (isums * parts["sc"][None, :, b]).sum(-1)  # S, exact (|S| < 2^31)
        else:
            total = qb @ w[:, b].T
        acc = quant.fma32(d[None, :, b] * dx[:, b, None], total.astype(np.float32), acc)
        if "mn" in parts:
            mins = sums[:, b].astype(np.int64) @ parts["mn"][:, b].T  # M
            acc = quant.fma32(-(parts["dmin"][None, :, b] * dx[:, b, None]), mins.astype(np.float32), acc)
        elif "m" in parts:
            acc = quant.fma32(np.broadcast_to(parts["m"][None, :, b], acc.shape), sx[:, b, None], acc)
    return acc
