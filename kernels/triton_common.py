"""What every Triton kernel file shares: supported dtypes, interpreter detection, rounding.

Triton's CPU interpreter (TRITON_INTERPRET=1) stores bf16 as raw uint16, so arithmetic on
bf16 values there is meaningless (kernels convert to fp32 first), and its fp32 -> bf16
cast truncates instead of rounding to nearest even. `round_to` rounds like a GPU (and like
torch) in both modes, so interpreter tests measure the kernel, not the interpreter.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRET_BF16_FIX = tl.constexpr(INTERPRET)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """x (any float dtype) rounded to nearest even in DTYPE."""
    if _INTERPRET_BF16_FIX:  # compile-time: on a GPU only the plain cast below exists
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.int32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)  # round half to even at bit 16
            bits = (bits >> 16) << 16  # now exact in bf16, so the truncating cast is exact
            return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return x.to(DTYPE)
